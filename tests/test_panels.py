"""Panels of 16 outputs (pagellm/layers/panels.py, kernels/cpu_panels.c; AVX-512 BW + VNNI):
each GGUF type's blocks decode to exactly the file's values (gguf's reference dequantizer),
the products match float64 products with those values within the activations' rounding bound
(int16; K-quants' default forms Q4_K8 and Q6_K8 and the i-quants' IQ4_NL8 / IQ4_XS8, int8) on every row count the engine sends (1..40: passes of
up to 6 rows), partial panels, one and two threads give the same bits, a NaN stays in its row,
and the packed forms and the fused decode layer take panels where the kernel is built."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagellm.kernels import native
from pagellm.layers import panels, quant
from tests.gguf_files import random_blocks
from tests.helpers import outputs_on_one_and_two_threads

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, "Q4_K int8", "Q6_K int8", Q.IQ4_NL, Q.IQ4_XS]
LEVELS = (Q.IQ4_NL, Q.IQ4_XS)  # 4-bit codes indexing 16 levels; int8 activations only
INT8 = {"Q4_K int8": Q.Q4_K, "Q6_K int8": Q.Q6_K}
needs_kernel = pytest.mark.skipif(not panels.available(),
                                  reason="panel kernels need AVX-512 BW and VNNI")


def _shape(t):  # K a multiple of the type's unit; 37 outputs: two panels and a partial third
    return 37, (512 if t in (Q.Q4_K, Q.Q6_K, Q.IQ4_XS) else 160)


@pytest.fixture(params=TYPES, ids=lambda t: getattr(t, "name", t))
def qtype(request, monkeypatch):
    """A GGUF type; Q4_K twice: its int16-activation panels (PAGELLM_PANELS_INT8=0) and its
    default int8 ones (Q4_K8); Q6_K in its int8 ones (Q6_K8; it has no int16 panels)."""
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "1" if request.param in INT8 else "0")
    return INT8.get(request.param, request.param)


def test_blocks_decode_to_the_files_values(qtype):
    """Runs on every machine: the decoding and the layout are Python, read back here byte by
    byte (_read_back) as the kernel reads them."""
    n, k = _shape(qtype)
    b = random_blocks(qtype, n, k, seed=3, amplitude=0.2)
    fmt, u, params = panels.decode(b.raw.numpy(), qtype, k)
    ref = dequantize(b.raw.numpy(), qtype).astype(np.float32)
    packed = panels.pack(fmt, u, **params)
    unit = 256 if qtype in (Q.Q4_K, Q.Q6_K, Q.IQ4_XS) else 32
    assert packed.shape[:2] == (3, k // unit)
    # as many bytes as the file's blocks, or within 20% (Q4_0 / Q5_0 also store their min)
    assert b.raw.numel() * 3 * 16 / n <= packed.numel() <= b.raw.numel() * 3 * 16 / n * 1.2
    # the bytes read back as cpu_panels.c reads them give the same weights
    assert np.array_equal(_read_back(packed.numpy(), fmt, n, k), ref)


def _read_back(buf: np.ndarray, fmt: int, n: int, k: int) -> np.ndarray:
    """The weights [n, k] that cpu_panels.c's layout (its header comment) holds, read with
    plain loops over the bytes: a check of panels.pack that runs on every machine."""
    p = buf.shape[0]
    w = np.zeros((p * 16, k), np.float32)
    for pi in range(p):
        for unit in range(buf.shape[1]):
            ub = buf[pi, unit]
            kfmt = fmt in (panels.Q4_K, panels.Q4_K8, panels.Q6_K8)
            blocks = [(ub, unit)] if not kfmt else [
                (ub[256 + 256 * i:], unit * 8 + i) for i in range(8)]
            if fmt == panels.IQ4_XS8:  # d, the blocks' int8 scales [block][o]; 8 blocks of codes
                d = ub[0:32].view(np.float16).astype(np.float32)
                isc = ub[32:160].view(np.int8).reshape(8, 16)
                blocks = [(ub[160 + 256 * i:], unit * 8 + i) for i in range(8)]
            if fmt == panels.Q6_K8:  # d, the int8 scales [group][o]; blocks of 384 bytes
                d = ub[0:32].view(np.float16).astype(np.float32)
                isc = ub[32:288].view(np.int8).reshape(16, 16)
                blocks = [(ub[288 + 384 * i:], unit * 8 + i) for i in range(8)]
            elif kfmt:
                d = ub[0:32].view(np.float16).astype(np.float32)
                dmin = ub[32:64].view(np.float16).astype(np.float32)
                words = ub[64:256].view(np.uint32).reshape(3, 16)  # A, B, C per output
            for i, (b, g) in enumerate(blocks):
                for o in range(16):
                    if fmt == panels.Q6_K8:  # gguf's order: d * sc, then times q - 32
                        for a in range(4):
                            for j in range(4):
                                v = int(b[64 * a + 4 * o + j])
                                hb = int(b[256 + 64 * (a // 2) + 4 * o + j]) >> (4 * (a % 2))
                                for half, q in ((0, (v & 15) | (hb & 3) << 4),
                                                (1, (v >> 4) | ((hb >> 2) & 3) << 4)):
                                    sc = d[o] * np.float32(isc[2 * i + half, o])
                                    w[pi * 16 + o, 32 * g + 16 * half + 4 * a + j] = (
                                        sc * np.float32(q - 32))
                        continue
                    if fmt in (panels.IQ4_NL8, panels.IQ4_XS8):  # gguf's order: d * (ls - 32)
                        sc = (b[256:288].view(np.float16)[o].astype(np.float32)
                              if fmt == panels.IQ4_NL8 else d[o] * np.float32(isc[i, o]))
                        for a in range(4):
                            for j in range(4):
                                v = int(b[64 * a + 4 * o + j])
                                for half, q in ((0, v & 15), (1, v >> 4)):
                                    w[pi * 16 + o, 32 * g + 16 * half + 4 * a + j] = (
                                        sc * np.float32(panels.IQ4_LEVELS[q]))
                        continue
                    if fmt == panels.Q4_F32:
                        sc, mn = b[256:320].view(np.float32)[o], b[320:384].view(np.float32)[o]
                    elif fmt == panels.Q4_F16:
                        sc = b[256:288].view(np.float16)[o]
                        mn = b[288:320].view(np.float16)[o]
                    elif fmt == panels.Q5_F16:
                        sc = b[320:352].view(np.float16)[o]
                        mn = b[352:384].view(np.float16)[o]
                    else:
                        a_, b_, c_ = (int(x) for x in words[:, o])
                        byte = lambda v, j: (v >> (8 * j)) & 0xFF  # noqa: E731
                        if i < 4:
                            s6, m6 = byte(a_, i) & 63, byte(b_, i) & 63
                        else:
                            s6 = (byte(c_, i - 4) & 15) | ((byte(a_, i - 4) >> 6) << 4)
                            m6 = (byte(c_, i - 4) >> 4) | ((byte(b_, i - 4) >> 6) << 4)
                        sc, mn = d[o] * np.float32(s6), -(dmin[o] * np.float32(m6))
                    if fmt == panels.Q4_K8:  # register a, byte 4o + j: inputs 4a + j, 16 + 4a + j
                        for a in range(4):
                            for j in range(4):
                                v = int(b[64 * a + 4 * o + j])
                                for half, q in ((0, v & 15), (1, v >> 4)):
                                    w[pi * 16 + o, 32 * g + 16 * half + 4 * a + j] = (
                                        np.float32(sc) * np.float32(q) + np.float32(mn))
                        continue
                    for c in range(8):
                        for t in range(2):
                            v = int(b[32 * c + 2 * o + t])
                            for half, q in ((0, v & 15), (1, v >> 4)):
                                if fmt == panels.Q5_F16:
                                    mask = int(b[256 + 8 * c + 4 * half:][:4].view(np.uint32)[0])
                                    q += 16 * ((mask >> (2 * o + t)) & 1)
                                j = 32 * g + 4 * c + 2 * half + t
                                w[pi * 16 + o, j] = np.float32(sc) * np.float32(q) + np.float32(mn)
    return w[:n]


def _bound(x: torch.Tensor, w: torch.Tensor, levels: int = 32767) -> torch.Tensor:
    """Half an activation step of each 32-value block of x (max|x| / levels: int16's 32767,
    Q4_K8's int8 127) times |w| summed, plus float32 rounding of the terms."""
    r, k = x.shape
    step = x.abs().view(r, k // 32, 32).amax(-1) / levels  # [R, G]
    wsum = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, G]
    return 0.5 * step @ wsum.t() + 1e-6 * (x.abs() @ w.abs().t()) + 1e-9


@needs_kernel
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(qtype):
    """Each row of an R-row product (tiles of up to 6 rows: 7 and 13 split) has the bits of
    that row alone: speculation's verification rows score as plain decoding does."""
    n, k = _shape(qtype)
    packed = quant.NativePanels(random_blocks(qtype, n, k, seed=13, amplitude=0.2))
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([packed(x[i:i + 1]) for i in range(13)])
    for rows in range(2, 14):
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows
    assert packed(x[:0]).shape == (0, n)  # no rows: nothing


@needs_kernel
def test_products_match_the_files_values_on_every_row_count(qtype):
    n, k = _shape(qtype)
    b = random_blocks(qtype, n, k, seed=4, amplitude=0.2)
    packed = quant.NativePanels(b)
    int8 = packed.fmt in panels.INT8_FORMATS
    assert int8 == ((qtype in INT8.values() and panels.int8_activations()) or qtype in LEVELS)
    w = torch.from_numpy(dequantize(b.raw.numpy(), qtype).astype(np.float64))
    g = torch.Generator().manual_seed(4)
    for rows in [*range(1, 14), 18, 24, 33, 40]:
        x = torch.randn(rows, k, generator=g, dtype=torch.float64) * 2
        x[0, 40] = 700.0  # a block far above the rest of its row: blocks scale on their own
        out = packed(x.float())
        assert out.shape == (rows, n) and out.dtype == torch.float32
        x = x.float().double()
        err, bound = (out.double() - x @ w.t()).abs(), _bound(x, w, 127 if int8 else 32767)
        assert bool((err <= bound).all()), (rows, (err / bound).max().item())
        if int8 and rows == 3:  # the int8 bound is not loose by orders of magnitude
            assert (err / bound).max().item() > 0.05


@needs_kernel
def test_q4_blocks_take_fp16_panels_only_where_exact():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (20, 64), generator=g, dtype=torch.uint8)
    scale = torch.rand(20, 2, generator=g).half().float()  # a GGUF file's f16 values
    exact = quant.NativeQ4(quant.Int4Blocks(q, scale, 8 * scale - 0.5))
    assert exact.fmt == panels.Q4_F16 and exact.nbytes == 2 * 320 * 2
    rough = quant.NativeQ4(quant.Int4Blocks(q, scale + 1e-5, 8 * scale))  # not f16 values
    assert rough.fmt == panels.Q4_F32
    x = torch.randn(3, 64)
    for packed, blocks in ((exact, quant.Int4Blocks(q, scale, 8 * scale - 0.5)),
                           (rough, quant.Int4Blocks(q, scale + 1e-5, 8 * scale))):
        w = blocks.dequantize().double()
        err = (packed(x).double() - x.double() @ w.t()).abs()
        assert bool((err <= _bound(x.double(), w)).all())


