"""Int8 products for many-row steps (prefill chunks, large batches) on CPUs without bf16
units: K-quant weights' own codes against int8 activations, instead of a dense float32 copy of
every such weight.

A K-quant weight (Q4_K, Q5_K, Q6_K) is, per 256-value super-block,

    w_j = d * isc_j * c_j + m_j        c_j in 0..63 (an unsigned byte)

with d the super-block's float scale, isc the integer sub-block scales (Q4_K / Q5_K: 6 bits
per 32 values; Q6_K: int8 per 16) and m the offsets (Q4_K / Q5_K: the sub-block mins
-dmin * mn per 32; Q6_K: the zero point, -32 d isc per 16). Then, with x_j ~ D * 2^sh * xq_j
(int8 per 32 values, sh a block's power-of-two scale inside its super-block, cpu_int8.c
quantize_i8),

    sum_j w_j x_j ~ d * D * sum_j 2^sh isc_j c_j xq_j  +  sum_blocks m * sum_block x

the first an exact integer sum (kernels/cpu_int8.c), the second one small float32 product of
the offsets with the activations' float block sums (K / 32 or K / 16 inputs). The only
rounding beyond float32's is the activations' (half a step per value, the step within 2x of
the block's max|x| / 127, or 1/8128 of its super-block's max for blocks 64x smaller); the
codes hold every weight of the file exactly.

The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) carry a float scale per 32 values, whose
product with the activations' scale costs as many multiplying instructions as float32 does
(kernels/cpu_int8.c): they keep their dense weights (as do the types requantized to Q8_0 at
load, gguf_loader.REQUANTIZED_TYPES).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagellm.kernels import native

SUPER = 256
INT8_TYPES = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})


# Within each 32-value block the kernel's codes and activations are stored in this order
# (position p holds value BLOCK_ORDER[p]; kernels/cpu_int8.c ORDER says why).
BLOCK_ORDER = torch.tensor([0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23,
                            8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31])


@dataclass
class Int8Codes:
    """A K-quant weight [N, K]: w = d * isc * codes + offset."""

    codes: torch.Tensor  # [N, K] uint8, 0..63, BLOCK_ORDER within each 32-value block
    d: torch.Tensor  # [N, K / 256] float32
    scales: torch.Tensor  # [N, K / 32] int32: isc of the block's first 16 values | second's << 16
    offset: torch.Tensor  # [N, K / 32] float32 (Q4_K / Q5_K) or [N, K / 16] (Q6_K)

    @property
    def isc(self) -> torch.Tensor:  # [N, K / 16] the integer sub-block scales, in value order
        lo = (self.scales & 0xFFFF).to(torch.int16)
        hi = (self.scales >> 16).to(torch.int16)
        return torch.stack([lo, hi], dim=-1).flatten(1)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def offset_width(self) -> int:
        """Inputs per offset: 32 or 16."""
        return self.codes.shape[1] // self.offset.shape[1]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n, k = self.codes.shape
        codes = torch.empty_like(self.codes).view(n, k // 32, 32)
        codes[:, :, BLOCK_ORDER] = self.codes.view(n, k // 32, 32)  # back to value order
        scale = self.d.repeat_interleave(SUPER // 16, dim=1) * self.isc.float()  # [N, K / 16]
        w = codes.view(n, k // 16, 16).float() * scale.unsqueeze(-1)
        return (w.view(n, k) + self.offset.repeat_interleave(self.offset_width, dim=1))


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """[B] float32 from the half at byte `at` of each block (raw [B, block bytes])."""
    return raw[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 12 scale bytes [B, 12] -> 6-bit scales, mins [B, 8] (sub-block order)."""
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _unpack_blocks(raw: np.ndarray, t: T):
    """raw [B, block bytes] -> codes [B, 256] uint8, d [B, 1], isc [B, 16] int8, offset
    [B, 8] (Q4_K / Q5_K) or [B, 16] (Q6_K); layouts as ggml-quants.c writes them."""
    if t in (T.Q4_K, T.Q5_K):
        five = t == T.Q5_K
        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, mn = _k_scales(raw[:, 4:16])
        qs = raw[:, 48:176] if five else raw[:, 16:144]
        chunks = qs.reshape(-1, 4, 32)  # 64 values each: sub-block 2c low nibbles, 2c+1 high
        codes = np.stack([chunks & 15, chunks >> 4], axis=2).reshape(-1, 256)
        if five:
            qh = raw[:, 16:48]  # bit i of byte j: value 32 i + j gets 16
            bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = codes | (bits.reshape(-1, 256) << 4).astype(np.uint8)
        isc = np.repeat(sc.astype(np.int8), 2, axis=1)
        return codes, d[:, None], isc, -dmin[:, None] * mn
    if t == T.Q6_K:
        ql, qh = raw[:, 0:128].reshape(-1, 2, 64), raw[:, 128:192].reshape(-1, 2, 32)
        isc = raw[:, 192:208].copy().view(np.int8)
        d = _f16(raw, 208)
        low = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4,
                              ql[..., 32:] >> 4], axis=2)  # [B, 2, 128]: quadrants q = 0..3
        high = np.concatenate([(qh >> (2 * q)) & 3 for q in range(4)], axis=2)
        codes = (low | (high << 4)).reshape(-1, 256)
        return codes, d[:, None], isc, -32 * d[:, None] * isc.astype(np.float32)
    raise ValueError(f"{t.name} has no int8 form")


