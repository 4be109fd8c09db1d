"""Paged attention in plain PyTorch ops (the CPU backend and the reference for GPU kernels).

The pool this backend allocates is stored head-major, `[num_kv_heads, num_blocks, block_size,
head_dim]`, and handed out as a permuted view with the logical shape every backend shares
(`[num_blocks, block_size, num_kv_heads, head_dim]`). Gathering a batch's blocks from it with one
`index_select` yields `[num_kv_heads, batch, kv_len, head_dim]`, contiguous: exactly the operand
a batched matmul over (head, sequence) needs, so the gather is the only copy of K/V per layer.
(With the token-major layout the gathered K/V had to be transposed into a second copy, which
cost as much as the gather and the matmuls together.)

With the native kernels (kernels/cpu_attention.c) every sequence of a step, prefill chunks
included, attends in one call that reads K/V in place through the block tables. Without them:
short queries (decode, speculative verification) are batched: one matmul-softmax-matmul over
every sequence, padded to the longest; long queries (prefill chunks) go one sequence at a time
through PyTorch's fused attention, whose CPU kernel works in tiles (flash attention: no
[queries, keys] score matrix, which for a 4,000-token prompt was 0.6 GB a layer); a chunk after
cached keys takes two unmasked passes (the cached keys, then its own causally) merged by their
log-sum-exps, not one masked pass (`_prefix_then_causal`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention.base import AttentionBackend, AttentionMetadata
from pagellm.kernels import cpu_attention, native
from pagellm.layers.linear import upcast

# Sequences whose query is at most this long go through the batched path.
_BATCHED_MAX_QUERY_LEN = 16


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kvh, hd] view -> its [kvh, num_blocks, block_size, hd] storage
    (a copy when the pool was not allocated head-major, e.g. by a test or another backend)."""
    return cache.permute(2, 0, 1, 3).contiguous()


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row]
    block_tables: torch.Tensor,  # [batch, num_blocks_per_seq] int64
    max_len: int,
) -> torch.Tensor:  # [num_kv_heads, batch, padded_len >= max_len, head_dim], contiguous
    """The blocks' rows, an int8 pool's as their float32 values."""
    hm = head_major(cache)
    kvh, _, block_size, width = hm.shape
    batch = block_tables.shape[0]
    needed = (max_len + block_size - 1) // block_size
    idx = block_tables[:, :needed].reshape(-1)
    rows = hm.index_select(1, idx).view(kvh, batch, needed * block_size, width)
    return cpu_attention.dequantize_rows(rows) if rows.dtype == torch.int8 else rows


def _attend(
    q: torch.Tensor,  # [n, rows, head_dim]
    k: torch.Tensor,  # [n, kv_len, head_dim]
    v: torch.Tensor,  # [n, kv_len, head_dim]
    bias: torch.Tensor,  # [n or 1, rows, kv_len] float32: 0 where a key is visible, else -inf
    scale: float,
    softcap: float | None = None,  # scores capped to softcap * tanh(s / softcap) (Gemma 2)
) -> torch.Tensor:  # [n, rows, head_dim]
    dtype = q.dtype
    if upcast(q) or q.dtype != k.dtype:  # float32 K/V copies cost less than bf16 bmm's slow
        q, k, v = q.float(), k.float(), v.float()  # path on such CPUs; or a float32 KV pool
    if softcap:
        scores = torch.bmm(q, k.transpose(1, 2)).float() * scale
        scores = torch.tanh(scores / softcap) * softcap + bias
    elif q.dtype == torch.float32:  # scale * q k^T + bias in one op
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(q, k.transpose(1, 2)).float() * scale + bias
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, v).to(dtype)


