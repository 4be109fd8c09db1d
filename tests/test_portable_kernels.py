"""The portable build (CPUs without AVX2: the scalar code paths of every C source) gives the
same results as the references: paged attention against a float64 reference, RMSNorm against
torch, and the fused decoder layer against the module path on the default model. An AVX2 build
(no AVX-512: the 8-wide paths a 16-wide CPU never runs) does the same for the gating and the
argmax. (The block-quantized products' portable build is tested in test_cpu_kernels /
test_gguf_kernels.)
"""
from __future__ import annotations

import pytest

from pagellm.kernels import native
from tests import test_cpu_attention, test_cpu_layer, test_cpu_norm, test_sampling

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGELLM_CACHE_DIR", str(tmp_path_factory.mktemp("portable")))
    try:
        return native.load(native.build("cc", [f for f in native.FLAGS if f != "-march=native"]))
    finally:
        mp.undo()


@pytest.fixture
def portable(portable_lib, monkeypatch):
    """Every kernel call of this test goes to the portable library."""
    monkeypatch.setattr(native, "library", lambda: portable_lib)
    assert native.library() is portable_lib and native.available()


@pytest.fixture
def avx2(avx2_kernels, monkeypatch):
    """Every kernel call of this test goes to the AVX2 library (conftest.avx2_kernels)."""
    monkeypatch.setattr(native, "library", lambda: avx2_kernels)


KV_DTYPES = test_cpu_attention.KV_DTYPES


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size,kvh,group", [(1, 1, 1), (16, 2, 4), (16, 3, 3)])
def test_attention(portable, block_size, kvh, group, kv_dtype):
    test_cpu_attention.test_native_attention_matches_reference(block_size, kvh, group, kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("d", [8, 20, 64, 128])
def test_attention_head_sizes(portable, d, kv_dtype):
    test_cpu_attention.test_head_sizes_take_every_vector_path(d, kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_kv(portable, kv_dtype):
    test_cpu_attention.test_native_write_kv_fills_the_slots(kv_dtype)


@pytest.mark.parametrize("rows", [1, 7])
def test_norm(portable, rows):
    test_cpu_norm.test_native_norm_matches_torch(rows)


def test_fused_layer(portable, monkeypatch):
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "UPCAST_BF16", True)  # as test_cpu_layer's autouse fixture
    test_cpu_layer.test_fused_layer_matches_module_path()


@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 37)])
def test_silu_mul_bf16(portable, rows, inter):
    test_cpu_layer.test_silu_mul_bf16_is_the_float32_gate_rounded_once(rows, inter)


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 24), (5, 37)])
def test_silu_mul_bf16_avx2(avx2, rows, inter):
    test_cpu_layer.test_silu_mul_bf16_is_the_float32_gate_rounded_once(rows, inter)


@pytest.mark.parametrize("vocab", [1, 15, 17, 49152])
def test_argmax(portable, vocab):
    test_sampling.test_native_argmax_is_torchs_with_ties_nans_and_infinities(vocab)


@pytest.mark.parametrize("vocab", [1, 7, 9, 49152])
def test_argmax_avx2(avx2, vocab):
    test_sampling.test_native_argmax_is_torchs_with_ties_nans_and_infinities(vocab)
