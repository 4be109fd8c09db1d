"""The int8-activation product of 32-value block weights (pagellm/kernels/cpu_q32.c,
layers/q32.py) against float64 products with gguf's own dequantization: the unsigned codes
hold every weight of each type exactly, and a product is within the bound int8 activations
allow (half a step of max|x| / 127 per value, times the weight's magnitude, and the
bf16 output's rounding) for row counts around the 6-row tiles and past a 192-row chunk,
outputs not a multiple of 32, fused parts of different types, and 1 or 2 threads."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.layers import q32, quant
from tests.gguf_files import random_blocks
from tests.helpers import outputs_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not q32.available(),
                                reason="needs AVX-512 VNNI or AVX2 (and a C compiler)")
TYPES = sorted(q32.Q32_TYPES, key=lambda t: t.name)
K_QUANTS = (Q.Q4_K, Q.Q5_K)  # 32-value sub-blocks of 256-value super-blocks
# Codes of 32 and more (Q8_0, the i-quants, requantized blocks) need the AVX-512 VNNI tiles;
# the AVX2 ones take the 4- and 5-bit types (tests/test_q32_avx2.py runs these tests on that
# build wherever the CPU has AVX2)
needs_byte_codes = pytest.mark.skipif(q32.max_code() < 255,
                                      reason="codes of 32 and more: AVX-512 VNNI tiles")


def _takes(qtype) -> bool:
    """Whether the tiles of the library in use take this type's codes."""
    return q32.CODE_MAX[qtype] <= q32.max_code()


def _wide_part():
    """The type of the fused tests' wider part: Q8_0 where the tiles take bytes, else Q5_0."""
    return Q.Q8_0 if _takes(Q.Q8_0) else Q.Q5_0


