"""Device, dtype and the KV budget: how many blocks the pool gets."""
from __future__ import annotations

import torch

from pagellm.config import CacheConfig

DEFAULT_KV_CACHE_BYTES = 2 * 2**30  # the whole pool is committed (zeroed) at start
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on GPUs and on CPUs with bf16 instructions; float32 on other CPUs,
    where float32 products are faster (and bf16 would only save memory)."""
    if name == "auto":
        from pagellm.layers.linear import UPCAST_BF16

        return torch.float32 if device.type == "cpu" and UPCAST_BF16 else torch.bfloat16
    return _DTYPES[name]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if cache.kv_cache_fraction is not None:
        return int(available_memory(device) * cache.kv_cache_fraction)
    if device.type == "cuda":
        return int(available_memory(device) * 0.85)
    return min(DEFAULT_KV_CACHE_BYTES, available_memory(device) // 4)


def num_kv_blocks(config, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                  tp_size: int = 1) -> tuple[int, int]:
    """(number of blocks, budget in bytes). ValueError when not even one block fits."""
    from pagellm.engine.model_runner import kv_bytes_per_block

    budget = kv_budget_bytes(cache, device)
    per_block = kv_bytes_per_block(config, cache.block_size, dtype, tp_size)
    n = budget // per_block
    if n < 1:
        raise ValueError(f"kv_cache_memory {budget} bytes holds no block of {per_block} bytes")
    return int(n), budget
