"""The many-row layer (kernels/cpu_wide_layer.py: oneDNN bf16 products with native steps
between them) gives exactly the module path's values on the default model: each call's
output and the K/V it writes, over prefill steps, chunked prefill after cached keys and a
decode batch past the packed kernels' rows; and so the same tokens and log-probabilities."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from tests.helpers import layer_path_and_module_path
from pagellm.layers import onednn, q32

# the engine is built as on a CPU with bf16 units (the bf16_units fixture): its head and any
# non-q32 product prepacked for oneDNN, which refuses bf16 on a CPU without AVX-512 BW / VL /
# DQ (the AVX2 configuration of the one-call layer: tests/test_q32_avx2.py)
pytestmark = pytest.mark.skipif(not (native.available() and onednn.bf16_runs()),
                                reason="no C compiler, or no oneDNN bf16 on this CPU")


@pytest.fixture(autouse=True)
def bf16_units(monkeypatch):
    """The wide layer serves CPUs with bf16 units (bf16 products prepacked for oneDNN); build
    the engine that way on any CPU (oneDNN computes bf16 products without the units, slowly)."""
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "UPCAST_BF16", False)
    monkeypatch.setattr(linear, "USE_INT8", False)


def _prompts():
    words = ("river town morning boats water children school bank sun fishermen "
             "market bread lamp window road").split()
    # 44 prompts of 3-17 words: a 44-row decode batch (past the packed kernels' 40 rows),
    # and one long prompt that chunked prefill splits over cached keys
    short = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 15))
             for i in range(44)]
    return short + [" ".join(words[j % len(words)] for j in range(600))]


def _engine(kv: str = "auto"):
    # no prefix cache: a second run of the same prompts would compute their last tokens in a
    # step of a few rows (the packed kernels), not the same steps again
    return LLM(dtype="bfloat16", kv_cache_memory="64MiB", block_size=8, max_num_seqs=64,
               max_num_batched_tokens=512, enable_prefix_caching=False, kv_cache_dtype=kv)


def _compare_per_step(llm, layer_index: int, prompts, max_tokens: int = 4):
    """Each wide call of one layer against the module path on a copy of the same input and
    cache: the same output and the same K/V written, bit for bit. The wide call runs first, on
    the cache as the step found it (run second, the module path's own writes would hide a wide
    layer that wrote none). Returns the steps' (query lens, seq lens) and the mismatches."""
    model = llm.engine.model
    assert all(layer.wide_layer is not None for layer in model.layers)
    layer = model.layers[layer_index]
    attn = layer.self_attn
    wide = layer.wide_layer
    rows, mismatches = [], []

    class Compare:
        def usable(self, x, md):
            return wide.usable(x, md)

        def positions_ok(self, positions, md):
            return wide.positions_ok(positions, md)

        def __call__(self, positions, x, md, out_rows=None):
            out, ref, wide_kv = layer_path_and_module_path(layer, "wide_layer", wide, positions,
                                                           x, md, out_rows)
            rows.append((list(md.query_lens_cpu), list(md.seq_lens_cpu)))
            if not torch.equal(out, ref):
                mismatches.append(("out", x.shape[0], (out - ref).abs().max().item()))
            for got, cache in zip(wide_kv, (attn.k_cache, attn.v_cache)):
                if not torch.equal(got, cache):
                    mismatches.append(("kv", x.shape[0]))
            return out

    layer.wide_layer = Compare()
    one_calls = []
    orig = type(wide)._call_q32

    def counting(self, *args):
        if self is wide:
            one_calls.append(1)
        return orig(self, *args)

    type(wide)._call_q32 = counting
    try:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        layer.wide_layer = wide
        type(wide)._call_q32 = orig
    if wide._q32 is not None:  # every wide call of this layer was the one native call
        assert len(one_calls) == len(rows), (len(one_calls), len(rows))
    return rows, mismatches


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_wide_layer_output_equals_module_output_per_step(kv):
    """The default model (Q4_1 projections): where the CPU has the q32 products, every layer
    is one native call (wide_layer_q32). Over the default pool and an int8 one (its rows
    quantized from the same K/V, the same bits)."""
    llm = _engine(kv)
    assert (llm.engine.kv_dtype == torch.int8) == (kv == "int8")
    try:
        if q32.available():
            assert all(layer.wide_layer._q32 is not None for layer in llm.engine.model.layers)
        rows, mismatches = _compare_per_step(llm, 5, _prompts())
    finally:
        llm.shutdown()
    assert not mismatches, mismatches
    # a step with 41+ decoding rows, and a prefill chunk after cached keys (a long query
    # shorter than its sequence) went through the wide layer
    assert any(sum(n == 1 for n in q) > 40 for q, _ in rows), rows
    assert any(n > 16 and n < s for q, lens in rows for n, s in zip(q, lens)), [(q[-3:], l[-3:]) for q, l in rows]