def _cols(qtype, blocks: int) -> int:
    """A row of `blocks` 32-value blocks, rounded up to whole super-blocks for K-quants."""
    return -(-blocks * 32 // 256) * 256 if qtype in (*K_QUANTS, Q.IQ4_XS) else blocks * 32


def _bound(x: torch.Tensor, product: q32.Q32Linear) -> torch.Tensor:
    """Half a step of each activation block (the product's: 32 values, or its requantized
    block) times the sum of the block's |w_j| (the min term m * sx multiplies the rounded
    activations too: K-quant mins are as large as the codes' part), and float32's
    rounding."""
    n, k, b = product.out_features, product.in_features, product.block
    w = product.dequantize().double()
    weight = w.abs().view(n, k // b, b).sum(-1)  # [N, K / b]
    step = x.double().abs().view(x.shape[0], k // b, b).amax(-1) / 127  # [R, K / b]
    return 0.5 * step @ weight.t() + 2e-6 * (x.double().abs() @ w.abs().t()) + 1e-9


def _check(out: torch.Tensor, x: torch.Tensor, product: q32.Q32Linear, weights) -> None:
    """x: the activations as the product sees them (bf16 values)."""
    assert out.dtype == torch.bfloat16
    ref = x.double() @ weights.double().t()
    err = (out.double() - ref).abs()
    bound = _bound(x, product) + ref.abs() * 2 ** -8  # and the bf16 output's rounding
    assert bool((err <= bound).all()), f"error {(err / bound).max():.2f}x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unsigned_codes_are_the_files_weights_exactly(qtype):
    k = _cols(qtype, 3)
    blocks = random_blocks(qtype, 7, k, seed=int(qtype))
    u, d, m = q32.unsigned_blocks(blocks)
    assert u.dtype == torch.uint8 and d.shape == m.shape == (7, k // 32)
    w = u.double().view(7, k // 32, 32) * d.double()[..., None] + m.double()[..., None]
    assert torch.equal(w.view(7, k).float(), blocks.dequantize())
    assert torch.equal(q32.Q32Linear([blocks]).dequantize(), blocks.dequantize())


def test_the_int4_loader_form_gives_its_own_weights():
    g = torch.Generator().manual_seed(0)
    int4 = quant.Int4Blocks(torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=g),
                            torch.rand(5, 2, generator=g) / 20, torch.randn(5, 2, generator=g) / 20)
    # m = zero - 8 * scale in float32: within an ulp of the dequantized weights
    w = q32.Q32Linear([int4]).dequantize()
    assert torch.allclose(w, int4.dequantize(), rtol=0, atol=2 ** -22)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_tile_shape_is_within_the_int8_bound(qtype):
    """A type whose codes the tiles do not take (AVX2: 32 and more) has no form, and a
    form made anyway is refused rather than run into int16 sums that would wrap."""
    k = _cols(qtype, 5)
    blocks = random_blocks(qtype, 45, k, seed=int(qtype))  # a partial panel; 5 or 8 blocks
    product = q32.Q32Linear([blocks])
    if not _takes(qtype):
        assert q32.Q32Linear.from_parts([blocks]) is None and not q32.fits(blocks)
        with pytest.raises(ValueError, match="codes up to"):
            product(torch.zeros(2, k))
        return
    assert q32.fits(blocks) and q32.Q32Linear.from_parts([blocks]) is not None
    w = blocks.dequantize()
    g = torch.Generator().manual_seed(int(qtype))
    for rows in [1, 2, 3, 5, 6, 7, 11, 12, 13, 197]:
        x = torch.randn(rows, k, generator=g) * 3
        x[0, :32] *= 40  # one block far larger than the rest
        xb = x.to(torch.bfloat16)
        _check(product(xb), xb.float(), product, w)
        assert torch.equal(product(x), product(xb))  # float32 inputs are rounded to bf16 first


def test_fused_parts_of_different_types_on_one_and_two_threads():
    parts = [random_blocks(Q.Q4_1, 40, 128, seed=1), random_blocks(_wide_part(), 24, 128, seed=2),
             quant.Int4Blocks(torch.randint(0, 16, (8, 128), dtype=torch.uint8),
                              torch.rand(8, 4) / 20, torch.randn(8, 4) / 20)]
    product = q32.Q32Linear(parts)
    w = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(70, 128).to(torch.bfloat16)
    one, two = outputs_on_one_and_two_threads(product, x)
    assert one.shape == (70, 72) and torch.equal(one, two)
    _check(one, x.float(), product, w)


def test_k_quant_parts_fused_with_each_other_on_one_and_two_threads():
    """A Q4_K_M file's gate (Q4_K) | up (Q5_K) and a Q4_K part after a 32-value one: each
    sub-block's scale and min are its own block's d and m."""
    parts = [random_blocks(Q.Q4_K, 64, 512, seed=11), random_blocks(Q.Q5_K, 64, 512, seed=12),
             random_blocks(Q.Q4_1, 8, 512, seed=13)]
    product = q32.Q32Linear(parts)
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(product.dequantize(), w)
    x = (torch.randn(23, 512) * 2).to(torch.bfloat16)
    one, two = outputs_on_one_and_two_threads(product, x)
    assert one.shape == (23, 136) and torch.equal(one, two)
    _check(one, x.float(), product, w)


def test_panels_whose_min_is_a_fixed_multiple_of_d_fold_it_into_the_integer_sum():
    """Q4_0 (m = -8 d), Q5_0 (-16 d) and Q8_0 (-128 d) panels start each block's sum from -z
    times its activations' sum; Q4_1, Q5_1 and K-quant panels keep the float min term. Folded
    or not, a product is the same sum: the same bf16 outputs but for float32's roundings (at
    most one step of bf16 apart), and within the int8 bound."""
    parts = [random_blocks(Q.Q4_1, 64, 128, seed=21), random_blocks(Q.Q4_0, 32, 128, seed=22),
             random_blocks(Q.Q5_0, 32, 128, seed=23)]
    if _takes(Q.Q8_0):
        parts.append(random_blocks(Q.Q8_0, 40, 128, seed=24))
    product = q32.Q32Linear(parts)
    # panels: two of Q4_1, one of Q4_0, one of Q5_0, then Q8_0 and its padding
    assert product.zeros.tolist() == [0, 0, 8, 16] + ([128, 128] if _takes(Q.Q8_0) else [])
    assert q32.Q32Linear([random_blocks(Q.Q5_1, 32, 128, seed=25)]).zeros is None
    unfolded = q32.Q32Linear(parts)
    unfolded.zeros = None
    w = torch.cat([p.dequantize() for p in parts])
    g = torch.Generator().manual_seed(26)
    for rows in [1, 7, 197]:
        x = (torch.randn(rows, 128, generator=g) * 3).to(torch.bfloat16)
        folded, plain = product(x), unfolded(x)
        _check(folded, x.float(), product, w)
        step = plain.float().abs() * 2 ** -7 + 1e-30  # one bf16 step at most
        assert bool(((folded.float() - plain.float()).abs() <= step).all())
        assert torch.equal(folded[:, :64], plain[:, :64])  # Q4_1 panels: the same operations
    one, two = outputs_on_one_and_two_threads(product, x)
    assert torch.equal(one, two)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda t: t.name)
def test_four_bit_codes_are_kept_two_a_byte_with_the_same_products(qtype):
    """4-bit codes are kept in nibbles (half the bytes) and multiply exactly as the same codes
    one a byte: the same bits for every tile shape, past a 192-row chunk, gated too, on 1 and
    2 threads. Wider codes (Q5_0, Q8_0, a 4-bit part fused with a Q8_0 one) stay bytes."""
    k = _cols(qtype, 3)
    blocks = random_blocks(qtype, 128, k, seed=int(qtype) + 40)
    packed, plain = q32.Q32Linear([blocks]), q32.Q32Linear([blocks], pack_nibbles=False)
    assert packed.nibbles and not plain.nibbles
    assert packed.codes.numel() * 2 == plain.codes.numel()
    assert torch.equal(packed.unpacked_codes(), plain.codes)
    assert torch.equal(packed.dequantize(), blocks.dequantize())
    g = torch.Generator().manual_seed(int(qtype))
    for rows in [1, 5, 6, 7, 13, 197]:
        x = (torch.randn(rows, k, generator=g) * 3).to(torch.bfloat16)
        want = plain(x)
        one, two = outputs_on_one_and_two_threads(packed, x)
        assert torch.equal(one.view(torch.int16), want.view(torch.int16))
        assert torch.equal(two.view(torch.int16), want.view(torch.int16))
        assert torch.equal(packed.gated(x).view(torch.int16), plain.gated(x).view(torch.int16))
    wider = ([random_blocks(Q.Q5_0, 32, 64, seed=41)], [random_blocks(Q.Q8_0, 32, 64, seed=42)],
             [random_blocks(Q.Q4_1, 32, 64, seed=43), random_blocks(Q.Q8_0, 32, 64, seed=44)])
    for parts in wider:
        assert not q32.Q32Linear(parts).nibbles


def test_the_gated_product_is_the_product_then_silu_mul_bit_for_bit():
    """gated(x): gate | up panels gated in the product's tiles give exactly the bits of the
    product's bf16 output through silu_mul_bf16, for every tile shape, past a 192-row chunk,
    on 1 and 2 threads; an output count that does not split into 32-wide halves is refused."""
    from pagellm.kernels.cpu_layer import silu_mul_bf16

    parts = [random_blocks(Q.Q4_1, 64, 96, seed=3), random_blocks(Q.Q5_0, 64, 96, seed=4)]
    product = q32.Q32Linear(parts)  # gate: Q4_1, up: Q5_0 (two panels each)
    g = torch.Generator().manual_seed(5)
    for rows in [1, 5, 6, 7, 13, 197]:
        x = (torch.randn(rows, 96, generator=g) * 4).to(torch.bfloat16)
        x[0, :8] = 60.0  # gates deep in SiLU's saturation and its tail
        x[-1, 40:48] = -60.0
        want = silu_mul_bf16(product(x))
        one, two = outputs_on_one_and_two_threads(product.gated, x)
        assert one.shape == (rows, 64)
        assert torch.equal(one.view(torch.int16), want.view(torch.int16))
        assert torch.equal(two.view(torch.int16), want.view(torch.int16))
    odd = q32.Q32Linear([random_blocks(Q.Q4_0, 96, 64, seed=6)])  # 48 + 48: not 32-wide
    assert not odd.gates
    with pytest.raises(ValueError, match="multiple of 32"):
        odd.gated(torch.zeros(2, 64))


def test_other_types_have_no_int8_form():
    """Q6_K's scales are per 16 values (two in a 32-value block): no u8 code and one d hold
    them, so a projection with a Q6_K part keeps its dense form."""
    assert q32.unsigned_blocks(random_blocks(Q.Q6_K, 2, 256, seed=0)) is None
    q3 = quant.GGUFBlocks(torch.zeros(2, 110, dtype=torch.uint8), Q.Q3_K, 256)
    assert q32.unsigned_blocks(q3) is None and not q32.unsigned_blocks_kind(q3)
    assert q32.Q32Linear.from_parts([random_blocks(Q.Q4_K, 32, 256, seed=0),
                                     random_blocks(Q.Q6_K, 32, 256, seed=0)]) is None


def test_a_projection_with_a_q32_form_keeps_no_dense_weight():
    """A fused q|k|v of 32-value parts: the dense weight is never made (meta device), few rows
    take the packed kernel, many the q32 one; a Q6_K part keeps the whole weight dense."""
    from pagellm.layers import linear

    parts = [random_blocks(t, 32, 256, seed=s)
             for s, t in enumerate((Q.Q4_1, Q.Q4_1, _wide_part()))]
    layer = linear.ColumnParallelLinear(256, ((32, 1), (32, 1), (32, 1)), bias=False)
    for shard, part in enumerate(parts):
        layer.load("weight", part, shard)
    assert layer.weight.device.type == "meta" and layer.q32 is not None
    assert layer.bf16_wide is layer.q32 and layer.wide is layer.q32
    assert layer.q32.block == 32  # the file's blocks (PAGELLM_Q32_BLOCK unset)
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(50, 256).to(torch.bfloat16).float()
    _check(layer(x).to(torch.bfloat16), x, layer.q32, dense)  # 50 rows: q32
    ref = x[:2].double() @ dense.double().t()
    few = layer(x[:2]).double()  # packed int16 kernel: float32-close
    assert (few - ref).abs().max() <= 1e-4 * ref.abs().max()

    mixed = linear.ColumnParallelLinear(256, ((32, 1), (32, 1)), bias=False)
    k6 = random_blocks(Q.Q6_K, 32, 256, seed=9)
    mixed.load("weight", parts[0], 0)
    mixed.load("weight", k6, 1)
    assert mixed.q32 is None and mixed.weight.device.type == "cpu"
    assert torch.equal(mixed.weight.data, torch.cat([parts[0].dequantize(), k6.dequantize()]))


def test_a_nan_or_infinite_activation_block_gives_nan_outputs_for_its_row_only():
    blocks = random_blocks(Q.Q4_1, 40, 96, seed=4)
    product = q32.Q32Linear([blocks])
    x = torch.randn(8, 96)
    x[2, 40], x[5, 3] = float("nan"), float("inf")
    y = product(x)
    assert torch.isnan(y[2]).all() and torch.isnan(y[5]).all()
    rest = [0, 1, 3, 4, 6, 7]
    assert torch.isfinite(y[rest]).all() and torch.equal(y[rest], product(x[rest]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=7.5), torch.nan_to_num(b, nan=7.5)) and bool(
        (a.isnan() == b.isnan()).all())


def test_float32_activations_quantize_as_their_bf16_rounding():
    """q32_quantize_f32 (float32 rows rounded as they are read) gives the codes and scales of
    q32_quantize over `.to(bfloat16)`: halfway cases, values that round up to the next power
    of two or to infinity, NaN and infinite blocks, zero blocks; 1 and 2 threads."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 128, generator=g) * 5
    bits = x.view(torch.int32)
    bits[1] = (bits[1] & ~0xFFFF) | 0x8000  # exactly halfway between two bf16 values
    bits[2] = (bits[2] & ~0xFFFF) | 0x7FFF
    x[3, :32] = 3.4e38  # rounds to infinity in bf16: the block is NaN
    x[4, 40] = float("nan")
    x[5, 70] = float("-inf")
    x[6, :64] = 0.0
    x[7] = 1.99999  # rounds up to 2.0
    x.view(torch.int32)[8, 5] = -1  # a NaN with every payload bit set (0xFFFFFFFF)
    x.view(torch.int32)[9, 100] = 0x7FFFFFFF
    want = q32.quantize(x.to(torch.bfloat16))
    for got in outputs_on_one_and_two_threads(q32.quantize, x):
        assert torch.equal(got[0], want[0])
        assert _same(got[1], want[1]) and _same(got[2], want[2])
    assert all(torch.isnan(want[1][r, g]) for r, g in ((3, 0), (4, 1), (5, 2), (8, 0), (9, 3)))


def test_the_gated_products_quantized_output_is_its_output_quantized():
    """q32_linear_gated_q: each tile's 32 gated values of a row quantized where they are made
    give the codes and scales q32_quantize gives from the gated product's bf16 output."""
    from pagellm.kernels import native

    parts = [random_blocks(Q.Q4_1, 64, 96, seed=7), random_blocks(_wide_part(), 64, 96, seed=8)]
    product = q32.Q32Linear(parts)
    g = torch.Generator().manual_seed(9)
    for rows in [1, 6, 7, 197]:
        x = (torch.randn(rows, 96, generator=g) * 4).to(torch.bfloat16)
        x[-1, 3] = float("nan")  # the last row's gated values are NaN: NaN blocks
        want = q32.quantize(product.gated(x))
        xq, dx, sx = q32.quantize(x)
        aq = torch.empty(rows, 64, dtype=torch.int8)
        adx, asx = torch.empty(rows, 2), torch.empty(rows, 2)
        for threads in (1, 2):
            aq.fill_(99), adx.fill_(-1.0), asx.fill_(-1.0)  # nothing left from the last run
            assert native.library().q32_linear_gated_q(
                xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows, 96, 32,
                product.codes.data_ptr(), product.d.data_ptr(), product.m.data_ptr(),
                product.zeros_ptr(), int(product.nibbles), 128,
                aq.data_ptr(), adx.data_ptr(), asx.data_ptr(), 32, None, threads) == 0
            assert torch.equal(aq, want[0]) and _same(adx, want[1]) and _same(asx, want[2])
        assert torch.isnan(adx[-1]).all()


# Requantized blocks: the file's values as int8 codes with one scale per 64-256 inputs
WIDE = (64, 128, 192, 256)


@needs_byte_codes
def test_requantized_blocks_are_opt_in_and_the_longest_that_divides_the_inputs(monkeypatch):
    parts = [random_blocks(Q.Q4_1, 32, 576, seed=1), random_blocks(Q.Q8_0, 32, 576, seed=2)]
    exact = q32.Q32Linear.from_parts(parts)  # the default: the file's blocks, exactly
    assert exact.block == 32 and exact.nibbles is False and torch.equal(
        exact.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert exact.pending_block is None
    monkeypatch.setenv("PAGELLM_Q32_BLOCK", "auto")
    assert [q32.wide_block(k) for k in (576, 1536, 896, 8960, 320, 96)] == [
        192, 256, 128, 256, 64, None]
    # the file's blocks until the loader requantizes the form (q32_smooth.requantize_model)
    form = q32.Q32Linear.from_parts(parts)
    assert form.block == 32 and form.pending_block == 192
    assert torch.equal(form.dequantize(), exact.dequantize())
    wide = q32.Q32Linear.from_blocks(*form.own_blocks(), 192)
    assert wide.block == 192 and wide.pending_block is None and wide.inv is None
    assert torch.equal(wide.codes, q32.Q32Linear(parts, block=192).codes)
    assert q32.Q32Linear.from_parts([random_blocks(Q.Q4_1, 32, 96, seed=3)]).pending_block is None
    monkeypatch.setenv("PAGELLM_Q32_BLOCK", "64")
    assert q32.Q32Linear.from_parts(parts).pending_block == 64
    monkeypatch.setenv("PAGELLM_Q32_BLOCK", "256")
    assert q32.Q32Linear.from_parts(parts).pending_block is None  # 576 is no multiple of 256
    for bad in ("48", "512", "fast"):
        monkeypatch.setenv("PAGELLM_Q32_BLOCK", bad)
        with pytest.raises(ValueError, match="PAGELLM_Q32_BLOCK"):
            q32.Q32Linear.from_parts(parts)
    with pytest.raises(ValueError, match="block"):
        q32.Q32Linear(parts, block=80)
    with pytest.raises(ValueError, match="block"):
        q32.Q32Linear(parts, block=256)  # 576 is not a multiple of 256


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("block", WIDE)
def test_requantized_codes_hold_each_weight_within_half_a_step(qtype, block):
    """Each weight moves by at most half its block's step max|w| / 127 (the nearest code),
    the codes are bytes (no nibbles) around a folded zero of 128, and a block of zeros
    stays zeros."""
    k = 768
    blocks = random_blocks(qtype, 40, k, seed=int(qtype) + block)
    w = blocks.dequantize().double()
    product = q32.Q32Linear([blocks], block=block)
    assert product.block == block and not product.nibbles
    assert product.d.shape == (2, k // block, 32)
    assert product.zeros is not None and bool((product.zeros == 128).all())
    got = product.dequantize().double()
    step = w.abs().view(40, k // block, block).amax(-1, keepdim=True) / 127
    err = (got - w).view(40, k // block, block).abs()
    assert bool((err <= step * (0.5 + 1e-4)).all())  # and d's float32 rounding times 127
    assert float(err.max()) > 0  # requantized, not the file's codes
    codes = product.unpacked_codes().permute(0, 2, 1, 3).reshape(64, k)[:40]  # real outputs
    assert int(codes.min()) >= 1 and int(codes.max()) <= 255  # |c| <= 127

    zero = quant.Int4Blocks(torch.full((32, k), 8, dtype=torch.uint8),
                            torch.ones(32, k // 32), torch.zeros(32, k // 32))  # w = 0 exactly
    z = q32.Q32Linear([zero], block=block)
    assert bool((z.d == 0).all()) and bool((z.dequantize() == 0).all())
    if _takes(Q.Q8_0):  # requantized codes are bytes: AVX-512 VNNI tiles
        assert bool((z(torch.randn(3, k)) == 0).all())


@needs_byte_codes
@pytest.mark.parametrize("block", WIDE)
def test_requantized_products_of_every_tile_shape_are_within_the_int8_bound(block):
    """The products against the requantized weights (activations rounded per the same
    block) on fused parts of several types, one and two threads the same."""
    k = 768
    parts = [random_blocks(Q.Q4_1, 40, k, seed=1), random_blocks(Q.Q4_K, 24, k, seed=2),
             random_blocks(Q.Q8_0, 13, k, seed=3)]  # a partial last panel
    product = q32.Q32Linear(parts, block=block)
    w = product.dequantize()
    exact = torch.cat([p.dequantize() for p in parts]).double()  # the file's own weights
    g = torch.Generator().manual_seed(block)
    for rows in [1, 2, 5, 6, 7, 13, 197]:
        x = torch.randn(rows, k, generator=g) * 3
        x[0, :block] *= 40  # one block far larger than the rest
        xb = x.to(torch.bfloat16)
        one, two = outputs_on_one_and_two_threads(product, xb)
        assert torch.equal(one, two)
        _check(one, xb.float(), product, w)
        assert torch.equal(product(x), one)  # float32 inputs are rounded to bf16 first
        # against the file's weights: the int8 bound plus what requantizing moved them by
        ref = xb.double() @ exact.t()
        moved = xb.double().abs() @ (w.double() - exact).abs().t()
        assert bool(((one.double() - ref).abs() <= _bound(xb.float(), product) + moved
                     + ref.abs() * 2 ** -8).all())


@pytest.mark.parametrize("block", WIDE)
def test_quantizing_in_longer_blocks(block):
    """One scale per block values of a row: max|x| / 127, codes the nearest integers, sums of
    the rounded values; float32 rows as their bf16 rounding; a NaN or infinity makes its block
    NaN."""
    g = torch.Generator().manual_seed(block)
    x = torch.randn(33, 768, generator=g) * 5  # 16+ rows: two threads split them
    x[2, block + 3] = float("nan")
    x[4, 0] = float("inf")
    xq, dx, sx = q32.quantize(x.to(torch.bfloat16), block)
    assert dx.shape == sx.shape == (33, 768 // block)
    for got in outputs_on_one_and_two_threads(lambda t: q32.quantize(t, block), x):
        assert torch.equal(got[0], xq) and _same(got[1], dx) and _same(got[2], sx)
    xb = x.to(torch.bfloat16).double().view(33, -1, block)
    want_dx = xb.abs().amax(-1) / 127
    ok = torch.isfinite(want_dx)
    assert torch.isnan(dx[2, 1]) and torch.isnan(dx[4, 0]) and int(ok.sum()) == dx.numel() - 2
    assert torch.isnan(sx[2, 1]) and torch.isnan(sx[4, 0])
    bad = xq.view(33, -1, block)
    assert not bad[2, 1].any() and not bad[4, 0].any()  # a bad block's codes are zeros
    assert torch.allclose(dx.double()[ok], want_dx[ok], rtol=1e-6)
    mx = xb.float().abs().amax(-1, keepdim=True)
    inv = torch.full_like(mx, 127) / mx  # the kernel's float32 arithmetic (127 / t: a reciprocal)
    codes = torch.round(xb.float() * inv)
    assert torch.equal(xq.view(33, -1, block)[ok], codes[ok].to(torch.int8))
    assert torch.allclose(sx.double()[ok], (dx.double()[..., None] * xq.view(33, -1, block)
                                            .double()).sum(-1)[ok], rtol=1e-5)


@pytest.mark.parametrize("block", (32, 64))
def test_a_block_too_small_for_a_finite_code_factor_quantizes_to_zeros(block):
    """A block whose largest magnitude is below 127 / FLT_MAX (~3.7e-37, which bf16 holds:
    127 / max overflows) takes codes of 0 and a block sum of 0, so a product reads it as
    zeros (an infinite factor made every code -128, whatever the values' signs); the blocks
    beside it keep their codes, in the bf16 and float32 quantizers alike."""
    g = torch.Generator().manual_seed(block)
    x = torch.randn(2, 4 * block, generator=g)
    x[1, block:2 * block] = torch.randn(block, generator=g) * 1e-37
    for xq, dx, sx in (q32.quantize(x.to(torch.bfloat16), block), q32.quantize(x, block)):
        want_q, want_dx, _ = q32.quantize(x[[0]].to(torch.bfloat16), block)
        assert torch.equal(xq[0], want_q[0]) and torch.equal(dx[0], want_dx[0])
        assert not xq[1, block:2 * block].any() and float(sx[1, 1]) == 0.0
        assert bool(torch.isfinite(dx).all()) and bool(torch.isfinite(sx).all())
        assert xq[1, :block].any() and xq[1, 2 * block:].any()


@needs_byte_codes
@pytest.mark.parametrize("own", (32, 128))
@pytest.mark.parametrize("block", (64, 192))
def test_the_gated_product_quantized_in_longer_blocks_is_its_output_quantized(block, own):
    """q32_linear_gated_q whose next product takes longer blocks (spanning several panels):
    the codes and scales q32_quantize gives from the gated product's bf16 output, on rows past
    one chunk of 192, one and two threads; the gated product itself on the file's blocks
    (own 32: PAGELLM_Q32_BLOCK=192 on a model whose hidden size 384 is no multiple of it)
    or requantized ones."""
    from pagellm.kernels import native

    parts = [random_blocks(Q.Q4_1, 192, 384, seed=7), random_blocks(Q.Q8_0, 192, 384, seed=8)]
    product = q32.Q32Linear(parts, block=own)
    assert product.gates
    g = torch.Generator().manual_seed(9)
    for rows in [1, 7, 197]:
        x = (torch.randn(rows, 384, generator=g) * 4).to(torch.bfloat16)
        x[-1, 3] = float("nan")
        want = q32.quantize(product.gated(x), block)
        xq, dx, sx = q32.quantize(x, own)
        aq = torch.empty(rows, 192, dtype=torch.int8)
        adx, asx = torch.empty(rows, 192 // block), torch.empty(rows, 192 // block)
        for threads in (1, 2):
            aq.fill_(99), adx.fill_(-1.0), asx.fill_(-1.0)
            assert native.library().q32_linear_gated_q(
                xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows, 384, own,
                product.codes.data_ptr(), product.d.data_ptr(), product.m.data_ptr(),
                product.zeros_ptr(), int(product.nibbles), 384,
                aq.data_ptr(), adx.data_ptr(), asx.data_ptr(), block, None, threads) == 0
            assert torch.equal(aq, want[0]) and _same(adx, want[1]) and _same(asx, want[2])
        assert torch.isnan(adx[-1]).all()
