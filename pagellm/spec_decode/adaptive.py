"""Chooses how many tokens to speculate each step, so that speculation never makes decoding slower.

Two layers, measurements overruling the model:

1. A model of the gain. The target's forward over n tokens takes T(n) seconds, learned from the
   steps themselves: an average per n seen, straight lines between them (StepTimes). T is not
   a + b n: a CPU engine switches kernels with the row count (packed 4-bit weights below ~16
   rows, dense float32 above), so a 16-row decode step can be cheap and a 32-row verification
   step not. A proposal round of the draft model takes D seconds (0 for n-gram lookup). With
   acceptance rate alpha, k proposals emit on average E(k) = 1 + alpha (1 + c2 + c2 c3 + ...)
   tokens per sequence, where c_j is the pooled rate of accepting proposal j given j - 1
   (= alpha for independent tries, (1 - alpha^(k+1)) / (1 - alpha) in all; copied text comes
   in runs, so c_j is higher there), so for B decoding sequences k is the argmax of
       B * E(k) / (T(B (k + 1)) + k D)     against     B / T(B) without speculation.
   A sequence whose own acceptance cannot pay for its extra row gets no proposals. alpha and
   c_j are kept per kind of proposal (Proposal.kind: the n-gram match length), alpha also per
   sequence and kind.

2. Measured steps (StepWalls). Per batch size and per k (0: plain decoding), the wall time
   of whole engine steps is measured (the median of the latest ones): draft rounds,
   verification, sampling, everything the model does not see. Where a k was measured, its
   time replaces the model's estimate (other k scale the nearest measured one by the model's cost ratio, never below the straight line
   through measured ones), so k is the argmax of sum of E(alpha_s, min(k, avail_s)) over the
   batch / W(k), avail_s: the proposals sequence s has (a free proposer looks first). Step
   times, unlike tokens per step, do not depend on luck in acceptance: a few samples pin
   them down, and a measured k must beat plain decoding by twice the medians' standard
   errors.

Probes keep both sides fresh: while speculating, a plain step now and then (the context grows
and the machine is shared) and the runner-up k; while not, a step with the most promising k
now and then. A probe whose step takes s times as long as the ones in use and delivers r times
fewer tokens per second loses s (1 - 1/r) steps, so it comes every s (1 - 1/r) / 2% steps (at
least MIN_PROBE_EVERY, at most MAX_PROBE_EVERY) and probes cost about 2% of the time. Where
held-back proposals are scored against the emitted tokens (n-gram: proposing is free),
acceptance stays fresh without probes, which then only re-time steps: 0.5%.
"""
from __future__ import annotations

import bisect
import statistics

from pagellm.sequence import Sequence

_EMA = 0.2  # weight of a new observation in acceptance and timing averages
_PRIOR_WEIGHT = 2.0  # how many observations the prior acceptance counts for
_MARGIN = 1.02  # speculation must be predicted (or measured) this much faster
_UNMEASURED_MARGIN = 1.25  # ... and this much where its step time is only modelled
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 8, 1024
MAX_BACKOFF = 16
_PROBE_LOSS = 0.02  # probes of a losing arm may cost this share of the time
_WALL_WINDOW = 9  # step walls per k whose median is its measured time
_NOISE_MARGIN = 2.0  # standard errors of the walls' medians a gain must exceed
_PAST_LIMIT_ROW_COST = 2.0  # an unmeasured row past the few-row kernels, in plain-step rows


def _average(prev: float, x: float, n: int) -> float:
    """Running average with x as the n-th sample: a plain mean of the first samples (one
    outlier fades fast), then an exponential average that follows drift."""
    return prev + max(_EMA, 1 / n) * (x - prev)


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
        self.count[n] = self.count.get(n, 0) + 1
        self.seconds[n] = _average(self.seconds.get(n, seconds), seconds, self.count[n])

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


