"""4-bit weights kept packed: GGUF Q4_0 / Q4_1 linears multiplied without dequantizing them.

A decode step at small batch reads every weight once, so it is bound by how fast weights stream
through the core. A GGUF Q4 tensor is 32-element blocks of 4-bit codes with one scale (and for
Q4_1 one offset) per block:

    Q4_0: w = d * (q - 8)        Q4_1: w = d * q + m        (q in 0..15)

which is exactly PyTorch's grouped int4 format `w = (q - 8) * scale + zero` with group 32,
scale = d and zero = 0 (Q4_0) or m + 8 d (Q4_1). `torch.ops.aten._weight_int4pack_mm_for_cpu`
multiplies bf16 activations by such weights straight from the packed codes (1.3x faster than a
bf16 product for one row on an AVX2 CPU, 3-4x for 2-16 rows). Past ~16 rows a dense float32
product is faster, so a linear keeps both its dense weight and, when available, the packed one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
# Products with fewer rows than this use the packed weights. Measured on AVX2 for a
# 3072 x 576 weight (ms): rows 1: 0.36 packed / 0.47 bf16 / 0.59 upcast to float32;
# 4: 0.40 / 1.58 / 1.20; 16: 1.58 / 6.46 / 1.92; 32: 3.38 / 12.6 / 2.70.
MAX_ROWS = 17


@dataclass
class Int4Blocks:
    """A weight [N, K] as 4-bit codes with a scale and zero per GROUP inputs of each row."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // GROUP] float32
    zero: torch.Tensor  # [N, K // GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, the same values as the GGUF file
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() - 8
        w = w * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.view(n, k)

    def narrow(self, dim: int, start: int, length: int) -> Int4Blocks:
        if dim == 0:
            return Int4Blocks(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                              self.zero.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a 4-bit weight splits along its inputs only at multiples of {GROUP}")
        return Int4Blocks(self.q.narrow(1, start, length),
                          self.scale.narrow(1, start // GROUP, length // GROUP),
                          self.zero.narrow(1, start // GROUP, length // GROUP))


def cat_rows(parts: list[Int4Blocks]) -> Int4Blocks:
    return Int4Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]))


def packable(n: int, k: int) -> bool:
    """Shapes the CPU kernel takes: outputs a multiple of 16, inputs a multiple of the group."""
    return n % 16 == 0 and k % GROUP == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def pack(w: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed codes [N, K / 2] uint8, scales_and_zeros [K / GROUP, N, 2] bfloat16)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32).contiguous(), 2)
    scales_zeros = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x W^T [..., N] in x's dtype, computed with bf16 activations."""
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.reshape(-1, shape[-1]).to(torch.bfloat16), packed, GROUP, scales_zeros)
    return y.view(*shape[:-1], y.shape[-1]).to(x.dtype)