@needs_kernel
@pytest.mark.parametrize("int8", ["0", "1"])
def test_threads_split_panels_without_changing_them_and_nan_stays_in_its_row(int8, monkeypatch):
    monkeypatch.setenv("PAGELLM_PANELS_INT8", int8)
    b = random_blocks(Q.Q4_K, 70, 512, seed=6, amplitude=0.2)
    packed = quant.NativePanels(b)
    assert packed.fmt == (panels.Q4_K8 if int8 == "1" else panels.Q4_K)
    one, two = outputs_on_one_and_two_threads(packed, torch.randn(7, 512))
    assert torch.equal(one, two)
    x = torch.randn(3, 512)
    x[1, 300] = float("nan")
    y = packed(x)
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    if int8 == "1":  # an infinity too: its block is NaN (the int16 path gives +-inf or NaN)
        x[1, 300] = float("inf")
        y = packed(x)
        assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())


@needs_kernel
def test_a_block_too_small_for_a_finite_code_factor_quantizes_to_zeros(qtype):
    """A block whose largest magnitude is below 127 / FLT_MAX (~3.7e-37; int16 panels:
    32767 / FLT_MAX, ~9.6e-35) has no finite code factor and takes codes of 0
    (vec_math.h code_factor), so a row of such values gives outputs of exactly 0 (an
    infinite factor made every code the most negative one, whatever the values' signs): what
    is left of such a row (the min term's exact sums, where a form has one) is odd in x, and
    the rows beside it are untouched; every panel form."""
    n, k = _shape(qtype)
    b = random_blocks(qtype, n, k, seed=9, amplitude=0.2)
    packed = quant.NativePanels(b)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    want = packed(x)
    x[1] = torch.randn(k, generator=torch.Generator().manual_seed(10)) * 1e-37
    y = packed(x)
    assert torch.equal(packed(-x)[1], -y[1]) and bool(y[1].isfinite().all())
    assert torch.equal(y[[0, 2]], want[[0, 2]])


