"""Block weights laid out in panels of 16 outputs for kernels/cpu_panels.c (AVX-512 BW + VNNI):
the GGUF blocks decoded into integer codes and per-block parameters, exactly (the kernel's
values are the file's), then interleaved as the kernel reads them. See cpu_panels.c for the
layout and why.

    fmt                 from                         bytes a weight (file's)
    Q4_F32 (0)          Int4Blocks (float32 scales)  0.75
    Q4_F16 (1)          Q4_0, Q4_1 (fp16 d, m)       0.625  (0.5625, 0.625)
    Q5_F16 (2)          Q5_0, Q5_1                   0.75   (0.6875, 0.75)
    Q4_K   (3)          Q4_K                         0.5625 (0.5625)
    Q4_K8  (4)          Q4_K, for int8 activations   0.5625 (0.5625)
    Q6_K8  (5)          Q6_K, for int8 activations   0.8203 (0.8203)
    IQ4_NL8 (6)         IQ4_NL, int8 activations     0.5625 (0.5625)
    IQ4_XS8 (7)         IQ4_XS, int8 activations     0.5391 (0.5313)

Q4_K takes Q4_K8 and Q6_K takes Q6_K8 (int8 activations: about half the instructions of int16
ones, so that a 2-5-row verification step costs little more than one row) unless
PAGELLM_PANELS_INT8=0; then Q4_K takes Q4_K and Q6_K keeps the file's rows (NativeGGUF: in
int16 panels its 2-bit planes made it slower at 1-5 rows).
"""
from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagellm.kernels import native

OUT = 16  # outputs a panel
Q4_F32, Q4_F16, Q5_F16, Q4_K, Q4_K8, Q6_K8, IQ4_NL8, IQ4_XS8 = range(8)
FORMAT_OF = {T.Q4_0: Q4_F16, T.Q4_1: Q4_F16, T.Q5_0: Q5_F16, T.Q5_1: Q5_F16, T.Q4_K: Q4_K}
INT8_FORMAT_OF = {T.Q4_K: Q4_K8, T.Q6_K: Q6_K8}
# the 4-bit i-quants: codes indexing a table of 16 levels (looked up in the kernel), int8
# activations only; no other native kernel takes them (elsewhere they are requantized to Q8_0)
LEVEL_FORMAT_OF = {T.IQ4_NL: IQ4_NL8, T.IQ4_XS: IQ4_XS8}
INT8_FORMATS = frozenset({*INT8_FORMAT_OF.values(), *LEVEL_FORMAT_OF.values()})  # int8 activations
# ggml's kvalues_iq4nl: the value of each 4-bit code of IQ4_NL / IQ4_XS (times the block's scale)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)


def available() -> bool:
    """Whether the panel kernels are built here (AVX-512 BW and VNNI); PAGELLM_PANELS=0 turns
    them off (weights loaded after that keep the row layouts)."""
    lib = native.library()
    return (os.environ.get("PAGELLM_PANELS", "1") != "0" and lib is not None
            and bool(lib.panels_available()))


def int8_activations() -> bool:
    """Whether K-quant weights loaded now take Q4_K8 / Q6_K8 (PAGELLM_PANELS_INT8, default on;
    the i-quants' formats have int8 activations only, whatever it says)."""
    return os.environ.get("PAGELLM_PANELS_INT8", "1") != "0"


def format_of(ggml_type: T) -> int | None:
    """The panel format weights of this type load into now, or None (they keep their rows)."""
    if ggml_type in LEVEL_FORMAT_OF:
        return LEVEL_FORMAT_OF[ggml_type]
    if int8_activations() and ggml_type in INT8_FORMAT_OF:
        return INT8_FORMAT_OF[ggml_type]
    return FORMAT_OF.get(ggml_type)


