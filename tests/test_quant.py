"""GGUF Q4_0/Q4_1 weights kept packed (pagellm/layers/quant.py): the codes, scales and zeros
read from the file give back exactly the file's values, the packed product matches a dense one,
and the engine on the default model gives the dense model's outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagellm import LLM, SamplingParams
from pagellm.kernels import native
from pagellm.layers import quant
from pagellm.layers.linear import ColumnParallelLinear, RowParallelLinear
from tests.helpers import assert_greedy_close
from pagellm.models import gguf_loader
from pagellm.models.loader import default_model_path, load_model_files
from pagellm.models.registry import use_packed


def _tensor(qtype, rows, cols, rope_heads=None, seed=0):
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(data, qtype).reshape(-1)
    t = gguf_loader.GGUFTensor("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight",
                               (rows, cols), qtype, 0, raw.nbytes, rope_heads)
    return raw, t


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
@pytest.mark.parametrize("rope_heads", [None, 4])
def test_int4_blocks_hold_the_files_exact_values(qtype, rope_heads):
    raw, t = _tensor(qtype, 64, 96, rope_heads)
    blocks = gguf_loader._load_int4(raw, t)
    assert blocks.q.dtype == torch.uint8 and int(blocks.q.max()) <= 15
    assert blocks.scale.shape == (64, 3)
    dense = gguf_loader._load_tensor(raw, t)  # the dequantizing path, permutation included
    assert torch.equal(blocks.dequantize(), dense)
    if rope_heads is None:
        ref = dequantize(raw.reshape(64, -1), qtype)
        assert np.array_equal(blocks.dequantize().numpy(), ref)


def test_narrow_splits_rows_and_whole_groups_only():
    raw, t = _tensor(GGMLQuantizationType.Q4_1, 32, 128)
    b = gguf_loader._load_int4(raw, t)
    full = b.dequantize()
    assert torch.equal(b.narrow(0, 16, 16).dequantize(), full[16:])
    assert torch.equal(b.narrow(1, 32, 64).dequantize(), full[:, 32:96])
    with pytest.raises(ValueError, match="multiples of 32"):
        b.narrow(1, 16, 64)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_packed_product_matches_dense(rows):
    raw, t = _tensor(GGMLQuantizationType.Q4_1, 48, 160, seed=rows)
    b = gguf_loader._load_int4(raw, t)
    x = torch.randn(rows, 160)
    ref = x @ b.dequantize().t()
    packed = quant.pack(b)
    assert isinstance(packed, quant.NativeQ4) == native.available()
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    if isinstance(packed, quant.NativeQ4):  # float32 activations: close to exact
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    out = packed(x.bfloat16())
    assert out.dtype == torch.bfloat16
    # bf16 activations and output: ~3 significant digits
    assert torch.allclose(out.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):  # the fallback kernel too
        out = quant.TorchInt4(b)(x.bfloat16()).float()
        assert torch.allclose(out, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


def test_linears_keep_packed_weights_beside_dense_ones():
    raw_a, ta = _tensor(GGMLQuantizationType.Q4_0, 32, 64, seed=1)
    raw_b, tb = _tensor(GGMLQuantizationType.Q4_1, 16, 64, seed=2)
    a, b = gguf_loader._load_int4(raw_a, ta), gguf_loader._load_int4(raw_b, tb)
    col = ColumnParallelLinear(64, ((32, 1), (16, 1)), bias=False)
    col.load("weight", a, 0)
    assert col.packed is None  # one part still missing
    col.load("weight", b, 1)
    assert col.packed is not None  # packed once every part is in
    col.to(torch.bfloat16)
    # .to(dtype) leaves the packed form alone; its bytes are codes plus block scales
    assert col.packed.nbytes > 48 * 64 // 2
    if isinstance(col.packed, quant.NativeQ4) and col.packed.panels is not None:
        # a GGUF file's f16 scales and mins: the f16 panels (320 bytes a panel and block)
        assert col.packed.panels.dtype == torch.uint8 and col.packed.panels.shape == (3, 2, 320)
    elif isinstance(col.packed, quant.NativeQ4):
        assert col.packed.codes.dtype == torch.uint8 and col.packed.scale_min.dtype == torch.float32
    dense = torch.cat([a.dequantize(), b.dequantize()])
    if col.q32 is not None:  # AVX-512 VNNI + bf16 units: the int8 form instead of a dense copy
        assert col.weight.device.type == "meta"
        assert torch.allclose(col.q32.dequantize(), dense, rtol=0, atol=1e-6)
    else:
        assert torch.equal(col.weight.float(), dense.bfloat16().float())
    x = torch.randn(2, 64)
    ref = x @ dense.t()
    out = col(x.bfloat16()).float()  # 2 rows: the packed path
    assert torch.allclose(out, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    row = RowParallelLinear(64, 32)
    row.load("weight", a)
    row.to(torch.bfloat16)
    assert row.packed is not None
    mixed = ColumnParallelLinear(64, ((32, 1), (16, 1)), bias=False)
    mixed.load("weight", a, 0)
    mixed.load("weight", b.dequantize(), 1)  # a dense part: the fused weight stays dense
    assert mixed.packed is None and torch.equal(mixed.weight, dense)
    odd = ColumnParallelLinear(64, ((8, 1),), bias=False)  # 8 outputs: PyTorch's kernel wants 16k
    odd.load("weight", a.narrow(0, 0, 8), 0)
    assert (odd.packed is None) != native.available()  # the native kernel takes any count
    if odd.q32 is not None:
        assert torch.allclose(odd.q32.dequantize(), a.dequantize()[:8], rtol=0, atol=1e-6)
    else:
        assert torch.equal(odd.weight, a.dequantize()[:8])
    big = torch.randn(40, 64)  # many rows: the dense path, same values
    assert torch.allclose(row(big.bfloat16()).float(), big @ a.dequantize().t(), rtol=0.03,
                          atol=0.03 * (big @ a.dequantize().t()).abs().max().item())


def test_quantization_choice_and_errors(tiny_llama):
    tiny_llama = tiny_llama[0]
    gguf_files = load_model_files(None, load_tokenizer=False)
    hf_files = load_model_files(tiny_llama, load_tokenizer=False)
    cpu = torch.device("cpu")
    assert gguf_files.packed_linears and not hf_files.packed_linears
    assert use_packed(None, gguf_files, torch.bfloat16, cpu)
    assert not use_packed(None, gguf_files, torch.float32, cpu)  # float32 stays dense
    assert not use_packed("none", gguf_files, torch.bfloat16, cpu)
    assert not use_packed(None, hf_files, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="quantization='gguf'"):
        use_packed("gguf", gguf_files, torch.float32, cpu)
    with pytest.raises(ValueError, match="quantization='gguf'"):
        use_packed("gguf", hf_files, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="quantization"):
        LLM(tiny_llama, quantization="awq")


def test_default_model_packed_matches_dense():
    """bf16, the default model: packed 4-bit projections vs the same values dequantized."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = {}
    for q in ("none", "gguf"):
        llm = LLM(default_model_path(), dtype="bfloat16", quantization=q, kv_cache_memory="32MiB")
        packed, total = llm.engine.model.num_packed()
        assert total == 30 * 4  # qkv, o, gate_up, down per layer
        assert packed == (0 if q == "none" else total)
        if q == "gguf":
            dense = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
            assert llm.engine.model.weight_bytes() > dense  # the packed copies are counted
        outs[q] = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
    # TOL: the dense run computes in bf16 end to end, logits included: a bf16 logit between
    # 16 and 32 is a multiple of 1/8 (7 mantissa bits), so each of the two logits behind a
    # log-probability (the token's and the largest, which dominates the normalizer) is off by
    # up to 1/16, and the bf16 activations of 30 layers drift a little more; the packed run
    # (float32 activations, int16 block sums ~1e-4 relative) has float32 logits. Observed:
    # 0.139 (0.125 of it two rounding steps of 1/16) where a SiLU rounded once instead of twice
    # moved the dense run's roundings. Greedy tokens then agree at every position, except
    # where the dense run's chosen token leads the runner-up by less than 2 * TOL (a near-tie
    # either side may break); from there the two continuations may differ.
    TOL = 0.2
    for dense, packed in zip(outs["none"], outs["gguf"]):
        assert_greedy_close(dense.outputs[0], packed.outputs[0], TOL)


