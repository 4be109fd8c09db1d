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


def split(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """(start, count) of this rank's share of `total` units. Shares differ by at most one, so
    e.g. 3 KV heads split over 2 ranks as 2 + 1."""
    rank = _TP_RANK if rank is None else rank
    size = _TP_SIZE if size is None else size
    start = rank * total // size
    return start, (rank + 1) * total // size - start


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


class single_process:
    """Build modules unsharded inside this block (the draft model lives on rank 0 alone)."""

    def __enter__(self):
        global _TP_RANK, _TP_SIZE
        self._saved = (_TP_RANK, _TP_SIZE)
        _TP_RANK, _TP_SIZE = 0, 1

    def __exit__(self, *exc):
        global _TP_RANK, _TP_SIZE
        _TP_RANK, _TP_SIZE = self._saved