def linear(x: torch.Tensor, panels: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """x [..., K] (any float dtype) times N outputs' panels -> [..., N] float32."""
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    rc = native.library().panel_linear(x2.data_ptr(), x2.shape[0], k, panels.data_ptr(), fmt, n,
                                       y.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("panel_linear: out of memory for activation buffers")
    if rc != 0:
        raise ValueError(f"panel_linear: format {fmt} with {k} inputs is not one the kernel takes")
    return y.view(*x.shape[:-1], n)


# ---- layout ---------------------------------------------------------------------------------

def _pad(a: np.ndarray, p: int) -> np.ndarray:
    """[N, ...] -> [P * 16, ...] with zero rows past N."""
    pad = p * OUT - a.shape[0]
    return np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a


def _groups(u: np.ndarray, p: int) -> np.ndarray:
    """codes [N, K] -> [P, G, 8 (group c), 2 (half), 16 (o), 2 (t)]: input 4c + 2 half + t."""
    g = u.shape[1] // 32
    return _pad(u, p).reshape(p, OUT, g, 8, 2, 2).transpose(0, 2, 3, 4, 1, 5)


def _nibbles(u: np.ndarray, p: int) -> np.ndarray:
    """The 4-bit plane: [P, G, 256] (group c: byte 2o + t = input 4c + t | input 4c + 2 + t << 4)."""
    q = _groups(u & 15, p)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(p, q.shape[1], 256)


def _high_pairs(u: np.ndarray, p: int) -> np.ndarray:
    """Q6_K8's high 2 bits of the codes: [P, G, 128], per block 2 registers h of 64 bytes,
    byte 4o + j = (from bit 0) inputs 8h + j, 16 + 8h + j, 8h + 4 + j, 16 + 8h + 4 + j."""
    g = u.shape[1] // 32
    q = (_pad(u, p) >> 4).reshape(p, OUT, g, 2, 2, 2, 4)  # input 32g + 16 half + 4 (2h + t) + j
    b = (q[:, :, :, 0, :, 0] | q[:, :, :, 1, :, 0] << 2 | q[:, :, :, 0, :, 1] << 4
         | q[:, :, :, 1, :, 1] << 6)  # [P, o, G, h, j]
    return np.ascontiguousarray(b.transpose(0, 2, 3, 1, 4)).reshape(p, g, 128)


def _quads(u: np.ndarray, p: int) -> np.ndarray:
    """Q4_K8's codes: [P, G, 256], per block 4 registers a of 64 bytes, byte 4o + j = input
    4a + j | input 16 + 4a + j << 4 (output o)."""
    g = u.shape[1] // 32
    q = _pad(u & 15, p).reshape(p, OUT, g, 2, 4, 4)  # input 32g + 16 half + 4a + j
    b = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)  # [P, G, a, o, j]
    return np.ascontiguousarray(b).reshape(p, g, 256)


def _per_block(a: np.ndarray, p: int) -> np.ndarray:
    """[N, B] values per block -> [P, B, 16 * itemsize] bytes (16 outputs' values a block)."""
    a = _pad(a, p)
    return np.ascontiguousarray(a.reshape(p, OUT, a.shape[1]).transpose(0, 2, 1)).view(np.uint8)


def pack(fmt: int, u: np.ndarray, **params: np.ndarray) -> torch.Tensor:
    """codes u [N, K] uint8 and the format's per-block parameters -> the panels, uint8
    [P, K / unit, unit bytes]:
      Q4_F32: scale, low float32 [N, K / 32]; Q4_F16 / Q5_F16: the same as float16;
      Q4_K, Q4_K8: d, dmin float16 [N, K / 256], scales12 uint8 [N, K / 256, 12] (the file's
      bytes); Q6_K8: d float16 [N, K / 256], isc int8 [N, K / 256, 16] (u: the 6-bit codes);
      IQ4_NL8: scale float16 [N, K / 32]; IQ4_XS8: d float16 [N, K / 256], isc int8
      [N, K / 256, 8] (u: the 4-bit codes, indices of IQ4_LEVELS).
"""
    n, k = u.shape
    p, g = -(-n // OUT), k // 32
    codes = (_quads(u, p) if fmt in (Q4_K8, Q6_K8, IQ4_NL8, IQ4_XS8)
             else _nibbles(u, p))  # [P, G, 256]
    if fmt == IQ4_NL8:
        return torch.from_numpy(np.ascontiguousarray(
            np.concatenate([codes, _per_block(params["scale"], p)], axis=2)))
    if fmt in (Q4_F32, Q4_F16, Q5_F16):
        parts = [codes]
        if fmt == Q5_F16:  # fifth bits: per group a mask for each half, bit 2o + t
            bits = ((_groups(u, p) >> 4) & 1).astype(np.uint8)  # [P, G, 8, 2, 16, 2]
            parts.append(np.packbits(bits.reshape(p, g, 8, 2, 32), axis=-1, bitorder="little")
                         .reshape(p, g, 64))
        parts += [_per_block(params["scale"], p), _per_block(params["low"], p)]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)))
    s = k // 256
    if fmt == Q6_K8:
        isc = _pad(params["isc"], p).reshape(p, OUT, s, 16).transpose(0, 2, 3, 1)  # [P, S, 16, o]
        head = np.concatenate([_per_block(params["d"], p),
                               np.ascontiguousarray(isc).view(np.uint8).reshape(p, s, 256)], axis=2)
        blocks = np.concatenate([codes, _high_pairs(u, p)], axis=2)  # [P, G, 384]
    elif fmt == IQ4_XS8:
        isc = _pad(params["isc"], p).reshape(p, OUT, s, 8).transpose(0, 2, 3, 1)  # [P, S, 8, o]
        head = np.concatenate([_per_block(params["d"], p),
                               np.ascontiguousarray(isc).view(np.uint8).reshape(p, s, 128)], axis=2)
        blocks = codes  # [P, G, 256]
    elif fmt in (Q4_K, Q4_K8):
        blocks = codes  # [P, G, 256]
        words = _pad(params["scales12"], p).reshape(p, OUT, s, 3, 4).transpose(0, 2, 3, 1, 4)
        head = np.concatenate([_per_block(params["d"], p), _per_block(params["dmin"], p),
                               words.reshape(p, s, 192)], axis=2)  # [P, S, 256]
    else:
        raise ValueError(f"unknown panel format {fmt}")
    out = np.concatenate([head, blocks.reshape(p, s, -1)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(out))


# ---- outputs of a head ----------------------------------------------------------------------

# Each int8 format's unit as segments (bytes, groups): every segment is [groups, 16 outputs,
# bytes / groups / 16], so one output's bytes can be gathered into another panel.
_SEGMENTS = {
    Q4_K8: [(32, 1), (32, 1), (192, 3)] + [(256, 4)] * 8,
    Q6_K8: [(32, 1), (256, 16)] + [(256, 4), (128, 2)] * 8,
}
GATHERABLE = frozenset(_SEGMENTS)


def gather(buf: torch.Tensor, fmt: int, ids: torch.Tensor) -> torch.Tensor:
    """Panels [P, U, unit bytes] of a GATHERABLE format -> the panels of outputs `ids` (in that
    order): each output keeps its bytes, so its products have the same bits as in buf."""
    ids = ids.cpu().numpy()
    m, (p, u, _) = len(ids), buf.shape
    q = -(-m // OUT)
    src = buf.numpy()
    out, at = [], 0
    for size, groups in _SEGMENTS[fmt]:
        seg = src[:, :, at:at + size].reshape(p, u, groups, OUT, size // groups // OUT)
        rows = seg[ids // OUT, :, :, ids % OUT]  # [M, U, groups, width]
        rows = _pad(rows, q).reshape(q, OUT, *rows.shape[1:]).transpose(0, 2, 3, 1, 4)
        out.append(rows.reshape(q, u, size))
        at += size
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(out, axis=2)))


# ---- GGUF blocks -> codes and parameters ------------------------------------------------------

def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at:at + 2].copy().view(np.float16)[:, 0]


def decode(raw: np.ndarray, ggml_type: T, k: int) -> tuple[int, np.ndarray, dict]:
    """A GGUF weight's rows of blocks [N, row_bytes] -> (fmt, codes [N, K] uint8, parameters for
    pack), the same values as the file's. ValueError where no format holds them exactly."""
    from pagellm.layers import q32  # the 32-value types' and Q4_K's codes

    n = raw.shape[0]
    fmt = format_of(ggml_type)
    if fmt is None:
        raise ValueError(f"no panel format for {ggml_type.name}")
    if fmt == Q6_K8:
        from pagellm.layers import int8  # the Q6_K codes and scales, in value order

        b = np.ascontiguousarray(raw).reshape(-1, 210)  # [N * S, 210]
        u, _, isc, _ = int8._unpack_blocks(b, ggml_type)
        return fmt, u.reshape(n, k), {"d": _f16(b, 208).reshape(n, -1),
                                      "isc": isc.reshape(n, -1, 16)}
    if fmt in (Q4_F16, Q5_F16):
        u, d, m = (t.numpy() for t in q32._decode(raw, ggml_type, k))
        with np.errstate(over="ignore"):
            d16, m16 = d.astype(np.float16), m.astype(np.float16)
        if not np.isfinite(m16).all():  # Q4_0 / Q5_0: -8 d, -16 d past fp16's range (d > 8188 / 4094)
            if fmt == Q5_F16:
                raise ValueError("no exact panel form: a Q5 block's min is past fp16's range")
            return Q4_F32, u, {"scale": d, "low": m}
        return fmt, u, {"scale": d16, "low": m16}
    if fmt in (IQ4_NL8, IQ4_XS8):
        return fmt, *_iq4(np.ascontiguousarray(raw), ggml_type, n, k)
    if ggml_type == T.Q4_K:
        b = np.ascontiguousarray(raw).reshape(-1, 144)  # [N * S, 144]
        u = q32.k_codes(b, ggml_type).reshape(n, k)
        # the 6-bit scales and mins stay the file's 12 bytes: the kernel decodes them
        return fmt, u, {"d": _f16(b, 0).reshape(n, -1), "dmin": _f16(b, 2).reshape(n, -1),
                        "scales12": np.ascontiguousarray(b[:, 4:16]).reshape(n, -1, 12)}
    raise ValueError(f"no panel format for {ggml_type.name}")


def _iq4(raw: np.ndarray, ggml_type: T, n: int, k: int) -> tuple[np.ndarray, dict]:
    """IQ4_NL / IQ4_XS rows -> (codes [N, K], pack's parameters). IQ4_NL: per 32 values an
    fp16 scale and 16 bytes (byte j: value j in its low nibble, j + 16 in its high one);
    IQ4_XS: per 256 an fp16 d, the 8 blocks' 6-bit scales ls (low 4 bits from 4 bytes, high 2
    from a uint16), each block's scale d * (ls - 32), and 8 such 16-byte code blocks."""
    if ggml_type == T.IQ4_NL:
        b = raw.reshape(-1, 18)
        q = b[:, 2:]
        u = np.concatenate([q & 15, q >> 4], axis=1).reshape(n, k)
        return u, {"scale": _f16(b, 0).reshape(n, -1)}
    b = raw.reshape(-1, 136)
    high = b[:, 2:4].copy().view(np.uint16)[:, 0].astype(np.int32)
    low = b[:, 4:8].astype(np.int32)
    ib = np.arange(8)
    ls = ((low[:, ib // 2] >> (4 * (ib % 2))) & 15) | (((high[:, None] >> (2 * ib)) & 3) << 4)
    q = b[:, 8:].reshape(-1, 8, 16)
    u = np.concatenate([q & 15, q >> 4], axis=2).reshape(n, k)
    return u, {"d": _f16(b, 0).reshape(n, -1), "isc": (ls - 32).astype(np.int8).reshape(n, -1, 8)}