@pytest.mark.skipif(not q32.available(), reason="needs the q32 products (AVX-512 VNNI, bf16 units)")
@pytest.mark.parametrize("block", ["auto", "128 unsmoothed"])
def test_requantized_blocks_give_the_module_paths_output_per_step(monkeypatch, caplog, block):
    """PAGELLM_Q32_BLOCK=auto: the default model's products take blocks of 192 (q|k|v, o,
    gate|up: 576 inputs) and 256 (down: 1,536), smoothed (every product's activations times
    their factors), the gated product quantizing its output for the longer block after each
    chunk of rows. 128 with PAGELLM_Q32_SMOOTH=0: only down takes it (576 is no multiple of
    128; the load log names the projections that keep the file's blocks), unsmoothed, the
    gated product quantizing its 32-block outputs for down's 128. Either way the one native
    call still equals the module path bit for bit."""
    import logging

    monkeypatch.setenv("PAGELLM_Q32_BLOCK", block.split()[0])
    if block != "auto":
        monkeypatch.setenv("PAGELLM_Q32_SMOOTH", "0")
    want = [192, 192, 192, 256] if block == "auto" else [32, 32, 32, 128]
    with caplog.at_level(logging.INFO, logger="pagellm.layers.q32_smooth"):
        llm = _engine("auto")
    try:
        for layer in llm.engine.model.layers:
            assert [p.q32.block for p in layer.wide_layer._projections] == want
            smoothed = [p.q32.inv is not None for p in layer.wide_layer._projections]
            assert smoothed == [block == "auto" and b > 32 for b in want]
            assert layer.wide_layer._q32 is not None
        rows, mismatches = _compare_per_step(llm, 5, _prompts())
    finally:
        llm.shutdown()
    assert not mismatches, mismatches
    assert any(sum(n == 1 for n in q) > 40 for q, _ in rows), rows
    log = " ".join(r.getMessage() for r in caplog.records if "requantized" in r.getMessage())
    if block == "auto":
        assert "120 products requantized (120 smoothed)" in log and log.endswith(": none"), log
    else:
        assert "30 products requantized (0 smoothed)" in log, log
        for name in ("qkv_proj", "o_proj", "gate_up_proj"):
            assert f"{name} (30 layers)" in log, log


