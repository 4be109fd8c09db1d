"""The real Scheduler and BlockManager driven by a fake model runner (no model).

The fake "model" samples a token that is a pure function of the sequence's tokens, so a request
that is preempted and recomputed must end with exactly the tokens it gets when it runs alone.
It also keeps a model of the KV cache (slot -> the token prefix whose KV it holds) and checks,
after every step, that every computed position of every running sequence holds its own prefix.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.engine.block_manager import BlockManager
from pagellm.engine.scheduler import Scheduler, SchedulerOutput
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence, SequenceStatus


def next_token(tokens: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % 97


class FakeEngine:
    """What LLMEngine.step does, minus the model: schedule, 'compute', sample, finish."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 1024, enable_prefix_caching: bool = False):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        self.bs = block_size
        self.kv: dict[int, tuple[int, ...]] = {}
        self.finished: list[Sequence] = []
        self.history: list[SchedulerOutput] = []
        self._ids = 0

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        seq = Sequence(self._ids, f"r{self._ids}", 0, list(prompt),
                       SamplingParams(max_tokens=max_tokens), None)
        self._ids += 1
        self.sched.add(seq)
        return seq

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def step(self) -> SchedulerOutput:
        sched, bm = self.sched, self.bm
        before_waiting = list(sched.waiting)
        refs_before = [b.ref_cnt for b in bm.blocks]
        tables_before = {s.seq_id: list(s.block_table) for s in sched.running}
        out = sched.schedule()
        self.history.append(out)
        # -- the step's contract ---------------------------------------------------------------
        assert out.total_tokens <= sched.max_num_batched_tokens
        assert all(n > 0 for n in out.num_tokens)
        assert len(sched.running) <= sched.max_num_seqs
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        for seq, n in zip(out.seqs, out.num_tokens):
            assert seq.status == SequenceStatus.RUNNING and seq in sched.running
            assert n <= seq.num_tokens_to_compute
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens + n)
        for v in out.preempted:
            assert v not in out.seqs and v not in sched.running
            assert v.block_table == [] and v.num_computed_tokens == 0
            assert v.status == SequenceStatus.WAITING
        # Blocks the victims shared with sequences that stay lose exactly the victims' references.
        victim_refs = Counter(b for v in out.preempted for b in tables_before[v.seq_id])
        for b, n in victim_refs.items():
            if refs_before[b] > n:
                assert bm.blocks[b].ref_cnt == refs_before[b] - n
        if out.preempted:
            # Victims go to the head of the queue, oldest first; nothing new is admitted.
            k = len(out.preempted)
            assert list(sched.waiting)[:k] == list(reversed(out.preempted))
            assert list(sched.waiting)[k:] == before_waiting
        # -- the "forward" ---------------------------------------------------------------------
        for seq, n in zip(out.seqs, out.num_tokens):
            tokens = seq.tokens_slice(0, seq.num_computed_tokens + n)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[self.slot(seq, pos)] = tuple(tokens[: pos + 1])
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: sample one token
                seq.output_token_ids.append(next_token(seq.token_ids))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    sched.remove(seq)
                    self.finished.append(seq)
        self.check()
        return out

    def check(self) -> None:
        bm = self.bm
        bm.check_invariants([s.block_table for s in self.sched.running])
        for s in self.sched.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0
        for s in self.sched.running:
            for pos in range(s.num_computed_tokens):
                assert self.kv[self.slot(s, pos)] == tuple(s.token_ids[: pos + 1]), (s.seq_id, pos)

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            out = self.step()
            assert out.seqs, "nothing scheduled although every request fits the pool"
            steps += 1
            assert steps < max_steps, "no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        return steps


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


# ---- scripted -----------------------------------------------------------------------------
def test_first_step_fills_the_token_budget_in_arrival_order():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    a, b, c = (eng.add(list(range(10)), 4), eng.add(list(range(20, 32)), 4),
               eng.add(list(range(40, 45)), 4))
    out = eng.step()
    assert out.seqs == [a, b] and out.num_tokens == [10, 6]  # b's prompt is chunked
    assert list(eng.sched.waiting) == [c]
    # A mid-prompt chunk samples nothing.
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    out = eng.step()
    # Running first (a decodes 1, b finishes its prompt with 6); c's 5-token prompt fits in
    # the 9 left.
    assert out.seqs == [a, b, c] and out.num_tokens == [1, 6, 5]
    out = eng.step()
    assert out.num_tokens == [1, 1, 1]


def test_chunked_prefill_splits_a_long_prompt():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    s = eng.add(list(range(30)), 3)
    chunks, tables = [], []
    while eng.sched.has_unfinished():
        out = eng.step()
        chunks.append(out.num_tokens)
        tables.append(len(s.block_table))
    assert chunks == [[8], [8], [8], [6], [1], [1]]
    # Blocks follow the chunks: 2, 4, 6, 8 blocks for 8, 16, 24, 30 tokens; decode of positions
    # 30 and 31 stays in block 8; the request is then gone.
    assert tables == [2, 4, 6, 8, 8, 0]
    assert s.output_token_ids == expected_output(list(range(30)), 3)


