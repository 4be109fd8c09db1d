"""Paged attention and KV writes over a head-major float32 or bf16 pool (cpu_attention.c)."""
from __future__ import annotations

import torch

from pagellm.kernels import native


def usable(query: torch.Tensor, k_store: torch.Tensor) -> bool:
    """Whether the kernels take these operands: float32 queries on the CPU, a float32 or bf16
    pool in head-major storage."""
    return (query.dtype == torch.float32 and k_store.dtype in (torch.float32, torch.bfloat16)
            and query.device.type == "cpu" and k_store.is_contiguous() and native.available())


def paged_attention(query: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, seqs: torch.Tensor, scale: float,
                    out: torch.Tensor) -> None:
    """query, out [T, H, D] float32 contiguous; k_store, v_store [KVH, NB, BS, D]; block_tables
    [S, MB], seq_lens [S], query_start_loc [S + 1], seqs [n] int32: fills out's rows of seqs."""
    kvh, nb, bs, d = k_store.shape
    if native.library().paged_attention(
            query.data_ptr(), out.data_ptr(), k_store.data_ptr(), v_store.data_ptr(),
            query.shape[1], kvh, d, nb, bs, block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), query_start_loc.data_ptr(), seqs.data_ptr(), seqs.numel(),
            scale, torch.get_num_threads(), k_store.dtype == torch.bfloat16) != 0:
        raise MemoryError("paged_attention: out of memory for score buffers")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_store: torch.Tensor,
             v_store: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [T, KVH, D] float32 contiguous -> their slots (int64) of the stores (float32,
    or rounded to nearest even into bf16 ones)."""
    kvh, nb, bs, d = k_store.shape
    native.library().write_kv(key.data_ptr(), value.data_ptr(), k_store.data_ptr(),
                              v_store.data_ptr(), slot_mapping.data_ptr(), key.shape[0], kvh, d,
                              nb * bs, k_store.dtype == torch.bfloat16)
