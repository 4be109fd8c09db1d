"""The GGUF block kernel (pagellm/kernels/cpu_gguf.c) against float64 products with gguf's own
dequantization, for every type it takes: every row count 1..20 and 40 (row passes of at most 8,
the one-row path), odd block counts, threads, mixed fused parts, and the portable (non-AVX2)
build of the same source."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagellm.kernels import native
from pagellm.layers import panels, quant
from tests.helpers import outputs_on_one_and_two_threads
from tests.gguf_files import F16_FIELDS, random_blocks, sub_block_mins

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")
TYPES = sorted(F16_FIELDS, key=lambda t: t.name)


def _bound(x: torch.Tensor, blocks: quant.GGUFBlocks, lib=None) -> torch.Tensor:
    """The error int16 activations allow: half a step (max|x| of the A values sharing it /
    32767, A the build's activation group for the type: 32, or 256 for K-quants in the AVX-512
    build, from 2 rows) per element, times the coded part of the weight |w - m| (a sub-block's min m
    multiplies the exact float sum of x), plus float32 summation."""
    w = blocks.dequantize().double()
    n, k = w.shape
    group = (lib or native.library()).gguf_act_group(int(blocks.ggml_type), x.shape[0])
    step = x.double().abs().view(x.shape[0], k // group, group).amax(-1) / 32767  # [R, K / A]
    step = step.repeat_interleave(group // 32, dim=1)  # [R, G]
    mins = torch.from_numpy(sub_block_mins(blocks))  # [N, G]
    coded = (w.view(n, k // 32, 32) - mins.unsqueeze(-1)).abs().sum(-1)  # [N, G]
    return 0.5 * step @ coded.t() + 2e-6 * (x.double().abs() @ w.abs().t()) + 1e-9


def _check(out: torch.Tensor, x: torch.Tensor, blocks: quant.GGUFBlocks, lib=None) -> None:
    ref = x.double() @ blocks.dequantize().double().t()
    err = (out.double() - ref).abs()
    bound = _bound(x, blocks, lib)
    assert bool((err <= bound).all()), f"{blocks.ggml_type.name}: error {(err / bound).max():.2f}x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_row_count_matches_the_dequantized_product(qtype):
    unit = 256 if qtype.name.endswith("_K") else 32
    blocks = random_blocks(qtype, 24, 3 * unit, seed=int(qtype))  # three blocks: an odd count
    packed = quant.NativeGGUF(blocks)
    g = torch.Generator().manual_seed(int(qtype))
    for rows in [*range(1, 21), 40]:
        x = torch.randn(rows, 3 * unit, generator=g) * 3
        _check(packed(x), x, blocks)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_outliers_and_zeros(qtype):
    blocks = random_blocks(qtype, 16, 512, seed=3)
    x = torch.randn(5, 512)
    x[:, 7] = 5000.0  # one block 1000x the rest: every block keeps its own scale
    _check(quant.NativeGGUF(blocks)(x), x, blocks)
    assert torch.equal(quant.NativeGGUF(blocks)(torch.zeros(3, 512)), torch.zeros(3, 16))


def test_threads_split_outputs_without_changing_them():
    blocks = random_blocks(Q.Q4_K, 64, 512, seed=4)
    one, two = outputs_on_one_and_two_threads(quant.NativeGGUF(blocks), torch.randn(3, 512))
    assert torch.equal(one, two)  # each output is summed by one thread in a fixed order


def test_fused_parts_of_different_types():
    """A Q4_K_M file's q|k (Q4_K) beside v (Q6_K): one product per run of one type."""
    q, k, v = (random_blocks(t, 32, 256, seed=s) for s, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K)))
    packed = quant.pack_parts([q, k, v])
    assert isinstance(packed, quant.PackedParts) and len(packed.parts) == 2
    assert packed.nbytes == sum(b.raw.numel() for b in (q, k, v))
    x = torch.randn(4, 256)
    out = packed(x)
    assert out.shape == (4, 96)
    for i, b in enumerate((q, k, v)):
        _check(out[:, 32 * i:32 * (i + 1)], x, b)
    # one run of one type: one form (in panels where cpu_panels.c is built: test_panels.py)
    one = quant.NativePanels if panels.available() else quant.NativeGGUF
    assert type(quant.pack_parts([q, k])) is one


def test_narrow_splits_on_block_boundaries():
    blocks = random_blocks(Q.Q6_K, 8, 512, seed=5)
    dense = blocks.dequantize()
    assert torch.equal(blocks.narrow(1, 256, 256).dequantize(), dense[:, 256:])
    assert torch.equal(blocks.narrow(0, 2, 3).dequantize(), dense[2:5])
    with pytest.raises(ValueError, match="multiples of 256"):
        blocks.narrow(1, 128, 384)