def test_max_num_seqs_is_respected_and_waiting_is_fcfs():
    eng = FakeEngine(num_blocks=256, block_size=4, max_num_seqs=3)
    seqs = [eng.add([i] * 5, 2 + i % 3) for i in range(7)]
    admitted: list[Sequence] = []
    while eng.sched.has_unfinished():
        out = eng.step()
        assert len(eng.sched.running) <= 3 and len(out.seqs) <= 3
        admitted += [s for s in out.seqs if s not in admitted]
    assert admitted == seqs
    assert [s.output_token_ids for s in seqs] == [expected_output([i] * 5, 2 + i % 3)
                                                  for i in range(7)]


def test_requests_join_and_leave_at_every_step():
    # One request arrives per step and each lives for three steps: from the third step on, every
    # step admits one and retires one, while the batch goes on.
    eng = FakeEngine(num_blocks=128, block_size=2, max_num_batched_tokens=64)
    rng = random.Random(0)
    wanted = {}
    for step in range(30):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(1, 9))]
        seq = eng.add(prompt, 3)
        wanted[seq.seq_id] = expected_output(prompt, 3)
        running_before = {s.seq_id for s in eng.sched.running}
        out = eng.step()
        running_after = {s.seq_id for s in eng.sched.running}
        assert seq in out.seqs and seq.seq_id in running_after  # joined at once
        left = running_before - running_after
        assert left == ({step - 2} if step >= 2 else set())
        assert eng.finished[-1].seq_id == step - 2 if step >= 2 else not eng.finished
        assert len(out.seqs) == min(step + 1, 3)
    eng.run()
    assert {s.seq_id: s.output_token_ids for s in eng.finished} == wanted


def test_preemption_takes_the_newest_and_it_recomputes_later():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each: the pool is full.
    eng = FakeEngine(num_blocks=6, block_size=4)
    prompts = [[1] * 7, [2] * 7, [3] * 7]
    a, b, c = (eng.add(p, 6) for p in prompts)
    out = eng.step()
    assert out.seqs == [a, b, c] and eng.bm.num_free_blocks == 0
    out = eng.step()  # position 7: still in block 1
    assert out.preempted == [] and out.num_tokens == [1, 1, 1]
    c_blocks = list(c.block_table)
    out = eng.step()  # position 8 opens block 2: a and b need one, c (newest) gives its two
    assert out.preempted == [c]
    assert out.seqs == [a, b] and out.num_tokens == [1, 1]
    assert a.block_table[2] in c_blocks and b.block_table[2] in c_blocks
    assert eng.sched.waiting[0] is c and c.status == SequenceStatus.WAITING
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == expected_output(prompts[2], 2)  # kept, to be recomputed
    assert eng.sched.num_preemptions == 1
    eng.run()
    assert [s.output_token_ids for s in (a, b, c)] == [expected_output(p, 6) for p in prompts]
    # c came back through the waiting queue and recomputed prompt + outputs in one chunk.
    recompute = [out.num_tokens[out.seqs.index(c)] for out in eng.history[3:] if c in out.seqs]
    assert recompute[0] == 7 + 2


def test_preemption_of_several_victims_keeps_their_order():
    eng = FakeEngine(num_blocks=8, block_size=2)
    seqs = [eng.add([i] * 4, 8) for i in range(4)]  # 2 full blocks each: pool full
    eng.step()
    # Position 4 opens a 3rd block for everyone: seq 0 takes one of seq 3's blocks, seq 1 the
    # other, seq 2 finds none and is itself the newest left. Oldest victim first in the queue.
    out = eng.step()
    assert out.preempted == [seqs[3], seqs[2]] and out.seqs == seqs[:2]
    assert list(eng.sched.waiting) == [seqs[2], seqs[3]]
    eng.run()
    assert [s.output_token_ids for s in seqs] == [expected_output([i] * 4, 8) for i in range(4)]


def test_a_sequence_that_preempts_itself_is_not_scheduled():
    # The newest sequence needs a block, none is free, and it is itself the newest: it goes back
    # to the queue while the older one runs on in the same step.
    eng = FakeEngine(num_blocks=3, block_size=2)
    a = eng.add([1], 4)  # 1 block
    b = eng.add([2, 2, 2, 2], 2)  # 2 blocks: the pool is full
    eng.step()
    out = eng.step()  # a computes position 1 (block 0); b's position 4 needs a 3rd block
    assert out.preempted == [b] and out.seqs == [a] and out.num_tokens == [1]
    assert list(eng.sched.waiting) == [b] and eng.sched.running == [a]
    eng.run()
    assert a.output_token_ids == expected_output([1], 4)
    assert b.output_token_ids == expected_output([2, 2, 2, 2], 2)


