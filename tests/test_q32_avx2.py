"""The AVX2 build of the q32 products (kernels/cpu_q32.c without AVX-512: vpmaddubsw pair sums
gathered in int16), on any CPU with AVX2: its tiles take codes below 32 (the 4- and 5-bit
types) and refuse wider ones; test_q32's bounds, bit-for-bit and refusal tests hold on it; and
it gives the native build's bits (on an AVX-512 VNNI CPU: the same sums, then the same float
operations lane for lane)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.kernels import native
from pagellm.layers import q32
from tests import test_q32
from tests.gguf_files import random_blocks

FITS = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K)  # codes below 32


@pytest.fixture
def avx2(avx2_kernels, monkeypatch):
    """Every kernel call of this test goes to the AVX2 library (conftest.avx2_kernels)."""
    monkeypatch.setattr(native, "library", lambda: avx2_kernels)
    monkeypatch.delenv("PAGELLM_Q32", raising=False)
    assert q32.max_code() == 31 and q32.available()


@pytest.mark.parametrize("qtype", sorted(q32.Q32_TYPES, key=lambda t: t.name),
                         ids=lambda t: t.name)
def test_every_tile_shape_is_within_the_int8_bound(avx2, qtype):
    test_q32.test_every_tile_shape_is_within_the_int8_bound(qtype)


def test_the_types_it_takes(avx2):
    assert {t for t in q32.Q32_TYPES if q32.CODE_MAX[t] <= q32.max_code()} == set(FITS)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_four_bit_codes_in_nibbles(avx2, qtype):
    test_q32.test_four_bit_codes_are_kept_two_a_byte_with_the_same_products(qtype)


@pytest.mark.parametrize("name", [
    "test_fused_parts_of_different_types_on_one_and_two_threads",
    "test_k_quant_parts_fused_with_each_other_on_one_and_two_threads",
    "test_panels_whose_min_is_a_fixed_multiple_of_d_fold_it_into_the_integer_sum",
    "test_the_gated_product_is_the_product_then_silu_mul_bit_for_bit",
    "test_a_projection_with_a_q32_form_keeps_no_dense_weight",
    "test_a_nan_or_infinite_activation_block_gives_nan_outputs_for_its_row_only",
    "test_float32_activations_quantize_as_their_bf16_rounding",
    "test_the_gated_products_quantized_output_is_its_output_quantized",
])
def test_q32_tests_on_the_avx2_build(avx2, name):
    getattr(test_q32, name)()


@pytest.mark.parametrize("block", (64, 192))
def test_quantizing_in_longer_blocks(avx2, block):
    test_q32.test_quantizing_in_longer_blocks(block)


@pytest.mark.parametrize("block", (32, 64))
def test_a_block_too_small_for_a_finite_code_factor(avx2, block):
    test_q32.test_a_block_too_small_for_a_finite_code_factor_quantizes_to_zeros(block)


def _calls(product, x):
    """The products, the gated product and the quantizers of x (bf16 and float32 rows)."""
    return (product(x), product.gated(x), *q32.quantize(x), *q32.quantize(x.float(), 64))


def test_the_same_bits_as_the_native_build(avx2_kernels, monkeypatch):
    """Every 4- and 5-bit type, folded and float min terms, nibbles and bytes, rows around the
    tiles of both builds (5 and 6) and past a 192-row chunk, NaN blocks: the AVX2 build's
    outputs and quantized activations are the native build's bit for bit (on an AVX-512
    VNNI CPU a different tile; on an AVX2 one, two builds of the same code)."""
    lib = native.library()
    if lib is None or not q32.available():
        pytest.skip("no native q32 kernels on this machine")
    parts = [random_blocks(t, 64, 256, seed=int(t)) for t in FITS]
    forms = [q32.Q32Linear(parts), q32.Q32Linear(parts[:3]),  # bytes; nibbles (4-bit parts)
             q32.Q32Linear(parts[:3], pack_nibbles=False)]
    assert [f.nibbles for f in forms] == [False, True, False] and forms[0].zeros is not None
    g = torch.Generator().manual_seed(3)
    cases = []
    for rows in (1, 4, 5, 6, 11, 30, 197):
        x = (torch.randn(rows, 256, generator=g) * 3).to(torch.bfloat16)
        x[0, :32] *= 30
        if rows > 4:
            x[3, 77] = float("nan")
        cases.append(x)
    want = [[_calls(f, x) for x in cases] for f in forms]
    monkeypatch.setattr(native, "library", lambda: avx2_kernels)
    assert q32.max_code() == 31
    for f, outs in zip(forms, want):
        for x, ref in zip(cases, outs):
            for got, exp in zip(_calls(f, x), ref):
                assert _bits(got, exp)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values bit for bit (bf16 and int8 outputs), NaN where the other has NaN
    (float32 scales)."""
    if a.dtype == torch.float32:
        return test_q32._same(a, b)
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return torch.equal(a, b)


