"""Many-row products of 32-value block weights against int8 activations (kernels/cpu_q32.c),
on CPUs with AVX-512 VNNI (every type here) or AVX2 alone (the 4- and 5-bit types: Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, whose codes below 32 let vpmaddubsw's pair sums gather in
int16; max_code). On AVX2 they replace the float32 product of a dense copy: the default
model's projections at 64 rows 2.0-2.4x faster on two Zen 3 cores, at 2,048 rows 1.5-1.9x,
and its 64-request run 2.1x (182 -> 391 output tok/s).

A GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weight is, per 32 inputs of an output,
w_j = d * u_j + m with u_j an unsigned byte (and so is each 32-value sub-block of a Q4_K /
Q5_K super-block; Q6_K's scales are per 16 values: it has no such form); the activations round per 32 values to int8
(llama.cpp's Q8_1 scheme), so that vpdpbusd multiplies 64 byte pairs an instruction, twice
the multiply-adds of a bf16 product's vdpbf16ps. Measured on an AVX-512 Zen 5 core pair against
oneDNN's bf16 product of the same weights (the default model's shapes, 16 to 2,048 rows):
1.15-1.9x the speed, with a relative error of ~5.6e-3 against ~2.4e-3 for bf16 activations.
The codes take 1 byte a weight plus 8 bytes of d, m per 32 (the dense bf16 copy: 2 bytes).

Requantized blocks (opt-in: PAGELLM_Q32_BLOCK=auto, or 64-256): the float work of each block
(a convert, the two scales' product and one or two FMAs per 16 outputs and row) runs on the
pipes the products need and caps a 32-value tile at ~73% of vpdpbusd's peak. With a block,
the file's values are requantized to int8 codes with one scale per `block` inputs (auto: 256,
192, 128 or 64, the longest that divides K; symmetric, d = max|w| / 127, codes rounded to
nearest even, stored + 128 with the zero folded into the integer sum) and the activations are
rounded per the same block (as llama.cpp's Q8_K takes 256 values a scale), so the tile does
its float work once per block: the default model's 64-request run 1.25-1.36x (auto) and
1.1x (64) on two Zen 4 cores. The cost is accuracy, mostly the activations' coarser steps
(one outlier sets the step of its whole block), which the loader smooths (q32_smooth: each
input's weights times a measured factor, its activations divided by it, `inv`): scored on a
text, the default model's mean |log-probability difference| from float32 transformers is
0.060 with the file's blocks, 0.059 with blocks of 64 smoothed (0.086 unsmoothed), 0.078
with auto (0.123), where transformers in bf16 sits at 0.040. Every code is a byte (no
nibbles), so a 4-bit file's many-row form takes 1.5x the bytes (blocks of 64).
"""
from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from pagellm.kernels import native
from pagellm.layers import quant

logger = logging.getLogger(__name__)

PANEL = 32  # outputs a panel of codes holds
BLOCK = 32  # inputs per block (d, m) of the file's own codes
WIDE_BLOCKS = (256, 192, 128, 64)  # PAGELLM_Q32_BLOCK=auto's requantized blocks, longest first
MAX_BLOCK = 256  # the kernels' longest block (cpu_q32.c Q32_MAX_BLOCK)
# K-quants: each 32-value sub-block of a Q4_K / Q5_K super-block is w_j = (d sc) u_j - dmin mn
# with 6-bit integers sc, mn: the same form, exactly (f16 times a 6-bit integer fits float32)
# The 4-bit i-quants too: w = d * level(q) with 16 signed int8 levels is d * (level + 128) - 128 d,
# an unsigned byte code (not two a byte) and a min term, exactly
Q32_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.IQ4_NL, T.IQ4_XS})


def max_code() -> int:
    """The largest code this build's tiles take: 255 with AVX-512 VNNI (vpdpbusd), 31 with
    AVX2 alone (vpmaddubsw pair sums gathered in int16, kernels/cpu_q32.c), 0 without
    either (or without the native kernels)."""
    lib = native.library()
    return _max_code_of(lib) if lib is not None else 0


