"""The token-budget loop: continuous batching, chunked prefill, preemption by recompute.

Each step hands the model runner `{sequence: number of tokens to compute now}`. Running
sequences go first (oldest first), then waiting ones are admitted while budget, sequence slots
and blocks last. When a running sequence cannot get a block, the newest running sequence is
preempted: its blocks go back to the pool and it waits to recompute its tokens later.

Speculative proposals are tokens to compute like any other (`Sequence.spec_token_ids`): the
scheduler alone takes their slots (in `schedule`, or ahead of it through `reserve` for a
proposer that writes the lookahead's KV into this cache), returns those its budget leaves
unverified, and rolls a sequence back after verification (`rollback`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagellm.engine.block_manager import BlockManager
from pagellm.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # Scheduled sequences in batch order, and how many tokens each computes this step.
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int,
                 on_release: Callable[[Sequence], None] | None = None):
        self.block_manager = block_manager
        # Called when a sequence leaves (finished, aborted) or is preempted: whoever keeps
        # state per sequence beside the scheduler (speculation) drops it there.
        self.on_release = on_release
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.forget(seq)
        if self.on_release is not None:
            self.on_release(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Take the slots of seq's next num_tokens tokens now, before `schedule` (a proposer
        that writes its proposals' KV into this cache: the early-exit draft). `schedule` finds
        them taken and returns those its token budget leaves unverified. False: no room."""
        return self.block_manager.allocate_slots(seq, num_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies the runner must make before the next forward."""
        return self.block_manager.take_pending_copies()

    def advance(self, out: SchedulerOutput) -> None:
        """The step's forward ran: each sequence's computed count catches up."""
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n

    def rollback(self, seq: Sequence) -> None:
        """After verification, seq's KV is valid up to its last accepted proposal (every
        token but the newest); the slots of the rejected ones return."""
        seq.spec_token_ids = []
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq, seq.num_computed_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num = min(seq.num_tokens_to_compute, budget)
            if num <= 0:
                i += 1
                continue
            if seq.spec_token_ids and num < seq.num_tokens_to_compute:
                # Out of budget for all proposals: verify only those that fit, and return the
                # slots of the others if they were reserved ahead (`reserve`).
                fit = num - (seq.num_tokens - seq.num_computed_tokens)
                seq.spec_token_ids = seq.spec_token_ids[: max(fit, 0)]
                self.block_manager.truncate(seq, seq.num_computed_tokens + num)
            while not self.block_manager.allocate_slots(seq, num):
                victim = self.running.pop()  # newest first
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_tokens.append(num)
                budget -= num
                i += 1
                continue
            break  # seq itself was preempted: nothing after it is left to schedule
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num = min(seq.num_tokens_to_compute - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate_slots(seq, num, cached):
                break  # keep FCFS order: the head waits until blocks come back
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(num)
            budget -= num

    def recompute(self, seq: Sequence) -> None:
        """Send a running sequence back to the head of the queue to recompute its tokens (its
        cached prefix was dropped by a failed step)."""
        self.running.remove(seq)
        self._preempt(seq, SchedulerOutput())

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
