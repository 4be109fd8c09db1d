"""Paged attention in plain PyTorch ops (the CPU backend and the reference for GPU kernels).

Short queries (decode, speculative verification) are batched: their K/V are gathered through the
block tables into a padded `[batch, max_len]` view and attended with matmul-softmax-matmul,
which on CPU is much faster in bfloat16 than scaled_dot_product_attention with GQA.
Long queries (prefill chunks) are attended one sequence at a time.
"""
from __future__ import annotations

import torch

from pagellm.attention.base import AttentionBackend, AttentionMetadata
from pagellm.layers.linear import upcast

# Sequences whose query is at most this long go through the batched path.
_BATCHED_MAX_QUERY_LEN = 16


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, num_blocks_per_seq]
    max_len: int,
) -> torch.Tensor:  # [batch, num_kv_heads, max_len, head_dim]
    batch, nblocks = block_tables.shape
    block_size = cache.shape[1]
    needed = (max_len + block_size - 1) // block_size
    blocks = cache[block_tables[:, :needed]]  # [batch, needed, bs, kvh, hd]
    blocks = blocks.reshape(batch, needed * block_size, cache.shape[2], cache.shape[3])
    return blocks[:, :max_len].transpose(1, 2)


def _attend(
    q: torch.Tensor,  # [batch, num_kv_heads, group * q_len, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    mask: torch.Tensor,  # [batch, 1, group * q_len, kv_len] bool: True = may attend
    scale: float,
) -> torch.Tensor:  # [batch, num_kv_heads, group * q_len, head_dim]
    dtype = v.dtype
    if upcast(q):
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).to(dtype)


def _batched_plan(md: AttentionMetadata, starts: list[int], seqs: list[int], group: int):
    """Per-step tensors of the batched path: query lengths, padded sizes, block tables and
    the causal/length mask [batch, 1, group * max_q, max_kv]."""
    qlens = [md.query_lens_cpu[b] for b in seqs]
    slens = [md.seq_lens_cpu[b] for b in seqs]
    max_q, max_kv, batch = max(qlens), max(slens), len(seqs)
    contiguous = all(n == max_q for n in qlens) and seqs == list(range(seqs[0], seqs[0] + batch))
    idx = torch.tensor(seqs, dtype=torch.long, device=md.block_tables.device)
    tables = md.block_tables.index_select(0, idx).long()
    # Query j of sequence i is at position slen - qlen + j and sees keys <= that position.
    qpos = (torch.tensor(slens) - torch.tensor(qlens)).unsqueeze(1) + torch.arange(max_q)
    mask = torch.arange(max_kv).view(1, 1, -1) <= qpos.unsqueeze(-1)  # [batch, max_q, max_kv]
    mask = mask.unsqueeze(1).expand(batch, group, max_q, max_kv).reshape(
        batch, 1, group * max_q, max_kv)
    return qlens, max_q, max_kv, contiguous, tables, mask.to(md.block_tables.device)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        nb, bs, kvh, hd = k_cache.shape
        k_cache.view(nb * bs, kvh, hd).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(nb * bs, kvh, hd).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        short = [b for b, n in enumerate(metadata.query_lens_cpu) if n <= _BATCHED_MAX_QUERY_LEN]
        if short:
            self._batched(query, k_cache, v_cache, metadata, starts, short, scale, out)
        for b, qlen in enumerate(metadata.query_lens_cpu):
            if qlen > _BATCHED_MAX_QUERY_LEN:
                self._single(query, k_cache, v_cache, metadata, starts, b, scale, out)
        return out

    def _batched(self, query, k_cache, v_cache, md, starts, seqs, scale, out):
        num_heads, head_dim = query.shape[1], query.shape[2]
        kvh = k_cache.shape[2]
        group = num_heads // kvh
        plan = md.cache.get(("batched", group))
        if plan is None:  # the same for every layer of the step
            plan = md.cache[("batched", group)] = _batched_plan(md, starts, seqs, group)
        qlens, max_q, max_kv, contiguous, tables, mask = plan
        batch = len(seqs)
        if contiguous:  # rows of equal query length, back to back: a view, no copy
            lo = starts[seqs[0]]
            q = query[lo : lo + batch * max_q].view(batch, max_q, num_heads, head_dim)
        else:
            q = query.new_zeros(batch, max_q, num_heads, head_dim)
            for i, b in enumerate(seqs):
                q[i, : qlens[i]] = query[starts[b] : starts[b] + qlens[i]]
        # [batch, q, kvh, group, hd] -> [batch, kvh, group * q, hd] (row r = g * max_q + j)
        q = q.view(batch, max_q, kvh, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, kvh, group * max_q, head_dim)
        k = gather_kv(k_cache, tables, max_kv)
        v = gather_kv(v_cache, tables, max_kv)
        o = _attend(q, k, v, mask, scale)  # [batch, kvh, group*max_q, hd]
        o = o.view(batch, kvh, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(batch, max_q, num_heads, head_dim)
        if contiguous:
            lo = starts[seqs[0]]
            out[lo : lo + batch * max_q] = o.reshape(batch * max_q, num_heads, head_dim)
        else:
            for i, b in enumerate(seqs):
                out[starts[b] : starts[b] + qlens[i]] = o[i, : qlens[i]]

    def _single(self, query, k_cache, v_cache, md, starts, b, scale, out):
        num_heads, head_dim = query.shape[1], query.shape[2]
        kvh = k_cache.shape[2]
        group = num_heads // kvh
        qlen, slen = md.query_lens_cpu[b], md.seq_lens_cpu[b]
        q = query[starts[b] : starts[b] + qlen]  # [qlen, H, hd]
        table = md.block_tables[b : b + 1].long()
        k = gather_kv(k_cache, table, slen)  # [1, kvh, slen, hd]
        v = gather_kv(v_cache, table, slen)
        q = q.view(qlen, kvh, group, head_dim).permute(1, 2, 0, 3).reshape(1, kvh, group * qlen, head_dim)
        qpos = torch.arange(slen - qlen, slen)
        mask = torch.arange(slen).view(1, -1) <= qpos.view(-1, 1)  # [qlen, slen]
        mask = mask.unsqueeze(0).expand(group, qlen, slen).reshape(1, 1, group * qlen, slen)
        o = _attend(q, k, v, mask.to(q.device), scale)  # [1, kvh, group*qlen, hd]
        o = o.view(kvh, group, qlen, head_dim).permute(2, 0, 1, 3).reshape(qlen, num_heads, head_dim)
        out[starts[b] : starts[b] + qlen] = o