@pytest.mark.skipif(not q32.available(), reason="needs the q32 products (AVX-512 VNNI, bf16 units)")
def test_every_layer_in_one_call_gives_the_per_layer_calls_tokens_and_logprobs(monkeypatch):
    """The default model's layers are all one-call q32 layers: a many-row step runs them all
    in one native call (WideStack, wide_layers_q32), with the same tokens and log-probabilities,
    bit for bit, as layer by layer (prefill chunks, one after cached keys, and a 44-row decode
    batch); a step whose rows take the packed kernels (the fused layer) does not."""
    from pagellm.kernels.cpu_wide_layer import WideStack

    llm = _engine()
    model = llm.engine.model
    stack = model.wide_stack
    assert isinstance(stack, WideStack) and len(stack.wides) == len(model.layers)
    rows = []
    orig = WideStack.__call__

    def counting(self, positions, x, md, *rest):
        rows.append(x.shape[0])
        return orig(self, positions, x, md, *rest)

    monkeypatch.setattr(WideStack, "__call__", counting)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    try:
        one_call = llm.generate(prompts, sp, use_tqdm=False)
        stacked = list(rows)
        model.wide_stack = None
        per_layer = llm.generate(prompts, sp, use_tqdm=False)
        model.wide_stack = stack
        (few,) = llm.generate([prompts[0]], sp, use_tqdm=False)  # a few rows a step
    finally:
        llm.shutdown()
    # 512-row prefill chunks and a decode batch of 40+ rows took it
    assert max(stacked) == 512 and any(40 < r < 64 for r in stacked), stacked
    for a, b in zip(one_call, per_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert rows == stacked and len(few.outputs[0].token_ids) == 4  # the fused layer's steps
    # The engine's profiling pass runs the stack over a temporary pool, which must be freed
    # once the pass lets it go (the CPU's KV budget is read from the memory left after it):
    # the stack keeps no reference to a pool.
    import weakref

    from pagellm.engine.model_runner import profile_forward

    eng = llm.engine
    profile_forward(model, 512, 1, eng.config.cache.block_size, eng.kv_dtype, eng.device)
    held = [r() if isinstance(r, weakref.ref) else r for r in stack._pools[0]]
    assert len(held) == 2 * len(model.layers) and all(t is None for t in held)


def _assert_tiny_layer_equal(llm, layer_index: int) -> None:
    """A tiny GGUF model's layer over decode steps of many rows and a prefill chunk after
    cached keys (both asserted to have run through it): the module path's values, bit for bit."""
    prompts = [[(7 * i + j) % 90 + 3 for j in range(3 + i % 13)] for i in range(48)]
    prompts.append([(j * 5) % 90 + 3 for j in range(100)])  # prefilled in chunks
    rows, mismatches = _compare_per_step(llm, layer_index, prompts)
    assert not mismatches, mismatches
    assert any(sum(n == 1 for n in q) > 16 for q, _ in rows), [q for q, _ in rows]
    assert any(n > 16 and n < s for q, lens in rows for n, s in zip(q, lens))


@pytest.mark.skipif(not q32.available(), reason="needs the q32 products (AVX-512 VNNI, bf16 units)")
@pytest.mark.parametrize("kind", ["32-value", "K-quant"])
def test_one_call_layer_with_a_qkv_bias_equals_the_module_path(tmp_path, monkeypatch, kind):
    """A Qwen2 layer (q|k|v bias) whose projections are all q32 ones (32-value types, or a
    Q4_K_M file's Q4_K / Q5_K sub-blocks) runs as one native call and gives the module path's
    output and K/V, bit for bit."""
    from gguf import GGMLQuantizationType as Q

    from tests import test_gguf_models as tiny

    types = {"q_proj": Q.Q5_0, "k_proj": Q.Q8_0, "v_proj": Q.Q4_1, "o_proj": Q.Q8_0,
             "gate_proj": Q.Q5_1, "up_proj": Q.Q4_1, "down_proj": Q.Q4_0}
    if kind == "K-quant":
        types = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q5_K, "o_proj": Q.Q4_K,
                 "gate_proj": Q.Q4_K, "up_proj": Q.Q5_K, "down_proj": Q.Q4_K}
    monkeypatch.setattr(tiny, "_LAYER_TYPES", [tiny._LAYER_TYPES[0], types])
    path = tmp_path / "qwen2.gguf"
    tiny.write_tiny_gguf(path, "qwen2")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=2**24, block_size=8, max_num_seqs=64,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    try:
        layers = llm.engine.model.layers
        assert layers[1].wide_layer._q32 is not None and layers[0].wide_layer._q32 is None
        assert layers[1].self_attn.qkv_proj.bias is not None
        _assert_tiny_layer_equal(llm, 1)
    finally:
        llm.shutdown()


