"""Linear layers that own their weight loading, sharded for tensor parallelism.

With one process they are plain linears. Column-parallel layers hold a slice of the output
features; row-parallel layers hold a slice of the input features and all-reduce their output.
Fused projections (q|k|v, gate|up) load each checkpoint tensor into their own slice of it.
Slices are given in units (heads, or single features) so that e.g. 3 KV heads split 2 + 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import parallel


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# CPUs without bf16 instructions multiply bf16 matrices several times slower than float32
# (measured on AVX2: 37 ms vs 7 ms for 64 x 576 x 3072). There, batched products upcast
# the bf16 weights on the fly; single-row products stay in bf16, where it is no slower.
UPCAST_BF16 = not _cpu_has_native_bf16()
_UPCAST_MIN_ROWS = 8


def upcast(*tensors: torch.Tensor) -> bool:
    """Whether a CPU product of these bf16 tensors is faster done in float32."""
    t = tensors[0]
    return (UPCAST_BF16 and t.dtype == torch.bfloat16 and t.device.type == "cpu"
            and t.numel() // t.shape[-1] >= _UPCAST_MIN_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed in float32 for batched bf16 inputs on CPUs without bf16 units."""
    if upcast(x):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) for this rank's rows of W. parts: for each fused part, (full output
    size, unit size): the part's units are split across ranks."""

    def __init__(self, in_features: int, parts: tuple[tuple[int, int], ...], bias: bool):
        super().__init__()
        self.ranges = []  # per part: (start row in the checkpoint tensor, local rows)
        for full, unit in parts:
            start, count = parallel.split(full // unit)
            self.ranges.append((start * unit, count * unit))
        out = sum(n for _, n in self.ranges)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """name 'weight' or 'bias'; tensor holds the full (unsharded) part number `shard`."""
        start, size = self.ranges[shard]
        offset = sum(n for _, n in self.ranges[:shard])
        getattr(self, name).data.narrow(0, offset, size).copy_(tensor.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) (+ b); this rank holds `unit`-sized groups of the
    input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, unit: int = 1):
        super().__init__()
        start, count = parallel.split(in_features // unit)
        self.start, self.in_local = start * unit, count * unit
        self.reduce = parallel.tp_size() > 1
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        if name == "bias":  # added once, after the reduction
            self.bias.data.copy_(tensor)
            return
        self.weight.data.copy_(tensor.narrow(1, self.start, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.reduce:
            y = parallel.all_reduce(y)
        return y + self.bias if self.bias is not None else y