def test_lookahead_is_reserved_trimmed_and_rolled_back_by_the_scheduler():
    """Proposals are the scheduler's business end to end: slots reserved ahead (`reserve`,
    the early-exit draft), trimmed to the token budget in `schedule`, and after verification
    the rejected ones' slots returned (`rollback`); `on_release` hears of every sequence
    that leaves or is preempted."""
    released = []
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=3, on_release=released.append)
    seq = Sequence(0, "r0", 0, [1, 2, 3], SamplingParams(max_tokens=20), None)
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out)
    seq.output_token_ids.append(4)  # the prompt's token: 4 tokens, 3 with KV
    assert seq.num_computed_tokens == 3
    seq.spec_token_ids = [5, 6, 7, 8]
    assert sched.reserve(seq, 1 + 4)  # the last token and four proposals: 8 slots
    assert len(seq.block_table) == 4
    out = sched.schedule()  # a budget of 3: the last token and two proposals
    assert out.num_tokens == [3] and seq.spec_token_ids == [5, 6]
    assert len(seq.block_table) == 3  # the slot of positions 6-7 went back
    sched.advance(out)
    assert seq.num_computed_tokens == 6
    seq.output_token_ids += [5, 9]  # one proposal accepted, then the target's own token
    sched.rollback(seq)
    assert seq.spec_token_ids == [] and seq.num_computed_tokens == 5
    assert len(seq.block_table) == 3  # positions 0-5 (5 valid, 6 is the new token's)
    assert released == []
    other = Sequence(1, "r1", 0, [1] * 9, SamplingParams(max_tokens=4), None)
    sched.add(other)
    sched._preempt(seq, SchedulerOutput())
    sched.remove(other)
    assert released == [seq, other] and bm.num_free_blocks == bm.num_blocks
    sched.remove(seq)


# ---- random workloads: never a lost request ---------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 24),
       budget=st.integers(1, 40), max_num_seqs=st.integers(1, 6), caching=st.booleans())
def test_random_workloads_finish_every_request(data, block_size, num_blocks, budget,
                                               max_num_seqs, caching):
    eng = FakeEngine(num_blocks, block_size, max_num_seqs, budget, caching)
    capacity = num_blocks * block_size
    # Each request fits the pool on its own (prompt + outputs <= capacity).
    reqs = data.draw(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12),
                                        st.integers(1, 8), st.integers(0, 3)),
                              min_size=1, max_size=8))
    reqs = [(p[: capacity - 1], min(m, capacity - len(p[: capacity - 1])), at)
            for p, m, at in reqs]
    wanted = {}
    step = 0
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    while pending or eng.sched.has_unfinished():
        while pending and pending[0][1][2] <= step:
            _, (prompt, max_tokens, _) = pending.pop(0)
            seq = eng.add(prompt, max_tokens)
            wanted[seq.seq_id] = expected_output(prompt, max_tokens)
        if eng.sched.has_unfinished():
            out = eng.step()
            assert out.seqs or out.preempted
            assert out.seqs, "nothing scheduled although every request fits the pool"
        step += 1
        assert step < 2000
    assert {s.seq_id: s.output_token_ids for s in eng.finished} == wanted
    assert eng.bm.num_free_blocks == num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_heavy_preemption_loses_nothing(caching):
    rng = random.Random(1)
    eng = FakeEngine(num_blocks=10, block_size=2, max_num_batched_tokens=7,
                     enable_prefix_caching=caching)
    wanted = {}
    for _ in range(12):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        max_tokens = rng.randrange(1, 20 - len(prompt))
        wanted[eng.add(prompt, max_tokens).seq_id] = expected_output(prompt, max_tokens)
    eng.run()
    assert eng.sched.num_preemptions >= 5
    assert {s.seq_id: s.output_token_ids for s in eng.finished} == wanted
    if caching:
        assert eng.bm.prefix_hits > 0


# ---- on the engine ------------------------------------------------------------------------
def test_request_that_outgrows_the_whole_pool_ends_instead_of_cycling(tiny_llama):
    """Chunked prefill admits it piece by piece; once it needs more blocks than the pool has,
    preempting itself must not loop (recompute, outgrow, preempt, ...): it ends with 'length'."""
    from pagellm import LLM

    path, _ = tiny_llama
    # 4 blocks of 4 tokens (2 layers x K,V x 4 tokens x 2 kv heads x 16 dims x 4 bytes each)
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=4 * 2048,
              max_num_batched_tokens=8)
    eng = llm.engine
    assert eng.num_blocks == 4
    eng.add_request("r", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=30,
                                                            ignore_eos=True))
    outs = []
    for _ in range(100):
        outs += [o for o in eng.step() if o.finished]
        if not eng.has_unfinished_requests():
            break
    assert len(outs) == 1, "the request never finished"
    out = outs[0].outputs[0]
    # 16 positions have KV; the 17th token is the last one sampled: 7 outputs.
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 10 + 1
