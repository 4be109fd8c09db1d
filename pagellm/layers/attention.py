"""Self-attention over the paged KV cache: project, (normalize q and k per head,) rotate, write
K/V by slot, attend (over a sliding window in some layers), project."""
from __future__ import annotations

import torch
from torch import nn

from pagellm import parallel
from pagellm.attention.base import AttentionBackend, AttentionMetadata
from pagellm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding


class PagedSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, rotary: RotaryEmbedding, backend: AttentionBackend,
                 qk_norm_eps: float | None = None, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None):
        """qk_norm_eps: q and k get an RMSNorm over each head before the rotation (Qwen3,
        Gemma 3); window: a sliding window (each row sees its last `window` positions);
        scale: the scores' factor, head_dim ** -0.5 unless given (Gemma's
        query_pre_attn_scalar); softcap: the scaled scores capped to softcap * tanh(s /
        softcap) before the softmax (Gemma 2's attn_logit_softcapping)."""
        super().__init__()
        # Tensor parallelism splits whole KV heads (each with its group of query heads).
        group = num_heads // num_kv_heads
        _, self.num_kv_heads = parallel.split(num_kv_heads)
        if self.num_kv_heads == 0:
            raise ValueError(f"tensor_parallel_size {parallel.tp_size()} exceeds the model's "
                             f"{num_kv_heads} KV heads")
        self.num_heads = self.num_kv_heads * group
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim, qk_norm_eps)
        kv = (num_kv_heads * head_dim, head_dim)
        self.qkv_proj = ColumnParallelLinear(
            hidden_size, ((num_heads * head_dim, group * head_dim), kv, kv), bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, unit=group * head_dim)
        self.rotary = rotary
        self.backend = backend
        # Bound by the model runner to this layer's slice of the KV pool.
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        md: AttentionMetadata,
        out_rows: torch.Tensor | None = None,  # only these rows' outputs are wanted
    ) -> torch.Tensor:  # [num_tokens, hidden], or [len(out_rows), hidden]
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q and k heads are adjacent in the fused output: rotate them in one pass.
        qk = qkv[:, : q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head's vector normalized: rows of head_dim
            h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
            qk = torch.cat((self.q_norm(qk[:, :h].reshape(n * h, hd)).view(n, h, hd),
                            self.k_norm(qk[:, h:].reshape(n * kvh, hd)).view(n, kvh, hd)), 1)
        qk = self.rotary(positions, qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        o = self.backend.forward(q, self.k_cache, self.v_cache, md, self.scale,
                                 self.window, self.softcap).reshape(n, q_size)
        return self.o_proj(o if out_rows is None else o.index_select(0, out_rows))