def test_a_min_past_fp16s_range_keeps_exact_values():
    """Q4_0's min is -8 d: past fp16's range for d > 8188 it is kept in float32 (Q4_F32);
    Q5_0's (-16 d) has no such form: those weights keep the file's rows."""
    b4 = random_blocks(Q.Q4_0, 16, 64, seed=7)
    raw = b4.raw.numpy().reshape(16, 2, 18).copy()
    raw[3, 1, 0:2] = np.array([10000.0], np.float16).view(np.uint8)
    b4 = quant.GGUFBlocks(torch.from_numpy(raw.reshape(16, -1)), Q.Q4_0, 64)
    fmt, u, params = panels.decode(b4.raw.numpy(), Q.Q4_0, 64)
    assert fmt == panels.Q4_F32
    assert np.array_equal(_read_back(panels.pack(fmt, u, **params).numpy(), fmt, 16, 64),
                          dequantize(b4.raw.numpy(), Q.Q4_0).astype(np.float32))
    b5 = random_blocks(Q.Q5_0, 16, 64, seed=8)
    raw = b5.raw.numpy().reshape(16, 2, 22).copy()
    raw[0, 0, 0:2] = np.array([5000.0], np.float16).view(np.uint8)
    b5 = quant.GGUFBlocks(torch.from_numpy(raw.reshape(16, -1)), Q.Q5_0, 64)
    with pytest.raises(ValueError, match="fp16"):
        panels.decode(b5.raw.numpy(), Q.Q5_0, 64)
    assert quant.NativePanels.of(b5) is None
    if native.available():
        assert isinstance(quant.pack_parts([b5]), quant.NativeGGUF)
    if panels.available():
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7)).double()
        w = b4.dequantize().double()
        out = quant.NativePanels(b4)(x.float()).double()
        assert torch.isfinite(out).all()
        assert bool(((out - x @ w.t()).abs() <= _bound(x, w)).all())