def test_requantized_blocks_are_not_offered(avx2, monkeypatch, caplog):
    """Requantized codes are bytes: PAGELLM_Q32_BLOCK leaves the file's blocks (a warning)."""
    monkeypatch.setenv("PAGELLM_Q32_BLOCK", "auto")
    q32._warn_no_requantized_blocks.cache_clear()
    with caplog.at_level("WARNING"):
        assert q32.wide_block(576) is None
    assert "AVX-512 VNNI" in caplog.text
    form = q32.Q32Linear.from_parts([random_blocks(Q.Q4_1, 32, 576, seed=1)])
    assert form.block == 32 and form.pending_block is None
    with pytest.raises(ValueError, match="codes up to 255"):
        q32.Q32Linear([random_blocks(Q.Q4_1, 32, 576, seed=1)], block=192)(torch.zeros(1, 576))


def _prompts():
    words = ("river town morning boats water children school bank sun fishermen "
             "market bread lamp window road").split()
    # 44 prompts of 3-17 words: a 44-row decode batch, past the packed kernels' 40 rows
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 15))
            for i in range(44)]


def test_the_one_call_layers_on_a_cpu_without_bf16_units(avx2, monkeypatch):
    """The default model as an AVX2 CPU runs it: float32 activations, q32 forms for every
    projection (no dense copy), and many-row steps (the prompts' prefill, a 44-row decode
    batch) through the one-call layers of the AVX2 library (WideStack: bf16 between the
    products, as on CPUs with bf16 units). Against the module path (float32 between the same
    products: the q32 quantizers round their inputs to bf16, the outputs are bf16) gives the
    same tokens and log-probabilities."""
    from pagellm import LLM, SamplingParams
    from pagellm.kernels import cpu_wide_layer
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "UPCAST_BF16", True)
    monkeypatch.setattr(linear, "USE_INT8", True)
    llm = LLM(kv_cache_memory="64MiB", max_num_seqs=64, enable_prefix_caching=False)
    try:
        model = llm.engine.model
        projections = [m for m in model.modules() if isinstance(m, linear._Packed)]
        assert projections and all(m.q32 is not None and m.weight.device.type == "meta"
                                   for m in projections)
        assert model.wide_stack is not None and model.act_dtype == torch.float32
        calls = []
        orig = cpu_wide_layer.WideStack.__call__
        monkeypatch.setattr(cpu_wide_layer.WideStack, "__call__",
                            lambda self, *a: calls.append(a[1].shape[0]) or orig(self, *a))
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
        wide = llm.generate(_prompts(), sp, use_tqdm=False)
        assert calls and max(calls) > 44 and 44 in calls  # the prefill and the decode batch
        stack, layers = model.wide_stack, [lay.wide_layer for lay in model.layers]
        model.wide_stack = None
        for lay in model.layers:
            lay.wide_layer = None
        try:
            plain = llm.generate(_prompts(), sp, use_tqdm=False)
        finally:
            model.wide_stack = stack
            for lay, w in zip(model.layers, layers):
                lay.wide_layer = w
    finally:
        llm.shutdown()
    for a, b in zip(wide, plain):  # the module path rounds to bf16 where the layer does
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [dict(d) for d in a.outputs[0].logprobs] == [dict(d) for d in b.outputs[0].logprobs]