@functools.lru_cache(maxsize=4)
def _max_code_of(lib) -> int:
    """Asked once per library (every product checks its codes against it)."""
    return int(lib.q32_max_code())


def available() -> bool:
    """The kernels are built here (AVX-512 VNNI, or AVX2 for codes below 32);
    PAGELLM_Q32=0 turns them off."""
    return os.environ.get("PAGELLM_Q32", "1") != "0" and max_code() > 0


# The largest unsigned code of each type's form (unsigned_blocks): what the tiles must take
CODE_MAX = {T.Q4_0: 15, T.Q4_1: 15, T.Q4_K: 15, T.Q5_0: 31, T.Q5_1: 31, T.Q5_K: 31,
            T.Q8_0: 255, T.IQ4_NL: 255, T.IQ4_XS: 255}


def asked_block() -> int | str | None:
    """What PAGELLM_Q32_BLOCK asks for: None (the file's own 32-value blocks: the default),
    "auto", or a block (a multiple of 32 from 64 to 256)."""
    want = os.environ.get("PAGELLM_Q32_BLOCK", "32").strip().lower()
    if want in ("", "32", "exact"):
        return None
    if want == "auto":
        return want
    if not want.isdigit() or int(want) % BLOCK or not 64 <= int(want) <= MAX_BLOCK:
        raise ValueError(f"PAGELLM_Q32_BLOCK: 32, auto, or a multiple of 32 from 64 to "
                         f"{MAX_BLOCK}; got {want!r}")
    return int(want)


def wide_block(k: int) -> int | None:
    """The requantized block for K inputs that PAGELLM_Q32_BLOCK asks for, or None (the
    file's own 32-value blocks). "auto": the longest of WIDE_BLOCKS dividing K; a number:
    that block where it divides K. Requantized codes are bytes: None where the tiles take
    only codes below 32 (AVX2), with a warning once."""
    want = asked_block()
    if want is not None and max_code() < 255:
        _warn_no_requantized_blocks()
        return None
    if want == "auto":
        return next((b for b in WIDE_BLOCKS if k % b == 0), None)
    return want if want is not None and k % want == 0 else None


@functools.cache
def _warn_no_requantized_blocks() -> None:
    logger.warning("PAGELLM_Q32_BLOCK: requantized blocks need AVX-512 VNNI (their codes are "
                   "bytes); keeping the file's own blocks")


def check_block(block: int, k: int) -> None:
    """A block the kernels take for K inputs: a multiple of 32, at most MAX_BLOCK, dividing K."""
    if block % BLOCK or not BLOCK <= block <= MAX_BLOCK or k % block:
        raise ValueError(f"q32: block ({block}) must be a multiple of 32 up to {MAX_BLOCK} "
                         f"dividing the inputs ({k})")


