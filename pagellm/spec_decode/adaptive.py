"""Chooses how many tokens to speculate each step, so that speculation never makes decoding slower.

Two layers, the second guarding the first:

1. A model of the gain. The target's forward over n tokens takes T(n) seconds, learned from the
   steps themselves: an average per n seen, straight lines between them (StepTimes). T is not
   a + b n: a CPU engine switches kernels with the row count (packed 4-bit weights below ~16
   rows, dense float32 above), so a 16-row decode step can be cheap and a 32-row verification
   step not. A proposal round of the draft model takes D seconds (0 for n-gram lookup). With
   acceptance rate alpha, k proposals emit on average E(k) = (1 - alpha^(k+1)) / (1 - alpha)
   tokens per sequence, so for B decoding sequences k is the argmax of
       B * E(k) / (T(B (k + 1)) + k D)     against     B / T(B) without speculation.
   A sequence whose own acceptance cannot pay for its extra row gets no proposals.

2. A measurement of the result (Arms). Per batch size and per k, the wall time per emitted
   token of whole engine steps (proposing, verifying and sampling included) is averaged;
   k = 0 is plain decoding. A k measured slower than plain decoding is not used, and k grows
   one step at a time (k + 1 is tried once k measured faster), so the model's mistakes cost a
   step or two, not a run.

While speculating, plain decoding is re-measured now and then, and while not, one proposal
(k = 1): a probe. Probes of a side measured r times slower per token come every (r - 1) / 2%
steps (at least MIN_PROBE_EVERY, at most MAX_PROBE_EVERY), so that they cost about 2% of the
time, and a change of workload is still noticed. A probe starts a fresh average: the old one
describes an earlier part of the run.
"""
from __future__ import annotations

import bisect

from pagellm.sequence import Sequence

_EMA = 0.2  # weight of a new observation in acceptance and timing averages
_PRIOR_WEIGHT = 2.0  # how many observations the prior acceptance counts for
_MARGIN = 1.02  # speculation must be predicted (or measured) this much faster
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 8, 1024
_PROBE_LOSS = 0.02  # probes of a losing arm may cost this share of the time
_STALE = 8  # a k not measured for this many steps starts a new average
_MIN_SAMPLES = 2  # steps of an arm before its measurement may overrule the model (one step
_CLEAR = 1.5  # suffices when the arms differ by more than this factor)


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 0.999:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class StepTimes:
    """T(n): per step size n an average of measured forward times; between sizes a straight
    line; below the smallest size its time; above the largest, the slope of the two largest."""

    def __init__(self):
        self.sizes: list[int] = []  # sorted
        self.seconds: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, n: int, seconds: float) -> None:
        if n not in self.seconds:
            bisect.insort(self.sizes, n)
            self.seconds[n], self.count[n] = seconds, 1
        else:  # a plain mean of the first samples (one outlier fades fast), then an average
            self.count[n] += 1  # that follows drift
            self.seconds[n] += max(_EMA, 1 / self.count[n]) * (seconds - self.seconds[n])

    def predict(self, n: int) -> float | None:
        if not self.sizes:
            return None
        s, t = self.sizes, self.seconds
        i = bisect.bisect_left(s, n)
        if i < len(s) and s[i] == n:
            return t[n]
        if i == 0:
            return t[s[0]]
        if i == len(s):
            if len(s) == 1:  # one size seen: as the prior, each token adds 1/32 of it
                return t[s[0]] * (1 + (n - s[0]) / 32)
            lo, hi = s[-2], s[-1]
        else:
            lo, hi = s[i - 1], s[i]
        slope = max(0.0, (t[hi] - t[lo]) / (hi - lo))
        return t[lo] + slope * (n - lo)

    def summary(self) -> dict[int, float]:
        return {n: self.seconds[n] for n in self.sizes}