class StepWalls:
    """Measured wall seconds of whole decode steps at one batch size, per k (0: plain
    decoding): everything a step costs, the draft's rounds and verification's sampling
    included. Unlike time per token, a step's time does not depend on luck in acceptance, so
    a few samples pin it down."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self._recent: dict[int, list[float]] = {}  # the latest _WALL_WINDOW walls per k
        self.speed = 1.0  # the machine's slowness now, relative to the walls kept
        self.tokens: dict[int, float] = {}  # tokens emitted per step, averaged
        # Proposals verified per step (extra rows): the median of the same window as the
        # walls, so that a k's wall and rows describe the same steps (a step's time grows
        # with its rows: the median wall is that of about the median rows). One-sequence
        # probes of 1 row among whole-batch steps of 12 made an average of rows and a
        # median of walls price a row at a fifth of its cost.
        self.rows: dict[int, float] = {}
        self._recent_rows: dict[int, list[int]] = {}
        self.count: dict[int, int] = {}
        self.num_observed = 0
        self.last: dict[int, int] = {}  # observation number of each k's latest measurement
        self.one_probes = 0  # draft probes given to one sequence of the batch
        # Draft-model probes that did not turn speculation on space the next one further
        # apart (x2 each, up to MAX_BACKOFF): a useless draft also pays to catch up on each
        # new request's context at its first probe, which the step walls do not show.
        self.backoff = 1
        self.probing = False

    def observe(self, k: int, seconds: float, tokens: float, rows: int | None = None) -> None:
        # Tokens per step follow the workload, a step's time does not: a probe after a long
        # pause replaces the old token count instead of averaging into it.
        stale = self.since(k) > MIN_PROBE_EVERY
        self.count[k] = self.count.get(k, 0) + 1
        # The median of the latest walls: a shared machine slows single steps by 20-50% now
        # and then, which an average takes in (one batch-1 run measured k=1 slower than k=4).
        # They are kept in units of the machine's current speed: each step's ratio to its k's
        # wall moves a speed factor common to every k. Plain steps are measured rarely while
        # speculation is on (and the reverse), and a machine whose speed drifts by 20%
        # between those moments would otherwise compare k's walls from different moods.
        if self.seconds.get(k):
            self.speed *= (seconds / (self.speed * self.seconds[k])) ** _EMA
        recent = self._recent.setdefault(k, [])
        recent.append(seconds / self.speed)
        del recent[:-_WALL_WINDOW]
        self.seconds[k] = statistics.median(recent)
        self.tokens[k] = tokens if stale else _average(self.tokens.get(k, tokens), tokens,
                                                       self.count[k])
        if rows is not None:
            recent_rows = self._recent_rows.setdefault(k, [])
            recent_rows.append(rows)
            del recent_rows[:-_WALL_WINDOW]
            self.rows[k] = statistics.median(recent_rows)
        self.num_observed += 1
        self.last[k] = self.num_observed

    def spread(self, k: int) -> float:
        """Relative standard error of k's median wall, from the window's median absolute
        deviation (a normal's sigma is 1.4826 MAD; a median's error ~1.25 sigma / sqrt(n))."""
        recent = self._recent.get(k)
        if not recent or len(recent) < 2:
            return 0.0
        mid = self.seconds[k]  # the window's median
        mad = statistics.median(abs(x - mid) for x in recent)
        return 1.25 * 1.4826 * mad / (len(recent) ** 0.5 * mid) if mid > 0 else 0.0

    def measured_rate(self, k: int) -> float | None:
        """Tokens per second of steps with k proposals, once measured twice."""
        if self.count.get(k, 0) < 2:
            return None
        return self.tokens[k] / self.seconds[k]

    def since(self, k: int) -> int:
        """Steps at this batch size since k was last measured."""
        return self.num_observed - self.last.get(k, 0)


class _KindStats:
    """Acceptance of one kind of proposal: forgetting sums of accepted and tried proposals,
    and per position j >= 2 how often it was reached (j - 1 accepted) and accepted."""

    def __init__(self, max_k: int):
        self.acc = self.tried = 0.0
        self.reach = [0.0] * (max_k + 1)
        self.hit = [0.0] * (max_k + 1)

    def observe(self, num_accepted: int, tried: int) -> None:
        self.acc = (1 - _EMA) * self.acc + num_accepted
        self.tried = (1 - _EMA) * self.tried + tried
        for j in range(2, tried + 1):  # positions reached after an accepted first one
            self.reach[j] = (1 - _EMA / 4) * self.reach[j] + 1
            self.hit[j] = (1 - _EMA / 4) * self.hit[j] + (j <= num_accepted)


class AdaptiveK:
    def __init__(self, max_k: int, enabled: bool = True, prior_alpha: float = 0.6,
                 draft_cost: bool = False, scores_unverified: bool = False):
        self.max_k = max_k
        self.draft_cost = draft_cost  # whether proposing runs a model (its cost unknown yet)
        # Whether proposals held back are scored against the emitted tokens (a free proposer,
        # SpecDecoder._score_unverified): acceptance then stays fresh without verification,
        # and probes only re-measure step times, which need far fewer samples.
        self.scores_unverified = scores_unverified
        self.enabled = enabled
        self.prior_alpha = prior_alpha
        self.alpha = prior_alpha  # overall acceptance estimate, every kind of proposal
        self._overall = _KindStats(max_k)  # the forgetting sums behind self.alpha
        # Per kind of proposal (Proposal.kind: an n-gram match's length; 0 for a draft), its
        # acceptance and the pooled acceptance at position j given that j - 1 was accepted
        # (forgetting sums, index j): copied text is accepted in runs, so later positions are
        # accepted more often than a per-token rate says (copy prompts: 0.90 then 0.98, 1.0,
        # 0.95); a 1-token n-gram match is right far less often than a 4-token one (copy
        # prompts: 0.19 against 0.83 per token), and a request's proposals alternate between
        # kinds as it copies, edits and resumes copying.
        self.kinds: dict[int, _KindStats] = {}
        # Per sequence, per kind: acceptance and the number of drafts behind it.
        self.seq_alpha: dict[int, dict[int, float]] = {}
        self.seq_count: dict[int, dict[int, int]] = {}
        self.step_time = StepTimes()
        self.draft_round_time = 0.0  # seconds per draft forward round (average)
        self.walls: dict[int, StepWalls] = {}
        # Steps of more rows than this leave the model's few-row kernels (None: no such
        # limit known); set by the engine (LLMEngine: packed_row_limit).
        self.row_limit: int | None = None
        self._partial_probe = False  # this step's proposals went to one sequence only

    # ---- observations ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The target's forward pass over num_tokens tokens took `seconds`."""
        self.step_time.observe(num_tokens, seconds)

    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds:
            per = seconds / rounds
            self.draft_round_time = per if not self.draft_round_time else (
                (1 - _EMA) * self.draft_round_time + _EMA * per)

    def observe_decode_step(self, batch: int, seconds: float, k: int, tokens: int,
                            rows: int | None = None) -> None:
        """A whole engine step over `batch` decoding sequences (no prefill work in it) took
        `seconds` and emitted `tokens`; k: the most proposals any sequence had (0: none)."""
        if self.enabled and batch:
            walls = self._walls(batch)
            if self._partial_probe:  # counts as a step for the probe schedule, not a time
                walls.num_observed += 1
                walls.last[k] = walls.num_observed
            else:
                walls.observe(k, seconds, tokens, rows)
        self._partial_probe = False

    def observe_acceptance(self, seq: Sequence, num_draft: int, num_accepted: int,
                           kind: int = 0) -> None:
        if num_draft == 0:
            return
        # Per-proposal acceptance: accepted / tried (the first rejection ends the tries).
        tried = min(num_accepted + 1, num_draft)
        # Overall and per kind: acceptance counts with forgetting, started from a prior worth
        # a few observations, so that one bad draft already moves the estimate most of the way.
        self._overall.observe(num_accepted, tried)
        self.alpha = ((self._overall.acc + _PRIOR_WEIGHT * self.prior_alpha)
                      / (self._overall.tried + _PRIOR_WEIGHT))
        stats = self.kinds.get(kind)
        if stats is None:
            stats = self.kinds[kind] = _KindStats(self.max_k)
        stats.observe(num_accepted, tried)
        rate = num_accepted / tried
        # A request starts from its kind's pooled estimate, counted as one observation, so
        # its own first drafts move it fast (a chat request after copy-heavy ones), then it
        # follows its own recent drafts.
        counts = self.seq_count.setdefault(seq.seq_id, {})
        alphas = self.seq_alpha.setdefault(seq.seq_id, {})
        n = counts[kind] = counts.get(kind, 0) + 1
        prev = alphas.get(kind, self.kind_alpha(kind))
        alphas[kind] = prev + max(_EMA, 1 / (n + 1)) * (rate - prev)

    def kind_alpha(self, kind: int) -> float:
        """Pooled acceptance of a kind of proposal; a kind not seen yet starts from the
        overall estimate."""
        stats = self.kinds.get(kind)
        if stats is None:
            return self.alpha
        return (stats.acc + _PRIOR_WEIGHT * self.alpha) / (stats.tried + _PRIOR_WEIGHT)

    def seq_estimate(self, seq: Sequence, kind: int = 0) -> float:
        """Acceptance expected of seq's proposals of this kind."""
        alpha = self.seq_alpha.get(seq.seq_id, {}).get(kind)
        return self.kind_alpha(kind) if alpha is None else alpha

    def expected(self, alpha: float, k: int, kind: int = 0) -> float:
        """Tokens a step with k proposals emits on average for a sequence whose proposals are
        accepted at rate alpha: its first proposal with probability alpha, each later one
        with the pooled rate of its kind given the one before, but never below alpha. (The
        pooled rates mix workloads: after chat requests they are low, and a copy request held
        to k=1 by them would never reach the later positions that would show otherwise.)"""
        stats = self.kinds.get(kind)
        total, run = 1.0, alpha
        for j in range(1, k + 1):
            if j > 1:
                reach, hit = (stats.reach[j], stats.hit[j]) if stats else (0.0, 0.0)
                pooled = (hit + _PRIOR_WEIGHT * alpha) / (reach + _PRIOR_WEIGHT)
                run *= max(alpha, pooled)
            total += run
        return total

    def forget(self, seq: Sequence) -> None:
        self.seq_alpha.pop(seq.seq_id, None)
        self.seq_count.pop(seq.seq_id, None)

    # ---- the decision ----------------------------------------------------------------------
    def _walls(self, batch: int) -> StepWalls:
        # One per batch size: a batch of 16 draining to 9 halves its plain step (96 ms to 53
        # here), and walls shared across those sizes made a batch-9 verification step look
        # cheap next to a batch-16 plain one (copy prompts: 175 ms for 9 sequences against 57
        # plain). A new size starts from plain decoding and the model's costs.
        return self.walls.setdefault(batch, StepWalls())

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

    def choose(self, seqs: list[Sequence], avail: list[int] | None = None,
               kinds: list[int] | None = None) -> list[int]:
        """Proposal count for each decoding sequence this step. avail: how many proposals
        each sequence has (a free proposer looks first), None: as many as asked for; kinds:
        the kind of each one's proposal (None: 0)."""
        self._partial_probe = False  # (a step not observed must not carry it over)
        if not seqs:
            return []
        if not self.enabled:
            return [self.max_k] * len(seqs)
        batch = len(seqs)
        kinds = kinds if kinds is not None else [0] * batch
        alphas = [self.seq_estimate(s, c) for s, c in zip(seqs, kinds)]
        avail = avail if avail is not None else [self.max_k] * batch
        walls = self._walls(batch)
        w0 = walls.seconds.get(0)
        if w0 is None:
            return [0] * batch  # a new batch size: measure plain decoding first
        # Expected tokens per second for each k: measured step walls where known, else the
        # model's relative cost applied to the measured plain step.
        walls_k = [self._wall(walls, batch, k, avail) for k in range(self.max_k + 1)]
        rates = [sum(self.expected(al, min(k, n), c) for al, n, c in zip(alphas, avail, kinds))
                 / walls_k[k] for k in range(self.max_k + 1)]
        for k in range(1, self.max_k + 1) if batch > 1 or not self.scores_unverified else ():
            # The tokens per second a k actually delivered overrule the acceptance model
            # when lower: per-sequence estimates lag behind a change of workload (a chat
            # request after copy-heavy ones starts from the pooled, high, acceptance), and
            # at batch > 1 the cost of a step's rows is modelled from steps that verified
            # other sequences (batch-16 copy fell to 0.94x of plain without this once held-
            # back proposals were scored through verified steps). Not needed at batch 1
            # where unverified proposals keep acceptance fresh.
            measured = walls.measured_rate(k)
            if measured is not None:
                rates[k] = min(rates[k], measured)
        best, spread0 = 0, walls.spread(0)
        for k in range(1, self.max_k + 1):
            # A k whose step time at this batch size is only modelled must promise more: the
            # model extrapolates from other step sizes, and a batch-16 step that it calls
            # 1.2x a plain one can take 3x (a whole-batch draft step: 540 ms against 70).
            # A measured k must beat plain decoding by more than the noise of both medians:
            # a shared machine's step walls scatter by 10-20%, and a gain of a few percent
            # read off them is as often a loss (batch 16: 0.96x of plain without this).
            margin = (_MARGIN + _NOISE_MARGIN * (walls.spread(k) + spread0)
                      if k in walls.seconds else _UNMEASURED_MARGIN)
            if rates[k] > rates[best] * (margin if best == 0 or k not in walls.seconds else 1.0):
                best = k
        if walls.probing:  # the outcome of the last probe of speculation
            walls.probing = False
            # Only a draft model backs off: its probes also pay a catch-up the walls do not
            # show, while an n-gram probe costs what its wall says, and backing off would
            # only delay noticing copy-heavy requests again.
            if self.draft_cost:
                walls.backoff = 1 if best else min(2 * walls.backoff, MAX_BACKOFF)
        k = best
        if best == 0:
            # Acceptance is learnt only from proposals: now and then the most promising k,
            # spaced so that its expected loss is about _PROBE_LOSS of the time.
            probe = max(range(1, self.max_k + 1), key=lambda j: rates[j])
            wait = min(walls.backoff * self._wait(walls_k[probe] / w0,
                                                  rates[0] / rates[probe], self._probe_loss()),
                       MAX_PROBE_EVERY)
            if min(walls.since(j) for j in range(1, self.max_k + 1)) >= wait:
                k = probe
                walls.probing = True
        elif walls.since(0) >= self._wait(w0 / walls_k[best],
                                          rates[best] / rates[0]):
            k = 0  # re-measure plain decoding (the context grows, the machine is shared)
        else:
            # The runner-up k is re-measured too: a step time measured once in a noisy moment
            # would otherwise keep a better k unused for good.
            alt = max((j for j in range(1, self.max_k + 1) if j != best), key=lambda j: rates[j],
                      default=None)
            if alt is not None and walls.since(alt) >= self._wait(
                    walls_k[alt] / walls_k[best],
                    rates[best] / rates[alt]):
                k = alt
        if k == 0:
            return [0] * batch
        untried = not any(j in walls.seconds for j in range(1, self.max_k + 1))
        if self.draft_cost and batch > 1 and (best == 0 or (untried and walls.one_probes < 2)):
            # A draft's first proposals for a sequence run the draft over its whole context
            # (it lags while speculation is off): probe with the shortest sequence alone, and
            # learn acceptance that way before the whole batch pays. (Not a measurement of
            # k for the batch: its step time is not recorded.)
            self._partial_probe = True
            walls.one_probes += 1
            shortest = min(range(batch), key=lambda i: seqs[i].num_tokens)
            return [k if i == shortest else 0 for i in range(batch)]
        if batch == 1 or (best == 0 and not self.scores_unverified):
            return [k] * batch
        # A sequence pays for its k rows when the tokens they add on average, E(k) - 1, beat
        # their share of the step's extra time, in units of a plain step per sequence.
        rows = sum(min(k, n) for n in avail) or 1
        per_row = (walls_k[k] - w0) / rows * batch / w0  # in plain steps per sequence
        ks = [k if self.expected(al, min(k, n), c) - 1 > min(k, n) * per_row else 0
              for al, n, c in zip(alphas, avail, kinds)]
        if any(ks) or best != 0:
            return ks if any(ks) else [k] * batch
        # A probe where held-back proposals are scored (acceptance needs no probes; only the
        # step time does) and no sequence pays alone: the likeliest sequence only. A probe
        # for everyone with a proposal cost 2.4x a plain step at batch 16 (chat: 0.97x of
        # plain from 2% of steps).
        i = max(range(batch), key=lambda j: (min(k, avail[j]) > 0, alphas[j]))
        return [k if j == i else 0 for j in range(batch)]

    def _wall(self, walls: StepWalls, batch: int, k: int,
              avail: list[int] | None = None) -> float:
        """_wall_k for a step whose sequences have `avail` proposals each (None: k each):
        a step's extra time grows with the rows verified, and a free proposer's steps with
        the same k verify 4 rows or 64 as few or many sequences have a proposal."""
        wall = self._wall_k(walls, batch, k)
        measured = walls.rows.get(k)
        if k == 0:
            return wall
        proposals = batch * k if avail is None else sum(min(k, n) for n in avail)
        if avail is not None and measured:
            wall = walls.seconds[0] + (wall - walls.seconds[0]) * proposals / measured
        if k not in walls.seconds:
            # Not measured: a verified row costs what the measured k's rows did at this batch
            # size (they may have verified 2 rows or 60), else at least what one did at the
            # nearest smaller batch, in rows of a plain step (the more rows a step has, the
            # closer the few-row kernels are to compute-bound: a row cost 0.16 plain rows at
            # batch 1, 0.37 at 3, 0.7 at 7-10, 0.9 at 16). Batch sizes each have their own
            # walls, and this keeps a draining batch from probing every size it passes.
            rel = self._row_cost(walls, batch)
            rel = self._row_cost_below(batch) if rel is None else rel
            if rel is not None:
                w0 = walls.seconds[0]
                wall = max(wall, w0 + rel * proposals * w0 / batch)
        rows = batch + proposals
        if (self.row_limit is not None and rows > self.row_limit
                and (measured is None or proposals > measured)):
            # Past the rows the model runs in its few-row kernels (packed 4-bit weights on
            # the CPU), nothing measured says how much a row costs: assume twice what a row
            # of a plain step costs. (A batch-16 k=4 step, 80 rows, was predicted from the
            # k=1 and k=2 steps at ~160 ms and took 612, 7.6 ms a row against 5 in a plain
            # step; a batch-12 k=3 step took 500.) Such a step is then never worth a try.
            wall = max(wall, _PAST_LIMIT_ROW_COST * walls.seconds[0] * rows / batch)
        return wall

    def _row_cost_below(self, batch: int) -> float | None:
        """_row_cost at the largest batch size below `batch` that measured a k; None where
        none did."""
        for b in sorted((b for b in self.walls if b < batch), reverse=True):
            rel = self._row_cost(self.walls[b], b)
            if rel is not None:
                return rel
        return None

    @staticmethod
    def _row_cost(w: StepWalls, batch: int) -> float | None:
        """A verified row's extra time in rows of a plain step, averaged over the k measured
        in w (None: none measured)."""
        w0 = w.seconds.get(0)
        costs = [(w.seconds[k] - w0) / w.rows[k] / (w0 / batch) for k in w.seconds
                 if k and w.rows.get(k) and w0]
        return max(0.0, sum(costs) / len(costs)) if costs else None

    def _wall_k(self, walls: StepWalls, batch: int, k: int) -> float:
        """A step's wall time with k proposals: measured; else the nearest smaller k's
        measured time scaled by the model's cost ratio, but never below the straight line
        through the measured k around it (or the two largest below it). Each proposal adds
        about the same rows' worth of time, and the model, fitted on every step size
        including prefill chunks, underrated verification at batch 16 by 2-3x: each unmeasured
        k looked cheap once, and a cold start tried them all (~300 ms extra each)."""
        seconds = walls.seconds
        if k in seconds:
            # A step that verifies more rows never takes less time: a k whose median a larger
            # k undercuts was measured in slow moments, and would stay unused for good (a
            # batch-1 k=3 held 39 ms, k=4 29, plain 19, through a whole run).
            rows = walls.rows.get(k, 0)
            return min([seconds[k]] + [seconds[j] for j in seconds
                                       if j > k and walls.rows.get(j, 0) >= rows])
        below = sorted(j for j in seconds if j < k)
        near = below[-1]
        scaled = seconds[near] * self._cost(batch, k) / self._cost(batch, near)
        above = [j for j in seconds if j > k]
        if above:
            lo, hi = near, min(above)
        elif len(below) >= 2:
            lo, hi = below[-2], near
        else:
            return scaled
        line = seconds[lo] + (seconds[hi] - seconds[lo]) * (k - lo) / (hi - lo)
        return max(scaled, line) if not above else line

    def _probe_loss(self) -> float:
        """Share of the time probes of speculation may cost while it is off: a quarter of
        the usual where acceptance is learnt without them (they only re-measure times)."""
        return _PROBE_LOSS / 4 if self.scores_unverified else _PROBE_LOSS

    @staticmethod
    def _wait(step_ratio: float, ratio: float, loss: float = _PROBE_LOSS) -> float:
        """Steps between probes of a side whose steps take step_ratio times as long as the
        ones in use and deliver `ratio` times fewer tokens per second, so that probes cost
        about `loss` of the time: a probe step loses step_ratio * (1 - 1 / ratio) steps."""
        per_probe = step_ratio * (1 - 1 / ratio) if ratio > 0 else step_ratio
        return min(max(MIN_PROBE_EVERY, per_probe / loss), MAX_PROBE_EVERY)

    def summary(self) -> dict:
        """The controller's state, for benchmarks and logs."""
        return {"alpha": self.alpha, "draft_round_s": self.draft_round_time,
                "alpha_by_kind": {c: self.kind_alpha(c) for c in sorted(self.kinds)},
                "step_s": self.step_time.summary(),
                # at the machine's current speed (kept divided by it)
                "step_wall_s": {b: {k: w.seconds[k] * w.speed for k in sorted(w.seconds)}
                                for b, w in sorted(self.walls.items())}}
