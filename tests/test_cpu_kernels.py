"""The native block-quantized kernels (pagellm/kernels/cpu_quant.c, built by
pagellm/kernels/native.py) against float64 products
with the dequantized weights: every row count 1..20 and 24, 33, 40 (row blocks of 8, the one-row path with an
odd number of blocks), Q4 with and without mins, Q8, thread counts, and the portable (non-AVX2)
build of the same source."""
from __future__ import annotations

import pytest
import torch

from pagellm.kernels import native
from pagellm.layers import panels, quant
from tests.helpers import outputs_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


@pytest.fixture(params=["panels", "rows"])
def layout(request, monkeypatch):
    """NativeQ4's two layouts: panels of 16 outputs (cpu_panels.c, AVX-512 BW + VNNI) and rows
    (cpu_quant.c, every CPU; PAGELLM_PANELS=0)."""
    if request.param == "panels" and not panels.available():
        pytest.skip("panel kernels need AVX-512 BW and VNNI")
    monkeypatch.setenv("PAGELLM_PANELS", "1" if request.param == "panels" else "0")
    return request.param


def _q4(n, k, seed, with_min=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.05
    zero = (torch.randn(n, k // 32, generator=g) * 0.1) if with_min else torch.zeros(n, k // 32)
    return quant.Int4Blocks(q, scale, zero)


def _q8(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return quant.Int8Blocks(q, torch.rand(n, k // 32, generator=g) * 0.01)


def _close(out, x, blocks, per_block=False):
    """out within the error of int16 activations: per element half a step of max|x| / 32767
    over the row (or, per_block, over the 32-value block: rows with a block far below the
    row's largest value are scaled block by block), times the coded part of the weight (scale
    * q; a Q4 block's min multiplies the exact sum of x), plus float32 summation."""
    x, w = x.double(), blocks.dequantize().double()
    ref = x @ w.t()
    n, k = w.shape
    blocks_max = x.abs().view(x.shape[0], k // 32, 32).amax(-1)  # [R, G]
    step = (blocks_max if per_block else blocks_max.amax(-1, keepdim=True).expand_as(blocks_max)) / 32767
    coded = blocks.q.view(n, k // 32, 32).double().abs().sum(-1) * blocks.scale.double()  # [N, G]
    bound = 0.5 * step @ coded.t() + 1e-6 * (x.abs() @ w.abs().t()) + 1e-9
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), (err / bound).max().item()


@pytest.mark.parametrize("k", [32, 96, 576])
def test_q4_matches_dequantized_product_for_every_row_count(k, layout):
    w = _q4(40, k, seed=k)
    packed = quant.NativeQ4(w)
    assert (packed.panels is not None) == (layout == "panels")
    g = torch.Generator().manual_seed(k)
    for rows in [*range(1, 21), 24, 33, 40]:  # the engine sends up to 40 rows (max_rows 41)
        x = torch.randn(rows, k, generator=g) * 3
        _close(packed(x), x, w)


def test_q4_without_mins_and_with_outliers(layout):
    w = _q4(24, 64, seed=1, with_min=False)  # Q4_0: min = -8 * scale
    x = torch.randn(5, 64)
    x[:, 3] = 5000.0  # an outlier 1000x the rest: the other block gets a scale of its own
    _close(quant.NativeQ4(w)(x), x, w, per_block=True)
    _close(quant.NativeQ8(_q8(24, 64, seed=7))(x), x, _q8(24, 64, seed=7), per_block=True)
    x[:, 3] = 50.0  # within 128x: one scale per row, still >= 8 significant bits everywhere
    _close(quant.NativeQ4(w)(x), x, w)
    zero = torch.zeros(2, 64)
    assert torch.equal(quant.NativeQ4(w)(zero), torch.zeros(2, 24))
    # values below 32767 / FLT_MAX (~9.6e-35): no finite int16 factor, codes of 0
    # (vec_math.h code_factor), so what is left (the min term's exact sums) is odd in x;
    # an infinite factor saturated every code to -32768, whatever the values' signs
    tiny = torch.randn(2, 64) * 1e-37
    assert torch.equal(quant.NativeQ4(w)(-tiny), -quant.NativeQ4(w)(tiny))


def test_q8_head_matches_dequantized_product():
    w = _q8(300, 128, seed=2)
    head = quant.NativeQ8(w)
    for rows in (1, 2, 7, 9, 17):
        x = torch.randn(rows, 128)
        out = head(x.bfloat16())  # logits come back float32 whatever the input dtype
        assert out.dtype == torch.float32
        _close(out, x.bfloat16(), w)


def test_threads_split_outputs_without_changing_them(layout):
    w = _q4(64, 128, seed=3)
    one, two = outputs_on_one_and_two_threads(quant.NativeQ4(w), torch.randn(3, 128))
    assert torch.equal(one, two)  # each output is summed by one thread in a fixed order


def test_portable_build_gives_the_same_products(tmp_path, monkeypatch):
    """The scalar code path (CPUs without AVX2) built from the same source."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    lib = native.load(native.build("cc", [f for f in native.FLAGS if f != "-march=native"]))
    assert any(tmp_path.iterdir())
    w, w8 = _q4(16, 96, seed=4), _q8(16, 96, seed=5)
    q8 = quant.NativeQ8(w8)
    q4_rows = quant.NativeQ4.row_form(w)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 96)
        for fn, (codes, scales), blocks in ((lib.q4_linear, q4_rows, w),
                                            (lib.q8_linear, (q8.codes, q8.scale), w8)):
            y = torch.empty(rows, 16)
            assert fn(x.data_ptr(), rows, 96, codes.data_ptr(), scales.data_ptr(), 16, y.data_ptr(), 1) == 0
            _close(y, x, blocks)
    # no panel kernel there: NativeQ4 keeps the row layout on such a build
    assert lib.panels_available() == 0
    packed = panels.pack(panels.Q4_F32, w.q.numpy(), scale=w.scale.numpy(),
                         low=(w.zero - 8 * w.scale).numpy())
    y = torch.empty(1, 16)
    assert lib.panel_linear(x.data_ptr(), 1, 96, packed.data_ptr(), panels.Q4_F32, 16,
                            y.data_ptr(), 1) == -2


def test_disabled_kernels_fall_back(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    native.library.cache_clear()
    try:
        assert not native.available()
        w = _q4(32, 64, seed=6)
        packed = quant.pack(w)
        assert isinstance(packed, quant.TorchInt4)
        x = torch.randn(2, 64)
        ref = x @ w.dequantize().t()
        assert torch.allclose(packed(x.bfloat16()).float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    finally:
        monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
        native.library.cache_clear()
    assert native.available()


def test_failed_build_falls_back(monkeypatch, tmp_path):
    """No compiler on the machine: a warning, and PyTorch kernels instead of a crash."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        assert not native.available()
        assert isinstance(quant.pack(_q4(16, 64, seed=8)), quant.TorchInt4)
    finally:
        monkeypatch.delenv("CC")
        native.library.cache_clear()
    assert native.available()
