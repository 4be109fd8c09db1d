"""The GGUF block kernel (pagellm/kernels/cpu_gguf.c) against float64 products with gguf's own
dequantization, for every type it takes: every row count 1..20 and 40 (row passes of at most 8),
odd block counts, threads, mixed fused parts, and the portable (non-AVX2)
build of the same source; and every few-row kernel of block-quantized weights (these, and
cpu_quant.c's) gives a row the bits it has alone, in the AVX-512 and the AVX2 build."""
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
    # values below 32767 / FLT_MAX (~9.6e-35): codes of 0 (vec_math.h code_factor), so
    # what is left (the mins' exact sums) is odd in x, where saturated codes were not
    tiny = torch.randn(3, 512) * 1e-37
    assert torch.equal(quant.NativeGGUF(blocks)(-tiny), -quant.NativeGGUF(blocks)(tiny))


def test_threads_split_outputs_without_changing_them():
    blocks = random_blocks(Q.Q4_K, 64, 512, seed=4)
    one, two = outputs_on_one_and_two_threads(quant.NativeGGUF(blocks), torch.randn(3, 512))
    assert torch.equal(one, two)  # each output is summed by one thread in a fixed order


def test_fused_parts_of_different_types(monkeypatch):
    """A Q4_K_M file's q|k (Q4_K) beside v (Q6_K): one product per run of one type (int16
    activations here; the int8 panels' bound is test_panels.py's)."""
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")
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
    # cpu_quant.c's kernels take whole 32-value blocks only
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.cpu_quant.q8_linear(torch.randn(2, 48), torch.zeros(4, 48, dtype=torch.int8),
                                  torch.ones(4, 1))


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


def assert_rows_have_their_own_bits(product, x: torch.Tensor) -> None:
    """Each row of product(x[:R]), for R = 2..len(x), has the bits of product(that row) alone."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


def _rows_with_tiny_blocks(k: int, seed: int) -> torch.Tensor:
    """9 rows; rows 1, 4 and 7 have a block 1e-4 of their largest: those take a scale per
    block where the others may take one per row (cpu_quant.c), a choice each row makes alone."""
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(seed))
    x[1::3, 32:64] *= 1e-4
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(qtype):
    """Each row of an R-row product has the bits of that row alone, whatever pass (rows 1-8;
    9 as 5 + 4), kernel (the AVX-512 build's 32-value blocks: 1-2 rows block by block, 3+ in
    chunks of 16; K-quants: chunks of 8 blocks from 3 rows) or lane arrangement takes it: a
    target's verification rows score a token as plain decoding of the request alone does, so
    its greedy output with speculation (and beside other requests) is its own."""
    k = 35 * 256 if qtype.name.endswith("_K") else 37 * 32
    packed = quant.NativeGGUF(random_blocks(qtype, 40, k, seed=12))
    x = _rows_with_tiny_blocks(k, 12)
    assert_rows_have_their_own_bits(packed, x)
    # no rows (a prefill chunk that needs no logits, before a K-quant head): nothing, no
    # division by the row count
    assert packed(x[:0]).shape == (0, 40)


@pytest.mark.parametrize("form", ["q8", "q4"])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it_in_cpu_quant(form):
    """The same for cpu_quant.c's Q8_0 head (the default model's) and Q4 row kernels, with rows
    that take one int16 scale beside rows that need one per block; the products stay within
    the int16 bound of the dense one."""
    g = torch.Generator().manual_seed(5)
    k, n = 576, 48
    if form == "q8":
        w = quant.Int8Blocks(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g),
                             torch.rand(n, k // 32, generator=g) * 0.01)
        product = quant.NativeQ8(w)
    else:
        w = quant.Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                             torch.rand(n, k // 32, generator=g) * 0.01,
                             torch.randn(n, k // 32, generator=g) * 0.01)
        product = quant.NativeQ4(w)
        product.panels = None  # the row form (cpu_quant.c), as on CPUs without AVX-512
        product.codes, product.scale_min = quant.NativeQ4.row_form(w)
    x = _rows_with_tiny_blocks(k, 5)
    assert_rows_have_their_own_bits(product, x)
    assert product(x[:0]).shape == (0, n)  # a prefill chunk that needs no logits
    dense = w.dequantize().double()
    err = (product(x).double() - x.double() @ dense.t()).abs()
    # half a step of the row's scale (a block's own scale is finer) per weight, and float32 sums
    bound = 0.5 * x.double().abs().amax(-1, keepdim=True) / 32767 * dense.abs().sum(-1) + 1e-5
    assert bool((err <= bound).all()), (err / bound).max()


def test_the_avx2_build_gives_rows_their_own_bits_too():
    """On a CPU with AVX-512 the products above take its kernels; the AVX2 ones (every 32-value
    and K-quant type: one row and several rows share one arithmetic) are checked in a process
    that turns the AVX-512 paths off (PAGELLM_GGUF_AVX512=0, PAGELLM_PANELS=0)."""
    if native.library().gguf_act_group(int(Q.Q4_K), 2) != 256:
        pytest.skip("this build has no AVX-512 path: the tests above ran the AVX2 kernels")
    import os
    import subprocess
    import sys
    env = {**os.environ, "PAGELLM_GGUF_AVX512": "0", "PAGELLM_PANELS": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "do_not_depend_on_the_rows_beside_it"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{len(TYPES) + 2} passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-1000:]


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
