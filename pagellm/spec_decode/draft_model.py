"""Draft-model proposer: a smaller model with the target's tokenizer proposes k tokens by
decoding autoregressively over its own paged KV cache.

For each target sequence the draft keeps a shadow Sequence that shares the target's token lists
(so accepted tokens appear in both at once) and has its own block table and computed count.
After verification the shadow's cache is rolled back to what the target accepted.
"""
from __future__ import annotations

import time

import torch

from pagellm.engine.block_manager import BlockManager
from pagellm.engine.model_runner import ModelRunner
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.sampling.sampler import SamplingRow, argmax_rows, draw_rows, processed_logits
from pagellm.sequence import Sequence
from pagellm.spec_decode.base import Proposal, Proposer
from pagellm.structured import batch_masks


class DraftModelProposer(Proposer):
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, eos_token_id: int | set[int] | None, max_model_len: int,
                 enable_prefix_caching: bool = True):
        self._init_rounds(model, eos_token_id, max_model_len, device)
        # Prefix-cached like the target's: a request that shares a prefix with an earlier one
        # (a system prompt, the earlier turns of a chat) catches the draft up on the rest only.
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device)

    @property
    def own_runner(self) -> ModelRunner:
        """The runner of the draft's own KV cache (its share of the memory budget)."""
        return self.runner

    def _init_rounds(self, model, eos_token_id, max_model_len: int,
                     device: torch.device) -> None:
        """What the proposal rounds use, whichever cache the draft writes to."""
        self.model = model
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.shadows: dict[int, Sequence] = {}
        # unseeded requests' draws, on the draft's device (see LLMEngine._rng)
        self.rng = torch.Generator(device=device).manual_seed(1234)
        self.last_rounds = 0  # proposal rounds of the latest propose() call
        self.last_seconds = 0.0
        self.last_catchup_seconds = 0.0  # its rounds that caught a shadow up on context
        # A head limited to its first ids also scores the ids past the limit that a request's
        # own text holds: seq -> (its tokens read so far, those ids)
        self._past_limit: dict[int, tuple[int, set[int]]] = {}

    @property
    def has_cost(self) -> bool:
        return True

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids,
                              seq.params, seq.eos_token_id, cache_salt=seq.cache_salt)
            shadow.output_token_ids = seq.output_token_ids  # shared: accepted tokens show up
            self.shadows[seq.seq_id] = shadow
        return shadow

    def _start(self, seq: Sequence, k: int) -> Sequence | None:
        """The shadow that proposes k tokens for seq this step (None: none this step)."""
        return self._shadow(seq)

    def _room(self, shadow: Sequence, n: int) -> bool:
        """Cache slots for the shadow's next n tokens (its catch-up, then one per round). A
        new shadow takes its cached prefix first (its computed count moves past it)."""
        bm = self.block_manager
        if not shadow.block_table and shadow.num_computed_tokens == 0:
            cached = bm.find_cached_prefix(shadow)
            return bm.allocate_slots(shadow, n - len(cached) * bm.block_size, cached)
        return bm.allocate_slots(shadow, n)

    def _written(self, ok: bool) -> None:
        """After a round's forward: the prefix-cache blocks registered for it hold their KV
        (ok), or never will (the forward failed: out of the cache, so no later request reads
        them; the caller releases the shadows)."""
        if ok:
            self.block_manager.commit()
        else:
            self.block_manager.drop_uncommitted()

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        start = time.perf_counter()
        proposals = {s.seq_id: Proposal([], None) for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        active = [(s, shadow, k) for s, k in zip(seqs, num_tokens)
                  if k > 0 and (shadow := self._start(s, k)) is not None]
        rounds, catchup = 0, 0.0
        while active:
            round_start = time.perf_counter()
            batch, counts = [], []
            for seq, shadow, k in active:
                if self._room(shadow, shadow.num_tokens_to_compute):
                    batch.append((seq, shadow, k))
                    counts.append(shadow.num_tokens_to_compute)  # past a cached prefix
                else:
                    self.release(seq)  # no room for its draft KV: no proposals this step
            if not batch:
                break
            out = SchedulerOutput([b[1] for b in batch], counts)
            rows = list(torch.tensor(counts).cumsum(0) - 1)
            not_own = self._score_own_text([b[0] for b in batch])
            try:
                # a grammar masks the request's proposals (the shadow has none of its own):
                # its rows need logits right beyond their argmax
                logits = self.runner.execute(
                    out, [int(r) for r in rows],
                    constrained=[b[0].constraint is not None for b in batch])
            except BaseException:
                self._written(False)
                raise
            self._written(True)
            if not_own is not None:
                logits = logits.index_put(tuple(t.to(logits.device) for t in not_own),
                                          torch.tensor(float("-inf"), dtype=logits.dtype,
                                                       device=logits.device))
            # A first round feeds 1 token, or 2 after a step that accepted every proposal (the
            # last proposal and the target's own token): a proposal round's cost. More is a
            # shadow catching up on context (a prompt, or tokens emitted while it was off).
            if max(counts) > 2:
                catchup += time.perf_counter() - round_start
            else:
                rounds += 1
            for (seq, shadow, _), n in zip(batch, counts):
                shadow.num_computed_tokens += n
            stopped = self._sample_round(batch, logits, probs)
            active = [(s, sh, k) for s, sh, k in batch
                      if len(sh.spec_token_ids) < k and s.seq_id not in stopped]
        for seq in seqs:
            shadow = self.shadows.get(seq.seq_id)
            if shadow is not None and shadow.spec_token_ids:
                q = torch.stack(probs[seq.seq_id]) if not seq.params.greedy else None
                proposals[seq.seq_id] = Proposal(list(shadow.spec_token_ids), q)
        # proposal rounds and their time; catch-up rounds (a prompt, or tokens emitted while
        # the draft was off) apart: the controller prices k by proposal rounds alone
        self.last_rounds = rounds
        self.last_seconds = time.perf_counter() - start - catchup
        self.last_catchup_seconds = catchup
        return [proposals[s.seq_id] for s in seqs]

    def _score_own_text(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A draft head limited to its first n ids (draft_vocab_size) also scores every id
        past n that these requests' prompts and outputs hold, and the end-of-sequence ids:
        the names in code being edited, the words of a question. Read incrementally: each
        token once per request. Returns the (rows, ids) of the union that a sampled row's own
        text does not hold, for the caller to mask: a sampled request's q, and so its seeded
        draws, are then the same beside any other requests (a greedy row's proposals may take
        the union's ids: its output is the target's argmax either way)."""
        limit = getattr(self.model, "vocab_limit", None)
        if limit is None:
            return None
        eos = self.eos_token_id
        eos_ids = {e for e in ((eos,) if isinstance(eos, int) else eos or ()) if e >= limit}
        ids, own = set(eos_ids), []
        for seq in seqs:
            read, past = self._past_limit.get(seq.seq_id, (0, set()))
            n_prompt = len(seq.prompt_token_ids)
            if read < n_prompt:
                past.update(t for t in seq.prompt_token_ids[read:] if t >= limit)
                read = n_prompt
            past.update(t for t in seq.output_token_ids[read - n_prompt:] if t >= limit)
            self._past_limit[seq.seq_id] = (seq.num_tokens, past)
            ids |= past
            own.append(past)
        self.model.also_score(torch.tensor(sorted(ids), dtype=torch.int64) if ids else None)
        rows, cols = [], []
        for i, (seq, past) in enumerate(zip(seqs, own)):
            others = sorted(ids - past - eos_ids) if not seq.params.greedy else ()
            rows += [i] * len(others)
            cols += others
        return (torch.tensor(rows), torch.tensor(cols)) if rows else None

    def _sample_round(self, batch, logits: torch.Tensor, probs) -> set[int]:
        """Draws this round's proposals; returns the sequences that stop proposing."""
        rows = [SamplingRow(seq.params, seq.prompt_token_ids,
                            seq.output_token_ids + shadow.spec_token_ids,
                            seq.generator or self.rng, self.eos_token_id)
                for seq, shadow, _ in batch]
        # Structured outputs: q under the grammar's mask after this round's earlier proposals,
        # as verification masks p.
        constrained = [i for i, (seq, _, _) in enumerate(batch) if seq.constraint is not None]
        for i, m in zip(constrained, batch_masks([(batch[i][0].constraint, batch[i][1].spec_token_ids)
                                                  for i in constrained])):
            rows[i].grammar_bias = m.bias[-1]
        proc = processed_logits(logits, rows)
        # A row with nothing left to draw (a grammar that allows only ids beyond the draft's
        # vocabulary limit): that sequence proposes no more this step. Only a mask can do it.
        dead = (~proc[constrained].isfinite().any(-1)).nonzero().flatten().tolist() if constrained else []
        stopped = {batch[constrained[i]][0].seq_id for i in dead}
        live = [i for i, (seq, _, _) in enumerate(batch) if seq.seq_id not in stopped]
        sampled = [i for i in live if not batch[i][0].params.greedy]
        tokens = argmax_rows(proc)  # greedy rows' proposals
        if sampled:  # one batched draw; the tokens reach the host in one transfer
            idx = torch.tensor(sampled, device=proc.device)
            q = proc[idx].softmax(dim=-1)
            tokens[idx] = draw_rows(q, [rows[i].generator for i in sampled])
            for j, i in enumerate(sampled):
                probs[batch[i][0].seq_id].append(q[j])
        tokens = tokens.tolist()
        for i in live:
            batch[i][1].spec_token_ids.append(tokens[i])
        return stopped

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            return
        shadow.spec_token_ids = []
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, num_valid)
        self.block_manager.truncate(shadow, shadow.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        self._past_limit.pop(seq.seq_id, None)
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.forget(shadow)


class EarlyExitModel:
    """The target's own first N layers, final norm and LM head, called as a model: the same
    modules (no copy of the weights), bound to the target's KV cache."""

    def __init__(self, target, num_layers: int):
        self.target, self.config = target, target.config
        self.layers = target.layers[:num_layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, md,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.target(input_ids, positions, md, num_layers=len(self.layers),
                           out_rows=out_rows)

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        return self.target.compute_logits(hidden, argmax_only=argmax_only)

    def argmax_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.argmax_ids(hidden)


class EarlyExitProposer(DraftModelProposer):
    """A draft made of the target's first N layers (self-speculation, as with early-exit
    models), sharing the target's weights and its KV cache: the first N layers' KV of the
    context is the target's own, so the draft never catches up on a context (a separate draft
    prefills each request's whole context at its first proposals, ~1.5 ms per token on one
    core for 8 of the default model's 30 layers), and it costs no memory of its own.

    The draft writes its rounds' KV (first N layers) into the slots verification is about to
    fill, which the target's scheduler reserves before the draft runs (`Scheduler.reserve`;
    `schedule` then returns those its token budget leaves unverified); verification
    overwrites them with the same values, and the scheduler's rollback returns what was
    rejected."""

    def __init__(self, target, num_layers: int, eos_token_id, max_model_len: int):
        self._init_rounds(EarlyExitModel(target, num_layers), eos_token_id, max_model_len,
                          target.norm.weight.device)
        self.scheduler = None
        self.runner: ModelRunner | None = None

    @property
    def own_runner(self) -> None:
        return None  # the target's cache and weights: no memory of its own

    def bind_target(self, scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = ModelRunner.over_bound_caches(self.model, runner)

    def _start(self, seq: Sequence, k: int) -> Sequence | None:
        # Slots for the last token and the k proposals, as the scheduler will schedule them.
        if not self.scheduler.reserve(seq, 1 + k):
            return None
        # A shared partly filled block (n > 1 siblings) was just copied for seq: the copy
        # must hold the context before the draft reads it.
        self.runner.copy_blocks(self.scheduler.take_pending_copies())
        shadow = self._shadow(seq)
        shadow.block_table = seq.block_table
        shadow.num_computed_tokens = seq.num_computed_tokens
        shadow.spec_token_ids = []
        return shadow

    def _room(self, shadow: Sequence, n: int) -> bool:
        return True  # taken in _start

    def _written(self, ok: bool) -> None:
        pass  # the target's cache: its engine commits (or drops) the step's blocks

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is not None:
            shadow.spec_token_ids = []

    def release(self, seq: Sequence) -> None:
        self.shadows.pop(seq.seq_id, None)  # the blocks are the target's
