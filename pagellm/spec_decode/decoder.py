"""Speculative decoding inside the engine step: propose before scheduling, verify after the
target's forward pass, and keep the statistics.

The engine's whole interface to speculation: `bind` once, then each step `propose`, `verify`
and `observe` (the step's times, for the controller); `release` is the scheduler's
`on_release` (a sequence left or was preempted). Slots for proposals and the rollback after
verification are the scheduler's (`Scheduler.reserve` / `schedule` / `rollback`).

The target scores each sequence's last real token plus its k proposals in one pass, giving
k + 1 rows of logits. The rejection sampler turns them into 1..k+1 emitted tokens, distributed
exactly as the target alone would emit them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagellm.sampling.rejection import rejection_sample
from pagellm.sampling.sampler import (SamplingRow, argmax_rows, logprobs_of, processed_logits,
                                      uniform_rows)
from pagellm.sequence import Sequence
from pagellm.spec_decode.adaptive import AdaptiveK
from pagellm.spec_decode.base import Proposal, Proposer
from pagellm.structured import batch_masks

logger = logging.getLogger("pagellm")


@dataclass
class SpecStats:
    max_k: int
    num_drafts: int = 0  # sequence-steps that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = [0] * self.max_k

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: accepted ones plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_per_position": list(self.accepted_per_position)}


@dataclass
class Verified:
    token_ids: list[int]
    logprobs: list[tuple[float, dict[int, float]] | None]


class SpecDecoder:
    def __init__(self, proposer: Proposer, max_k: int, adaptive: bool, max_model_len: int,
                 eos_token_id: int | set[int] | None):
        self.proposer = proposer
        self.max_k = max_k
        self.controller = AdaptiveK(max_k, enabled=adaptive, draft_cost=proposer.has_cost,
                                    scores_unverified=not proposer.has_cost)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.stats = SpecStats(max_k)
        self._q: dict[int, torch.Tensor | None] = {}
        self._step = (0, 0, 0)  # (decoding sequences, most proposals, all proposals) this step
        # Free proposers: per sequence, a proposal not verified (output index it was made at,
        # tokens), scored against the emitted tokens; and how many were scored so.
        self._unverified: dict[int, tuple[int, list[int], int]] = {}
        self._kind: dict[int, int] = {}  # kind of each sequence's proposal being verified
        self.num_unverified = 0
        self._verified = [0, 0]
        self._catchup = 0.0  # seconds of this step's draft catch-up (not a cost of k)
        self._free = False  # this step's proposals came without a draft round (lookup first)

    def bind(self, scheduler, runner, row_limit: int | None) -> None:
        """The target's scheduler and model runner, once built; row_limit: the most rows the
        target's few-row kernels take (layers.linear.packed_row_limit)."""
        self.proposer.bind_target(scheduler, runner)
        self.controller.row_limit = row_limit

    def draft_runner(self):
        """The model runner of a draft with a KV cache of its own (None: none)."""
        return self.proposer.own_runner

    def propose(self, running: list[Sequence]) -> None:
        """Attach proposals (`seq.spec_token_ids`) to every running sequence that is decoding
        (only its last token lacks KV). Proposal counts respect max_tokens and the context
        length. A failure costs only this step's proposals."""
        try:
            self._propose(running)
        except Exception:  # proposals are an optimisation: this step decodes without them
            logger.exception("speculative proposal failed; this step runs without proposals")
            for seq in running:
                self.release(seq)

    def _propose(self, running: list[Sequence]) -> None:
        # Decoding: only the newest token lacks KV, and the first token came from a plain step
        # (n > 1 siblings fork at that step).
        decoding = [s for s in running if s.num_tokens_to_compute == 1 and s.num_output_tokens]
        rooms = []
        for seq in decoding:
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            if seq.params.num_speculative_tokens is not None:  # the request's own cap
                room = min(room, seq.params.num_speculative_tokens)
            rooms.append(max(0, min(room, self.max_k)))
        if self.proposer.has_cost:
            ks = [min(k, r) for k, r in zip(self.controller.choose(decoding), rooms)]
            proposals = self.proposer.propose(decoding, ks)
            # a proposer may go past k where proposing is free (lookup first), never past room
            proposals = [p if len(p.token_ids) <= r else
                         Proposal(p.token_ids[:r], None if p.probs is None else p.probs[:r], p.kind)
                         for p, r in zip(proposals, rooms)]
            rounds = getattr(self.proposer, "last_rounds", 0)
            self.controller.observe_draft(rounds, getattr(self.proposer, "last_seconds", 0.0))
            # a catch-up is paid once per request (or per return from plain decoding), not
            # per step with k proposals: the step's wall is learnt without it
            self._catchup = getattr(self.proposer, "last_catchup_seconds", 0.0)
            if self._catchup:
                self.controller.observe_catchup(self._catchup)
            self._free = getattr(self.proposer, "last_free", False)
        else:
            # A free proposer (n-gram) proposes for everyone first: the controller then knows
            # who has a proposal, and those it holds back are scored against the tokens the
            # target emits instead (_score_unverified).
            self._score_unverified(decoding)
            full = self.proposer.propose(decoding, rooms)
            ks = self.controller.choose(decoding, [len(p.token_ids) for p in full],
                                        [p.kind for p in full])
            proposals = [Proposal(p.token_ids[:k], p.probs, p.kind) for p, k in zip(full, ks)]
            for seq, prop, k in zip(decoding, full, ks):
                # A proposal held back earlier stays until the emitted tokens settle it, also
                # while this step verifies another: dropping it then would count only those
                # rejected at once (a run that is being accepted is when speculation resumes),
                # and one-token matches, right in runs on copy prompts, looked useless
                # (0.22 acceptance on copy prompts when dropped, 0.67 when kept).
                if not k and prop.token_ids and seq.seq_id not in self._unverified:
                    self._unverified[seq.seq_id] = (seq.num_output_tokens, prop.token_ids,
                                                    prop.kind)
        proposals = [_within_grammar(seq, prop) for seq, prop in zip(decoding, proposals)]
        for seq, prop in zip(decoding, proposals):
            seq.spec_token_ids = list(prop.token_ids)
            if prop.token_ids:
                self._q[seq.seq_id] = prop.probs
                self._kind[seq.seq_id] = prop.kind
        self._step = (len(decoding), max((len(p.token_ids) for p in proposals), default=0),
                      sum(len(p.token_ids) for p in proposals))
        self._verified = [0, 0]  # this step's verified sequences and the tokens they emitted

    def _score_unverified(self, seqs: list[Sequence]) -> None:
        """Score proposals that were held back against what the target emitted since.
        Verification with a one-hot q accepts token x with probability p(x) (the processed
        distribution, greedy included), and plain decoding emits x with that same probability,
        at each position given the ones before: the count of leading matches is distributed
        as the count of accepted proposals. So the controller learns acceptance without
        paying for verification steps (a probe at batch 16 cost 2-3 plain steps)."""
        for seq in seqs:
            held = self._unverified.get(seq.seq_id)
            if held is None:
                continue
            start, prop, kind = held
            emitted = seq.output_token_ids[start:start + len(prop)]
            a = 0
            while a < len(emitted) and emitted[a] == prop[a]:
                a += 1
            if a < len(emitted) or a == len(prop):  # a rejection seen, or all accepted
                del self._unverified[seq.seq_id]
                self.num_unverified += 1
                self.controller.observe_acceptance(seq, len(prop), a, kind)

    def observe(self, num_seqs: int, seconds: float) -> None:
        """The whole step (proposing included) ran num_seqs sequences in `seconds`. Learnt
        only from steps where every sequence decodes: a prefill chunk's rows cost what
        verification rows do not."""
        decoding, k, rows = self._step
        if not num_seqs or num_seqs != decoding:
            return
        seqs, tokens = self._verified
        seconds -= self._catchup
        self._catchup = 0.0
        self.controller.observe_decode_step(decoding, seconds, k, decoding - seqs + tokens,
                                            rows, timed=not self._free)

    def verify(self, seqs: list[Sequence], logits: list[torch.Tensor],
               rng: torch.Generator) -> list[Verified]:
        """logits[i]: [1 + len(seqs[i].spec_token_ids), vocab] target logits of sequence i.
        Greedy and sampled sequences are each verified as one batch: tokens and acceptance
        counts reach the host in a fixed number of transfers a step, not one per sequence."""
        results: list[Verified | None] = [None] * len(seqs)
        # Structured outputs: the grammar's mask at every verified position, so p is the
        # target's distribution under the constraint (q was drawn under the same masks).
        bias: list[torch.Tensor | None] = [None] * len(seqs)
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None]
        for i, m in zip(constrained, batch_masks([(seqs[i].constraint, seqs[i].spec_token_ids)
                                                  for i in constrained])):
            bias[i] = m.bias
        for group, verify in ((lambda p: p.greedy, self._verify_greedy),
                              (lambda p: not p.greedy, self._verify_sampled)):
            idx = [i for i, s in enumerate(seqs) if group(s.params)]
            if idx:
                for i, v in zip(idx, verify([seqs[i] for i in idx], [logits[i] for i in idx],
                                            rng, [bias[i] for i in idx])):
                    results[i] = v
        return results

    def _rows(self, seq: Sequence, bias: torch.Tensor | None,
              generator: torch.Generator | None) -> list[SamplingRow]:
        """One sampling row per verified position: the proposals before it count as output."""
        spec = seq.spec_token_ids
        return [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + spec[:j],
                            generator, self.eos_token_id, None if bias is None else bias[j])
                for j in range(len(spec) + 1)]

    def _verify_greedy(self, seqs: list[Sequence], logits: list[torch.Tensor],
                       rng: torch.Generator, bias: list[torch.Tensor | None]) -> list[Verified]:
        """Greedy: p is one-hot at the argmax, so the rejection sampler accepts a proposal iff
        it is the argmax and always emits the argmax, whatever q is. The same result without
        its [k + 1, vocab] tensors (a batch-16 k=4 step built 30 MB of them)."""
        rows = [r for seq, b in zip(seqs, bias) for r in self._rows(seq, b, seq.generator)]
        best = argmax_rows(processed_logits(torch.cat(logits), rows)).tolist()
        verified, offset = [], 0
        for seq in seqs:
            spec = seq.spec_token_ids
            a = 0
            while a < len(spec) and spec[a] == best[offset + a]:
                a += 1
            verified.append(spec[:a] + [best[offset + a]])
            offset += len(spec) + 1
            self._q.pop(seq.seq_id, None)
        return self._finish(seqs, logits, verified)

    def _verify_sampled(self, seqs: list[Sequence], logits: list[torch.Tensor],
                        rng: torch.Generator,
                        bias: list[torch.Tensor | None]) -> list[Verified]:
        k = max(len(s.spec_token_ids) for s in seqs)
        vocab, dev = logits[0].shape[-1], logits[0].device
        batch = len(seqs)
        p = torch.zeros(batch, k + 1, vocab, device=dev)
        q = torch.zeros(batch, k, vocab, device=dev) if k else None
        # Proposals built on the host, one copy; per sequence k uniforms for the accept tests
        # and the final draw's noise in one draw from its generator (uniform_rows: one copy
        # per generator device)
        draft_ids = torch.zeros(batch, k, dtype=torch.long)
        for b, seq in enumerate(seqs):
            draft_ids[b, : len(seq.spec_token_ids)] = torch.tensor(seq.spec_token_ids)
        draft_ids = draft_ids.to(dev)
        u = uniform_rows([seq.generator or rng for seq in seqs], k + vocab, dev)
        uniforms, noise = u[:, :k], u[:, k:].log().neg_()
        for b, (seq, rows_logits) in enumerate(zip(seqs, logits)):
            spec = seq.spec_token_ids
            proc = processed_logits(rows_logits, self._rows(seq, bias[b], seq.generator or rng))
            p[b, : len(spec) + 1] = proc.softmax(dim=-1)
            q_seq = self._q.pop(seq.seq_id, None)
            if q is not None and spec:
                if q_seq is None:  # one-hot proposals (n-gram, or greedy drafts)
                    q[b, torch.arange(len(spec), device=dev), draft_ids[b, : len(spec)]] = 1.0
                else:
                    q[b, : len(spec)] = q_seq[: len(spec)]
        num_draft = torch.tensor([len(s.spec_token_ids) for s in seqs], device=dev)
        accepted, final = rejection_sample(p, draft_ids, num_draft, q, uniforms, noise)
        accepted, final = torch.stack((accepted, final)).tolist()
        verified = [seq.spec_token_ids[:a] + [f] for seq, a, f in zip(seqs, accepted, final)]
        return self._finish(seqs, logits, verified)

    def _finish(self, seqs: list[Sequence], logits: list[torch.Tensor],
                verified: list[list[int]]) -> list[Verified]:
        """Records each sequence's acceptance and attaches the emitted tokens' logprobs (one
        batch over the sequences that asked for them)."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        lps: dict[int, list] = {}
        if want:
            rows = torch.cat([logits[i][: len(verified[i])] for i in want])
            tokens = [t for i in want for t in verified[i]]
            tops = [seqs[i].params.logprobs for i in want for _ in verified[i]]
            flat = logprobs_of(torch.log_softmax(rows.float(), dim=-1), tokens, tops)
            offset = 0
            for i in want:
                lps[i] = flat[offset: offset + len(verified[i])]
                offset += len(verified[i])
        results = []
        for i, (seq, tokens) in enumerate(zip(seqs, verified)):
            results.append(Verified(tokens, lps.get(i, [None] * len(tokens))))
            self._record(seq, len(seq.spec_token_ids), len(tokens) - 1)
        return results

    def _record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        # What the draft's own cache keeps: the context and the accepted proposals.
        self.proposer.on_verified(seq, seq.num_tokens + num_accepted)
        self._verified[0] += 1
        self._verified[1] += num_accepted + 1
        if num_draft == 0:
            return
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_draft
        self.stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.stats.accepted_per_position[j] += 1
        self.controller.observe_acceptance(seq, num_draft, num_accepted,
                                           self._kind.pop(seq.seq_id, 0))

    def release(self, seq: Sequence) -> None:
        seq.spec_token_ids = []
        self._q.pop(seq.seq_id, None)
        self._kind.pop(seq.seq_id, None)
        self._unverified.pop(seq.seq_id, None)
        self.proposer.release(seq)
        self.controller.forget(seq)


def _within_grammar(seq: Sequence, prop: Proposal) -> Proposal:
    """A proposal cut before its first token the sequence's grammar forbids. Exact: such a
    token has p = 0 under the mask and would be rejected; the cut only removes proposals that
    are deterministic given the context (n-gram, greedy drafts): a sampled draft draws from
    the masked q and never proposes one."""
    if seq.constraint is None or not prop.token_ids:
        return prop
    n = seq.constraint.valid_prefix(prop.token_ids)
    if n == len(prop.token_ids):
        return prop
    return Proposal(prop.token_ids[:n], None if prop.probs is None else prop.probs[:n], prop.kind)
