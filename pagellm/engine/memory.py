"""Device, dtype and the KV budget: how many blocks the pool gets."""
from __future__ import annotations

import torch

from pagellm.config import CacheConfig

DEFAULT_KV_CACHE_BYTES = 2 * 2**30  # the whole pool is committed (zeroed) at start
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, packed_weights: bool = False) -> torch.dtype:
    """'auto': bfloat16 on GPUs and on CPUs with bf16 instructions. On other CPUs float32,
    where dense float32 products are faster, unless the model's GGUF Q4 weights can stay
    packed (packed_weights): their kernel takes bf16 activations and halves batch-1 decode time,
    while batched products are computed in float32 either way."""
    if name == "auto":
        from pagellm.layers.linear import UPCAST_BF16

        if device.type == "cpu" and UPCAST_BF16 and not packed_weights:
            return torch.float32
        return torch.bfloat16
    return _DTYPES[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                     act_dtype: torch.dtype | None = None) -> torch.dtype:
    """'auto': the model's dtype, except a bfloat16 model on a CPU without the native kernels
    and without bf16 units, or whose activations run in float32 there (act_dtype), whose KV is
    kept in float32: the PyTorch attention computes in float32 there (bf16 batched products
    are several times slower), and converting every gathered bf16 K/V block at every step of
    every layer cost more than the attention products themselves (batch-64 decode: ~60 of
    ~700 ms a step). The native attention kernel reads a bf16 pool directly (widening each
    value as it loads it, 8 or 16 at a time), so with the native kernels a bf16 model keeps a
    bf16 KV cache on every CPU: half the bytes, twice the tokens (on two AVX2 Zen 3 cores the
    default model's 64-request run 367 -> 394 output tok/s against a float32 pool).

    'int8' (CPU only, with the native kernels): each row of head_dim values as int8 codes and
    a float32 scale (kernels/kv_pool.h), 0.53x a bf16 pool's bytes at head_dim 64; attention
    widens the codes to float32 as it reads them."""
    if name == "int8":
        from pagellm.kernels import native

        if device.type != "cpu":
            raise ValueError(f"kv_cache_dtype int8 is a CPU pool; on {device.type} use the "
                             f"model's dtype")
        if not native.available():
            raise ValueError("kv_cache_dtype int8 needs pagellm's native CPU kernels, which "
                             "are off or did not build here (PAGELLM_NATIVE_KERNELS, $CC)")
        return torch.int8
    if name != "auto":
        kv = _DTYPES[name]
        if device.type != "cpu" and kv != model_dtype:
            raise ValueError(f"kv_cache_dtype {name} differs from the model's dtype "
                             f"({model_dtype}); on {device.type} they must match")
        return kv
    from pagellm.kernels import native
    from pagellm.layers.linear import UPCAST_BF16

    if (device.type == "cpu" and model_dtype == torch.bfloat16 and not native.available()
            and (UPCAST_BF16 or act_dtype == torch.float32)):
        return torch.float32
    return model_dtype


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


# On a GPU the default budget is this share of the device's memory, less what is in use when
# it is read (weights of every model, the CUDA context, other processes) and the profiling
# forward's activation peak.
GPU_MEMORY_UTILIZATION = 0.9


def kv_budget_bytes(cache: CacheConfig, device: torch.device, activation_peak: int = 0) -> int:
    """The KV pool's bytes, read once every model is loaded. activation_peak: what the
    profiling forward (the largest step) took beyond the weights, on a GPU (0 on the CPU,
    where MemAvailable read after that forward already counts what the allocator kept)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if cache.kv_cache_fraction is not None:
        return int(max(0, available_memory(device) - activation_peak) * cache.kv_cache_fraction)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        share = cache.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
        return int(total * share) - (total - free) - activation_peak
    return min(DEFAULT_KV_CACHE_BYTES, available_memory(device) // 4)


def num_kv_blocks(config, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                  tp_size: int = 1, activation_peak: int = 0) -> tuple[int, int]:
    """(number of blocks, budget in bytes). ValueError when not even one block fits."""
    from pagellm.engine.model_runner import kv_bytes_per_block

    budget = kv_budget_bytes(cache, device, activation_peak)
    per_block = kv_bytes_per_block(config, cache.block_size, dtype, tp_size)
    n = budget // per_block
    if n < 1:
        if cache.kv_cache_memory is not None:
            raise ValueError(f"kv_cache_memory {budget} bytes holds no block of {per_block} bytes")
        source = (f"kv_cache_fraction {cache.kv_cache_fraction} of available memory"
                  if cache.kv_cache_fraction is not None else
                  f"{cache.gpu_memory_utilization or GPU_MEMORY_UTILIZATION} of the GPU's "
                  "memory less what is in use"
                  if device.type == "cuda" else "a quarter of available memory")
        raise ValueError(f"the KV budget ({source}, after loading the weights"
                         f"{f' and {activation_peak} bytes of activations' if activation_peak else ''})"
                         f" is {budget} bytes: no block of {per_block} bytes fits; set "
                         "kv_cache_memory, or free memory")
    return int(n), budget