def unpack(blocks) -> Int8Codes:
    """An Int8Codes from quant.GGUFBlocks of a type in INT8_TYPES."""
    n, k = blocks.shape
    _, nbytes = blocks.unit
    raw = blocks.raw.contiguous().numpy().reshape(-1, nbytes)
    codes, d, isc, offset = _unpack_blocks(raw, blocks.ggml_type)

    def tensor(a: np.ndarray, dtype=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).view(n, -1)

    codes = codes.reshape(-1, 32)[:, BLOCK_ORDER.numpy()]
    halves = isc.astype(np.int16).view(np.uint16).astype(np.int32).reshape(-1, 2)
    scales = halves[:, 0] | (halves[:, 1] << 16)  # as the kernel reads two int16 lanes
    return Int8Codes(tensor(codes), tensor(d, np.float32), tensor(scales),
                     tensor(offset, np.float32))


def int8_form(blocks) -> bool:
    """Whether these blocks (quant.Int4Blocks / GGUFBlocks) have an int8 form here."""
    return (native.available() and getattr(blocks, "ggml_type", None) in INT8_TYPES
            and blocks.shape[1] % SUPER == 0)


def cat_rows(parts: list[Int8Codes]) -> Int8Codes:
    """Parts with offsets of one width stacked along the outputs."""
    return Int8Codes(*(torch.cat([getattr(p, f) for p in parts])
                       for f in ("codes", "d", "isc", "offset")))


class NativeInt8:
    """x W^T for many rows from Int8Codes (kernels/cpu_int8.c), float32 out. A fused
    projection's parts (q|k|v of different types) are runs of one layout each; the activations
    are quantized once and each run writes its own columns."""

    def __init__(self, parts: list[Int8Codes]):
        runs: list[list[Int8Codes]] = []
        for part in parts:
            if runs and runs[-1][0].offset_width == part.offset_width:
                runs[-1].append(part)
            else:
                runs.append([part])
        self.runs = [cat_rows(run) if len(run) > 1 else run[0] for run in runs]
        self.out_features = sum(r.codes.shape[0] for r in self.runs)

    @classmethod
    def from_blocks(cls, parts: list) -> NativeInt8 | None:
        """From a projection's parts (quant.Int4Blocks / GGUFBlocks), or None if some part has
        no int8 form."""
        if not all(int8_form(p) for p in parts):
            return None
        return cls([unpack(p) for p in parts])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.runs
                   for t in (r.codes, r.d, r.scales, r.offset))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = native.library()
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
        r = x2.shape[0]
        xq = torch.empty(r, k, dtype=torch.int8)
        dx = torch.empty(r, k // SUPER)
        sh = torch.empty(r, k // 32, dtype=torch.uint8)
        xs = {16: torch.empty(r, k // 16)}
        lib.quantize_i8(x2.data_ptr(), r, k, xq.data_ptr(), dx.data_ptr(), sh.data_ptr(),
                        xs[16].data_ptr())
        y = torch.empty(r, self.out_features)
        n0 = 0
        for w in self.runs:
            n = w.codes.shape[0]
            lib.i8_linear(xq.data_ptr(), dx.data_ptr(), sh.data_ptr(), r, k, w.codes.data_ptr(),
                          w.d.data_ptr(),
                          w.scales.data_ptr(), n, y[:, n0:].data_ptr(), self.out_features,
                          torch.get_num_threads())
            width = w.offset_width
            if width not in xs:  # sums over 32 values from those over 16
                xs[width] = xs[16].view(r, k // width, width // 16).sum(-1)
            y[:, n0:n0 + n].addmm_(xs[width], w.offset.t())
            n0 += n
        return y.view(*x.shape[:-1], self.out_features)
