"""The C library's allocator tuned for the CPU kernels' per-step temporaries."""
from __future__ import annotations


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc malloc_trim): loading a model frees
    its temporaries (dequantized parts, file blocks turned into packed forms), which the
    settings below would otherwise keep resident (1.1 GB after loading a 1.5B Q4_K_M model).
    Returns success; a no-op off glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim is not None and trim(0) is not None)


def keep_freed_memory() -> bool:
    """Ask glibc to serve the per-step temporaries (gathered K/V, activations: a few MB to
    tens of MB, allocated and freed every layer) from its heap and to keep freed memory
    there. By default glibc maps each such block fresh from the kernel and unmaps it on free,
    so every layer page-faults its temporaries in again (measured: a bf16 batch-64 decode
    attention layer 18.7 ms -> 7.3 ms). Process-wide; a no-op off glibc. Returns success."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)  # glibc's maximum on 64-bit
                and mallopt(m_trim_threshold, 256 * 2**20) and mallopt(m_top_pad, 64 * 2**20))


_HUGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(*shape: int, dtype):
    """A zeroed CPU tensor whose memory Linux is asked to back with transparent huge pages
    (madvise MADV_HUGEPAGE over the 2 MiB-aligned part of it, before anything writes it: the
    pages are then made huge as they are first touched). For the KV pool: a decode step reads
    each sequence's blocks wherever the block manager put them, a few KiB a block, and with
    4 KiB pages nearly every block costs a TLB miss and a page walk (64 sequences of 192
    tokens in blocks scattered over a 2 GiB bf16 pool, 30 layers, two Zen 4 cores: 23.0 ->
    16.5 ms, the two pools alternated in one process). Where madvise or THP is not there
    (THP set to "never", other systems), an ordinary zeroed tensor."""
    import torch

    t = torch.empty(*shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()


def advise_huge_pages(t) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside t's storage; whether the
    kernel took it (False off Linux, for a tensor under 2 MiB, or on refusal)."""
    import ctypes
    import sys

    libc = _libc() if sys.platform.startswith("linux") else None
    madvise = getattr(libc, "madvise", None)
    if madvise is None:
        return False
    start = t.untyped_storage().data_ptr()
    first = -(-start // _HUGE) * _HUGE
    end = (start + t.untyped_storage().nbytes()) // _HUGE * _HUGE
    if end <= first:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(first, end - first, _MADV_HUGEPAGE) == 0
