"""Paged attention in Triton (the GPU backend).

Two kernels:
- `_write_kv_kernel`: one program per new token copies its K and V rows
  `[num_kv_heads, head_dim]` into cache slot `slot_mapping[t]`; a slot of -1 (padding) is skipped.
- `_paged_attention_kernel`: flash-attention over the paged cache, one kernel for decode
  (query_len 1), speculative verification (query_len K+1) and (chunked, prefix-cached) prefill.
  Grid `(num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q))`. A program owns BLOCK_Q query
  tokens of one sequence and all GROUP query heads that share one KV head (GQA), packed into
  BLOCK_M = BLOCK_Q * GROUP_P rows, so each K/V tile is loaded once for the whole group and a
  decode step still fills a tensor-core tile (8 heads x 1 token = 8 rows, padded to 16).
  It walks the sequence's keys in tiles of BLOCK_N positions, finding each key's slot through the
  block table (`block_tables[b, pos // block_size] * block_size + pos % block_size`: no gather into
  a contiguous copy, and BLOCK_N is independent of block_size), with the online softmax in float32:

      m' = max(m, rowmax(s));  l' = l * 2^(m - m') + rowsum(2^(s - m'))
      acc' = acc * 2^(m - m') + 2^(s - m') @ V;   out = acc / l        (s already scaled by log2 e)

  Query row i of sequence b sits at position `seq_lens[b] - query_len[b] + i` and sees keys
  `0 ..= position` (causal), so a program stops at its last query's position.

Only verified under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); block sizes and
num_warps are chosen for an H100/H200 but have not been timed on one. Known gap: decode with
few sequences and long contexts uses only num_seqs * num_kv_heads programs; a split-KV
(flash-decoding) variant would fill the GPU better there.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # base.get_attention_backend falls back to the PyTorch backend
    raise ImportError("pagellm.attention.triton_paged needs the `triton` package") from exc

from pagellm.attention.base import AttentionBackend, AttentionMetadata

_LOG2_E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # new K/V: per token, per head (dim stride 1)
    stride_cs, stride_ch,  # cache viewed as [num_slots, num_kv_heads, head_dim]
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = slot * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,  # query / out: per token, per head (dim stride 1)
    stride_kb, stride_ks, stride_kh,  # K cache: per block, per slot-in-block, per head
    stride_vb, stride_vs, stride_vh,  # V cache: same
    stride_bt,  # block table: per sequence
    block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # this sequence has fewer query tiles than the longest one
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len  # KV positions before this step's queries

    # Row r: query token q_tile * BLOCK_Q + r // GROUP_P, query head kv_head * GROUP + r % GROUP_P.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_P  # [BLOCK_M] index within the sequence's query
    head = kv_head * GROUP + rows % GROUP_P  # [BLOCK_M]
    row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_off = tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    qk_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=qk_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # every row sees key 0, so m_i turns finite
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)  # keys this tile may see
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_start in range(0, kv_end, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = k_pos < kv_end
        block = tl.load(table + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        in_block = k_pos % block_size
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        # [BLOCK_M, HEAD_DIM_P] @ [HEAD_DIM_P, BLOCK_N] -> [BLOCK_M, BLOCK_N]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_M, BLOCK_N] @ [BLOCK_N, HEAD_DIM_P] -> [BLOCK_M, HEAD_DIM_P]
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=qk_mask)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
    block_n: int = 32,
) -> torch.Tensor:  # out
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    if num_tokens == 0 or md.num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    group = num_heads // num_kv_heads
    group_p = _pow2(group)
    # Rows per program: >= 16 (tl.dot minimum), 64 for prefill, one whole GQA group at least.
    block_m = max(group_p, min(64, _pow2(md.max_query_len * group_p, 16)))
    block_q = block_m // group_p
    grid = (md.num_seqs, num_kv_heads, triton.cdiv(md.max_query_len, block_q))
    tables = md.block_tables
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, tables, md.seq_lens, md.query_start_loc,
        scale * _LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0), block_size,
        HEAD_DIM=head_dim, HEAD_DIM_P=_pow2(head_dim, 16),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def __init__(self, block_n: int = 32) -> None:
        assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 16"
        self.block_n = block_n  # keys per tile of the attention kernel

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        out = torch.empty_like(query)
        return paged_attention(query, k_cache, v_cache, metadata, scale, out, self.block_n)