@pytest.mark.parametrize("int8", ["0", "1"])
def test_gguf_projections_take_panels_where_the_kernel_is_built(int8, monkeypatch):
    """pack_parts: Q4_K / Q5_0 runs become panels, Q6_K too with int8 activations (the
    default); Q8_0 keeps the file's rows."""
    if not native.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("PAGELLM_PANELS_INT8", int8)
    parts = [random_blocks(t, 32, 256, seed=s) for s, t in enumerate((Q.Q4_K, Q.Q4_K, Q.Q6_K))]
    form = quant.pack_parts(parts)
    kinds = [type(p) for p in form.parts]
    want = quant.NativePanels if panels.available() else quant.NativeGGUF
    assert kinds == [want, want if int8 == "1" else quant.NativeGGUF]
    assert isinstance(quant.pack_parts([random_blocks(Q.Q8_0, 32, 64, seed=9)]), quant.NativeGGUF)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ torch.cat([p.dequantize() for p in parts]).double().t()
    tol = 2e-2 if int8 == "1" and panels.available() else 1e-4  # int8 activations
    assert torch.allclose(form(x).double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    if panels.available():  # the fused decode layer takes the panel part as its own type
        from pagellm.kernels import cpu_layer

        parts = cpu_layer._parts(form)
        want = ([cpu_layer._PANELS + panels.Q4_K8, cpu_layer._PANELS + panels.Q6_K8] if int8 == "1"
                else [cpu_layer._PANELS + panels.Q4_K, int(Q.Q6_K)])
        assert [p.type for p in parts] == want


@needs_kernel
def test_panels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGELLM_PANELS", "0")
    assert not panels.available()
    assert isinstance(quant.pack_parts([random_blocks(Q.Q4_K, 16, 256, seed=1)]), quant.NativeGGUF)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_head_in_panels_serves_a_vocabulary_limit_and_gathered_ids(qtype):
    """An LM head of a gatherable format: its first n outputs and any ids give the bits the
    whole head gives them (a draft's limited head and its requests' own ids)."""
    b = random_blocks(qtype, 53, 512, seed=9, amplitude=0.2)
    head = quant.head_form(b)
    assert isinstance(head, quant.NativePanels) and head.fmt in panels.GATHERABLE
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(9))
    full = head(x)
    for n in (1, 16, 21, 53):
        assert torch.equal(head.first_rows(n)(x), full[:, :n])
    ids = torch.tensor([52, 0, 17, 17, 3, 40, 16, 15, 31, 32, 33, 1, 2, 50, 49, 48, 47, 20])
    sub = head.rows(ids)
    assert sub.out_features == len(ids) and torch.equal(sub(x), full[:, ids])
    assert head.rows(ids.clone()) is sub  # the same ids again: the kept gather
    assert torch.equal(head.rows(ids[:1])(x), full[:, ids[:1]])
    other = ids.flip(0)  # as many ids, another order: gathered anew
    assert torch.equal(head.rows(other)(x), full[:, other])


