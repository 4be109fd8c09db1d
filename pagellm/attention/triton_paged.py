"""Paged attention in Triton (the GPU backend).

Kernels:
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
  a contiguous copy, and BLOCK_N is independent of block_size), with the online softmax in float32
  (`_attend_keys`, shared with the split kernel below):

      m' = max(m, rowmax(s));  l' = l * 2^(m - m') + rowsum(2^(s - m'))
      acc' = acc * 2^(m - m') + 2^(s - m') @ V;   out = acc / l        (s already scaled by log2 e)

  Query row i of sequence b sits at position `seq_lens[b] - query_len[b] + i` and sees keys
  `0 ..= position` (causal), so a program stops at its last query's position.

Split-KV ("flash-decoding") path, for decode-shaped steps: when every sequence's whole query fits
one program (`max(16, pow2(max_query_len) * GROUP_P) <= SPLIT_KV_MAX_ROWS` rows, i.e. the grid
above has a single query tile: decode, and speculative verification up to query_len 8 at GROUP 8 /
64 at GROUP 1), that grid is only num_seqs * num_kv_heads programs, too few to fill the GPU when
few sequences have long contexts. Two kernels then split each sequence's keys instead:
- `_paged_attention_split_kernel`: grid `(num_seqs, num_kv_heads, num_splits)`; split s runs the
  same packed-GQA online softmax (block-table lookups, causal mask) over keys
  `[s * split_len, min((s + 1) * split_len, seq_len))` and writes its unnormalised partials to
  float32 scratch: m_s and l_s per row (log2 domain) and acc_s `[rows, head_dim]`. A split past a
  short sequence's end runs no tile and writes m_s = -inf, l_s = 0, acc_s = 0; a verification row
  whose position is before the split's first key likewise keeps m_s = -inf, l_s = 0 (the online
  softmax subtracts 0 instead of m' while m' is still -inf, so no inf - inf NaN).
- `_split_kv_reduce_kernel`: grid `(num_seqs, num_heads, max_query_len)`, one program per output
  row, combines the splits exactly (the same rescaling as one more online-softmax step):

      M = max_s m_s;   out = sum_s(acc_s * 2^(m_s - M)) / sum_s(l_s * 2^(m_s - M))

  Split 0 always holds key 0, which every row sees, so M is finite and -inf splits weigh 0.
`paged_attention` picks the path with `choose_num_splits` (thresholds below) unless the caller
forces it with `num_splits=`. The scratch (`[num_tokens, num_heads, num_splits]` for m and l,
`[..., head_dim]` for acc) is allocated per call with torch.empty on the query's device; through
PyTorch's caching allocator that is a free-list lookup, not a cudaMalloc.

Only verified under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); block sizes, num_warps
and the split-KV thresholds are chosen for an H100/H200 but none has been timed on one: how many
splits pay for the extra scratch write + reduce launch, and whether the split path should also
take steps that already have num_sms programs, are open.
"""
from __future__ import annotations

