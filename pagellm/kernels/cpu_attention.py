"""Paged attention and KV writes over a head-major pool (cpu_attention.c) of float32, bf16 or
int8 rows (kv_pool.h: an int8 row is head_dim codes and then its float32 scale, 4 bytes)."""
from __future__ import annotations

import torch

from pagellm.kernels import native

# the pools the native kernels read and write, and their kinds (kv_pool.h)
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# bytes an int8 row carries after its codes: its scale
INT8_SCALE_BYTES = 4


def kv_kind(pool: torch.Tensor) -> int:
    return _KINDS[pool.dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one pool row: head_dim, and for int8 its scale's bytes after the codes."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> int8 rows [..., D + 4] as store_kv_row writes them: codes
    round(x / s) (to nearest even), s = max |x| / 127 (float32) in the last 4 bytes. The
    reference of the native writes, and the write of pools the native kernels do not take."""
    x = x.float()
    mx = x.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(x).all(-1, keepdim=True)
    inv = 127.0 / mx  # inf for 0 and for max |x| < 127 / FLT_MAX: codes 0 there
    inv = torch.where(finite & torch.isfinite(inv), inv, torch.zeros_like(mx))
    codes = torch.where(finite, (x * inv).round().clamp(-127, 127), torch.zeros_like(x))
    scale = torch.where(finite, mx / 127.0, torch.full_like(mx, float("nan")))
    return torch.cat([codes.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] -> their values [..., D] float32 (codes times scale)."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


def usable(query: torch.Tensor, k_store: torch.Tensor) -> bool:
    """Whether the kernels take these operands: float32 queries on the CPU, a float32, bf16 or
    int8 pool in head-major storage."""
    return (query.dtype == torch.float32 and k_store.dtype in POOL_DTYPES
            and query.device.type == "cpu" and k_store.is_contiguous() and native.available())


def paged_attention(query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, seqs: torch.Tensor, scale: float,
                    out: torch.Tensor, window: int | None = None,
                    softcap: float | None = None) -> None:
    """query, out [T, H, D] float32 contiguous; k_store, v_store [KVH, NB, BS, row]; block_tables
    [S, MB], seq_lens [S], query_start_loc [S + 1], seqs [n] int32: fills out's rows of seqs.
    window: a sliding window (each row sees its last `window` positions only); softcap: the
    scores capped to softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    kvh, nb, bs, _ = k_store.shape
    if native.library().paged_attention_window(
            query.data_ptr(), out.data_ptr(), k_store.data_ptr(), v_store.data_ptr(),
            query.shape[1], kvh, query.shape[2], nb, bs, block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(),
            seqs.data_ptr(), seqs.numel(), scale, torch.get_num_threads(),
            kv_kind(k_store), window or 0, softcap or 0.0) != 0:
        raise MemoryError("paged_attention: out of memory for score buffers")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_store: torch.Tensor,
             v_store: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [T, KVH, D] float32 contiguous -> their slots (int64) of the stores (float32,
    rounded to nearest even into bf16 ones, or quantized into int8 rows)."""
    kvh, nb, bs, _ = k_store.shape
    native.library().write_kv(key.data_ptr(), value.data_ptr(), k_store.data_ptr(),
                              v_store.data_ptr(), slot_mapping.data_ptr(), key.shape[0], kvh,
                              key.shape[2], nb * bs, kv_kind(k_store))
