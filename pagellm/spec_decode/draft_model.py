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
from pagellm.sampling.sampler import SamplingRow, draw, processed_logits
from pagellm.sequence import Sequence
from pagellm.spec_decode.base import Proposal, Proposer


class DraftModelProposer(Proposer):
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, eos_token_id: int | set[int] | None, max_model_len: int):
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device)
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.shadows: dict[int, Sequence] = {}
        self.rng = torch.Generator().manual_seed(1234)
        self.last_rounds = 0  # forward rounds of the latest propose() call
        self.last_seconds = 0.0

    @property
    def has_cost(self) -> bool:
        return True

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.prompt_token_ids,
                              seq.params, seq.eos_token_id)
            shadow.output_token_ids = seq.output_token_ids  # shared: accepted tokens show up
            self.shadows[seq.seq_id] = shadow
        return shadow

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        start = time.perf_counter()
        proposals = {s.seq_id: Proposal([], None) for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        active = [(s, self._shadow(s), k) for s, k in zip(seqs, num_tokens) if k > 0]
        rounds = 0
        while active:
            batch, counts = [], []
            for seq, shadow, k in active:
                n = shadow.num_tokens_to_compute  # catch-up, then one token per round
                if self.block_manager.allocate_slots(shadow, n):
                    batch.append((seq, shadow, k))
                    counts.append(n)
                else:
                    self.release(seq)  # no room for its draft KV: no proposals this step
            if not batch:
                break
            out = SchedulerOutput([b[1] for b in batch], counts)
            rows = list(torch.tensor(counts).cumsum(0) - 1)
            logits = self.runner.execute(out, [int(r) for r in rows])
            rounds += 1
            for (seq, shadow, _), n in zip(batch, counts):
                shadow.num_computed_tokens += n
            self._sample_round(batch, logits, probs)
            active = [(s, sh, k) for s, sh, k in batch if len(sh.spec_token_ids) < k]
        for seq in seqs:
            shadow = self.shadows.get(seq.seq_id)
            if shadow is not None and shadow.spec_token_ids:
                q = torch.stack(probs[seq.seq_id]) if not seq.params.greedy else None
                proposals[seq.seq_id] = Proposal(list(shadow.spec_token_ids), q)
        self.last_rounds, self.last_seconds = rounds, time.perf_counter() - start
        return [proposals[s.seq_id] for s in seqs]

    def _sample_round(self, batch, logits: torch.Tensor, probs) -> None:
        rows = [SamplingRow(seq.params, seq.prompt_token_ids,
                            seq.output_token_ids + shadow.spec_token_ids,
                            seq.generator or self.rng, self.eos_token_id)
                for seq, shadow, _ in batch]
        proc = processed_logits(logits, rows)
        for i, (seq, shadow, _) in enumerate(batch):
            if seq.params.greedy:
                token = int(proc[i].argmax())
            else:
                q = proc[i].softmax(dim=-1)
                token = draw(q, rows[i].generator)
                probs[seq.seq_id].append(q)
            shadow.spec_token_ids.append(token)

    def on_verified(self, seq: Sequence) -> None:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            return
        shadow.spec_token_ids = []
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, seq.num_computed_tokens)
        self.block_manager.truncate(shadow, shadow.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.forget(shadow)
