"""Prefix cache: hash chaining, longest-chain reuse, LRU eviction, collisions, and engine-level
identity of greedy output with the cache on and off (float32, tiny random model)."""
from __future__ import annotations

import pytest
import torch

import pagellm.engine.block_manager as block_manager_module
from pagellm import LLM, SamplingParams
from pagellm.engine.block_manager import BlockManager, hash_block
from tests.test_block_manager import compute, free_order, make_seq
from tests.test_scheduler import FakeEngine, expected_output


def hashes_of(bm: BlockManager, seq) -> list[int | None]:
    return [bm.blocks[b].block_hash for b in seq.block_table]


# ---- hashes -------------------------------------------------------------------------------
def test_hash_chains_the_parent_block_and_the_salt():
    bm = BlockManager(16, 4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_seq(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])  # block 1 has the same tokens as a's
    c = make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-2")
    for s in (a, b, c):
        assert compute(bm, s, 9)
    h0 = hash_block(None, (1, 2, 3, 4), None)
    h1 = hash_block(h0, (5, 6, 7, 8), None)
    assert hashes_of(bm, a) == [h0, h1, None]  # the partial block is not hashed
    hb = hashes_of(bm, b)
    assert hb[0] != h0 and hb[1] != h1  # same tokens, different parent: different hash
    assert hb[1] == hash_block(hb[0], (5, 6, 7, 8), None)
    hc = hashes_of(bm, c)
    assert hc[0] == hash_block(None, (1, 2, 3, 4), "tenant-2") != h0
    assert hc[1] == hash_block(hc[0], (5, 6, 7, 8), "tenant-2") != h1
    assert bm.cached == {h0: a.block_table[0], h1: a.block_table[1], hb[0]: b.block_table[0],
                         hb[1]: b.block_table[1], hc[0]: c.block_table[0], hc[1]: c.block_table[1]}
    bm.check_invariants([a.block_table, b.block_table, c.block_table])
    # A salted prompt never hits an unsalted one, and the other way round.
    assert bm.find_cached_prefix(make_seq(3, range(1, 11), salt="other")) == []
    assert bm.find_cached_prefix(make_seq(4, range(1, 11), salt="tenant-2")) == c.block_table[:2]


def test_only_full_blocks_of_computed_tokens_are_registered():
    bm = BlockManager(16, 4)
    s = make_seq(0, range(11))
    assert compute(bm, s, 6)  # chunk 1: block 0 full, block 1 half
    assert hashes_of(bm, s)[0] is not None and hashes_of(bm, s)[1] is None
    assert compute(bm, s, 5)  # chunk 2: block 1 full, block 2 has 3 of 4
    assert [h is not None for h in hashes_of(bm, s)] == [True, True, False]
    assert len(bm.cached) == 2


