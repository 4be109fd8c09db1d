"""Attention backend interface and the per-step metadata every backend reads.

A step is a flat batch of `num_tokens` new tokens from `num_seqs` sequences. Sequence b owns
query rows `query_start_loc[b] : query_start_loc[b + 1]`; after this step it has `seq_lens[b]`
tokens of KV in the cache, so its i-th query row sits at position
`seq_lens[b] - query_len[b] + i` and attends (causally) to key positions `0 ..= that position`.
Prefill, chunked prefill, decode and speculative verification are all this one shape.

KV cache of one layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
Token at position p of sequence b lives in slot
`block_tables[b, p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length of each sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    # Host copies: CPU backends loop and group on these without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step values a backend derives once and reuses in every layer (masks, index tensors).
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)


class AttentionBackend(ABC):
    """Allocates the KV pool, writes new K/V into their slots and attends over the pool."""

    name: str = "base"

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's K (or V) pool, zeroed: a tensor of logical shape
        [num_blocks, block_size, num_kv_heads, head_dim] whose storage order the backend picks."""
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                           device=device)

    def warm_up(self, runner, query_lens: list[int]) -> None:
        """Compile, over the runner's fresh pool, the kernels for these query lengths that the
        engine's warm-up forwards do not reach (a no-op where nothing compiles)."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None: ...

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: each row sees its last `window` positions
        softcap: float | None = None,  # scores capped to softcap * tanh(s / softcap) (Gemma 2)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_attention_backend(device: torch.device, sliding_window: bool = False) -> AttentionBackend:
    """Triton kernels on CUDA when they import (and the model has no sliding-window layers or
    soft-capped scores, which they do not compute: sliding_window then); the PyTorch backend
    everywhere else."""
    if device.type == "cuda" and not sliding_window:
        try:
            from pagellm.attention.triton_paged import TritonPagedAttention

            return TritonPagedAttention()
        except ImportError:
            pass
    from pagellm.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention()