import functools

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
def _attend_keys(
    q, q_pos, m_i, l_i, acc,  # [BLOCK_M, HEAD_DIM_P] query rows, their positions, running state
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) to walk
    k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_ok, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the rows over keys [kv_lo, kv_hi), causal by q_pos; returns m, l, acc.

    A row may see none of these keys (a split that starts after its position): while its m' is
    still -inf the exponentials subtract 0 instead, so it keeps m = -inf, l = 0, acc = 0.
    """
    for kv_start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_ok = k_pos < kv_hi
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
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_M, BLOCK_N] @ [BLOCK_N, HEAD_DIM_P] -> [BLOCK_M, HEAD_DIM_P]
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


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
    m_i, l_i, acc = _attend_keys(
        q, q_pos, m_i, l_i, acc, 0, kv_end,
        k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_ok, scale_log2,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size,
        BLOCK_N, DOT_PRECISION,
    )

    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=qk_mask)


@triton.jit
def _paged_attention_split_kernel(
    # float32 scratch: m, l [num_tokens, num_heads, num_splits]; acc [..., num_splits, head_dim]
    m_ptr, l_ptr, acc_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # query: per token, per head (dim stride 1)
    stride_mt, stride_mh,  # m and l scratch: per token, per head (split stride 1)
    stride_at, stride_ah, stride_as,  # acc scratch: per token, per head, per split (dim stride 1)
    stride_kb, stride_ks, stride_kh,  # K cache: per block, per slot-in-block, per head
    stride_vb, stride_vs, stride_vh,  # V cache: same
    stride_bt,  # block table: per sequence
    block_size,
    split_len,  # keys per split, a multiple of BLOCK_N
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program: the whole query (<= BLOCK_Q tokens) of one sequence x one GQA group, one split.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP_P  # [BLOCK_M] index within the sequence's query
    head = kv_head * GROUP + rows % GROUP_P  # [BLOCK_M]
    row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_off = tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    qk_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=qk_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_P]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)  # <= kv_lo for a split past the end: no tile
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend_keys(
        q, q_pos, m_i, l_i, acc, kv_lo, kv_hi,
        k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_ok, scale_log2,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, block_size,
        BLOCK_N, DOT_PRECISION,
    )

    # Partials, unnormalised; an empty split writes m = -inf, l = 0, acc = 0 (weight 0 in reduce).
    ml_off = tok * stride_mt + head * stride_mh + split
    tl.store(m_ptr + ml_off, m_i, mask=row_ok)
    tl.store(l_ptr + ml_off, l_i, mask=row_ok)
    a_off = tok[:, None] * stride_at + head[:, None] * stride_ah + split * stride_as + dims[None, :]
    tl.store(acc_ptr + a_off, acc, mask=qk_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, query_start_loc_ptr,
    stride_ot, stride_oh,  # out: per token, per head (dim stride 1)
    stride_mt, stride_mh,  # m and l scratch: per token, per head (split stride 1)
    stride_at, stride_ah, stride_as,  # acc scratch: per token, per head, per split (dim stride 1)
    num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS_P: tl.constexpr,
):
    # One program: one output row (query token q_idx of sequence seq, query head `head`).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_idx = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_idx >= q_len:
        return
    tok = (q_start + q_idx).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS_P)
    s_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    ml_off = tok * stride_mt + head * stride_mh + splits
    m = tl.load(m_ptr + ml_off, mask=s_ok, other=float("-inf"))  # [NUM_SPLITS_P]
    l = tl.load(l_ptr + ml_off, mask=s_ok, other=0.0)
    a_off = tok * stride_at + head * stride_ah + splits[:, None] * stride_as + dims[None, :]
    acc = tl.load(acc_ptr + a_off, mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 holds key 0, which every row sees
    w = tl.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)  # [HEAD_DIM_P]
    o_off = tok * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


# Split-KV thresholds. None of these has been timed on a GPU (no GPU has run these kernels):
# they are first guesses from the shape of the work, to be tuned on an H100/H200.
# Rows per split-kernel program (query tokens x padded GQA group), the plain kernel's largest tile:
# the split path needs each sequence's whole query in one program.
SPLIT_KV_MAX_ROWS = 64
# Keys per split, at least: every split re-loads Q and writes [rows, head_dim] float32 partials
# that the reduce reads back, so a split walks >= 8 tiles of BLOCK_N = 32 keys to amortise that.
SPLIT_KV_MIN_KEYS = 256
# Splits per sequence, at most: bounds the scratch (num_splits x head_dim float32 per output row)
# and the reduce program's [num_splits, head_dim] tile; 16 x 256 keys = 4096-key contexts are
# fully split and longer ones just get longer splits.
SPLIT_KV_MAX_SPLITS = 16
# Streaming multiprocessors assumed when the device cannot be asked (CPU / interpreter): an H200.
DEFAULT_NUM_SMS = 132


def split_kv_rows(max_query_len: int, group: int) -> int:
    """Rows of one split-kernel program: the whole query of a sequence x its padded GQA group."""
    return max(16, _pow2(max_query_len) * _pow2(group))


def choose_num_splits(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int,
                      max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Splits per sequence for the split-KV path, or 0 for the single-kernel path.

    Split when the step is decode-shaped (each sequence's whole query fits one program of at most
    SPLIT_KV_MAX_ROWS rows), the plain grid of num_seqs * num_kv_heads programs leaves SMs idle,
    and the longest sequence has >= 2 * SPLIT_KV_MIN_KEYS keys. Then take the smallest power of
    two that gives every SM a program, capped by SPLIT_KV_MAX_SPLITS and by
    max_seq_len // SPLIT_KV_MIN_KEYS (so each split of the longest sequence gets >= that many keys).
    """
    if max_query_len < 1 or split_kv_rows(max_query_len, group) > SPLIT_KV_MAX_ROWS:
        return 0
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 0
    limit = min(SPLIT_KV_MAX_SPLITS, max_seq_len // SPLIT_KV_MIN_KEYS)
    if limit < 2:
        return 0
    splits = 2
    while splits * 2 <= limit and programs * splits < num_sms:
        splits *= 2
    return splits


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


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
    num_splits: int | None = None,  # None: choose_num_splits; 0: single kernel; n >= 1: n splits
) -> torch.Tensor:  # out
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    if num_tokens == 0 or md.num_seqs == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(md.num_seqs, num_kv_heads, group, md.max_query_len,
                                       max(md.seq_lens_cpu), _num_sms(query.device))
    elif num_splits < 0:
        raise ValueError(f"num_splits must be None or >= 0, got {num_splits}")
    elif num_splits > 0 and split_kv_rows(md.max_query_len, group) > SPLIT_KV_MAX_ROWS:
        raise ValueError(
            f"split-KV needs each sequence's query in one program of <= {SPLIT_KV_MAX_ROWS} rows; "
            f"max_query_len {md.max_query_len} x group {group} needs "
            f"{split_kv_rows(md.max_query_len, group)}")
    if num_splits > 0:
        _split_kv_attention(query, k_cache, v_cache, md, scale, out, block_n, num_splits)
        return out
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


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uninitialised float32 split-KV partials (tests swap in NaN-filled ones)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _split_kv_attention(query, k_cache, v_cache, md: AttentionMetadata, scale: float,
                        out: torch.Tensor, block_n: int, num_splits: int) -> None:
    """The two-kernel split-KV path of `paged_attention` (query already has dim stride 1)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_p = _pow2(group)
    block_q = split_kv_rows(md.max_query_len, group) // group_p  # >= max_query_len
    # Split length: the longest sequence cut in num_splits, rounded up to whole key tiles (so
    # trailing splits may be empty for every sequence; they cost a program that writes -inf).
    split_len = triton.cdiv(triton.cdiv(max(md.seq_lens_cpu), num_splits), block_n) * block_n
    # Scratch per call (caching allocator); every (row, split) the reduce reads is written first.
    m = _scratch((num_tokens, num_heads, num_splits), query.device)
    l = _scratch((num_tokens, num_heads, num_splits), query.device)
    acc = _scratch((num_tokens, num_heads, num_splits, head_dim), query.device)
    tables = md.block_tables
    head_dim_p = _pow2(head_dim, 16)
    _paged_attention_split_kernel[(md.num_seqs, num_kv_heads, num_splits)](
        m, l, acc, query, k_cache, v_cache, tables, md.seq_lens, md.query_start_loc,
        scale * _LOG2_E,
        query.stride(0), query.stride(1),
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0), block_size, split_len,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    _split_kv_reduce_kernel[(md.num_seqs, num_heads, md.max_query_len)](
        out, m, l, acc, md.query_start_loc,
        out.stride(0), out.stride(1),
        m.stride(0), m.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS_P=_pow2(num_splits),
        num_warps=1 if _pow2(num_splits) * head_dim_p <= 1024 else 4,
    )


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def __init__(self, block_n: int = 32) -> None:
        assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 16"
        self.block_n = block_n  # keys per tile of the attention kernels

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def warm_up(self, runner, query_lens: list[int]) -> None:
        """The split-KV kernels for each query length that takes them: warm-up steps are
        short, so the chooser would not pick them before a long context did, mid-request."""
        k_cache, v_cache = runner.kv_caches[0]
        attn = runner.model.layers[0].self_attn
        group = attn.num_heads // attn.num_kv_heads
        for q in query_lens:
            if split_kv_rows(q, group) > SPLIT_KV_MAX_ROWS:
                continue
            _, _, md = runner.synthetic_step([q])
            query = torch.zeros(q, attn.num_heads, attn.head_dim, dtype=k_cache.dtype,
                                device=k_cache.device)
            paged_attention(query, k_cache, v_cache, md, 1.0, torch.empty_like(query),
                            self.block_n, num_splits=2)

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        if window or softcap:  # get_attention_backend gives such models the PyTorch backend
            raise ValueError("the Triton attention kernels have no sliding window or soft-capping")
        # paged_attention picks the single-kernel or the split-KV path per step.
        out = torch.empty_like(query)
        return paged_attention(query, k_cache, v_cache, metadata, scale, out, self.block_n)
