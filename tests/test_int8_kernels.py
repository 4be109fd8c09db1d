"""The int8 many-row product (pagellm/kernels/cpu_int8.c, layers/int8.py) against float64
products with gguf's own dequantization: the unpacked codes hold every weight exactly, and a
product is within the bound int8 activations allow, for every K-quant type, row counts around
the 4-row tiles and past a row chunk, an odd output count, threads, fused parts of different
types, and the portable (non-AVX2) build of the same source."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.kernels import native
from pagellm.layers import int8, quant
from tests.gguf_files import random_blocks
from tests.helpers import outputs_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
TYPES = sorted(int8.INT8_TYPES, key=lambda t: t.name)


def _bound(x: torch.Tensor, codes: int8.Int8Codes) -> torch.Tensor:
    """Half an int8 step per element, the step at most max(2 max|x_block| / 127,
    max|x_super-block| / 8128), times the coded part |w - m| of the weight (the offset m
    multiplies the exact float sum of x), plus float32 summation."""
    w = codes.dequantize().double()
    n, k = w.shape
    blocks = x.double().abs().view(x.shape[0], k // 256, 8, 32).amax(-1)  # [R, S, 8]
    supers = blocks.amax(-1, keepdim=True)
    step = torch.maximum(2 * blocks / 127, supers / 8128).flatten(1)  # [R, K / 32]
    coded = (w - codes.offset.double().repeat_interleave(codes.offset_width, dim=1)).abs()
    coded = coded.view(n, k // 32, 32).sum(-1)  # [N, K / 32]
    return 0.5 * step @ coded.t() + 2e-6 * (x.double().abs() @ w.abs().t()) + 1e-9


def _check(out: torch.Tensor, x: torch.Tensor, blocks) -> None:
    codes = int8.unpack(blocks)
    ref = x.double() @ blocks.dequantize().double().t()
    err = (out.double() - ref).abs()
    bound = _bound(x, codes)
    assert bool((err <= bound).all()), f"error {(err / bound).max():.2f}x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpacked_codes_are_the_files_weights_exactly(qtype):
    blocks = random_blocks(qtype, 5, 768, seed=int(qtype))
    codes = int8.unpack(blocks)
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 63
    assert torch.equal(codes.dequantize(), blocks.dequantize())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_tile_shape_is_within_the_int8_bound(qtype):
    blocks = random_blocks(qtype, 23, 768, seed=int(qtype))  # odd outputs, 3 super-blocks
    product = int8.NativeInt8.from_blocks([blocks])
    g = torch.Generator().manual_seed(int(qtype))
    for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 40, 67]:
        x = torch.randn(rows, 768, generator=g) * 3
        _check(product(x), x, blocks)


def test_row_chunks_outliers_and_zeros():
    """More rows than one chunk of activations (192 kB / K rows), a super-block 1000x the rest
    (every super-block keeps its own scale), and all-zero rows."""
    blocks = random_blocks(Q.Q4_K, 16, 4096, seed=3)
    product = int8.NativeInt8.from_blocks([blocks])
    x = torch.randn(61, 4096)  # chunks of 48 rows at K = 4096
    x[:, 7] = 5000.0
    _check(product(x), x, blocks)
    assert torch.equal(product(torch.zeros(5, 4096)), torch.zeros(5, 16))
    # a super-block so small that its step's reciprocal overflows: codes of 0 (code_factor),
    # so what is left (the mins' exact sums) is odd in x; saturated codes (-127) were not
    tiny = torch.randn(5, 4096) * 1e-37
    assert torch.equal(product(-tiny), -product(tiny))


def test_blocks_beside_an_outlier_keep_int8_precision():
    """A value 40x the rest: the other 32-value blocks of its super-block still round to
    within half a step of their own max / 127 (one scale per super-block would give them a
    step 40x coarser)."""
    lib = native.library()
    x = torch.randn(3, 512)
    x[:, 7] = 100.0
    xq = torch.empty(3, 512, dtype=torch.int8)
    dx, sh, xs = torch.empty(3, 2), torch.empty(3, 16, dtype=torch.uint8), torch.empty(3, 32)
    lib.quantize_i8(x.data_ptr(), 3, 512, xq.data_ptr(), dx.data_ptr(), sh.data_ptr(), xs.data_ptr())
    values = torch.empty(3, 16, 32)
    values[:, :, int8.BLOCK_ORDER] = xq.view(3, 16, 32).float()  # back to value order
    step = dx.repeat_interleave(8, dim=1) * 2.0 ** sh.float()  # [3, 16]
    back = (values * step.unsqueeze(-1)).view(3, 512)
    own = x.abs().view(3, 16, 32).amax(-1) / 127
    assert bool(((back - x).abs().view(3, 16, 32) <= own.unsqueeze(-1) + 1e-6).all())
    assert int(sh[:, 0].min()) == 6  # the outlier's block: the super-block's largest scale
    assert int(sh[:, 1:8].max()) < 6  # the rest of its super-block: finer steps
    torch.testing.assert_close(xs, x.view(3, 32, 16).sum(-1))


def test_threads_split_outputs_without_changing_them():
    product = int8.NativeInt8.from_blocks([random_blocks(Q.Q6_K, 64, 512, seed=4)])
    one, two = outputs_on_one_and_two_threads(product, torch.randn(50, 512))
    assert torch.equal(one, two)  # each output is summed by one thread in a fixed order


def test_fused_parts_of_different_types():
    """q|k (Q4_K) beside v (Q6_K): one run per layout, activations quantized once, each run
    writing its own columns."""
    q, k, v = (random_blocks(t, 24, 256, seed=s) for s, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K)))
    product = int8.NativeInt8.from_blocks([q, k, v])
    assert len(product.runs) == 2 and product.out_features == 72
    x = torch.randn(12, 256)
    out = product(x)
    for i, b in enumerate((q, k, v)):
        _check(out[:, 24 * i:24 * (i + 1)], x, b)


def test_types_without_an_int8_form_are_refused():
    """32-value types keep their dense weights (kernels/cpu_int8.c says why)."""
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
        assert int8.NativeInt8.from_blocks([random_blocks(qtype, 4, 256, seed=1)]) is None
    assert int8.NativeInt8.from_blocks([random_blocks(Q.Q4_K, 4, 256, seed=1),
                                        random_blocks(Q.Q8_0, 4, 256, seed=1)]) is None


def test_portable_build_gives_the_same_products(tmp_path, monkeypatch):
    """The scalar code path (CPUs without AVX2) built from the same source."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    lib = native.load(native.build("cc", [f for f in native.FLAGS if f != "-march=native"]))
    monkeypatch.setattr(native, "library", lambda: lib)
    for qtype in TYPES:
        blocks = random_blocks(qtype, 9, 512, seed=7)
        product = int8.NativeInt8.from_blocks([blocks])
        for rows in (1, 5, 9):
            x = torch.randn(rows, 512)
            _check(product(x), x, blocks)