def _causal_bias(slens: list[int], qlens: list[int], max_q: int, group: int, kv_len: int,
                 kvh: int, window: int | None = None,
                 ) -> torch.Tensor:  # [kvh * batch, group * max_q, kv_len] float32
    """Additive mask; for one sequence (batch 1) pass kvh=1 and let it broadcast over heads."""
    # Query j of sequence i is at position slen - qlen + j and sees keys <= that position
    # (and, in a sliding window, the last `window` of them only); row r = g * max_q + j (the
    # group's heads share one query position).
    qpos = (torch.tensor(slens) - torch.tensor(qlens)).unsqueeze(1) + torch.arange(max_q)
    mask = _visible(torch.arange(kv_len).view(1, 1, -1), qpos.unsqueeze(-1), window)
    batch = len(slens)
    mask = mask.unsqueeze(1).expand(batch, group, max_q, kv_len).reshape(
        1, batch, group * max_q, kv_len)
    bias = torch.zeros(kvh, batch, group * max_q, kv_len).masked_fill_(~mask, float("-inf"))
    return bias.view(kvh * batch, group * max_q, kv_len)


def _visible(keys: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether a key position is visible from a query position (broadcast): causal, and
    within the last `window` positions where there is a sliding window."""
    seen = keys <= qpos
    return seen if not window else seen & (qpos - keys < window)


def _batched_plan(md: AttentionMetadata, seqs: list[int], group: int, kvh: int, block_size: int,
                  window: int | None):
    """Per-step tensors of the batched path, the same for every layer of the step."""
    qlens = [md.query_lens_cpu[b] for b in seqs]
    slens = [md.seq_lens_cpu[b] for b in seqs]
    max_q, batch = max(qlens), len(seqs)
    kv_len = -(-max(slens) // block_size) * block_size
    contiguous = all(n == max_q for n in qlens) and seqs == list(range(seqs[0], seqs[0] + batch))
    idx = torch.tensor(seqs, dtype=torch.long, device=md.block_tables.device)
    tables = md.block_tables.index_select(0, idx).long()
    bias = _causal_bias(slens, qlens, max_q, group, kv_len, kvh, window).to(md.block_tables.device)
    return qlens, max_q, max(slens), contiguous, tables, bias


# PyTorch's CPU flash attention, returning each row's log-sum-exp beside its output.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_causal(
    q: torch.Tensor,  # [H, qlen, hd]: a chunk's queries, after `prefix` keys already cached
    k: torch.Tensor,  # [kvh, prefix + qlen, hd]
    v: torch.Tensor,  # [kvh, prefix + qlen, hd]
    prefix: int,
    scale: float,
) -> torch.Tensor:  # [H, qlen, hd]
    """Attention of a prefill chunk that follows cached keys, as two unmasked flash passes:
    every query sees all `prefix` keys, and the chunk's own keys causally from the top left;
    the two softmaxes merge exactly by their log-sum-exps (out = sum_i o_i e^(l_i - m) /
    sum_i e^(l_i - m)). With one masked pass instead, PyTorch's kernel computed every
    (query, key) score through the mask: a 2,048-token chunk after 5,952 cached tokens took
    288 ms a layer against 220 (9 heads of 64, two cores)."""
    heads, kvh = q.shape[0], k.shape[0]
    if heads != kvh:  # the kernel wants as many K/V heads as query heads
        k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
    q = q.unsqueeze(0)
    o1, l1 = _FLASH_WITH_LSE(q, k[None, :, :prefix], v[None, :, :prefix], scale=scale)[:2]
    o2, l2 = _FLASH_WITH_LSE(q, k[None, :, prefix:], v[None, :, prefix:], is_causal=True,
                             scale=scale)[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_().unsqueeze(-1), (l2 - m).exp_().unsqueeze(-1)
    return ((o1 * w1 + o2 * w2) / (w1 + w2))[0]



def native_seqs(k_cache: torch.Tensor, v_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor | None:
    """The step's sequences as the native kernel takes them (int32 0 .. S - 1) where it attends
    over this pool with this step's metadata (a head-major float32, bf16 or int8 pool; int32,
    contiguous tables, decided once per step), else None. Float32 CPU queries are the caller's
    to check (cpu_attention.usable); the many-row layer's one native call asks this too, so
    that it attends in C exactly where forward() would."""
    k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    if not (native.available() and k_store.dtype in cpu_attention.POOL_DTYPES
            and k_store.is_contiguous() and v_store.is_contiguous()):
        return None
    seqs = md.cache.get("native_seqs", False)
    if seqs is False:
        ok = all(t.dtype == torch.int32 and t.is_contiguous()
                 for t in (md.block_tables, md.seq_lens, md.query_start_loc))
        seqs = md.cache["native_seqs"] = (torch.arange(md.num_seqs, dtype=torch.int32)
                                          if ok else None)
    return seqs

class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def allocate_kv_cache(self, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        # Zeroed, not empty: attention multiplies masked-out (probability 0) slots by their
        # values, and 0 * NaN from uninitialised memory would poison the output. An int8 row
        # carries its scale after its codes (cpu_attention.row_width).
        store = torch.zeros(num_kv_heads, num_blocks, block_size,
                            cpu_attention.row_width(head_dim, dtype), dtype=dtype, device=device)
        return store.permute(1, 2, 0, 3)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
        k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
        if k_store.dtype == torch.int8:  # the native writes take float32 rows
            key, value = key.float(), value.float()
        if (cpu_attention.usable(key, k_store) and v_store.is_contiguous()
                and value.dtype == torch.float32 and slot_mapping.dtype == torch.int64):
            cpu_attention.write_kv(key.contiguous(), value.contiguous(), k_store, v_store,
                                   slot_mapping)
            return
        if k_store.dtype == torch.int8:
            key, value = cpu_attention.quantize_rows(key), cpu_attention.quantize_rows(value)
        for new, cache in ((key, k_cache), (value, v_cache)):
            nb, bs, kvh, hd = cache.shape
            hm = cache.permute(2, 0, 1, 3)
            if hm.is_contiguous():
                hm.view(kvh, nb * bs, hd).index_copy_(1, slot_mapping,
                                                      new.transpose(0, 1).to(cache.dtype))
            else:  # a token-major pool
                cache.view(nb * bs, kvh, hd).index_copy_(0, slot_mapping, new.to(cache.dtype))

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        # contiguous whatever query's layout (empty_like would copy a dense permutation's
        # strides, and the native kernel writes rows of [T, H, D])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        starts = metadata.query_start_loc.tolist()
        k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
        if k_store.dtype == torch.int8 and query.dtype != torch.float32:
            # an int8 pool's products are float32 (the module path of a bf16 model)
            return self.forward(query.float(), k_cache, v_cache, metadata, scale,
                                window, softcap).to(query.dtype)
        seqs = native_seqs(k_cache, v_cache, metadata) if cpu_attention.usable(query, k_store) else None
        if seqs is not None:
            # every sequence, prefill chunks included: reads K/V in place through the block
            # tables (no gathered copy, no padding, no float32 copy of a bf16 pool), a long
            # query split over the threads by rows (a 512-token prompt of the default model
            # prefilled at 2,930 tokens/s against 2,180 through PyTorch's fused attention)
            cpu_attention.paged_attention(
                query.contiguous(), k_store, v_store, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, seqs, scale, out, window, softcap)
            return out
        short = [b for b, n in enumerate(metadata.query_lens_cpu) if n <= _BATCHED_MAX_QUERY_LEN]
        if short:
            self._batched(query, k_cache, v_cache, metadata, starts, short, scale, out, window,
                          softcap)
        for b, qlen in enumerate(metadata.query_lens_cpu):
            if qlen > _BATCHED_MAX_QUERY_LEN:
                self._single(query, k_cache, v_cache, metadata, starts, b, scale, out, window,
                             softcap)
        return out

    def _batched(self, query, k_cache, v_cache, md, starts, seqs, scale, out, window, softcap):
        num_heads, head_dim = query.shape[1], query.shape[2]
        kvh = k_cache.shape[2]
        group = num_heads // kvh
        plan = md.cache.get(("batched", group, window))
        if plan is None:
            plan = md.cache[("batched", group, window)] = _batched_plan(
                md, seqs, group, kvh, k_cache.shape[1], window)
        qlens, max_q, max_kv, contiguous, tables, bias = plan
        batch = len(seqs)
        if contiguous:  # rows of equal query length, back to back: a view, no copy
            lo = starts[seqs[0]]
            q = query[lo : lo + batch * max_q].view(batch, max_q, num_heads, head_dim)
        else:
            q = query.new_zeros(batch, max_q, num_heads, head_dim)
            for i, b in enumerate(seqs):
                q[i, : qlens[i]] = query[starts[b] : starts[b] + qlens[i]]
        # [batch, q, kvh, group, hd] -> [kvh * batch, group * q, hd]
        q = q.view(batch, max_q, kvh, group, head_dim).permute(2, 0, 3, 1, 4)
        q = q.reshape(kvh * batch, group * max_q, head_dim)
        k = gather_kv(k_cache, tables, max_kv)
        v = gather_kv(v_cache, tables, max_kv)
        kv_len = k.shape[2]
        o = _attend(q, k.view(kvh * batch, kv_len, head_dim),
                    v.view(kvh * batch, kv_len, head_dim), bias, scale, softcap)
        o = o.view(kvh, batch, group, max_q, head_dim).permute(1, 3, 0, 2, 4)
        o = o.reshape(batch, max_q, num_heads, head_dim)
        if contiguous:
            lo = starts[seqs[0]]
            out[lo : lo + batch * max_q] = o.reshape(batch * max_q, num_heads, head_dim)
        else:
            for i, b in enumerate(seqs):
                out[starts[b] : starts[b] + qlens[i]] = o[i, : qlens[i]]

    def _single(self, query, k_cache, v_cache, md, starts, b, scale, out, window, softcap):
        """One long query (a prefill chunk) against its sequence's keys, causal from the bottom
        right: the chunk's queries follow the keys already in the cache (a sliding window's
        rows see their last `window` positions only)."""
        num_heads, kvh = query.shape[1], k_cache.shape[2]
        qlen, slen = md.query_lens_cpu[b], md.seq_lens_cpu[b]
        q = query[starts[b] : starts[b] + qlen]  # [qlen, H, hd]
        table = md.block_tables[b : b + 1].long()
        k = gather_kv(k_cache, table, slen)[:, 0, :slen]  # [kvh, slen, hd]
        v = gather_kv(v_cache, table, slen)[:, 0, :slen]
        dtype = q.dtype
        if upcast(q) or q.dtype != k.dtype:  # as _attend: float32 where bf16 products are slow
            q, k, v = q.float(), k.float(), v.float()
        windowed = bool(window) and slen > window  # some row does not see every key before it
        if softcap:  # capped scores: no fused kernel computes them
            pos = torch.arange(slen - qlen, slen, device=q.device).unsqueeze(1)
            seen = _visible(torch.arange(slen, device=q.device), pos, window)
            bias = torch.zeros(seen.shape, device=q.device).masked_fill_(~seen, float("-inf"))
            group = num_heads // kvh
            qg = q.view(qlen, kvh, group, -1).permute(1, 2, 0, 3).reshape(kvh, group * qlen, -1)
            o = _attend(qg, k, v, bias.repeat(group, 1).unsqueeze(0), scale, softcap)
            o = o.view(kvh, group, qlen, -1).permute(2, 0, 1, 3).reshape(qlen, num_heads, -1)
            out[starts[b] : starts[b] + qlen] = o.to(dtype)
            return
        if slen > qlen and not windowed and _FLASH_WITH_LSE is not None and q.device.type == "cpu":
            o = _prefix_then_causal(q.transpose(0, 1), k, v, slen - qlen, scale)
        else:
            mask = None  # no keys before the chunk: causal from the top left
            if slen > qlen or windowed:  # the same for every layer of the step (built here:
                # torch.nn.attention.bias's causal_lower_right would import triton, and the GPU
                # compilers)
                mask = md.cache.get(("single", b, window))
                if mask is None:
                    pos = torch.arange(slen - qlen, slen, device=q.device).unsqueeze(1)
                    mask = md.cache[("single", b, window)] = _visible(
                        torch.arange(slen, device=q.device), pos, window)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                is_causal=mask is None, scale=scale, enable_gqa=num_heads != kvh)[0]
        out[starts[b] : starts[b] + qlen] = o.transpose(0, 1).to(dtype)