class Arms:
    """Measured wall seconds per emitted token of decode steps at one batch size, for each
    number of proposals k (0: plain decoding), and the schedule of probes."""

    def __init__(self):
        self.sec: dict[int, float] = {}
        self.tok: dict[int, float] = {}
        self.count: dict[int, int] = {}  # samples in the current average
        self.last: dict[int, int] = {}  # when each k was last measured (observation number)
        self.num_observed = 0
        self.since_probe = 0
        self.last_on: bool | None = None

    def observe(self, k: int, tokens: int, seconds: float) -> None:
        if self.num_observed - self.last.get(k, -_STALE) >= _STALE:
            self.count[k] = 0  # an isolated probe: fresher than the old average, start anew
        f = 1 - _EMA if self.count.get(k) else 0.0  # ratio of averages: steps emit unequal
        self.sec[k] = f * self.sec.get(k, 0.0) + seconds  # token counts
        self.tok[k] = f * self.tok.get(k, 0.0) + tokens
        self.count[k] = self.count.get(k, 0) + 1
        self.num_observed += 1
        self.last[k] = self.num_observed

    def per_token(self, k: int) -> float | None:
        return self.sec[k] / self.tok[k] if self.count.get(k) and self.tok[k] > 0 else None

    def verdict(self, k: int) -> bool | None:
        """True: k proposals measured faster than none; False: slower; None: not known."""
        on, off = self.per_token(k), self.per_token(0)
        if on is None or off is None:
            return None
        if min(self.count[k], self.count[0]) < _MIN_SAMPLES and max(on / off, off / on) < _CLEAR:
            return None
        return on * _MARGIN < off

    def allowed(self, k: int) -> int:
        """The largest k' <= k worth using: not measured slower than plain decoding, and
        (a ladder) every smaller k measured faster before k' is tried. 0: none."""
        best = 0
        for j in range(1, k + 1):
            v = self.verdict(j)
            if v is False and j > 1 and self.last[j] < self.last[j - 1]:
                v = None  # measured before k - 1 was measured faster again: retry
            if v is False:
                break
            best = j
            if v is None:
                break  # try j before anything larger
        return best

    def probe_due(self, current: int) -> bool:
        """Called once per step with the k about to be used; True: probe the other side (plain
        decoding while speculating, one proposal while not)."""
        on = current > 0
        if self.last_on is not None and on != self.last_on:
            self.since_probe = 0  # a switch: the next probe a full interval later
        self.last_on = on
        self.since_probe += 1
        if on and self.count.get(0, 0) < _MIN_SAMPLES <= self.count.get(current, 0):
            due = True  # speculating, but plain decoding was not measured enough to compare
        else:
            # Long enough apart that probing a side measured r times slower per token costs
            # at most _PROBE_LOSS of the time.
            cur, other = self.per_token(current), self.per_token(0 if on else 1)
            ratio = other / cur if cur and other else 1.0
            due = self.since_probe >= min(max(MIN_PROBE_EVERY, (ratio - 1) / _PROBE_LOSS),
                                          MAX_PROBE_EVERY)
        if due:
            self.since_probe = 0
        return due