def test_wide_layer_gives_the_module_paths_tokens_and_logprobs():
    llm = _engine()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    layers = llm.engine.model.layers
    saved = [layer.wide_layer for layer in layers]
    calls = []
    # layer by layer, or every layer in one call (WideStack) where all are one-call layers
    kinds = [type(saved[0])] + ([type(llm.engine.model.wide_stack)]
                                if llm.engine.model.wide_stack is not None else [])
    origs = [k.__call__ for k in kinds]

    def counting(orig):
        def call(self, *args):
            calls.append(1)
            return orig(self, *args)
        return call

    try:
        for k, orig in zip(kinds, origs):
            k.__call__ = counting(orig)
        try:
            wide = llm.generate(_prompts(), sp, use_tqdm=False)
        finally:
            for k, orig in zip(kinds, origs):
                k.__call__ = orig
        for layer in layers:
            layer.wide_layer = None
        plain = llm.generate(_prompts(), sp, use_tqdm=False)
    finally:
        for layer, w in zip(layers, saved):
            layer.wide_layer = w
        llm.shutdown()
    assert calls
    for w, p in zip(wide, plain):
        assert w.outputs[0].token_ids == p.outputs[0].token_ids
        assert w.outputs[0].logprobs == p.outputs[0].logprobs


@pytest.mark.parametrize("rows,width", [(1, 5), (3, 64), (70, 576)])
def test_norm_rounds_rms_norm_once_and_adds_the_bf16_residual(rows, width):
    """rms_norm_bf16: x += add (bf16, widened exactly), out = rms_norm(x) rounded to nearest
    even: the float32 native norm's values through `.to(bfloat16)`, widths not a multiple of
    8 through the scalar tail."""
    from pagellm.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=g)
    x = torch.randn(rows, width, generator=g) * 3
    add = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    want_x, want_h = norm.add_forward(x.clone(), add.float())
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    got_x = x.clone()
    assert native.library().rms_norm_bf16(got_x.data_ptr(), add.data_ptr(),
                                          norm.weight.data_ptr(), out.data_ptr(), rows, width,
                                          1e-5, 2) == 0
    assert torch.equal(got_x, want_x) and torch.equal(out, want_h.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["one-call", "oneDNN"])
def test_a_qwen3_layer_equals_the_module_path(tmp_path, monkeypatch, kind):
    """A Qwen3 layer (q and k normalized per head before the rotation): as one native call
    where its products are all q32 ones (32-value types), else through the oneDNN products
    with the native steps between them (a Q6_K down projection has no q32 form); the module
    path's output and K/V either way, bit for bit."""
    from gguf import GGMLQuantizationType as Q

    from tests import test_gemma_qwen3 as tiny

    if kind == "one-call":
        if not q32.available():
            pytest.skip("needs the q32 products (AVX-512 VNNI, bf16 units)")
        monkeypatch.setattr(tiny, "_TYPES", {
            "q_proj": Q.Q5_0, "k_proj": Q.Q8_0, "v_proj": Q.Q4_1, "o_proj": Q.Q8_0,
            "gate_proj": Q.Q5_1, "up_proj": Q.Q4_1, "down_proj": Q.Q4_0})
    path = tmp_path / "qwen3.gguf"
    tiny.write_gguf(path, "qwen3")
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=2**24, block_size=8, max_num_seqs=64,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    try:
        layer = llm.engine.model.layers[1]
        assert layer.self_attn.q_norm is not None
        assert (layer.wide_layer._q32 is not None) == (kind == "one-call")
        _assert_tiny_layer_equal(llm, 1)
    finally:
        llm.shutdown()
