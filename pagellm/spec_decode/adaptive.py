"""Chooses how many tokens to speculate each step, so that speculation never makes decoding slower.

Model of a step: the target's forward over n tokens takes T(n) = a + b * n seconds (a: reading
the weights, b: per-token compute), fitted online by least squares with forgetting. A proposal
round of the draft model takes D seconds (0 for n-gram lookup). With acceptance rate alpha, k
proposals emit on average E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per sequence.

For B decoding sequences, k proposals each give throughput
    B * E(k) / (a + b * B * (k + 1) + k * D)   vs   B / (a + b * B) without speculation,
so k = argmax of that ratio; k = 0 when nothing beats plain decoding. At batch 1 on a
memory-bound machine a >> b and speculation pays; at large batches b * B dominates and it
switches itself off. A sequence whose own acceptance is too low to pay for its extra tokens
gets no proposals. While off, a probe round (k = 1) now and then refreshes the estimates so
that speculation resumes when it pays again.
"""
from __future__ import annotations

from pagellm.sequence import Sequence

_EMA = 0.2  # weight of a new observation in acceptance estimates
_PROBE_EVERY = 16  # steps between probes while speculation is off


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 0.999:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class StepTimeModel:
    """Least-squares fit of T(n) = a + b n with exponential forgetting."""

    def __init__(self, forget: float = 0.95):
        self.forget = forget
        self.s1 = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, n: int, seconds: float) -> None:
        f = self.forget
        self.s1 = f * self.s1 + 1
        self.sx = f * self.sx + n
        self.sy = f * self.sy + seconds
        self.sxx = f * self.sxx + n * n
        self.sxy = f * self.sxy + n * seconds

    def coefficients(self) -> tuple[float, float] | None:
        det = self.s1 * self.sxx - self.sx ** 2
        if self.s1 < 3 or det <= 1e-9 * max(self.sxx, 1.0):
            return None  # not enough spread in n yet
        b = (self.s1 * self.sxy - self.sx * self.sy) / det
        a = (self.sy - b * self.sx) / self.s1
        return max(a, 1e-6), max(b, 0.0)


class AdaptiveK:
    def __init__(self, max_k: int, enabled: bool = True, prior_alpha: float = 0.6,
                 prior_b_over_a: float = 1 / 32):
        self.max_k = max_k
        self.enabled = enabled
        self.alpha = prior_alpha
        self.seq_alpha: dict[int, float] = {}
        self.step_time = StepTimeModel()
        self.prior_b_over_a = prior_b_over_a
        self.draft_round_time = 0.0  # seconds per draft forward round (EMA)
        self._steps_off = 0

    # ---- observations ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_time.observe(num_tokens, seconds)

    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds:
            per = seconds / rounds
            self.draft_round_time = per if not self.draft_round_time else (
                (1 - _EMA) * self.draft_round_time + _EMA * per)

    def observe_acceptance(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        # Per-proposal acceptance: accepted / tried (the first rejection ends the tries).
        tried = min(num_accepted + 1, num_draft)
        rate = num_accepted / tried
        self.alpha = (1 - _EMA) * self.alpha + _EMA * rate
        prev = self.seq_alpha.get(seq.seq_id, self.alpha)
        self.seq_alpha[seq.seq_id] = (1 - _EMA) * prev + _EMA * rate

    def forget(self, seq: Sequence) -> None:
        self.seq_alpha.pop(seq.seq_id, None)

    # ---- the decision ----------------------------------------------------------------------
    def _cost(self, batch: int, k: int) -> float:
        coef = self.step_time.coefficients()
        if coef is None:  # until timings arrive: a prior, in units of a
            return 1.0 + self.prior_b_over_a * batch * (k + 1)
        a, b = coef
        return a + b * batch * (k + 1) + k * self.draft_round_time

    def choose(self, seqs: list[Sequence]) -> list[int]:
        """Proposal count for each decoding sequence this step."""
        if not seqs:
            return []
        if not self.enabled:
            return [self.max_k] * len(seqs)
        batch = len(seqs)
        alphas = [self.seq_alpha.get(s.seq_id, self.alpha) for s in seqs]
        base = batch / self._cost(batch, 0)
        best_k, best = 0, base
        for k in range(1, self.max_k + 1):
            rate = sum(expected_tokens(al, k) for al in alphas) / self._cost(batch, k)
            if rate > best * 1.02:  # demand a margin: estimates are noisy
                best_k, best = k, rate
        if best_k == 0:
            self._steps_off += 1
            if self._steps_off % _PROBE_EVERY:
                return [0] * batch
            best_k = 1  # probe
        else:
            self._steps_off = 0
        # A sequence pays for its first proposal when alpha beats that token's relative cost.
        marginal = (self._cost(batch, 1) - self._cost(batch, 0)) / self._cost(batch, 0)
        return [best_k if al > marginal or self._steps_off else 0 for al in alphas]
