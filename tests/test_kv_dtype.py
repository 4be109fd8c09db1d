"""kv_cache_dtype: the KV pool's own dtype (float32 KV for bf16 models on CPUs without bf16
units), and float32 dense copies of packed projections."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig
from pagellm.engine.memory import resolve_kv_dtype
from pagellm.layers import linear as lin

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 17, 33, 2, 40], [7] * 19, list(range(3, 40))]


@pytest.mark.parametrize("upcast_bf16", [True, False])
def test_auto_kv_dtype(monkeypatch, upcast_bf16):
    monkeypatch.setattr(lin, "UPCAST_BF16", upcast_bf16)
    want = torch.float32 if upcast_bf16 else torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, CPU) == want
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_dtype("auto", torch.float16, CPU) == torch.float16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("float32", torch.bfloat16, torch.device("cuda"))


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8")


def test_float32_kv_pool_for_bf16_model(tiny_llama):
    """A bf16 model over a float32 pool: the pool really is float32, its blocks count the
    float32 bytes, and the outputs match a bf16 pool's to bf16 accuracy."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    outs = {}
    for kv in ("float32", "bfloat16"):
        llm = LLM(path, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=2**20)
        eng = llm.engine
        assert eng.kv_dtype == getattr(torch, kv)
        assert all(k.dtype == eng.kv_dtype and v.dtype == eng.kv_dtype
                   for k, v in eng.runner.kv_caches)
        # The float32 LM head copy exists before the first step (made at load), on CPUs
        # where multi-row bf16 products run in float32.
        head = getattr(eng.model, "_head_f32", None)
        assert (head is not None and head[1].dtype == torch.float32) == lin.UPCAST_BF16
        outs[kv] = (eng.num_blocks, llm.generate(PROMPTS, sp, use_tqdm=False))
    (n32, f32), (n16, b16) = outs["float32"], outs["bfloat16"]
    assert n16 == 2 * n32  # the same budget holds half the float32 blocks
    for a, b in zip(f32, b16):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        tok = next(iter(first_b))
        assert abs(first_a.get(tok, -99) - first_b[tok]) < 0.1


def test_float32_pool_with_speculation(tiny_llama):
    """Draft and target pools follow kv_cache_dtype; greedy output equals no speculation."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory=2**20)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    spec = LLM(path, dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory=2**20,
               speculative_config={"method": "draft_model", "model": path,
                                   "num_speculative_tokens": 3, "adaptive": False})
    assert spec.engine.spec.proposer.runner.kv_caches[0][0].dtype == torch.float32
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, sp, use_tqdm=False)]
    agree = sum(a == b for a, b in zip(got, want))
    assert agree >= len(PROMPTS) - 1  # bf16: a near-tie may flip with the verification shape


def test_float32_copy_of_packed_weights_is_exact(monkeypatch):
    """keep_float32 stores the packed projections' dense weights in float32 on CPUs without
    bf16 units; batched products then equal the per-call upcast bit for bit."""
    from pagellm.layers import quant

    monkeypatch.setattr(lin, "UPCAST_BF16", True)
    g = torch.Generator().manual_seed(0)
    blocks = quant.Int4Blocks(torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8),
                              torch.rand(32, 2, generator=g) / 10, torch.randn(32, 2, generator=g) / 10)
    col = lin.ColumnParallelLinear(64, ((32, 1),), bias=False)
    col.load("weight", blocks)
    col.to(torch.bfloat16)
    x = torch.randn(quant.MAX_ROWS + 3, 64, generator=g).bfloat16()
    before = col(x)
    assert lin.keep_float32(col) == 1
    assert col.weight.dtype == torch.float32 and col.packed is not None
    assert torch.equal(col(x), before)
    monkeypatch.setattr(lin, "UPCAST_BF16", False)  # native bf16: nothing to convert
    col2 = lin.ColumnParallelLinear(64, ((32, 1),), bias=False)
    col2.load("weight", blocks)
    col2.to(torch.bfloat16)
    assert lin.keep_float32(col2) == 0 and col2.weight.dtype == torch.bfloat16