def _weights(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, rows: slice) -> torch.Tensor:
    """w = d u + m of these rows [r, K] float32 (u [N, K], d, m [N, K / 32])."""
    u, d, m = u[rows], d[rows], m[rows]
    n, k = u.shape
    w = u.view(n, k // BLOCK, BLOCK).float().mul_(d[..., None]).add_(m[..., None])
    return w.view(n, k)


CHUNK = 64  # rows requantized at a time: a few MB of float32, in cache between the passes


def column_max(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """max_i |w_ij| [K] float32 over the outputs of w = d u + m per 32 (q32_smooth.factors)."""
    out = torch.zeros(u.shape[1])
    for r in range(0, u.shape[0], CHUNK):
        torch.maximum(out, _weights(u, d, m, slice(r, r + CHUNK)).abs_().amax(0), out=out)
    return out


def requantize(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, block: int,
               smooth: torch.Tensor | None = None):
    """u [N, K] uint8, d, m [N, K / 32] (w = d u + m per 32) -> the same weights as int8 codes
    with one scale per `block` inputs: (u' = c + 128, d' = max|w| / 127, m' = -128 d'), c the
    nearest integer (ties to even) to w / d' (|c| <= 127); a block of zeros gets d' = 0.
    smooth [K] (or None): the weights of input j multiplied by smooth[j] first (their
    activations are divided by it: Q32Linear.inv). CHUNK rows at a time, in place."""
    n, k = u.shape
    u2 = torch.empty(n, k, dtype=torch.uint8)
    dw = torch.empty(n, k // block)
    tiny = torch.finfo(torch.float32).tiny
    for r in range(0, n, CHUNK):
        rows = slice(r, r + CHUNK)
        w = _weights(u, d, m, rows)
        if smooth is not None:
            w.mul_(smooth)
        w = w.view(w.shape[0], k // block, block)
        scale = w.abs().amax(dim=-1).div_(127)
        dw[rows] = scale
        # d' = 0: w = 0, c = 0
        c = w.div_(scale.clamp_min(tiny)[..., None]).round_().clamp_(-127, 127).add_(128)
        u2[rows] = c.view(-1, k).to(torch.uint8)
    return u2, dw, -128 * dw


def unsigned_blocks(part) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(u [N, K] uint8, d [N, K / 32] float32, m [N, K / 32] float32) with w = d * u + m for
    each block, or None for a part of another kind."""
    if isinstance(part, quant.Int4Blocks):  # torch convention w = (q - 8) * scale + zero
        return part.q, part.scale.float(), (part.zero - 8 * part.scale).float()
    if isinstance(part, quant.GGUFBlocks) and part.ggml_type in Q32_TYPES:
        return _decode(part.raw.numpy(), part.ggml_type, part.cols)
    return None


def k_codes(b: np.ndarray, ggml_type: T) -> np.ndarray:
    """Q4_K / Q5_K super-blocks b [S, bytes] -> their codes u [S * 8, 32], one row per
    32-value sub-block (also the panels' Q4_K codes). Layout: d, dmin (f16), 12 bytes of 6-bit
    scales and mins, (Q5_K: 32 bytes of fifth bits), 128 bytes of nibbles: sub-blocks 2c and
    2c + 1 are the low and high nibbles of bytes 32c..32c + 31."""
    qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    u = (qs & 0xF).reshape(-1, 8, 32)
    if ggml_type == T.Q5_K:  # bit j of byte i: the fifth bit of value i of sub-block j
        qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        u = u | ((qh & 1) << 4)
    return u.reshape(-1, 32)


def _decode_k(b: np.ndarray, ggml_type: T):
    """Q4_K / Q5_K super-blocks b [S, bytes] -> u [S * 8, 32], d, m [S * 8] per sub-block:
    d = d_super * scale, m = -dmin * min."""
    sc, mn = gguf_quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    d, dmin = _f16(b, 0), _f16(b, 2)
    return (k_codes(b, ggml_type), (d[:, None] * sc.astype(np.float32)).reshape(-1),
            (-(dmin[:, None] * mn.astype(np.float32))).reshape(-1))


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _decode(raw: np.ndarray, ggml_type: T, cols: int):
    """GGUF 32-value blocks (or K-quant sub-blocks) -> (u, d, m) of the same values, exactly."""
    n = raw.shape[0]
    _, nbytes = quant.GGML_QUANT_SIZES[ggml_type]
    b = np.ascontiguousarray(raw).reshape(-1, nbytes)  # [N * K / block, bytes]
    if ggml_type in (T.Q4_K, T.Q5_K):
        u, d, m = _decode_k(b, ggml_type)
    elif ggml_type in (T.IQ4_NL, T.IQ4_XS):
        from pagellm.layers import panels  # the codes, the levels and each 32's scale

        q, params = panels._iq4(b, ggml_type, n, cols)  # q [N, K]
        d = (params["scale"].astype(np.float32) if ggml_type == T.IQ4_NL else  # gguf's d * (ls - 32)
             params["d"].astype(np.float32)[..., None] * params["isc"].astype(np.float32))
        u = (panels.IQ4_LEVELS[q].astype(np.int16) + 128).astype(np.uint8)
        m = -128 * d
    elif ggml_type == T.Q8_0:
        d = _f16(b, 0)
        u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m = -128 * d
    else:
        d = _f16(b, 0)
        has_min = ggml_type in (T.Q4_1, T.Q5_1)
        qs = b[:, nbytes - 16:]
        u = np.concatenate([qs & 0xF, qs >> 4], axis=1)  # values 0-15, then 16-31
        if ggml_type in (T.Q5_0, T.Q5_1):
            at = 4 if has_min else 2
            qh = b[:, at:at + 4].copy().view(np.uint32)[:, 0]
            high = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1
            u = u | (high.astype(np.uint8) << 4)
        zero = {T.Q4_0: 8, T.Q5_0: 16}.get(ggml_type, 0)
        m = _f16(b, 2) if has_min else -zero * d
    blocks = cols // BLOCK
    return (torch.from_numpy(np.ascontiguousarray(u).reshape(n, cols)),
            torch.from_numpy(d.reshape(n, blocks)), torch.from_numpy(m.reshape(n, blocks)))


class Q32Linear:
    """y = x W^T for W [N, K] from 32-value blocks (one or more fused parts, in order): bf16
    activations in and out, like OneDNNLinear, which it replaces."""

    inv = None  # [K] float32: the activations' smoothing factors (1 / smooth), or None

    def __init__(self, parts: list, pack_nibbles: bool = True, block: int = BLOCK):
        decoded = [unsigned_blocks(p) for p in parts]
        if any(x is None for x in decoded):
            raise ValueError("q32: every part must be a 32-value block type")
        self._build(torch.cat([x[0] for x in decoded]), torch.cat([x[1] for x in decoded]),
                    torch.cat([x[2] for x in decoded]), pack_nibbles, block)

    def _build(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, pack_nibbles: bool,
               block: int, smooth: torch.Tensor | None = None) -> None:
        """The form of the weights w = d u + m per 32 inputs (u [N, K], d, m [N, K / 32]):
        their own blocks (block 32), or requantized with one scale per `block` inputs, each
        input's weights multiplied by smooth (and its activations by inv = 1 / smooth)."""
        n, k = u.shape
        if k % BLOCK:
            raise ValueError(f"q32: inputs ({k}) must be a multiple of {BLOCK}")
        check_block(block, k)
        if smooth is not None:
            if (block == BLOCK or smooth.shape != (k,)
                    or not bool(((smooth > 0) & torch.isfinite(smooth)).all())):
                raise ValueError("q32: smoothing takes a requantized block and K positive factors")
            self.inv = (1 / smooth.float()).contiguous()
        if block != BLOCK:
            u, d, m = requantize(u, d, m, block, smooth)
        self.block = block  # inputs per scale: the file's 32, or a requantized block
        pad = -n % PANEL
        if pad:  # zero outputs past N fill the last panel (never stored)
            u = torch.cat([u, u.new_zeros(pad, k)])
            d, m = (torch.cat([t, t.new_zeros(pad, k // block)]) for t in (d, m))
        p = (n + pad) // PANEL
        self.out_features, self.in_features = n, k
        # [P, 32, K / 4, 4] -> [P, K / 4, 32, 4]: 4 consecutive inputs of an output per lane
        codes = u.view(p, PANEL, k // 4, 4).permute(0, 2, 1, 3)
        # 4-bit codes (every part Q4_0, Q4_1, Q4_K or int4): two a byte, outputs o and o + 16
        # of a panel in one byte's low and high nibble ([P, K / 4, 16, 4]): half the memory
        # and half the bytes a step streams; the kernel unpacks with a shift and two masks
        self.nibbles = bool(pack_nibbles and int(u.max()) < 16) if u.numel() else False
        if self.nibbles:
            codes = codes[:, :, :PANEL // 2] | (codes[:, :, PANEL // 2:] << 4)
        self.codes = codes.contiguous()
        self.code_max = int(u.max()) if u.numel() else 0  # what the tiles must take (max_code)
        self.d = d.view(p, PANEL, k // block).permute(0, 2, 1).contiguous()
        self.m = m.view(p, PANEL, k // block).permute(0, 2, 1).contiguous()
        self.zeros = folded_zeros(self.d, self.m)

    def own_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u [N, K] uint8, d, m [N, K / 32]): the file's blocks this form holds (block 32)."""
        if self.block != BLOCK:
            raise ValueError("q32: only the file's own blocks can be requantized")
        n, k, g = self.out_features, self.in_features, self.in_features // BLOCK
        u = self.unpacked_codes().permute(0, 2, 1, 3).reshape(-1, k)[:n]
        d, m = (t.permute(0, 2, 1).reshape(-1, g)[:n] for t in (self.d, self.m))
        return u.contiguous(), d.contiguous(), m.contiguous()

    @classmethod
    def from_blocks(cls, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, block: int,
                    smooth: torch.Tensor | None = None) -> Q32Linear:
        """The form of the weights w = d u + m per 32 inputs (own_blocks()), requantized with
        one scale per `block` inputs where block > 32, each input's weights multiplied by
        smooth[j] where given (q32_smooth)."""
        form = cls.__new__(cls)
        form._build(u, d, m, True, block, smooth)
        return form

    # The requantized block PAGELLM_Q32_BLOCK asks for, while this form still holds the file's
    # own blocks: the model's loader requantizes it once its activations are measured
    # (q32_smooth.requantize_model); None when nothing waits.
    pending_block: int | None = None

    @classmethod
    def from_parts(cls, parts: list) -> Q32Linear | None:
        """The int8 form of these parts, or None if a part is of another type (callers ask
        available() first): the file's blocks, with pending_block set where PAGELLM_Q32_BLOCK
        asks for requantized ones (wide_block)."""
        if not all(fits(p) for p in parts):
            return None
        form = cls(parts)
        form.pending_block = wide_block(parts[0].shape[1])
        return form

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] bf16; x is rounded to bf16 first, as OneDNNLinear does, so
        that the module path and the wide layer (which normalizes into bf16) quantize the same
        values."""
        return self._run(x, self.out_features, "q32_linear")

    @property
    def gates(self) -> bool:
        """Whether gated() applies: N = 2I outputs (gate | up) with I a multiple of 32."""
        return self.out_features % (2 * PANEL) == 0

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> silu(gate) * up [..., N / 2] bf16 for a gate | up projection: the same
        bits as silu_mul_bf16(self(x)), gated inside the product (kernels/cpu_q32.c)."""
        if not self.gates:
            raise ValueError(f"q32: gating needs 2I outputs with I a multiple of {PANEL}")
        return self._run(x, self.out_features // 2, "q32_linear_gated")

    def _run(self, x: torch.Tensor, width: int, kernel: str) -> torch.Tensor:
        if self.code_max > max_code():
            raise ValueError(f"q32: codes up to {self.code_max}; this build's tiles take "
                             f"{max_code()} at most (AVX2 alone: 4- and 5-bit types)")
        lead, k = x.shape[:-1], self.in_features
        xq, dx, sx = quantize(x.reshape(-1, k), self.block, self.inv)
        rows = xq.shape[0]
        y = torch.empty(rows, width, dtype=torch.bfloat16)
        lib, threads = native.library(), torch.get_num_threads()
        rc = getattr(lib, kernel)(xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), rows, k, self.block,
                                  self.codes.data_ptr(), self.d.data_ptr(), self.m.data_ptr(),
                                  self.zeros_ptr(), int(self.nibbles), self.out_features,
                                  y.data_ptr(), threads)
        if rc != 0:
            raise MemoryError(f"{kernel}: out of memory for its block sums")
        return y.view(*lead, width)

    def inv_ptr(self) -> int | None:
        """The kernels' `inv` argument: None where the activations are not smoothed."""
        return self.inv.data_ptr() if self.inv is not None else None

    def zeros_ptr(self) -> int | None:
        """The kernels' `zeros` argument: None where no panel folds its min term."""
        return self.zeros.data_ptr() if self.zeros is not None else None

    def unpacked_codes(self) -> torch.Tensor:
        """[P, K / 4, 32, 4] uint8: the codes one a byte, whether or not they are kept in
        nibbles."""
        if not self.nibbles:
            return self.codes
        return torch.cat([self.codes & 0xF, self.codes >> 4], dim=2)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32: the weights these codes hold
        codes = self.unpacked_codes()
        p, kq, _, _ = codes.shape
        k = kq * 4
        u = codes.permute(0, 2, 1, 3).reshape(p * PANEL, k).float()
        b = self.block
        d = self.d.permute(0, 2, 1).reshape(p * PANEL, k // b)
        m = self.m.permute(0, 2, 1).reshape(p * PANEL, k // b)
        w = u.view(-1, k // b, b) * d[..., None] + m[..., None]
        return w.view(-1, k)[: self.out_features]

    @property
    def nbytes(self) -> int:
        zeros = self.zeros.numel() if self.zeros is not None else 0
        return self.codes.numel() + (self.d.numel() + self.m.numel() + zeros) * 4


def folded_zeros(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """d, m [P, K / block, 32] -> [P] int32: z where every m of panel p is -z d (Q4_0: 8, Q5_0:
    16, Q8_0: 128: the kernel then adds the min term inside the block's integer sum, one
    multiply-add less per 16 outputs and block), else 0; None where no panel has one."""
    zeros = torch.zeros(d.shape[0], dtype=torch.int32)
    for z in (128, 16, 8):  # padding panels (d = m = 0) fit any z
        zeros[(m == -z * d).flatten(1).all(dim=1)] = z
    return zeros if bool(zeros.any()) else None


def quantize(x: torch.Tensor, block: int = BLOCK, inv: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] -> (xq [R, K] int8, dx, sx [R, K / block] float32): the activations of a q32
    product, from x rounded to bf16 (float32 rows are rounded as they are read: no bf16
    copy), each value times inv[j] in float32 where given (Q32Linear.inv), one scale per
    `block` values of a row (the product's Q32Linear.block)."""
    rows, k = x.shape
    check_block(block, k)
    if inv is not None and (inv.dtype != torch.float32 or inv.shape != (k,)
                            or not inv.is_contiguous()):
        raise ValueError(f"q32: inv must be {k} contiguous float32 factors")
    if x.dtype != torch.float32:
        x = x.to(torch.bfloat16)
    x = x.contiguous()
    xq = torch.empty(rows, k, dtype=torch.int8)
    dx = torch.empty(rows, k // block, dtype=torch.float32)
    sx = torch.empty(rows, k // block, dtype=torch.float32)
    kernel = "q32_quantize_f32" if x.dtype == torch.float32 else "q32_quantize"
    getattr(native.library(), kernel)(x.data_ptr(), rows, k, block,
                                      None if inv is None else inv.data_ptr(), xq.data_ptr(),
                                      dx.data_ptr(), sx.data_ptr(), torch.get_num_threads())
    return xq, dx, sx


def unsigned_blocks_kind(part) -> bool:
    """Whether unsigned_blocks takes this part (without decoding it)."""
    return isinstance(part, quant.Int4Blocks) or (
        isinstance(part, quant.GGUFBlocks) and part.ggml_type in Q32_TYPES)


def fits(part) -> bool:
    """Whether this build's tiles multiply this part's codes (unsigned_blocks_kind, and
    codes up to max_code(): with AVX2 alone, the 4- and 5-bit types)."""
    if not unsigned_blocks_kind(part):
        return False
    top = 15 if isinstance(part, quant.Int4Blocks) else CODE_MAX[part.ggml_type]
    return top <= max_code()
