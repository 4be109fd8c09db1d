"""Linear layers that own their weight loading, sharded for tensor parallelism.

With tp_size == 1 they are plain linears. Column-parallel layers hold a slice of the output
features; row-parallel layers hold a slice of the input features and all-reduce their output.
Fused projections (q|k|v, gate|up) load each checkpoint tensor into its own slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import parallel


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b); output features split across ranks. `shard_sizes`: full output sizes
    of the fused parts in order, e.g. (q, k, v); each part is split evenly across ranks."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool):
        super().__init__()
        tp = parallel.tp_size()
        assert all(s % tp == 0 for s in shard_sizes), (shard_sizes, tp)
        self.local_sizes = tuple(s // tp for s in shard_sizes)
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """name 'weight' or 'bias'; tensor holds the full (unsharded) part number `shard`."""
        size = self.local_sizes[shard]
        offset = sum(self.local_sizes[:shard])
        part = tensor.narrow(0, parallel.tp_rank() * size, size)
        getattr(self, name).data.narrow(0, offset, size).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T); input features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = parallel.tp_size()
        assert in_features % tp == 0
        self.in_local = in_features // tp
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        if name == "bias":  # added once, after the reduction
            self.bias.data.copy_(tensor)
            return
        part = tensor.narrow(1, parallel.tp_rank() * self.in_local, self.in_local)
        self.weight.data.copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = parallel.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