# ---- reuse --------------------------------------------------------------------------------
def test_longest_chain_is_reused_with_exact_ids():
    bm = BlockManager(16, 4)
    a = make_seq(0, list(range(14)))  # 3 full blocks + 2 tokens
    assert compute(bm, a, 14)
    assert a.block_table == [0, 1, 2, 3]
    cases = [
        (list(range(14)) + [99], [0, 1, 2]),  # all full blocks
        (list(range(8)) + [50, 51, 52, 53, 54], [0, 1]),  # diverges in block 2
        (list(range(4)) + [50] * 9, [0]),
        ([50] + list(range(1, 14)), []),  # diverges in block 0: nothing, even if later match
        (list(range(12)), [0, 1]),  # fully cached prompt: its last block is computed again
        (list(range(13)), [0, 1, 2]),
    ]
    for i, (prompt, hits) in enumerate(cases, start=1):
        assert bm.find_cached_prefix(make_seq(i, prompt)) == hits, prompt
    b = make_seq(9, list(range(8)) + [50, 51, 52, 53, 54])
    hits = bm.find_cached_prefix(b)
    assert compute(bm, b, b.num_tokens - 8, hits)
    assert b.block_table == [0, 1, 4, 5]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 13
    assert [bm.blocks[i].ref_cnt for i in range(6)] == [2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("n", [5, 8, 9])
def test_fully_cached_prompt_still_computes_its_last_token(n):
    bm = BlockManager(16, 4)
    a = make_seq(0, range(n))
    assert compute(bm, a, n)
    b = make_seq(1, range(n))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == (n - 1) // 4
    assert compute(bm, b, n - 4 * len(hits), hits)
    assert b.num_computed_tokens == n and b.num_cached_tokens == 4 * len(hits)
    assert n - b.num_cached_tokens >= 1


def test_lru_eviction_takes_the_least_recently_freed_cached_block():
    bm = BlockManager(6, 2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    b = make_seq(1, [6, 7, 8, 9, 10])
    assert compute(bm, a, 5) and a.block_table == [0, 1, 2]  # 0, 1 cached
    assert compute(bm, b, 5) and b.block_table == [3, 4, 5]  # 3, 4 cached
    bm.forget(a)
    bm.forget(b)
    assert free_order(bm) == [2, 1, 0, 5, 4, 3]
    # c reuses a's chain: a's blocks become the most recently used.
    c = make_seq(2, [1, 2, 3, 4, 11])
    hits = bm.find_cached_prefix(c)
    assert hits == [0, 1]
    assert compute(bm, c, 1, hits)
    assert c.block_table == [0, 1, 2]  # block 2 was not cached: popped first
    assert free_order(bm) == [5, 4, 3]
    d = make_seq(3, [20, 21, 22, 23])
    assert compute(bm, d, 4)
    assert d.block_table == [5, 4]  # 4 was b's 2nd block: evicted before b's 1st (3)
    assert bm.find_cached_prefix(make_seq(4, [6, 7, 8, 9, 10])) == [3]
    bm.forget(c)
    assert free_order(bm) == [3, 2, 1, 0]
    e = make_seq(5, [30, 31])
    assert compute(bm, e, 2) and e.block_table == [3]  # b's chain goes before a's
    assert bm.find_cached_prefix(make_seq(6, [6, 7, 8, 9, 10])) == []
    assert bm.find_cached_prefix(make_seq(7, [1, 2, 3, 4, 5])) == [0, 1]
    bm.check_invariants([d.block_table, e.block_table])


def test_stale_hash_is_dropped_when_the_block_is_reused():
    bm = BlockManager(2, 2)
    a = make_seq(0, [1, 2, 3])
    assert compute(bm, a, 3)
    old_hash = bm.blocks[0].block_hash
    assert bm.cached == {old_hash: 0}
    bm.forget(a)
    assert free_order(bm) == [1, 0]
    b = make_seq(1, [7, 8, 9])  # takes both blocks: block 0 is overwritten with 9
    assert compute(bm, b, 3) and b.block_table == [1, 0]
    assert old_hash not in bm.cached
    assert bm.blocks[0].block_hash is None and bm.blocks[0].token_ids is None
    assert bm.blocks[0].generation == 1
    assert bm.find_cached_prefix(make_seq(2, [1, 2, 3])) == []
    assert bm.cached == {hash_block(None, (7, 8), None): 1}
    bm.check_invariants([b.block_table])


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    """Every block hashes to the same value: hits must still be confirmed token by token."""
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens, salt: 0)
    bm = BlockManager(16, 4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert compute(bm, a, 9)
    assert bm.cached == {0: a.block_table[0]}  # block 1's hash is taken: not registered
    assert bm.find_cached_prefix(make_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert bm.find_cached_prefix(make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])) == [a.block_table[0]]
    b = make_seq(3, [9, 9, 9, 9, 1, 2, 3, 4, 0])
    assert bm.find_cached_prefix(b) == []
    assert compute(bm, b, 9)
    bm.check_invariants([a.block_table, b.block_table])


def test_hash_ignoring_the_parent_never_serves_kv_of_another_prefix(monkeypatch):
    """A hash that collides across prefixes: the parent link must still reject the hit."""
    monkeypatch.setattr(block_manager_module, "hash_block",
                        lambda parent, tokens, salt: hash((tokens, salt)))
    bm = BlockManager(16, 4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    z = make_seq(1, [9, 9, 9, 9, 0])
    assert compute(bm, a, 9) and compute(bm, z, 5)
    # Block 0 hits z's block; block 1's tokens match a's block 1 but it follows another block.
    b = make_seq(2, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.find_cached_prefix(b) == [z.block_table[0]]


# ---- the scheduler and preemption ---------------------------------------------------------
def test_preempting_a_sharer_frees_only_its_own_references():
    eng = FakeEngine(num_blocks=6, block_size=4, enable_prefix_caching=True)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    a = eng.add(shared + [100], 3)
    c = eng.add([1, 2, 3, 4, 5, 6, 7, 8], 3)
    b = eng.add(shared + [101], 3)
    out = eng.step()
    assert out.seqs == [a, c, b]
    assert a.block_table == [0, 1, 2] and c.block_table == [3, 4] and b.block_table == [0, 1, 5]
    assert b.num_cached_tokens == 8 and out.num_tokens == [9, 8, 1]
    assert [blk.ref_cnt for blk in eng.bm.blocks] == [2, 2, 1, 1, 1, 1]
    out = eng.step()  # c's position 8 needs a block: b (newest) goes, and gives back only 5
    assert out.preempted == [b] and out.seqs == [a, c]
    assert c.block_table == [3, 4, 5] and a.block_table == [0, 1, 2]
    assert [blk.ref_cnt for blk in eng.bm.blocks] == [1, 1, 1, 1, 1, 1]
    assert b.block_table == [] and eng.sched.waiting[0] is b
    eng.run()
    assert b.output_token_ids == expected_output(shared + [101], 3)
    assert a.output_token_ids == expected_output(shared + [100], 3)


def test_prefix_counters_count_each_admission_once():
    # The head of the queue waits several steps for blocks; its lookup is counted once.
    eng = FakeEngine(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = eng.add([1, 2, 3, 4, 5], 2)  # takes all 3 blocks
    b = eng.add([1, 2, 3, 4, 6], 2)  # 2 hit blocks + 1 new: waits until a is done
    waited = 0
    while eng.sched.has_unfinished():
        eng.step()
        waited += b.status.value == "waiting"
    assert waited == 2
    assert eng.bm.prefix_queries == a.num_prompt_tokens + b.num_prompt_tokens
    assert eng.bm.prefix_hits == 4
    assert b.num_cached_tokens == 4


# ---- engine level -------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SYSTEM = [7, 3, 99, 41, 5, 18, 250, 64, 2, 9, 33, 33, 10, 77, 120, 6, 14, 201, 88, 45]  # 20
SUFFIXES = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31], [41, 42, 43, 44, 45], [51, 52],
            [61, 62, 63, 64, 65, 66]]
PROMPTS = [SYSTEM + s for s in SUFFIXES]
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, block 4, 2 kv heads, dim 16, fp32


def greedy(llm: LLM, prompts, max_tokens: int = 16) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=BYTES_PER_BLOCK * 256,
              enable_prefix_caching=False)
    return greedy(llm, PROMPTS)


def test_greedy_identical_with_prefix_cache_on(tiny_llama, reference):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=BYTES_PER_BLOCK * 256,
              enable_prefix_caching=True)
    assert greedy(llm, PROMPTS) == reference
    bm = llm.engine.block_manager
    # All six are admitted in the first step; the 2nd..6th reuse the 5 system-prompt blocks
    # registered by the 1st in that same step.
    assert bm.prefix_queries == sum(len(p) for p in PROMPTS)
    assert bm.prefix_hits == 5 * 4 * 5
    assert llm.engine.scheduler.num_preemptions == 0
    # Again: now every full prompt block is cached (free), up to the block holding the last
    # prompt token, which is always computed: (len - 1) // 4 blocks per prompt.
    assert greedy(llm, PROMPTS) == reference
    assert bm.prefix_queries == 2 * sum(len(p) for p in PROMPTS)
    assert bm.prefix_hits == 100 + sum((len(p) - 1) // 4 * 4 for p in PROMPTS)


def test_abort_of_a_sharer_keeps_the_other_exact(tiny_llama, reference):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=BYTES_PER_BLOCK * 64)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng.add_request("keep", PROMPTS[0], params)
    eng.add_request("drop", PROMPTS[3], params)
    eng.step()
    eng.step()
    shared = eng.requests["keep"].seqs[0].block_table[:5]
    assert eng.requests["drop"].seqs[0].block_table[:5] == shared
    eng.abort_request("drop")
    assert all(eng.block_manager.blocks[b].ref_cnt == 1 for b in shared)
    result = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                result = out.outputs[0].token_ids
    assert result == reference[0]


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_identical_under_eviction_and_preemption(tiny_llama, reference, caching):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=BYTES_PER_BLOCK * 16,
              enable_prefix_caching=caching, max_num_batched_tokens=32)
    assert llm.engine.num_blocks == 16
    assert greedy(llm, PROMPTS) == reference
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0
    if caching:
        assert eng.block_manager.prefix_hits > 0
        assert sum(b.generation for b in eng.block_manager.blocks) > 0  # cached blocks evicted
    else:
        assert eng.block_manager.prefix_queries == 0 and not eng.block_manager.cached


def test_identical_prompts_in_one_step_share_blocks(tiny_llama, reference):
    path, _ = tiny_llama
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=BYTES_PER_BLOCK * 64)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng.add_request("a", PROMPTS[1], params)
    eng.add_request("b", PROMPTS[1], params)
    a, b = eng.requests["a"].seqs[0], eng.requests["b"].seqs[0]
    eng.step()
    assert a.num_computed_tokens == b.num_computed_tokens == 27
    assert a.block_table[:6] == b.block_table[:6] == [0, 1, 2, 3, 4, 5]
    assert a.block_table[6] == 6 and b.block_table[6] == 7  # the partial last block is private
    assert [eng.block_manager.blocks[i].ref_cnt for i in range(8)] == [2] * 6 + [1, 1]
    assert b.num_cached_tokens == 24 and a.num_cached_tokens == 0
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
                assert out.num_cached_tokens == (24 if out.request_id == "b" else 0)
    assert finished == {"a": reference[1], "b": reference[1]}
