"""Triton paged attention vs the PyTorch reference backend.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 must
be set before the kernels are decorated, i.e. before pagellm.attention.triton_paged is imported);
with CUDA they run compiled on the GPU. Shapes are small because the interpreter is slow: the
split-KV tests force their split counts (`num_splits=`) with short splits (block_n=16), since the
chooser only splits contexts of hundreds of keys.
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
                    dtype=torch.float32, tol=1e-4, block_n=32, num_splits=0):
    """num_splits: 0 pins the single-kernel path, n >= 1 forces n KV splits, None lets it choose."""
    query, k_cache, v_cache, md = make_batch(seq_lens, query_lens, block_size, num_kv_heads, group,
                                             head_dim, dtype)
    scale = head_dim**-0.5
    expected = TorchPagedAttention().forward(query.float(), k_cache.float(), v_cache.float(), md, scale)
    # Output rows 1..n of a NaN buffer: every row must be overwritten, the guard rows untouched.
    buf = torch.full((query.shape[0] + 2, *query.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    out = buf[1:-1]
    triton_paged.paged_attention(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                 to_device(md), scale, out, block_n=block_n, num_splits=num_splits)
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


# --- split-KV (flash-decoding) path -------------------------------------------------------------


@pytest.fixture
def split_calls(monkeypatch):
    """Split counts the split-KV path ran with; its scratch starts as NaN, so a (row, split) the
    reduce reads without the split kernel having written it shows up as NaN in the output."""
    calls = []
    run_split = triton_paged._split_kv_attention

    def spy(*args):
        calls.append(args[-1])  # num_splits
        return run_split(*args)

    monkeypatch.setattr(triton_paged, "_split_kv_attention", spy)
    monkeypatch.setattr(triton_paged, "_scratch", lambda shape, device: torch.full(
        shape, float("nan"), dtype=torch.float32, device=device))
    return calls


@pytest.mark.parametrize("num_splits, block_size", [(2, 16), (2, 32), (4, 1), (5, 32)])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_split_kv_decode_ragged(num_splits, block_size, group, split_calls):
    # Longest sequence 70, block_n 16: splits of 48 keys (2 splits; with block 32 the second split
    # starts mid-block), 32 (4; the last split is past every sequence's end) or 16 (5; not a power
    # of two, and smaller than block 32). Sequences 1 and 7 are shorter than one split: their other
    # splits are empty.
    seq_lens = [1, 19, 40, 33, 70, 7]
    check_attention(seq_lens, [1] * len(seq_lens), block_size, num_kv_heads=2, group=group,
                    block_n=16, num_splits=num_splits)
    assert split_calls == [num_splits]


@pytest.mark.parametrize("group", [1, 3, 8])
def test_split_kv_verification(group, split_calls):
    # Multi-token queries (speculative verification) in one program each, causal within the step.
    # Splits of 16 keys: sequence 35's queries sit at 30..34, so in split [32, 48) rows 30 and 31
    # see no key at all (m = -inf, l = 0 there); likewise rows 14, 15 of sequence 18 in [16, 32).
    check_attention([5, 21, 35, 18, 60], [1, 5, 5, 4, 3], block_size=16, num_kv_heads=2,
                    group=group, block_n=16, num_splits=4)
    assert split_calls == [4]


def test_split_kv_one_split_and_wide_key_tiles(split_calls):
    # One split is the single-kernel computation plus a trivial reduce; block_n 64 > block_size.
    check_attention([70, 9, 33], [3, 1, 2], block_size=32, num_kv_heads=2, group=3, block_n=64,
                    num_splits=1)
    check_attention([70, 9, 33], [3, 1, 2], block_size=32, num_kv_heads=2, group=3, block_n=64,
                    num_splits=2)
    assert split_calls == [1, 2]


def test_split_kv_head_dim_not_power_of_two(split_calls):
    check_attention([40, 7, 66], [3, 1, 2], block_size=16, num_kv_heads=2, group=3, head_dim=24,
                    block_n=16, num_splits=3)
    assert split_calls == [3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_half_precision(dtype, split_calls):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter has no bfloat16 tl.dot")  # see test_half_precision
    check_attention([50, 17, 3], [1, 2, 1], block_size=16, num_kv_heads=2, group=4, dtype=dtype,
                    tol=2e-2, block_n=16, num_splits=4)
    assert split_calls == [4]


def test_split_kv_rejects_query_taller_than_one_program():
    query, k_cache, v_cache, md = make_batch([30, 20], [20, 1], 16, num_kv_heads=1, group=8)
    # 20 tokens -> 32 x 8 heads = 256 rows > SPLIT_KV_MAX_ROWS: the split kernel cannot hold it.
    with pytest.raises(ValueError, match="split-KV"):
        triton_paged.paged_attention(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                     to_device(md), 0.25, torch.empty_like(query, device=DEVICE),
                                     num_splits=2)


def test_choose_num_splits():
    choose = triton_paged.choose_num_splits
    min_keys, max_splits = triton_paged.SPLIT_KV_MIN_KEYS, triton_paged.SPLIT_KV_MAX_SPLITS
    # Few sequences x long context: split, the smallest power of two with >= num_sms programs.
    assert choose(num_seqs=4, num_kv_heads=8, group=4, max_query_len=1, max_seq_len=8192,
                  num_sms=132) == 8  # 32 programs x 8 = 256 >= 132 (x 4 = 128 is not)
    assert choose(2, 8, 4, 1, 4096, num_sms=32) == 2
    assert choose(1, 1, 8, 1, 100_000) == max_splits  # would want 132; capped
    # Each split of the longest sequence keeps >= SPLIT_KV_MIN_KEYS keys.
    assert choose(1, 8, 4, 1, 2 * min_keys - 1) == 0
    assert choose(1, 8, 4, 1, 2 * min_keys) == 2
    assert choose(1, 8, 4, 1, 5 * min_keys) == 4
    # Short contexts: the single kernel.
    assert choose(1, 8, 4, 1, 300) == 0
    assert choose(1, 8, 4, 1, 1) == 0
    # Many sequences: the plain grid already has a program per SM.
    assert choose(17, 8, 4, 1, 8192) == 0  # 136 programs >= 132
    assert choose(16, 8, 4, 1, 8192) == 2  # 128 programs < 132
    assert choose(64, 8, 4, 1, 8192, num_sms=1024) == 2
    # Verification queries split while query x padded group fits SPLIT_KV_MAX_ROWS (64) rows.
    assert choose(2, 8, 8, 5, 4096) > 0  # 8 x 8 = 64 rows
    assert choose(2, 8, 8, 9, 4096) == 0  # 16 x 8 = 128 rows
    assert choose(2, 8, 1, 64, 4096) > 0
    assert choose(2, 8, 1, 65, 4096) == 0  # prefill-shaped
    assert choose(2, 8, 3, 16, 4096) > 0  # group 3 pads to 4: 16 x 4 = 64 rows
    # Always 0 or a power of two in [2, SPLIT_KV_MAX_SPLITS].
    for num_seqs in (1, 2, 3, 7, 40, 200):
        for kvh in (1, 2, 8):
            for seq_len in (1, 255, 256, 511, 512, 777, 3000, 5000, 1 << 20):
                n = choose(num_seqs, kvh, 4, 1, seq_len)
                assert n == 0 or (2 <= n <= max_splits and n & (n - 1) == 0
                                  and seq_len // n >= min_keys), (num_seqs, kvh, seq_len, n)


def test_backend_picks_split_kv_for_long_decode(split_calls):
    # Two decode sequences on one KV head: 2 programs, and 600 keys is 2 splits of >= 256 keys.
    backend = triton_paged.TritonPagedAttention()
    for seq_lens, expected_calls in (([600, 300], [2]), ([200, 100], [2])):
        query, k_cache, v_cache, md = make_batch(seq_lens, [1, 1], 16, num_kv_heads=1, group=2)
        expected = TorchPagedAttention().forward(query, k_cache, v_cache, md, 0.25)
        out = backend.forward(query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                              to_device(md), 0.25)
        assert split_calls == expected_calls  # the short batch added no split-KV call
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_warm_up_runs_the_split_kernels_for_each_short_query(split_calls, tiny_llama):
    """The backend's warm-up (an engine's, at start) compiles the split-KV kernels over the
    engine's pool for each query length that can take them, and skips those too tall."""
    from pagellm import LLM

    path, _ = tiny_llama
    runner = LLM(path, dtype="float32", kv_cache_memory=2**20, block_size=4).engine.runner
    if DEVICE == "cuda":
        runner.kv_caches = [(k.to(DEVICE), v.to(DEVICE)) for k, v in runner.kv_caches]
        runner.device = torch.device(DEVICE)
    triton_paged.TritonPagedAttention().warm_up(runner, [1, 3, 200])
    assert split_calls == [2, 2]  # 200 tokens x group 2 is taller than one program