class AdaptiveK:
    def __init__(self, max_k: int, enabled: bool = True, prior_alpha: float = 0.6,
                 draft_cost: bool = False):
        self.max_k = max_k
        self.draft_cost = draft_cost  # whether proposing runs a model (its cost unknown yet)
        self.enabled = enabled
        self.prior_alpha = prior_alpha
        self.alpha = prior_alpha  # overall acceptance estimate
        self._acc = self._tried = 0.0  # forgetting sums behind self.alpha
        self.seq_alpha: dict[int, float] = {}
        self.step_time = StepTimes()
        self.draft_round_time = 0.0  # seconds per draft forward round (average)
        self.arms: dict[int, Arms] = {}

    # ---- observations ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The target's forward pass over num_tokens tokens took `seconds`."""
        self.step_time.observe(num_tokens, seconds)

    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds:
            per = seconds / rounds
            self.draft_round_time = per if not self.draft_round_time else (
                (1 - _EMA) * self.draft_round_time + _EMA * per)

    def observe_decode_step(self, batch: int, tokens: int, seconds: float, k: int) -> None:
        """A whole engine step over `batch` decoding sequences (no prefill work in it) emitted
        `tokens` tokens in `seconds`; k: the most proposals any sequence had (0: none)."""
        if self.enabled and batch:
            self._arms(batch).observe(k, tokens, seconds)

    def observe_acceptance(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        # Per-proposal acceptance: accepted / tried (the first rejection ends the tries).
        tried = min(num_accepted + 1, num_draft)
        # Overall: acceptance counts with forgetting, started from a prior worth a few
        # observations, so that one bad draft already moves the estimate most of the way.
        self._acc = (1 - _EMA) * self._acc + num_accepted
        self._tried = (1 - _EMA) * self._tried + tried
        self.alpha = ((self._acc + _PRIOR_WEIGHT * self.prior_alpha)
                      / (self._tried + _PRIOR_WEIGHT))
        rate = num_accepted / tried
        prev = self.seq_alpha.get(seq.seq_id, self.alpha)
        self.seq_alpha[seq.seq_id] = (1 - 2 * _EMA) * prev + 2 * _EMA * rate

    def forget(self, seq: Sequence) -> None:
        self.seq_alpha.pop(seq.seq_id, None)

    # ---- the decision ----------------------------------------------------------------------
    def _arms(self, batch: int) -> Arms:
        # Batch sizes above 8 share power-of-two buckets: the costs change slowly there.
        key = batch if batch <= 8 else 1 << (batch - 1).bit_length()
        return self.arms.setdefault(key, Arms())

    def _cost(self, batch: int, k: int) -> float:
        t = self.step_time.predict(batch * (k + 1))
        if t is None:  # no timings yet: weights dominate, each token adds 1/32 of a step
            t, base = 1.0 + batch * (k + 1) / 32, 1.0 + batch / 32
        else:
            base = self.step_time.predict(batch)
        draft = self.draft_round_time
        if self.draft_cost and not draft:  # a draft model not timed yet: a quarter step
            draft = 0.25 * base
        return t + k * draft

    def _model_choice(self, batch: int, alphas: list[float]) -> int:
        best_k, best = 0, batch / self._cost(batch, 0)
        for k in range(1, self.max_k + 1):
            rate = sum(expected_tokens(al, k) for al in alphas) / self._cost(batch, k)
            if rate > best * _MARGIN:
                best_k, best = k, rate
        return best_k

    def choose(self, seqs: list[Sequence]) -> list[int]:
        """Proposal count for each decoding sequence this step."""
        if not seqs:
            return []
        if not self.enabled:
            return [self.max_k] * len(seqs)
        batch = len(seqs)
        alphas = [self.seq_alpha.get(s.seq_id, self.alpha) for s in seqs]
        k = self._model_choice(batch, alphas)
        arms = self._arms(batch)
        if not arms.count.get(0):
            return [0] * batch  # a new batch size: measure plain decoding first
        k = arms.allowed(k)
        probe = arms.probe_due(k)
        if probe:
            k = 0 if k else 1  # a probe of speculation uses the cheapest k
        if k == 0:
            return [0] * batch
        if probe:
            return [k] * batch
        # A sequence pays for its k rows when the tokens they add on average, E(k) - 1, beat
        # their share of the step's extra time, in units of a plain step per sequence.
        extra = (self._cost(batch, k) - self._cost(batch, 0)) / self._cost(batch, 0)
        return [k if expected_tokens(al, k) - 1 > extra else 0 for al in alphas]

    def summary(self) -> dict:
        """The controller's state, for benchmarks and logs."""
        return {"alpha": self.alpha, "draft_round_s": self.draft_round_time,
                "step_s": self.step_time.summary(),
                "per_token_s": {b: {k: a.per_token(k) for k in sorted(a.count)}
                                for b, a in sorted(self.arms.items())}}