def test_a_head_without_int8_panels_keeps_the_files_rows(monkeypatch):
    if not native.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")
    assert isinstance(quant.head_form(random_blocks(Q.Q4_K, 16, 256, seed=1)), quant.NativeGGUF)
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "1")
    assert isinstance(quant.head_form(random_blocks(Q.Q5_0, 16, 256, seed=1)), quant.NativeGGUF)


@needs_kernel
def test_an_int8_panel_head_keeps_its_rows_where_bf16_products_are_native(monkeypatch):
    """Where bf16 products run natively the dense head takes over from 6 rows of a packed
    head (9 of a Q8_0 one), but not from a panel head with int8 activations: it stays faster
    up to its own limit."""
    from pagellm.layers import linear as linear_mod
    from pagellm.models.llama import head_max_rows

    int8_head = quant.head_form(random_blocks(Q.Q6_K, 32, 256, seed=2))
    monkeypatch.setenv("PAGELLM_PANELS_INT8", "0")
    rows_head = quant.head_form(random_blocks(Q.Q6_K, 32, 256, seed=2))
    assert isinstance(int8_head, quant.NativePanels) and isinstance(rows_head, quant.NativeGGUF)
    monkeypatch.setattr(linear_mod, "UPCAST_BF16", False)  # a CPU with bf16 units
    assert head_max_rows(int8_head) == int8_head.max_rows > 16
    assert head_max_rows(rows_head) == 6
    monkeypatch.setattr(linear_mod, "UPCAST_BF16", True)
    assert head_max_rows(rows_head) == rows_head.max_rows
