"""The CPU KV pool on transparent huge pages (kernels/malloc.zeros_on_huge_pages): zeroed, and
backed by 2 MiB pages where Linux offers them, so that reading a block costs no page walk of
its own."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagellm.attention.torch_paged import TorchPagedAttention
from pagellm.kernels.malloc import advise_huge_pages, zeros_on_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="no transparent huge pages here")


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's middle byte (/proc/self/smaps; the advice
    splits a mapping at the 2 MiB boundaries)."""
    storage = t.untyped_storage()
    addr, inside = storage.data_ptr() + storage.nbytes() // 2, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@thp
def test_kv_pool_is_zeroed_and_on_huge_pages():
    # 3 KV heads x 2,048 blocks of 16 x 64 bf16: 12 MiB, every whole 2 MiB page of it huge
    pool = TorchPagedAttention().allocate_kv_cache(2048, 16, 3, 64, torch.bfloat16, "cpu")
    assert pool.shape == (2048, 16, 3, 64) and pool.dtype == torch.bfloat16
    assert not pool.any()
    assert _huge_kib(pool) >= 8 * 1024
    if "[madvise]" in _THP.read_text():  # only advised memory is huge: a plain tensor is not
        plain = torch.zeros(3, 2048, 16, 64, dtype=torch.bfloat16)
        assert _huge_kib(plain) < _huge_kib(pool)


def test_small_tensors_and_other_devices_are_left_alone():
    assert not advise_huge_pages(torch.empty(1000))  # not one whole 2 MiB page
    t = zeros_on_huge_pages(5, 7, dtype=torch.float32)
    assert t.shape == (5, 7) and not t.any()
