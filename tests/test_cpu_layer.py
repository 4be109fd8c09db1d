"""The fused native decoder layer (pagellm/kernels/cpu_layer.c) gives the module path's
results on the default model: greedy tokens and their log-probabilities, at batch 1 and for a
batch of prompts of different lengths (several sequences, block tables, short prefills
through the fused layer, a prefill of more than 40 rows taking the module path in the same
run)."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels import cpu_attention, native
from tests.helpers import layer_path_and_module_path

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def bf16_upcast(monkeypatch):
    """The fused layer serves CPUs without bf16 units, where bf16 activations run in float32
    (layers/linear.py: UPCAST_BF16); on a CPU with them, build the engine that way regardless."""
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "UPCAST_BF16", True)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "List three colours of the rainbow and one fruit that has one of those colours:",
           "Summarize: the river runs through the middle of the town, and every morning the "
           "fishermen push their boats into the water before the sun comes up. Children walk "
           "along the bank on their way to school."]


def _run(llm, fused_on: bool):
    layers = llm.engine.model.layers
    saved = [layer.fused for layer in layers]
    if not fused_on:
        for layer in layers:
            layer.fused = None
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        return llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        for layer, f in zip(layers, saved):
            layer.fused = f


def test_fused_layer_matches_module_path():
    # no prefix cache: the second run prefills as the first did (a cached prompt would be
    # recomputed from its last block by the packed kernels, not by the many-row products
    # that prefilled it first: int8 activations in the q32 ones)
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", block_size=4,
              enable_prefix_caching=False)
    try:
        assert all(layer.fused is not None for layer in llm.engine.model.layers)
        # one float32 copy of the rotary tables for all layers (a copy each cost 30x)
        assert len({p.data_ptr() for layer in llm.engine.model.layers
                    for p in layer.fused._keep[:2]}) == 2
        calls = []
        orig = type(llm.engine.model.layers[0].fused).__call__

        def counting(self, *args):
            calls.append(1)
            return orig(self, *args)

        type(llm.engine.model.layers[0].fused).__call__ = counting
        try:
            fused = _run(llm, True)
        finally:
            type(llm.engine.model.layers[0].fused).__call__ = orig
        assert calls  # decode steps went through it
        plain = _run(llm, False)
    finally:
        llm.shutdown()
    for f, p in zip(fused, plain):
        assert f.outputs[0].token_ids == p.outputs[0].token_ids
        for a, b in zip(f.outputs[0].logprobs, p.outputs[0].logprobs):
            for tok, lp in b.items():
                # float32 rounding (fused multiply-adds, expf), amplified through 30 layers
                # where it moves an activation across an int16 rounding step; a token missing
                # from the other list is a near-tie at its edge (2nd and 3rd 0.005 apart)
                assert (abs(a[tok] - lp) < 3e-2 if tok in a
                        else lp < min(a.values()) + 3e-2), (tok, a, b)


@pytest.mark.parametrize("panels_on,kv", [(True, "auto"), (False, "auto"), (True, "int8")],
                         ids=["panels", "rows", "panels-int8"])
def test_fused_layer_output_equals_module_output_per_step(panels_on, kv, monkeypatch):
    """Each fused call against the module path on a copy of the same input and step: equal
    up to float32 rounding (relative to the residual stream's largest value). A rounding
    difference (vectorized exp, summation order) can move an activation across one int16
    quantization step, 1/32767 of its row's largest value, hence 1e-4; a wrong formula is
    off by more than 1e-2. The fused call runs first, on the cache as the step found it, and
    the K/V it writes are compared with the module path's from the same starting cache (run
    second, the module path's own writes would hide a fused layer that wrote none). Both Q4
    layouts: panels (cpu_panels.c, where built) and rows (cpu_quant.c). Over an int8 pool the
    K/V written are compared as values: the same float32 rounding can move one across an int8
    rounding step, 1/127 of its row's largest (hence 1e-2 there)."""
    from pagellm.kernels import cpu_layer
    from pagellm.layers import panels

    if panels_on and not panels.available():
        pytest.skip("panel kernels need AVX-512 BW and VNNI")
    monkeypatch.setenv("PAGELLM_PANELS", "1" if panels_on else "0")
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", block_size=4, kv_cache_dtype=kv)
    values = (cpu_attention.dequantize_rows if kv == "int8" else lambda t: t)
    try:
        assert (llm.engine.kv_dtype == torch.int8) == (kv == "int8")
        layer = llm.engine.model.layers[7]
        types = {p.type for proj in layer.fused._projs for p in proj.parts[:proj.nparts]}
        assert all((t >= cpu_layer._PANELS) == panels_on for t in types), types
        attn = layer.self_attn
        fused = layer.fused
        diffs, kv_diffs = [], []

        class Compare:
            def usable(self, x, md):
                return fused.usable(x, md)

            def __call__(self, positions, x, md):
                out, ref, fused_kv = layer_path_and_module_path(layer, "fused", fused, positions,
                                                                x, md)
                diffs.append(((out - ref).abs().max() / ref.abs().max()).item())
                slots = md.slot_mapping.long()
                for got, cache in zip(fused_kv, (attn.k_cache, attn.v_cache)):
                    flat_got = values(got.flatten(0, 1)[slots])
                    flat_ref = values(cache.flatten(0, 1)[slots])
                    kv_diffs.append(((flat_got - flat_ref).abs().max()
                                     / flat_ref.abs().max()).item())
                return out

        layer.fused = Compare()
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(kv_diffs) >= 10 and max(kv_diffs) < (1e-2 if kv == "int8" else 1e-4), kv_diffs
    assert len(diffs) >= 5 and max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 24), (5, 37), (64, 1536)])
def test_silu_mul_bf16_is_the_float32_gate_rounded_once(rows, inter):
    """silu(gate) * up over bf16 [rows, gate | up] computed in float32 and rounded to nearest
    even once: float32 torch's values to within one bf16 step (the vectorized exp's last
    bits can move a rounding), almost all of them exactly; NaN stays NaN; widths not a
    multiple of 16 take the 8-wide and scalar tails."""
    from pagellm.kernels.cpu_layer import silu_mul_bf16

    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    gu[0, 0] = float("nan")
    out = silu_mul_bf16(gu)
    gate, up = gu.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    assert out.shape == (rows, inter) and out.dtype == torch.bfloat16
    assert torch.isnan(out[0, 0]) and torch.isnan(want[0, 0])
    out, want = out.float()[:, 1:], want.float()[:, 1:]
    assert torch.allclose(out, want, rtol=2 ** -7, atol=1e-30)
    assert (out == want).float().mean() > 0.98