def test_auto_dtype_follows_packed_weights():
    from pagellm.engine.memory import resolve_dtype
    from pagellm.layers.linear import UPCAST_BF16

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, packed_weights=True) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == (torch.float32 if UPCAST_BF16 else torch.bfloat16)
    assert resolve_dtype("float32", cpu, packed_weights=True) == torch.float32


def test_default_model_greedy_identical_with_ngram_speculation():
    """The default model as users run it (dtype auto: Q4_1 projections and the Q8_0 head
    packed), n-gram speculation at k = 4 on every step, one request at a time: every
    verification step of up to 5 rows scores each row as a plain step of that row alone does
    (the few-row kernels give a row the bits it has alone), so greedy output is token for
    token the model's own. Edit prompts, where most proposals are accepted and some are not."""
    from pagellm.benchmarks.spec import CODE, CODE_TASKS

    prompts = [[{"role": "user", "content": t.format(c)}] for t in CODE_TASKS[:2] for c in CODE[:3]]
    params = SamplingParams(temperature=0, max_tokens=96)
    plain = LLM(default_model_path(), kv_cache_memory="32MiB")
    off = [plain.chat([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    plain.shutdown()
    llm = LLM(default_model_path(), kv_cache_memory="32MiB",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    on = [llm.chat([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert on == off
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 100 and 0.2 < stats.acceptance_rate < 1.0, stats.as_dict()


def test_default_model_long_prompt_in_chunks():
    """A prompt three times the step's token budget: its first chunks compute no logits (the
    packed head gets no rows), the last one gives the first token, as one step does."""
    ids = list(range(200, 500))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    want = LLM(default_model_path(), kv_cache_memory="32MiB").generate(
        [{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    got = LLM(default_model_path(), kv_cache_memory="32MiB", max_num_batched_tokens=100).generate(
        [{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 4
    # the chunks attend in other tiles than one whole prompt does: close, not bitwise
    assert_greedy_close(want, got, 0.05)