def test_the_unpacking_reads_the_layouts_gguf_documents():
    """Independent of gguf's dequantizer: a Q6_K block whose codes are all 32 is zero whatever
    its scales, and a Q4_K block of codes 0 is exactly its mins (-dmin * mn)."""
    blocks = random_blocks(Q.Q6_K, 2, 256, seed=9)
    raw = blocks.raw.numpy().copy()
    raw[:, :128] = 0  # low 4 bits 0
    raw[:, 128:192] = 0b10101010  # high 2 bits 2 in every quadrant: q6 = 32
    codes = int8.unpack(quant.GGUFBlocks(torch.from_numpy(raw), Q.Q6_K, 256))
    assert torch.equal(codes.codes, torch.full((2, 256), 32, dtype=torch.uint8))
    assert torch.equal(codes.dequantize(), torch.zeros(2, 256))
    blocks = random_blocks(Q.Q4_K, 2, 256, seed=8)
    raw = blocks.raw.numpy().copy()
    raw[:, 16:] = 0
    zeroed = quant.GGUFBlocks(torch.from_numpy(raw), Q.Q4_K, 256)
    np.testing.assert_array_equal(int8.unpack(zeroed).dequantize().numpy(),
                                  zeroed.dequantize().numpy())
    assert int(int8.unpack(zeroed).codes.max()) == 0


def test_a_projection_with_an_int8_form_keeps_no_dense_weight(monkeypatch):
    """A fused q|k|v of K-quant parts: the dense weight is never made (meta device), few rows
    take the packed kernel, many the int8 one; one Q8_0 part keeps the whole weight dense."""
    from pagellm.layers import linear

    monkeypatch.setattr(linear, "USE_INT8", True)
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")  # few rows in int16 (the panels' int8: test_panels)
    parts = [random_blocks(t, 32, 256, seed=s) for s, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K))]
    layer = linear.ColumnParallelLinear(256, ((32, 1), (32, 1), (32, 1)), bias=False)
    for shard, part in enumerate(parts):
        layer.load("weight", part, shard)
    assert layer.weight.device.type == "meta" and layer.int8 is not None
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(50, 256)
    ref = x.double() @ dense.double().t()
    for i, b in enumerate(parts):
        _check(layer(x)[:, 32 * i:32 * (i + 1)], x, b)  # 50 rows: int8
    few = layer(x[:2]).double()  # packed int16 kernel: float32-close
    assert (few - ref[:2]).abs().max() <= 1e-4 * ref[:2].abs().max()

    mixed = linear.ColumnParallelLinear(256, ((32, 1), (32, 1)), bias=False)
    q8 = random_blocks(Q.Q8_0, 32, 256, seed=9)
    mixed.load("weight", parts[0], 0)
    mixed.load("weight", q8, 1)
    assert mixed.int8 is None and mixed.weight.device.type == "cpu"
    assert torch.equal(mixed.weight.data, torch.cat([parts[0].dequantize(), q8.dequantize()]))
