"""Parity with transformers on tiny random models: logits, and greedy tokens token for token,
across block sizes, chunked prefill and forced preemption."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.helpers import assert_greedy_close, hf_greedy, make_tiny_model

PROMPTS = [[5, 17, 33, 4, 90, 12, 7], [3, 3, 3], list(range(10, 51)), [200, 100, 50, 25, 12, 6, 3, 1, 9, 8, 7, 6, 5]]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "smollm3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    overrides = {"tie_word_embeddings": True} if request.param == "qwen2" else {}
    if request.param == "smollm3":  # its second layer without rotary (NoPE)
        overrides = {"no_rope_layer_interval": 2}
    return str(path), make_tiny_model(path, request.param, **overrides)


def test_prefill_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20)
    eng = llm.engine
    prompt = PROMPTS[2]
    eng.add_request("r", prompt, SamplingParams(max_tokens=1))
    out = eng.scheduler.schedule()
    logits = eng.runner.execute(out, list(range(len(prompt))))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    eng.abort_request("r")


def test_decode_logprobs_match_transformers(tiny):
    """The logprobs the engine reports for each generated token equal the reference's."""
    path, hf = tiny
    llm = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4)
    prompt = PROMPTS[0]
    res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    full = torch.tensor([prompt + res.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tok == int(row.argmax())
        for t, v in lp.items():
            assert abs(v - float(row[t])) < 1e-4


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=16),
    dict(block_size=1),
    dict(block_size=4, max_num_batched_tokens=5),  # chunked prefill of every prompt
    dict(block_size=2, kv_cache_memory=1024 * 32, max_num_batched_tokens=64),
], ids=["bs16", "bs1", "chunked", "preempt"])
def test_greedy_batch_matches_transformers(tiny, engine_kwargs):
    path, hf = tiny
    n = 20
    kw = {"kv_cache_memory": 2**20, **engine_kwargs}
    llm = LLM(path, dtype="float32", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n)
        assert out.outputs[0].finish_reason == "length"
    if "kv_cache_memory" in engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("upcast_bf16", [True, False])
def test_bf16_products_close_to_float32(monkeypatch, upcast_bf16):
    """The bf16 path (native, or upcast to float32 on CPUs without bf16 units) computes the
    same products as float32 up to bf16 rounding."""
    from pagellm.layers import linear as lin

    monkeypatch.setattr(lin, "UPCAST_BF16", upcast_bf16)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=g), torch.randn(96, 64, generator=g)
    got = lin.linear(x.bfloat16(), w.bfloat16())
    assert got.dtype == torch.bfloat16
    ref = x.bfloat16().float() @ w.bfloat16().float().T
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=0.02)


def test_bf16_engine_greedy_close_to_float32(tiny_llama):
    """bfloat16 end to end against float32 on a tiny model, every position of 8 greedy tokens:
    log-probabilities within TOL, and the same tokens except after a float32 near-tie.

    TOL: bf16 keeps 8 significant bits, so each weight and activation is off by up to 2^-9
    relative; on this model's logits (|logit| < 2) that is ~4e-3 per logit after the last
    product (measured: at most 2e-3), hence 0.01; a token may flip only where float32's choice
    leads the runner-up by less than twice that."""
    TOL = 0.01
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    f32 = LLM(path, dtype="float32", kv_cache_memory=2**20).generate(PROMPTS, sp, use_tqdm=False)
    b16 = LLM(path, dtype="bfloat16", kv_cache_memory=2**20).generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(f32, b16):
        assert_greedy_close(a.outputs[0], b.outputs[0], TOL)
