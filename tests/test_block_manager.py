"""Exact bookkeeping of the KV block pool, and pool invariants under random operation sequences.

The property test keeps a model of the KV cache ("slot -> the token prefix whose KV it holds"):
every computed position of every live sequence must hold the KV of exactly its own prefix, so a
block shared, evicted or reused wrongly is caught, not only a wrong reference count.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.engine.block_manager import BlockManager
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence


def make_seq(seq_id: int, tokens, salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), None, cache_salt=salt)


def compute(bm: BlockManager, seq: Sequence, n: int, cached: list[int] | None = None) -> bool:
    """What one engine step does to a sequence: allocate, then (after the forward) count the KV."""
    ok = bm.allocate_slots(seq, n, cached)
    if ok:
        seq.num_computed_tokens += n
    return ok


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


def snapshot(bm: BlockManager, *seqs: Sequence):
    return (free_order(bm), dict(bm.cached),
            [(b.ref_cnt, b.block_hash, b.token_ids, b.parent, b.generation) for b in bm.blocks],
            [(list(s.block_table), s.num_computed_tokens, s.num_cached_tokens) for s in seqs])


# ---- scripted, exact ----------------------------------------------------------------------
def test_fifo_allocation_and_tail_first_free():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b, c = make_seq(0, range(10)), make_seq(1, range(5)), make_seq(2, range(13))
    assert compute(bm, a, 10)
    assert a.block_table == [0, 1, 2]
    assert compute(bm, b, 5)
    assert b.block_table == [3, 4]
    assert free_order(bm) == [5, 6, 7]
    bm.free(a)
    # Tail first: the end of a prefix is the first to be evicted.
    assert free_order(bm) == [5, 6, 7, 2, 1, 0]
    assert a.block_table == []
    assert compute(bm, c, 13)
    assert c.block_table == [5, 6, 7, 2]
    assert free_order(bm) == [1, 0]
    assert bm.num_free_blocks == 2 and bm.num_used_blocks == 6
    bm.check_invariants([b.block_table, c.block_table])


def test_block_taken_only_when_crossing_a_boundary():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    s = make_seq(0, [7, 7, 7])
    assert compute(bm, s, 3)
    assert s.block_table == [0]
    tables = []
    for t in range(4, 14):  # decode: one new token per step
        s.output_token_ids.append(t)
        assert compute(bm, s, 1)
        tables.append(list(s.block_table))
    # token counts 4..13: the 5th and 9th and 13th token each open a block, nothing else does
    assert tables == [[0]] + [[0, 1]] * 4 + [[0, 1, 2]] * 4 + [[0, 1, 2, 3]]
    assert bm.num_free_blocks == 4


def test_chunked_allocation_grows_table_per_chunk():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    s = make_seq(0, range(10))
    assert compute(bm, s, 4) and s.block_table == [0]
    assert compute(bm, s, 1) and s.block_table == [0, 1]
    assert compute(bm, s, 3) and s.block_table == [0, 1]
    assert compute(bm, s, 2) and s.block_table == [0, 1, 2]
    assert s.num_computed_tokens == 10


def test_allocate_failure_changes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_seq(0, range(12))
    assert compute(bm, a, 12)
    b = make_seq(1, range(100, 108))
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 8)  # needs 2 blocks, 1 is free
    assert snapshot(bm, a, b) == before
    assert bm.allocate_slots(b, 4)  # one block fits
    assert b.block_table == [3]


def test_allocate_failure_with_cache_hits_changes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_seq(0, range(12))
    assert compute(bm, a, 12)
    bm.forget(a)  # blocks 0..2 are now cached and free; queue [3, 2, 1, 0]
    assert free_order(bm) == [3, 2, 1, 0]
    d = make_seq(1, list(range(8)) + list(range(50, 59)))  # 17 tokens: 5 blocks, 2 of them hits
    hits = bm.find_cached_prefix(d)
    assert hits == [0, 1]
    before = snapshot(bm, d)
    assert not bm.allocate_slots(d, 9, hits)  # 2 hits + 3 new blocks > 4 free
    assert snapshot(bm, d) == before
    # The cached blocks are still findable and still free.
    assert bm.find_cached_prefix(make_seq(2, range(12))) == [0, 1]
    assert bm.allocate_slots(d, 4, hits)
    assert d.block_table == [0, 1, 3]
    assert d.num_computed_tokens == 8 and d.num_cached_tokens == 8
    assert free_order(bm) == [2]


def test_shared_blocks_ref_counts_and_free_order():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_seq(0, list(range(8)) + [90])
    assert compute(bm, a, 9)
    assert a.block_table == [0, 1, 2]
    b = make_seq(1, list(range(8)) + [91])
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert compute(bm, b, 1, hits)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    bm.check_invariants([a.block_table, b.block_table])
    bm.free(a)  # only a's own block comes back; the shared ones lose one reference
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_order(bm) == [4, 5, 6, 7, 2]
    assert b.block_table == [0, 1, 3]
    bm.check_invariants([b.block_table])
    bm.free(b)
    assert free_order(bm) == [4, 5, 6, 7, 2, 3, 1, 0]
    bm.check_invariants([])


def test_truncate_returns_rejected_tail_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    s = make_seq(0, range(5))
    assert compute(bm, s, 5)
    assert s.block_table == [0, 1]
    s.spec_token_ids = [40, 41, 42, 43, 44, 45]  # positions 5..10 -> needs block 2
    assert bm.allocate_slots(s, s.num_tokens_to_compute)
    assert s.block_table == [0, 1, 2]
    # Verification accepts two proposals: tokens 5, 6 are real, KV valid up to 7 tokens.
    s.output_token_ids += s.spec_token_ids[:2]
    s.spec_token_ids = []
    s.num_computed_tokens = 7
    bm.truncate(s, 7)
    assert s.block_table == [0, 1]
    assert free_order(bm)[-1] == 2 and bm.blocks[2].ref_cnt == 0
    bm.truncate(s, 7)  # idempotent
    assert s.block_table == [0, 1]
    # Speculative tokens never reach the prefix cache: only block 0 (tokens 0..3) is hashed.
    assert set(bm.cached.values()) == {0}
    s.output_token_ids.append(46)  # 8 real tokens: block 1 becomes full on the next step
    assert compute(bm, s, 1)
    assert set(bm.cached.values()) == {0, 1}
    assert bm.blocks[1].token_ids == (4, 40, 41, 46)
    bm.check_invariants([s.block_table])


def test_check_invariants_catches_inconsistency():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    s = make_seq(0, range(3))
    assert compute(bm, s, 3)
    bm.check_invariants([s.block_table])
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # blocks referenced by no table
    with pytest.raises(AssertionError):
        bm.check_invariants([s.block_table, s.block_table])  # ref counts too low
    with pytest.raises(AssertionError):
        bm.free(s)
        bm._release(0)  # a second release of a free block


def test_usage_counters():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(1) == 1
    assert bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2
    s = make_seq(0, range(9))
    assert compute(bm, s, 9)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.forget(s)
    assert bm.num_used_blocks == 0


# ---- property-based -----------------------------------------------------------------------
SYSTEM_PROMPTS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7, 7, 7, 7, 7, 7, 7, 7]]

prompt_st = st.tuples(st.sampled_from(range(len(SYSTEM_PROMPTS) + 1)),
                      st.lists(st.integers(0, 3), max_size=7)).map(
    lambda t: (SYSTEM_PROMPTS[t[0]] if t[0] < len(SYSTEM_PROMPTS) else []) + t[1]).filter(bool)

op_st = st.one_of(
    st.tuples(st.just("admit"), st.lists(st.tuples(prompt_st, st.sampled_from([None, "x"]),
                                                   st.integers(1, 12)), min_size=1, max_size=3)),
    st.tuples(st.just("readmit"), st.integers(0, 7), st.integers(1, 12)),
    st.tuples(st.just("advance"), st.integers(0, 7), st.integers(1, 6), st.integers(0, 3)),
    st.tuples(st.just("spec"), st.integers(0, 7),
              st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(0, 5)),
    st.tuples(st.just("preempt"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
)


class PoolModel:
    """Drives a BlockManager the way the engine does, and keeps the KV content model."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.live: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # preempted, no blocks
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds
        self.next_id = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def write_kv(self, seq: Sequence, n: int) -> None:
        """The forward pass: KV of positions [computed, computed + n), speculative tail included."""
        tokens = seq.tokens_slice(0, seq.num_computed_tokens + n)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.kv[self.slot(seq, pos)] = tuple(tokens[: pos + 1])

    def admit(self, seqs_and_chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Admit in one step (later ones may hit blocks the earlier ones allocated in this step),
        then run the forward for all admitted."""
        admitted = []
        for seq, chunk in seqs_and_chunks:
            hits = self.bm.find_cached_prefix(seq)
            assert len(hits) <= (seq.num_tokens - 1) // self.bs
            num = min(seq.num_tokens - len(hits) * self.bs, chunk)
            before = snapshot(self.bm, seq)
            if self.bm.allocate_slots(seq, num, hits):
                assert seq.block_table[: len(hits)] == hits
                assert seq.num_computed_tokens == len(hits) * self.bs
                admitted.append((seq, num))
            else:
                assert snapshot(self.bm, seq) == before
        for seq, num in admitted:
            self.write_kv(seq, num)
            seq.num_computed_tokens += num
            self.live.append(seq)
        return [s for s, _ in admitted]

    def run(self, op) -> None:
        kind = op[0]
        if kind == "admit":
            batch = []
            for prompt, salt, chunk in op[1]:
                seq = make_seq(self.next_id, prompt, salt)
                self.next_id += 1
                batch.append((seq, chunk))
            self.admit(batch)
        elif kind == "readmit" and self.waiting:
            seq = self.waiting[op[1] % len(self.waiting)]
            if self.admit([(seq, op[2])]):
                self.waiting.remove(seq)
        elif kind in ("advance", "spec", "preempt", "finish") and self.live:
            seq = self.live[op[1] % len(self.live)]
            getattr(self, kind)(seq, *op[2:])

    def advance(self, seq: Sequence, k: int, token: int) -> None:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)  # the token sampled last step
        num = min(seq.num_tokens_to_compute, k)
        before = snapshot(self.bm, seq)
        if self.bm.allocate_slots(seq, num):
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens + num)
            self.write_kv(seq, num)
            seq.num_computed_tokens += num
        else:
            assert snapshot(self.bm, seq) == before

    def spec(self, seq: Sequence, proposals: list[int], num_accept: int) -> None:
        if seq.num_computed_tokens != seq.num_tokens:
            return
        seq.output_token_ids.append(9)  # the bonus token of last step; proposals follow it
        seq.spec_token_ids = list(proposals)
        num = seq.num_tokens_to_compute
        before = snapshot(self.bm, seq)
        if not self.bm.allocate_slots(seq, num):
            assert snapshot(self.bm, seq) == before
            seq.spec_token_ids = []
            return
        self.write_kv(seq, num)
        accepted = seq.spec_token_ids[: min(num_accept, len(proposals))]
        seq.spec_token_ids = []
        seq.output_token_ids += accepted
        seq.num_computed_tokens = seq.num_tokens  # KV valid through the last accepted proposal
        self.bm.truncate(seq, seq.num_computed_tokens)
        assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)

    def preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.live.remove(seq)
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.bm.forget(seq)
        self.live.remove(seq)

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants([s.block_table for s in self.live])
        for s in self.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0
        referenced = {b for s in self.live for b in s.block_table}
        assert len(bm.free_queue) == len(set(bm.free_queue))
        assert referenced.isdisjoint(bm.free_queue)
        assert len(referenced) + bm.num_free_blocks == bm.num_blocks
        # Every hashed block is the one the map points at, and holds a full block's tokens.
        for block in bm.blocks:
            if block.block_hash is not None:
                assert bm.cached[block.block_hash] == block.block_id
                assert len(block.token_ids) == self.bs
        assert len(bm.cached) == sum(b.block_hash is not None for b in bm.blocks)
        if not bm.enable_prefix_caching:
            assert not bm.cached
        # KV content: each computed position holds the KV of its own prefix.
        for s in self.live:
            assert len(s.block_table) >= bm.blocks_needed(s.num_computed_tokens)
            tokens = s.token_ids
            for pos in range(s.num_computed_tokens):
                assert self.kv.get(self.slot(s, pos)) == tuple(tokens[: pos + 1]), (s, pos)
        # A cached block (free or not) still holds the KV of the tokens it is registered with,
        # after the prefix its parent link names while that parent is unchanged.
        for block in bm.blocks:
            if block.block_hash is None:
                continue
            first = block.block_id * self.bs
            for off, tok in enumerate(block.token_ids):
                assert self.kv[first + off][-1] == tok
            if block.parent is None:
                assert len(self.kv[first]) == 1
            else:
                pid, gen = block.parent
                if bm.blocks[pid].generation == gen and bm.blocks[pid].block_hash is not None:
                    assert self.kv[first][:-1] == self.kv[pid * self.bs + self.bs - 1]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 4]),
       caching=st.booleans(), ops=st.lists(op_st, max_size=40))
def test_random_operations_keep_pool_invariants(num_blocks, block_size, caching, ops):
    model = PoolModel(num_blocks, block_size, caching)
    for op in ops:
        model.run(op)
        model.check()
    for seq in list(model.live):
        model.finish(seq)
    model.check()
    assert model.bm.num_free_blocks == num_blocks


def test_random_operations_reach_sharing_eviction_and_preemption():
    """The pool model itself on a fixed script that reaches same-step hits, preemption,
    eviction of cached blocks and re-admission (so its checks are exercised on those paths)."""
    model = PoolModel(6, 2, True)
    script = [
        ("admit", [([1, 2, 3, 4, 5, 6, 0], None, 12), ([1, 2, 3, 4, 5, 6, 1], None, 12)]),
        ("advance", 0, 1, 2), ("advance", 1, 1, 3),
        ("preempt", 1), ("finish", 0),
        ("admit", [([7, 7, 7, 7, 7, 7, 7, 7, 2], None, 12)]),
        ("readmit", 0, 12),
    ]
    for op in script:
        model.run(op)
        model.check()
    assert model.bm.prefix_hits > 0
    assert sum(b.generation for b in model.bm.blocks) > 0  # cached blocks were evicted


# ---- costs linear in the prompt ------------------------------------------------------------
class CountingList(list):
    """A token list that counts the elements its slices and joins touch."""

    touched = 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            CountingList.touched += len(range(*i.indices(len(self))))
        return list.__getitem__(self, i)

    def __add__(self, other):
        CountingList.touched += len(self) + len(other)
        return list.__add__(self, other)


def test_hashing_looking_up_and_registering_a_long_prompt_is_linear():
    """A 64k-token prompt was hashed by joining every token once per block (~0.8 s), and
    looked up the same way every step it waited: each block now reads only its own tokens."""
    bs, length = 16, 8192
    bm = BlockManager(length // bs + 8, bs)
    seq = make_seq(0, [])
    seq.prompt_token_ids = CountingList(range(length))
    seq.output_token_ids = CountingList([1, 2, 3])
    CountingList.touched = 0
    assert bm.find_cached_prefix(seq) == []
    assert compute(bm, seq, seq.num_tokens)
    other = make_seq(1, [])
    other.prompt_token_ids = CountingList(range(length))
    assert len(bm.find_cached_prefix(other)) == (length - 1) // bs
    assert CountingList.touched <= 6 * length, CountingList.touched
    assert seq.tokens_slice(length - 2, length + 5) == [length - 2, length - 1, 1, 2, 3]


def test_running_outputs_are_views_and_finished_ones_lists():
    """make_output runs for every request every step: a running request's token ids, logprobs
    and token times are O(1) Prefix views (a copy of each was O(length) a step), fixed at the
    length they had; a finished request's are plain lists."""
    from pagellm.outputs import Prefix

    items = [1, 2, 3]
    view = Prefix(items)
    items.append(4)
    assert len(view) == 3 and view == [1, 2, 3] and list(view) == [1, 2, 3]
    assert view[-1] == 3 and view[1:] == [2, 3] and view[::-1] == [3, 2, 1]
    with pytest.raises(IndexError):
        view[3]
    assert repr(view) == "[1, 2, 3]" and view != [1, 2, 3, 4]
