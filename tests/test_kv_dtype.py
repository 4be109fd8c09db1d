"""kv_cache_dtype: the KV pool's own dtype (float32 KV for bf16 models on CPUs without bf16
units), and float32 dense copies of packed projections."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import CacheConfig
from pagellm.engine.memory import resolve_kv_dtype
from pagellm.layers import linear as lin
from pagellm.layers import onednn, q32

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 17, 33, 2, 40], [7] * 19, list(range(3, 40))]


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("upcast_bf16", [True, False])
def test_auto_kv_dtype(monkeypatch, upcast_bf16, native_on):
    from pagellm.kernels import native

    monkeypatch.setattr(lin, "UPCAST_BF16", upcast_bf16)
    monkeypatch.setattr(native, "available", lambda: native_on)
    # float32 KV only where the PyTorch attention would widen a bf16 pool at every step (no
    # native kernels, no bf16 units); the native kernel reads bf16 rows on every CPU
    want = torch.float32 if upcast_bf16 and not native_on else torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, CPU) == want
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_dtype("auto", torch.float16, CPU) == torch.float16
    # float32 activations (packed weights + fused layer): without the native kernels a
    # float32 pool; with them a bf16 pool that the native attention kernel widens as it reads
    want = torch.float32 if not native_on else torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, CPU, torch.float32) == want
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, CPU, torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("float32", torch.bfloat16, torch.device("cuda"))


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")


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
    monkeypatch.setenv("PAGELLM_Q32", "0")  # no q32 form (which would replace the dense copy)
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


def test_packed_model_on_a_cpu_with_bf16_units(monkeypatch):
    """With bf16 units a packed model still runs few-row steps as one native call per layer
    (float32 activations, float32 biases, a bf16 KV pool the kernels widen as they read it),
    while its dense weights stay bf16 for many-row steps, which convert their activations to
    bf16 (no float32 copy of anything)."""
    from pagellm.kernels import native

    if not native.available():
        pytest.skip("no C compiler on this machine")
    if not onednn.bf16_runs():  # the head and dense products prepacked as bf16 units take them
        pytest.skip("no oneDNN bf16 on this CPU")
    monkeypatch.setattr(lin, "UPCAST_BF16", False)
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB")
    eng = llm.engine
    model = eng.model
    assert model.act_dtype == torch.float32 and eng.kv_dtype == torch.bfloat16
    assert all(layer.fused is not None for layer in model.layers)
    assert getattr(model, "_head_f32", None) is None
    assert all(p.dtype != torch.float32 for n, p in model.named_parameters()
               if n.endswith("proj.weight"))
    # where oneDNN is there, the dense weights live only in its blocked layout (prepacked once),
    # or, with AVX-512 VNNI, nowhere: the file's 32-value blocks serve many rows (layers/q32.py)
    projections = [m for m in model.modules() if isinstance(m, lin._Packed)]
    assert all((m.bf16_wide is not None and m.weight.device.type == "meta")
               == (onednn.available() or q32.available()) for m in projections)
    calls, products = [], []
    orig_layer = type(model.layers[0].fused).__call__
    orig_linear, orig_onednn = torch.nn.functional.linear, onednn.OneDNNLinear.__call__

    def counting(self, *args):
        calls.append(1)
        return orig_layer(self, *args)

    def watching(x, w, b=None):
        products.append((x.dtype, w.dtype))
        return orig_linear(x, w, b)

    def watching_onednn(self, x):
        y = orig_onednn(self, x)
        products.append((torch.bfloat16, y.dtype))  # bf16 activations in, bf16 out
        return y

    monkeypatch.setattr(type(model.layers[0].fused), "__call__", counting)
    monkeypatch.setattr(torch.nn.functional, "linear", watching)
    monkeypatch.setattr(onednn.OneDNNLinear, "__call__", watching_onednn)
    orig_q32 = q32.Q32Linear.__call__

    def watching_q32(self, x):
        y = orig_q32(self, x)
        products.append((torch.bfloat16, y.dtype))  # rounded to bf16, then int8, bf16 out
        return y

    monkeypatch.setattr(q32.Q32Linear, "__call__", watching_q32)
    from pagellm.kernels.cpu_wide_layer import WideLayer, WideStack

    orig_one_call, orig_stack = WideLayer._call_q32, WideStack.__call__

    def watching_one_call(self, *args):  # a layer of four q32 products in one native call
        products.extend([(torch.bfloat16, torch.bfloat16)] * 4)
        return orig_one_call(self, *args)

    def watching_stack(self, *args):  # every such layer in one native call
        products.extend([(torch.bfloat16, torch.bfloat16)] * 4 * len(self.wides))
        return orig_stack(self, *args)

    monkeypatch.setattr(WideLayer, "_call_q32", watching_one_call)
    monkeypatch.setattr(WideStack, "__call__", watching_stack)
    long_prompt = list(range(100, 160))  # a 60-row prefill: dense bf16 products
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([long_prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert calls and products and all(p == (torch.bfloat16, torch.bfloat16) for p in products)
    monkeypatch.setattr(torch.nn.functional, "linear", orig_linear)
    monkeypatch.setattr(lin, "UPCAST_BF16", True)  # the same file as a CPU without bf16 units
    other = LLM(dtype="bfloat16", kv_cache_memory="32MiB")
    want = other.generate([long_prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert out[:3] == want[:3]  # prefill products in bf16 vs float32: a late near-tie may flip


def test_int8_kv_pool(tiny_llama):
    """kv_cache_dtype int8: each pool row holds head_dim int8 codes and a float32 scale; the
    same budget holds 2 hd / (hd + 4) times a bf16 pool's blocks; the outputs stay close to a
    float32 pool's (first tokens' log-probabilities within a code step's effect), and every
    block is back in the pool after (leak_check)."""
    from pagellm.engine.model_runner import kv_bytes_per_block

    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = {}
    for kv in ("float32", "bfloat16", "int8"):
        llm = LLM(path, dtype="float32", kv_cache_dtype=kv, kv_cache_memory=2**20)
        eng = llm.engine
        hd = eng.model.layers[0].self_attn.head_dim
        if kv == "int8":
            assert eng.kv_dtype == torch.int8
            assert all(k.dtype == torch.int8 and k.shape[-1] == hd + 4 and v.shape == k.shape
                       for k, v in eng.runner.kv_caches)
            assert kv_bytes_per_block(eng.hf_config, 16, torch.int8) == (
                kv_bytes_per_block(eng.hf_config, 16, torch.bfloat16) * (hd + 4) // (2 * hd))
        runs[kv] = (eng.num_blocks, llm.generate(PROMPTS, sp, use_tqdm=False))
        llm.shutdown()
    (n32, f32), (n16, _), (n8, i8) = runs["float32"], runs["bfloat16"], runs["int8"]
    assert n8 == 2**20 // kv_bytes_per_block(llm.engine.hf_config, 16, torch.int8)
    assert abs(n8 - n16 * 2 * hd / (hd + 4)) <= 1 and n16 == 2 * n32
    for a, b in zip(f32, i8):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for tok, lp in first_a.items():
            assert tok in first_b and abs(first_b[tok] - lp) < 0.05, (first_a, first_b)
        assert a.outputs[0].token_ids[:2] == b.outputs[0].token_ids[:2]


def test_int8_kv_pool_with_prefix_cache_and_speculation(tiny_llama):
    """An int8 pool under the prefix cache (a second run reads the first's blocks) and with a
    draft model (both pools int8): each run gives what plain int8 decoding gives."""
    path, _ = tiny_llama
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory=2**20)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    hits = plain.engine.scheduler.block_manager.prefix_hits
    again = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    assert plain.engine.scheduler.block_manager.prefix_hits > hits
    assert again == want
    plain.shutdown()
    spec = LLM(path, dtype="float32", kv_cache_dtype="int8", kv_cache_memory=2**20,
               speculative_config={"method": "draft_model", "model": path,
                                   "num_speculative_tokens": 3, "adaptive": False})
    assert spec.engine.spec.proposer.runner.kv_caches[0][0].dtype == torch.int8
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want


def test_int8_kv_is_a_cpu_pool():
    with pytest.raises(ValueError, match="kv_cache_dtype int8"):
        resolve_kv_dtype("int8", torch.bfloat16, torch.device("cuda"))
    assert resolve_kv_dtype("int8", torch.bfloat16, CPU) == torch.int8
    assert CacheConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
