"""Tensor-parallel state: this process's rank and group size, and the one collective models use.

Single-process runs never touch torch.distributed: tp_size() is 1 and all_reduce is identity.
"""
from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def set_tp(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
    if _TP_SIZE == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