def test_a_layout_the_kernel_does_not_take_is_refused():
    blocks = random_blocks(Q.Q4_K, 4, 256, seed=6)
    with pytest.raises(ValueError, match="not a layout"):
        quant.cpu_quant.gguf_linear(torch.randn(1, 256), blocks.raw, int(Q.Q2_K), 256)


def test_portable_build_gives_the_same_products(tmp_path, monkeypatch):
    """The scalar code path (CPUs without AVX2) built from the same source."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    lib = native.load(native.build("cc", [f for f in native.FLAGS if f != "-march=native"]))
    for qtype in TYPES:
        unit = 256 if qtype.name.endswith("_K") else 32
        blocks = random_blocks(qtype, 16, 3 * unit, seed=7)
        raw = blocks.raw.contiguous()
        for rows in (1, 3, 9):
            x = torch.randn(rows, 3 * unit)
            y = torch.empty(rows, 16)
            assert lib.gguf_linear(x.data_ptr(), rows, 3 * unit, raw.data_ptr(), raw.shape[1],
                                   int(qtype), 16, y.data_ptr(), 1) == 0
            _check(y, x, blocks, lib)


def test_random_blocks_decode_as_gguf_says():
    """The test's own min decoding agrees with gguf's dequantization: a Q4_K block of codes 0
    is exactly its sub-block mins."""
    blocks = random_blocks(Q.Q4_K, 2, 256, seed=8)
    raw = blocks.raw.numpy().reshape(2, 144).copy()
    raw[:, 16:] = 0  # every 4-bit code 0: w = -dmin * mn
    zeroed = quant.GGUFBlocks(torch.from_numpy(raw), Q.Q4_K, 256)
    w = zeroed.dequantize().numpy().reshape(2, 8, 32)
    np.testing.assert_allclose(w, np.repeat(sub_block_mins(zeroed)[:, :, None], 32, -1), rtol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_long_inputs_sum_in_chunks_the_same_on_any_thread_count(qtype):
    """A down projection's 8,960 inputs (35 K-quant blocks): from 3 rows the AVX-512 path takes
    K in chunks of 8 blocks (the last one 3), each output adding its chunks in order; 8 and 9
    rows split into passes of at most 7. Within the bound, and the same on 1 and 2 threads."""
    blocks = random_blocks(qtype, 40, 35 * 256, seed=7)
    packed = quant.NativeGGUF(blocks)
    g = torch.Generator().manual_seed(7)
    for rows in (2, 3, 5, 8, 9):
        x = torch.randn(rows, 35 * 256, generator=g)
        one, two = outputs_on_one_and_two_threads(packed, x)
        assert torch.equal(one, two)
        _check(two, x, blocks)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_rows_k_quant_outputs_do_not_depend_on_the_rows_beside_it(qtype):
    """Each row of an R-row K-quant product has the bits of that row alone, whatever pass,
    chunking of K (a down projection's 35 blocks: chunks of 8 from 3 rows) or split into
    passes (8, 9 rows) takes it: a target's verification rows score a token as plain decoding
    of the request alone does, so its greedy output with speculation is its own. (32-value
    types are not so yet: one row sums its blocks in two alternating chains, 3+ rows 16 blocks
    at a time; on AVX-512 their projections take panels, which are. Nor is the AVX2 build's
    one-row path.)"""
    if native.library().gguf_act_group(int(qtype), 2) != 256:
        pytest.skip("the AVX2 build takes one row its own way (k_block_1row)")
    k = 35 * 256
    packed = quant.NativeGGUF(random_blocks(qtype, 40, k, seed=12))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(12))
    alone = torch.cat([packed(x[i:i + 1]) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_32_value_blocks_in_chunks_of_16_on_every_row_count(qtype):
    """From 3 rows the AVX-512 path scales 32-value blocks 16 at a time (their d * dx and min
    terms in vectors, gathered from the blocks): 37 blocks are two whole chunks and a tail of
    5, and the tail's lanes past the row must read nothing (a 1,184-input row ends the
    weights). Within the bound on every row count, the same on 1 and 2 threads."""
    blocks = random_blocks(qtype, 24, 37 * 32, seed=11)
    packed = quant.NativeGGUF(blocks)
    g = torch.Generator().manual_seed(11)
    for rows in range(1, 10):
        x = torch.randn(rows, 37 * 32, generator=g) * 2
        one, two = outputs_on_one_and_two_threads(packed, x)
        assert torch.equal(one, two)
        _check(two, x, blocks)
