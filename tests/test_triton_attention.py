"""Triton paged attention vs the PyTorch reference backend.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must
be set before the kernels are decorated, i.e. before pagellm.attention.triton_paged is imported);
with CUDA they run compiled on the GPU. Shapes are small because the interpreter is slow.
"""
import importlib
import os
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pagellm.attention.base import AttentionMetadata  # noqa: E402
from pagellm.attention.torch_paged import TorchPagedAttention  # noqa: E402

if DEVICE == "cpu" and "pagellm.attention.triton_paged" in sys.modules:
    importlib.reload(sys.modules["pagellm.attention.triton_paged"])  # decorated without interpreter
from pagellm.attention import triton_paged  # noqa: E402

HEAD_DIM = 16


def make_batch(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim=HEAD_DIM,
               dtype=torch.float32, seed=0):
    """Random query and caches; each sequence's blocks are scattered over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks full of junk that must never be read
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    slots = []
    for b, (slen, qlen) in enumerate(zip(seq_lens, query_lens)):
        ids = [pool.pop() for _ in range(needed[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(slen - qlen, slen)]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return query, k_cache, v_cache, md


def to_device(md: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        md.slot_mapping.to(DEVICE), md.query_start_loc.to(DEVICE), md.seq_lens.to(DEVICE),
        md.block_tables.to(DEVICE), md.query_lens_cpu, md.seq_lens_cpu,
    )


def check_attention(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim=HEAD_DIM,
                    dtype=torch.float32, tol=1e-4, block_n=32):
    query, k_cache, v_cache, md = make_batch(seq_lens, query_lens, block_size, num_kv_heads, group,
                                             head_dim, dtype)
    scale = head_dim**-0.5
    expected = TorchPagedAttention().forward(query.float(), k_cache.float(), v_cache.float(), md, scale)
    # Output rows 1..n of a NaN buffer: every row must be overwritten, the guard rows untouched.
    buf = torch.full((query.shape[0] + 2, *query.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    out = buf[1:-1]
    triton_paged.paged_attention(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                 to_device(md), scale, out, block_n=block_n)
    assert not out.isnan().any(), "output rows left unwritten"
    assert buf[0].isnan().all() and buf[-1].isnan().all(), "wrote outside the output"
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_ragged(block_size, group):
    seq_lens = [1, 19, 40, 33, 64]
    check_attention(seq_lens, [1] * len(seq_lens), block_size, num_kv_heads=2, group=group)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_speculative_verification(block_size, group):
    check_attention([5, 21, 38], [5, 5, 5], block_size, num_kv_heads=2, group=group)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_chunks_with_prefix(block_size, group):
    # Chunk of 40 after a 30-token prefix, a whole 45-token prompt, a 20-token chunk at 50..69,
    # and a decode and a verification step in the same batch.
    seq_lens, query_lens = [70, 45, 70, 12, 30], [40, 45, 20, 1, 5]
    check_attention(seq_lens, query_lens, block_size, num_kv_heads=1, group=group)


@pytest.mark.parametrize("block_n", [16, 64])
def test_key_tile_independent_of_block_size(block_n):
    check_attention([70, 9, 33], [20, 1, 5], block_size=32, num_kv_heads=2, group=3, block_n=block_n)


def test_head_dim_not_power_of_two():
    check_attention([40, 7], [17, 1], block_size=16, num_kv_heads=2, group=3, head_dim=24)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # The interpreter keeps bfloat16 as uint16 and tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584, unsupported upstream); float16 covers the same code path.
        pytest.skip("Triton's interpreter has no bfloat16 tl.dot")
    check_attention([50, 17], [20, 1], block_size=16, num_kv_heads=2, group=4, dtype=dtype, tol=2e-2)


def test_backend_forward_matches_reference():
    query, k_cache, v_cache, md = make_batch([33, 10], [3, 10], 16, num_kv_heads=2, group=2)
    expected = TorchPagedAttention().forward(query, k_cache, v_cache, md, 0.25)
    # The query as a strided view of a fused QKV projection, the way the layer hands it over.
    fused = torch.cat([query, torch.randn(query.shape[0], 4, HEAD_DIM)], dim=1)
    query = fused[:, : query.shape[1]]
    backend = triton_paged.TritonPagedAttention()
    out = backend.forward(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), to_device(md), 0.25)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_writes_exactly_the_given_slots(block_size):
    num_blocks, kvh, hd = 6, 3, 24
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([5, -1, 0, num_blocks * block_size - 1, 2, -1], dtype=torch.int64)
    # Key/value as strided views of a fused projection (token stride != kvh * hd).
    fused = torch.randn(len(slots), 2, kvh, hd, generator=gen)
    key, value = fused[:, 0], fused[:, 1]
    k_cache = torch.full((num_blocks, block_size, kvh, hd), 7.0)
    v_cache = torch.full((num_blocks, block_size, kvh, hd), -7.0)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    TorchPagedAttention().write_kv(key[valid], value[valid], k_expected, v_expected, slots[valid])

    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    triton_paged.TritonPagedAttention().write_kv(
        key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE)
    )
    assert torch.equal(k_dev.cpu(), k_expected) and torch.equal(v_dev.cpu(), v_expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_casts_to_cache_dtype(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter truncates float32 -> bfloat16 instead of rounding")
    key = torch.randn(3, 2, 16)
    k_cache = torch.zeros(2, 4, 2, 16, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([7, 1, 4], dtype=torch.int64)
    triton_paged.write_kv(key.to(DEVICE), (-key).to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    flat_k, flat_v = k_cache.view(8, 2, 16).cpu(), v_cache.view(8, 2, 16).cpu()
    assert torch.equal(flat_k[slots], key.to(dtype))
    assert torch.equal(flat_v[slots], (-key).to(dtype))
    assert not flat_k[[0, 2, 3, 5, 6]].any()
