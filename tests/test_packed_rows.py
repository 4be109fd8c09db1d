"""Packed or dense 4-bit products per decode step size (pagellm/kernels/packed_rows.py): the
choice follows measured step times, settles sizes it did not try from its neighbours, re-checks
the side not in use, leaves prefill alone, and quant.dense_from switches a product's path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagellm import LLM, SamplingParams
from pagellm.kernels import packed_rows
from pagellm.kernels.packed_rows import PackedRowChoice
from pagellm.kernels import native
from pagellm.layers import quant
from pagellm.layers.linear import RowParallelLinear
from pagellm.models import gguf_loader


def _run(choice: PackedRowChoice, rows: int, packed_s: float, dense_s: float) -> bool:
    """One step of `rows` rows on a machine where they take packed_s or dense_s; whether it
    ran dense."""
    dense_from = choice.choose(rows)
    choice.observe(rows, dense_from, dense_s if dense_from is not None else packed_s)
    return dense_from is not None


def test_alternates_then_keeps_the_faster_side_and_rechecks_the_other():
    c = PackedRowChoice(limit=40)
    sides = [_run(c, 16, packed_s=0.056, dense_s=0.043) for _ in range(4)]
    assert sides == [False, True, False, True]  # both tried, alternating
    ran = [_run(c, 16, packed_s=0.056, dense_s=0.043) for _ in range(packed_rows.RECHECK * 2 + 4)]
    # dense from now on, packed re-measured once per RECHECK steps of this size
    assert sum(not d for d in ran) == 2 and ran.count(True) == len(ran) - 2
    assert c.summary() == {16: "dense"}
    # the machine changes: the re-checks bring packed back
    for _ in range(packed_rows.RECHECK * 4):
        _run(c, 16, packed_s=0.030, dense_s=0.043)
    assert c.summary() == {16: "packed"}
    assert not _run(c, 16, packed_s=0.030, dense_s=0.043)


def test_sizes_settle_from_their_neighbours_and_out_of_range_stays_packed():
    c = PackedRowChoice(limit=40)
    for _ in range(4):
        _run(c, 12, packed_s=0.05, dense_s=0.04)  # dense wins at 12 rows
        _run(c, 8, packed_s=0.03, dense_s=0.04)  # packed at 8
    assert c.summary() == {8: "packed", 12: "dense"}
    assert c.choose(20) == 20  # more rows than a dense win: dense untried
    assert c.choose(7) is None  # fewer than a packed win: packed untried
    assert c.choose(10) is None  # between: tried, packed first
    assert c.choose(3) is None and c.choose(41) is None  # outside [MIN_ROWS, limit]
    assert PackedRowChoice.for_model(torch.nn.Linear(2, 2)) is None  # nothing packed


def test_dense_from_switches_the_product_path():
    data = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    raw = quantize(data, GGMLQuantizationType.Q4_1).reshape(-1)
    t = gguf_loader.GGUFTensor("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight",
                               (48, 160), GGMLQuantizationType.Q4_1, 0, raw.nbytes, None)
    lin = RowParallelLinear(160, 48)
    lin.load("weight", gguf_loader._load_int4(raw, t))
    assert lin.packed is not None
    x = torch.randn(8, 160)
    # the many-row form: int8 codes where the CPU takes them (no dense weight), else dense
    dense = lin.wide(x).float() if lin.wide is not None else x @ lin.weight.t()
    packed = lin.packed(x)
    with quant.dense_from(8):
        assert torch.equal(lin(x), dense)  # 8 rows >= 8: the dense weights
    with quant.dense_from(9):
        assert torch.equal(lin(x), packed)
    assert torch.equal(lin(x), packed)  # the packed form's own limit again
    assert not torch.equal(packed, dense)  # (the paths do differ in rounding)


@pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
def test_engine_chooses_on_decode_steps_only():
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB")
    try:
        choice = llm.engine.runner.packed_rows
        assert choice is not None and choice.limit == 40
        seen = []
        choose = choice.choose
        choice.choose = lambda rows: seen.append(rows) or choose(rows)
        prompts = [f"Count from {i} to {i + 20}:" for i in range(8)]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert seen and set(seen) == {8}  # one row per decoding sequence; prefill not asked
    assert choice.summary() and set(choice.summary()) == {8}  # both sides measured at 8
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
