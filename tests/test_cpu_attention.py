"""The native paged attention and KV writes (pagellm/kernels/cpu_attention.c) against a plain
float64 reference that gathers each sequence's K/V through its block table: decode, several
query rows per sequence (speculative verification), prefill chunks split into tasks of query
rows, GQA groups, block sizes 1 and 16; float32 and bf16 pools (the reference reads the
bf16 pool's own values, which the kernel widens exactly)."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.base import AttentionMetadata
from pagellm.attention.torch_paged import TorchPagedAttention
from pagellm.kernels import cpu_attention, native
from tests.helpers import outputs_on_one_and_two_threads

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


def _bf16_dot_products() -> bool:
    """Whether prefill chunks over a bf16 pool multiply bf16 pairs here (AVX-512 bf16)."""
    return "avx512_bf16" in native.cpu_flags()


def _bf16_bound(vc: torch.Tensor) -> float:
    """bf16 probabilities: each weight off by at most 2^-9 of itself, so each output by at most
    2^-8 of the largest |value| (0 where the products are float32)."""
    if vc.dtype != torch.bfloat16 or not _bf16_dot_products():
        return 0.0
    return 2 ** -8 * float(vc.float().abs().max())


def _values(cache: torch.Tensor) -> torch.Tensor:
    """A pool's values: an int8 pool's rows dequantized (codes times their row's scale)."""
    return cpu_attention.dequantize_rows(cache) if cache.dtype == torch.int8 else cache


def _reference(q, k_cache, v_cache, tables, seq_lens, qlens, scale, window=None, softcap=None):
    """q [T, H, D]; caches [NB, BS, KVH, row] -> [T, H, D] float64, over the pools' values;
    window: each row sees only its last `window` positions; softcap: scores s become
    softcap * tanh(s / softcap)."""
    k_cache, v_cache = _values(k_cache), _values(v_cache)
    out = torch.zeros(q.shape, dtype=torch.float64)
    h, kvh = q.shape[1], k_cache.shape[2]
    group, bs = h // kvh, k_cache.shape[1]
    start = 0
    for s, (L, ql) in enumerate(zip(seq_lens, qlens)):
        slots = [tables[s][t // bs] * bs + t % bs for t in range(L)]
        k = k_cache.reshape(-1, kvh, q.shape[2])[slots].double()  # [L, KVH, D]
        v = v_cache.reshape(-1, kvh, q.shape[2])[slots].double()
        for j in range(ql):
            visible = L - ql + j + 1
            lo = max(0, visible - window) if window else 0
            for head in range(h):
                scores = k[lo:visible, head // group] @ q[start + j, head].double() * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[start + j, head] = torch.softmax(scores, 0) @ v[lo:visible, head // group]
        start += ql
    return out


KV_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _case(block_size, kvh, group, seq_lens, qlens, seed=0, d=16, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nb = 160
    backend = TorchPagedAttention()
    cpu = torch.device("cpu")
    k_cache = backend.allocate_kv_cache(nb, block_size, kvh, d, kv_dtype, cpu)
    v_cache = backend.allocate_kv_cache(nb, block_size, kvh, d, kv_dtype, cpu)
    for cache in (k_cache, v_cache):
        values = torch.randn(nb, block_size, kvh, d, generator=g)
        # an int8 pool's rows: codes and their scale, as the writes make them
        cache.copy_(cpu_attention.quantize_rows(values) if kv_dtype == torch.int8 else values)
    perm = torch.randperm(nb, generator=g).tolist()  # scattered, non-monotonic blocks
    tables, used = [], 0
    for L in seq_lens:
        n = -(-L // block_size)
        tables.append(perm[used:used + n])
        used += n
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    md = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=qsl,
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
                           query_lens_cpu=list(qlens), seq_lens_cpu=list(seq_lens))
    q = torch.randn(sum(qlens), kvh * group, d, generator=g)
    return backend, q, k_cache, v_cache, md, tables


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kvh,group", [(1, 1), (3, 3), (2, 4)])
def test_native_attention_matches_reference(block_size, kvh, group, kv_dtype):
    seq_lens, qlens = [1, 37, 16, 70], [1, 1, 5, 3]  # decode rows and verification rows
    backend, q, kc, vc, md, tables = _case(block_size, kvh, group, seq_lens, qlens,
                                           kv_dtype=kv_dtype)
    assert cpu_attention.usable(q, kc.permute(2, 0, 1, 3))
    out = backend.forward(q, kc, vc, md, 0.25)
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, 0.25)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("d", [8, 20, 40, 64, 80, 128, 192, 256])
def test_head_sizes_take_every_vector_path(d, kv_dtype):
    """head_dim 64 and 128 (the 32-wide register blocks of V; 64-wide with AVX-512; over a
    bf16 pool with AVX-512 BW, unpacked rows, up to 256), 80 (a 64-wide block and a 16-wide
    tail), 40 and 8 (the 8-wide tail; not a multiple of 16, so 256-bit registers with AVX-512
    too), 20 (not a multiple of 8: the plain loops); key counts not a multiple of 4 or 8
    included."""
    seq_lens, qlens = [1, 38, 23, 70], [1, 2, 5, 4]
    backend, q, kc, vc, md, tables = _case(16, 3, 3, seq_lens, qlens, seed=d, d=d,
                                           kv_dtype=kv_dtype)
    out = backend.forward(q, kc, vc, md, d ** -0.5)
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, d ** -0.5)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_softmax_of_far_apart_scores():
    """Scores spread over ~200 (exp of the smallest underflows; the vectorized exp clamps):
    still the reference's probabilities."""
    seq_lens, qlens = [45], [3]
    backend, q, kc, vc, md, tables = _case(16, 1, 2, seq_lens, qlens, seed=3, d=64)
    kc.mul_(4.0)
    out = backend.forward(q * 4.0, kc, vc, md, 1.0)
    ref = _reference(q * 4.0, kc, vc, tables, seq_lens, qlens, 1.0)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native_kernel", [True, False])
def test_long_queries_on_either_path(monkeypatch, native_kernel):
    """A 40-row prefill chunk beside a decode row: the native kernel splits it into tasks of
    32 query rows; without it, PyTorch's fused attention takes it. Both the reference's."""
    if not native_kernel:
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    seq_lens, qlens = [40, 21], [40, 1]
    backend, q, kc, vc, md, tables = _case(16, 2, 2, seq_lens, qlens, seed=1)
    out = backend.forward(q, kc, vc, md, 0.5)
    assert torch.allclose(out.double(), _reference(q, kc, vc, tables, seq_lens, qlens, 0.5),
                          atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_native_write_kv_fills_the_slots(kv_dtype):
    """float32 values in place; into a bf16 pool rounded to nearest even, as torch rounds
    (ties, a value past bf16's largest finite one, infinities and NaN included); into an int8
    pool as quantize_rows makes its rows."""
    if kv_dtype == torch.int8:
        return _int8_write_kv_fills_the_slots()
    backend, _, kc, vc, _, _ = _case(4, 3, 1, [8], [1], kv_dtype=kv_dtype)
    before_k, before_v = kc.clone(), vc.clone()
    key, value = torch.randn(3, 3, 16), torch.randn(3, 3, 16)
    key[0, 0, :6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3961e38,
                                  float("inf"), float("-inf")])
    value[0, 0, 0] = float("nan")
    slots = torch.tensor([5, 0, 22])
    backend.write_kv(key, value, kc, vc, slots)
    flat_k, flat_v = kc.reshape(-1, 3, 16), vc.reshape(-1, 3, 16)
    assert torch.equal(flat_k[slots], key.to(kv_dtype))
    got_v = flat_v[slots]  # (a copy)
    assert torch.isnan(got_v[0, 0, 0])
    value[0, 0, 0] = got_v[0, 0, 0] = 0
    assert torch.equal(got_v, value.to(kv_dtype))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.reshape(-1, 3, 16)[untouched])
    assert torch.equal(flat_v[untouched], before_v.reshape(-1, 3, 16)[untouched])


def _int8_write_kv_fills_the_slots():
    """Each row's codes round(x / s) to nearest even and its scale s = max |x| / 127 in its
    last 4 bytes: quantize_rows' bits, and every value within s / 2 of the row's; a row of
    zeros has scale 0; a row holding an infinity or a NaN gets a NaN scale (what attends to it
    is NaN, as over the other pools) and zero codes. Other slots untouched."""
    backend, _, kc, vc, _, _ = _case(4, 3, 1, [8], [1], kv_dtype=torch.int8)
    before_k, before_v = kc.clone(), vc.clone()
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(3, 3, 16, generator=g) * 3, torch.randn(3, 3, 16, generator=g)
    key[0, 0, :4] = torch.tensor([127 / 254, -127 / 254 * 3, 2.5, -10.0])  # ties of x / s
    key[1, 2] = 0.0
    key[2, 1, 3] = float("inf")
    value[0, 0, 0] = float("nan")
    value[1, 1] = 0.0  # a largest value below 127 / FLT_MAX: no finite 127 / max, codes 0
    value[1, 1, 0], value[1, 1, 5] = 1e-38, -2e-38
    slots = torch.tensor([5, 0, 22])
    backend.write_kv(key, value, kc, vc, slots)
    flat_k, flat_v = kc.reshape(-1, 3, 20), vc.reshape(-1, 3, 20)
    assert not flat_v[slots][1, 1, :16].any()
    want_k, want_v = cpu_attention.quantize_rows(key), cpu_attention.quantize_rows(value)
    assert torch.equal(flat_k[slots], want_k) and torch.equal(flat_v[slots], want_v)
    got = cpu_attention.dequantize_rows(flat_k[slots])
    scale = flat_k[slots][..., 16:].contiguous().view(torch.float32)
    finite = torch.isfinite(scale)
    assert int(finite.sum()) == 8  # the rows with inf (key) and NaN (value) excepted
    assert bool(((got - key).abs() <= scale / 2 * (1 + 1e-6))[finite.expand_as(got)].all())
    assert float(scale[1, 2]) == 0.0 and torch.equal(got[1, 2], torch.zeros(16))
    assert torch.isnan(scale[2, 1]) and not flat_k[slots][2, 1, :16].any()
    assert torch.isnan(flat_v[slots][..., 16:].contiguous().view(torch.float32)[0, 0])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.reshape(-1, 3, 20)[untouched])
    assert torch.equal(flat_v[untouched], before_v.reshape(-1, 3, 20)[untouched])


@pytest.mark.parametrize("native_kernel", [True, False])
@pytest.mark.parametrize("kvh,group", [(1, 1), (3, 3)])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_chunk_after_cached_keys(monkeypatch, kvh, group, kv_dtype, native_kernel):
    """Long chunks after cached keys (chunked prefill, a prefix-cache hit): every query sees
    the cached keys and the chunk's own causally; equal to the reference next to a first
    chunk (causal only). The native kernel splits a chunk into tasks of 32 query rows (70 =
    32 + 32 + 6: each task's rows are the last of the sequence cut after them); PyTorch's
    path takes two flash passes merged by their log-sum-exps."""
    if not native_kernel:
        monkeypatch.setattr(cpu_attention, "usable", lambda *args: False)
    seq_lens, qlens = [90, 37, 64, 101], [40, 37, 17, 70]
    backend, q, kc, vc, md, tables = _case(16, kvh, group, seq_lens, qlens, seed=5,
                                           kv_dtype=kv_dtype)
    out = backend.forward(q, kc, vc, md, 0.3)
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, 0.3)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("d,kvh,group", [(64, 3, 3), (128, 3, 3), (128, 2, 6)])
@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_prefill_chunks_by_key_blocks(d, kvh, group, kv_dtype, spread):
    """Chunks of 16+ query rows with head_dim 64 or 128 go by blocks of 64 keys (online
    softmax): chunks after cached keys, a last block cut short, a chunk that ends on a block
    edge, tiles partly filled; with scores spread over a few hundred as well (spread 4: a
    later block's maximum far above an earlier one's, whose sums are then rescaled to almost
    nothing; float32 exps of such scores carry ~3e-5 of error on any path, a wrong rescale
    O(1)). The same bits on 1 and 2 threads.
    A bf16 pool on a CPU with bf16 dot products multiplies bf16 query values (given here
    already rounded, as a bf16 model's are) and probabilities rounded to bf16 (_bf16_bound)."""
    seq_lens, qlens = [300, 129, 64, 40], [100, 129, 30, 17]
    backend, q, kc, vc, md, tables = _case(16, kvh, group, seq_lens, qlens, seed=d + group,
                                           d=d, kv_dtype=kv_dtype)
    if kv_dtype == torch.int8:  # the rows' values times spread: their scales
        kc.copy_(cpu_attention.quantize_rows(_values(kc) * spread))
    else:
        kc.mul_(spread)
    q = q * spread
    if kv_dtype == torch.bfloat16:
        q = q.to(torch.bfloat16).float()
    scale = d ** -0.5 * spread
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, scale)
    one, two = outputs_on_one_and_two_threads(backend.forward, q, kc, vc, md, scale)
    tol = (1e-5 if spread == 1.0 else 2e-4) + _bf16_bound(vc)
    assert torch.allclose(one.double(), ref, atol=tol, rtol=1e-5)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_verification_rows_keep_float32_products(kv_dtype):
    """Fewer than 16 query rows a sequence (speculative verification: k + 1 rows) never take
    the prefill chunks' bf16 products, even with as many query vectors (15 rows x 6 heads):
    float32 scores and weights over either pool, as plain decoding computes them."""
    seq_lens, qlens = [300, 70, 33], [9, 15, 1]
    backend, q, kc, vc, md, tables = _case(16, 2, 6, seq_lens, qlens, seed=11, d=128,
                                           kv_dtype=kv_dtype)
    out = backend.forward(q, kc, vc, md, 128 ** -0.5)
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, 128 ** -0.5)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_thread_count_attends_every_task(kv_dtype):
    """Tasks go to the threads round robin, each prefetching its next task's first block: with
    fewer tasks than threads, as many, and many more (prefill chunks and decode rows of
    different lengths), every row is the reference's, and the same bits whatever the count."""
    seq_lens, qlens = [33, 1, 90, 7, 64, 200, 18], [1, 1, 40, 2, 1, 1, 18]
    backend, q, kc, vc, md, tables = _case(16, 3, 3, seq_lens, qlens, seed=7, d=64,
                                           kv_dtype=kv_dtype)
    if kv_dtype == torch.bfloat16:  # the prefill chunk's bf16 products: see the tests above
        q = q.to(torch.bfloat16).float()
    tol = 1e-5 + _bf16_bound(vc)
    ref = _reference(q, kc, vc, tables, seq_lens, qlens, 0.125)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 5, 40):
            torch.set_num_threads(threads)
            outs.append(backend.forward(q, kc, vc, md, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(outs[0].double(), ref, atol=tol, rtol=1e-5)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("d", [16, 64, 256])
@pytest.mark.parametrize("native_kernels", [True, False])
def test_sliding_window(d, kv_dtype, native_kernels, monkeypatch):
    """A sliding window (Gemma 3's local layers): each row sees its last `window` positions.
    Decode rows past the window, verification rows straddling its edge, a prefill chunk of
    40 rows after 60 cached keys (split into tasks; rows whose windows start at different
    keys), sequences shorter than the window (everything visible), block sizes that the
    window's first key falls inside; the native kernels and the PyTorch paths."""
    if not native_kernels:
        monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    seq_lens, qlens = [30, 9, 37, 100, 19], [1, 1, 5, 40, 19]
    backend, q, kc, vc, md, tables = _case(16, 1, 4, seq_lens, qlens, seed=d, d=d,
                                           kv_dtype=kv_dtype)
    for window in (7, 16, 33):
        out = backend.forward(q, kc, vc, md, d ** -0.5, window=window)
        ref = _reference(q, kc, vc, tables, seq_lens, qlens, d ** -0.5, window)
        # bf16 products where a prefill chunk sees its whole window (_bf16_bound)
        tol = 1e-5 + (_bf16_bound(vc) if native_kernels else 0)
        assert torch.allclose(out.double(), ref, atol=tol, rtol=1e-5), window
    # no window, and one wider than every sequence: the plain causal outputs
    plain = backend.forward(q, kc, vc, md, d ** -0.5)
    assert torch.equal(backend.forward(q, kc, vc, md, d ** -0.5, window=200), plain)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("native_kernels", [True, False])
def test_soft_capping(d, kv_dtype, native_kernels, monkeypatch):
    """Gemma 2's soft-capped scores (softcap * tanh(s / softcap) before the softmax): decode
    and verification rows, prefill chunks of 40 and 150 rows after cached keys (the native
    flash path's shapes, which the cap sends to the tiles; the PyTorch path's one-sequence
    form), with and without a sliding window, against float64; a cap that bends the scores
    changes the outputs."""
    if not native_kernels:
        monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    seq_lens, qlens = [30, 9, 37, 100, 19, 200], [1, 1, 5, 40, 19, 150]
    backend, q, kc, vc, md, tables = _case(16, 2, 2, seq_lens, qlens, seed=d, d=d,
                                           kv_dtype=kv_dtype)
    q = q * 2  # scores of a few units: the cap of 1.5 bends them
    for window in (None, 16):
        out = backend.forward(q, kc, vc, md, d ** -0.5, window=window, softcap=1.5)
        ref = _reference(q, kc, vc, tables, seq_lens, qlens, d ** -0.5, window, softcap=1.5)
        tol = 1e-5 + (_bf16_bound(vc) if native_kernels else 0)
        assert torch.allclose(out.double(), ref, atol=tol, rtol=1e-5), window
        uncapped = _reference(q, kc, vc, tables, seq_lens, qlens, d ** -0.5, window)
        assert (uncapped - ref).abs().max() > 100 * tol
