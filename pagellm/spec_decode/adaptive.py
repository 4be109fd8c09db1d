"""Chooses how many tokens to speculate each step (k; 0: none), so that speculation never
makes decoding slower.

For the B sequences decoding, k maximises the expected tokens per second
    sum over s of E(alpha_s, min(k, avail_s)) / W_B(k)    against    B / W_B(0) without.
- E(alpha, k): tokens a sequence emits with k proposals: the first accepted at its own rate
  alpha (per request and kind of proposal: an n-gram match's length), each later one at its
  kind's pooled rate given the one before (copied text comes in runs), never below alpha.
- W_B(k): a whole engine step's wall time (draft rounds, verification, sampling) at batch size
  B with k proposals: the median of the latest such steps, in units of the machine's current
  speed, scaled to the rows verified now. An unmeasured k costs per row what measured rows
  cost (at B, else the nearest smaller B, else what a decoding row costs between plain steps
  of two batch sizes, at least a prior; a draft's at B > 1: a plain-step row) plus the
  draft's rounds.
- A measured k must beat plain decoding by the noise of both medians, an unmeasured one by 25%;
  at B > 1 a sequence gets proposals only where its own acceptance pays for its rows, and a
  draft's step that turns sequences on pays their catch-ups on context.
Probes keep both sides fresh: while off, the most promising k (at B > 1 for one sequence);
while on, plain decoding or the runner-up. A probe whose step takes s times as long and gives
r times fewer tokens per second loses s (1 - 1/r) steps: one every s (1 - 1/r) / loss steps
costs `loss` of the time.
"""
from __future__ import annotations

from pagellm.sequence import Sequence
from pagellm.spec_decode.measure import EMA, PRIOR_WEIGHT, KindAcceptance, StepWalls

_MARGIN = 1.02  # a measured k must beat plain decoding by 2% beyond the noise
_UNMEASURED_MARGIN = 1.25  # a modelled step time extrapolates: demand a clear gain
_NOISE = 2.0  # standard errors of the two medians a measured gain must exceed
_PRIOR_ROW_COST = 0.25  # an unmeasured verified row, in plain-step rows: cheap, so a k gets tried
_PRIOR_BATCH_ROW_COST = 1.0  # ... a draft's at B > 1 with nothing measured: a plain-step row
_PAST_LIMIT_ROW_COST = 2.0  # a row past the few-row kernels, in plain-step rows: pessimistic
_PROBE_LOSS = 0.02  # share of the time probes of the side not in use may cost
MIN_PROBE_EVERY = 8  # steps between probes at least: a probe's wall is one of several
MAX_PROBE_EVERY = 1024  # ... and at most: a side that lost long ago is still re-timed
MAX_BACKOFF = 16  # a useless draft's probes spread out to 16x (they also pay a catch-up)
_TOKEN_FADE = 0.12  # a request's acceptance: weight lost per newer tried token (~8 tokens)


class AdaptiveK:
    def __init__(self, max_k: int, enabled: bool = True, prior_alpha: float = 0.6,
                 draft_cost: bool = False, scores_unverified: bool = False):
        self.max_k, self.enabled, self.prior_alpha = max_k, enabled, prior_alpha
        self.draft_cost = draft_cost  # proposing runs a model: each round costs draft_round_s
        # Held-back proposals are scored against the emitted tokens (a free proposer): then
        # acceptance stays fresh without verification, and probes only re-time steps.
        self.scores_unverified = scores_unverified
        self.alpha = prior_alpha  # overall acceptance, every kind
        self._overall = KindAcceptance(max_k)
        self.kinds: dict[int, KindAcceptance] = {}
        # seq -> kind -> (accepted, tried) tokens, fading
        self.seq_alpha: dict[int, dict[int, tuple[float, float]]] = {}
        self.draft_round_s = 0.0
        self.catchup_s = 0.0  # a draft's catch-up on context when it resumes (EMA)
        self.walls: dict[int, StepWalls] = {}  # per batch size: a draining batch changes cost
        self.row_limit: int | None = None  # rows the target's few-row kernels take (engine)
        self._one_probe = False  # this step's proposals went to one sequence of a batch
        self._on: set[int] = set()  # sequences given proposals last step (a draft's shadows current)

    # ---- observations ----------------------------------------------------------------------
    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds:
            per = seconds / rounds
            self.draft_round_s += (per - self.draft_round_s) * (EMA if self.draft_round_s else 1)

    def observe_catchup(self, seconds: float) -> None:
        """A draft caught up on context (tokens emitted while it was off): what resuming
        costs, paid by every probe of an idle draft on top of its step."""
        self.catchup_s += (seconds - self.catchup_s) * (EMA if self.catchup_s else 1)

    def observe_decode_step(self, batch: int, seconds: float, k: int, tokens: float,
                            rows: int | None = None, timed: bool = True) -> None:
        """A whole engine step over `batch` decoding sequences took `seconds` and emitted
        `tokens`; k: the most proposals any sequence had, rows: proposals verified. timed=False:
        a step that says nothing of k's cost (a draft's proposals came free) is only counted."""
        if self.enabled and batch:
            walls = self.walls.setdefault(batch, StepWalls())
            if not timed or (self._one_probe and self.draft_cost):  # e.g. a draft's catch-up
                walls.tick(k)
            else:
                walls.observe(k, seconds, batch * k if rows is None else rows, tokens)
        self._one_probe = False

    def observe_acceptance(self, seq: Sequence, num_draft: int, num_accepted: int,
                           kind: int = 0) -> None:
        if num_draft == 0:
            return
        tried = min(num_accepted + 1, num_draft)  # the first rejection ends the tries
        self._overall.observe(num_accepted, tried)
        self.alpha = self._overall.rate(self.prior_alpha)
        self.kinds.setdefault(kind, KindAcceptance(self.max_k)).observe(num_accepted, tried)
        # A request starts from its kind's pooled rate, counted as one tried token, then
        # follows its own recent drafts (a chat request after copy-heavy ones moves fast):
        # accepted over tried tokens, each step's counts and the older ones fading by token. (A
        # mean of each step's accepted / tried is biased low where k > 1: at 0.9 a token and
        # k = 4 it is 0.81, and one rejection took it from 0.88 to 0.71.)
        mine = self.seq_alpha.setdefault(seq.seq_id, {})
        hits, tries = mine.get(kind, (self.kind_alpha(kind), 1.0))
        fade = (1 - _TOKEN_FADE) ** tried
        mine[kind] = (hits * fade + num_accepted, tries * fade + tried)

    def forget(self, seq: Sequence) -> None:
        self.seq_alpha.pop(seq.seq_id, None)

    def kind_alpha(self, kind: int) -> float:
        stats = self.kinds.get(kind)
        return self.alpha if stats is None else stats.rate(self.alpha)

    def seq_estimate(self, seq: Sequence, kind: int = 0) -> float:
        got = self.seq_alpha.get(seq.seq_id, {}).get(kind)
        return self.kind_alpha(kind) if got is None else got[0] / got[1]

    def expected(self, alpha: float, k: int, kind: int = 0) -> float:
        """E(alpha, k): later positions at the kind's pooled rate, never below alpha (pooled
        rates mix workloads, and a copy request held to k = 1 would never show otherwise)."""
        stats, total, run = self.kinds.get(kind), 1.0, 1.0
        for j in range(1, k + 1):
            pooled = ((stats.hit[j] + PRIOR_WEIGHT * alpha) / (stats.reach[j] + PRIOR_WEIGHT)
                      if stats and j > 1 else alpha)
            run *= max(alpha, pooled)
            total += run
        return total

    # ---- the decision ----------------------------------------------------------------------
    def step_wall(self, batch: int, k: int, rows: int) -> float:
        """W_B(k) for a step verifying `rows` proposals (plain steps measured at B)."""
        walls = self.walls[batch]
        w0 = walls.wall(0)
        if k == 0:
            return w0
        measured = walls.rows(k) if k in walls.steps else 0
        if measured:  # the measured extra time, scaled to this step's rows; never above that
            # of a larger k with as many rows (a k measured in a slow moment stays unused)
            wk = min([walls.wall(k)] + [walls.wall(j) for j in walls.steps
                                        if j > k and walls.rows(j) >= measured])
            wall = w0 + (wk - w0) * rows / measured
        else:
            # a draft round in seconds, and in the walls' units (the machine's speed then)
            draft_s = self.draft_round_s or (0.25 * w0 * walls.speed if self.draft_cost else 0.0)
            wall = (w0 + self._row_cost(batch, draft_s) * rows * w0 / batch
                    + k * draft_s / walls.speed)
        if self.row_limit is not None and batch + rows > self.row_limit and rows > measured:
            # past the few-row kernels nothing measured says what a row costs
            wall = max(wall, _PAST_LIMIT_ROW_COST * w0 * (batch + rows) / batch)
        return wall

    def _row_cost(self, batch: int, draft: float) -> float:  # draft: a round's seconds
        """A verified row's cost in plain-step rows: measured at this batch size, else at the
        nearest smaller one (rows get dearer as steps grow and near compute-bound), else at
        B > 1 what a decoding row costs between plain steps of two batch sizes (never below the
        prior), else the prior (a draft's at B > 1: a plain-step row)."""
        for b in sorted((b for b in self.walls if b <= batch), reverse=True):
            cost = self.walls[b].row_cost(b, draft)
            if cost is not None:
                return cost
        if batch == 1:  # probes there are timed: the cheap prior gets a k tried, then measured
            return _PRIOR_ROW_COST
        plain = self._plain_row_cost(batch)
        if plain is None and self.draft_cost:
            # a draft's probes at B > 1 verify one sequence and are not timed (their
            # catch-up): nothing would correct cheap rows before a whole batch paid for them
            return _PRIOR_BATCH_ROW_COST
        return _PRIOR_ROW_COST if plain is None else max(_PRIOR_ROW_COST, plain)

    def _plain_row_cost(self, batch: int) -> float | None:
        """A row's cost in plain-step rows at `batch`, from the plain steps of two batch sizes:
        a verified row runs through the same kernels as a decoding row. A draining batch
        measures them at no cost. The sizes: `batch` and the smallest one measured down to
        half of it, else the nearest below, else the nearest above; at most 2 plain-step rows.
        Where the kernels are compute-bound per row (a 1.5B's K-quant rows at batch 8: one
        more row ~1.0 plain-step rows), the prior's cheap rows priced a k = 3 step of all 8
        sequences at 2x a plain step; it took 9x. None: not two sizes measured, or a row
        that costs nothing (noise)."""
        def seconds(b: int) -> float | None:  # a plain step now (each size keeps its units)
            w = self.walls.get(b)
            return w.wall(0) * w.speed if w is not None and 0 in w.steps else None

        here = seconds(batch)
        if here is None:
            return None
        sizes = sorted(b for b in self.walls if b != batch and seconds(b) is not None)
        below = [b for b in sizes if batch / 2 <= b < batch] or [b for b in sizes if b < batch][-1:]
        other = below[0] if below else next((b for b in sizes if b > batch), None)
        if other is None:
            return None
        per_row = (here - seconds(other)) / (batch - other)
        if per_row <= 0:
            return None  # noise between two medians, not free rows
        # two medians taken at different moments: a slow spell in one must not price rows
        # past what a row beyond the few-row kernels is assumed to cost
        return min(per_row / (here / batch), _PAST_LIMIT_ROW_COST)

    def _plan(self, batch, k, alphas, avail, kinds, fresh=None) -> tuple[list[int], float, float]:
        """(proposals per sequence, expected tokens/s, step wall) with k: at B > 1 only for
        sequences whose added tokens, E - 1, beat their rows' share of the extra time. fresh:
        which sequences had no proposals last step (at B > 1 a draft pays a catch-up on each
        of those it turns on)."""
        mine = [min(k, n) for n in avail]
        w0, w = self.walls[batch].wall(0), self.step_wall(batch, k, sum(mine))
        if batch > 1 and sum(mine):
            per_row = (w - w0) / sum(mine) * batch / w0  # in plain steps per sequence
            pay = [j if self.expected(a, j, c) - 1 > j * per_row else 0
                   for a, j, c in zip(alphas, mine, kinds)]
            if any(pay):
                mine, w = pay, self.step_wall(batch, k, sum(pay))
        if batch > 1 and self.draft_cost and fresh is not None:
            # Its shadow of a sequence it turns on first catches up on the context (the
            # tokens emitted while off: a prefill of the draft, timed apart from steps). The
            # step that turns sequences on pays it: otherwise a batch of 8 on the Qwen pair
            # turned sequences on and off, 7 catch-ups in 123 steps cost 15% of the time.
            turned_on = sum(1 for j, f in zip(mine, fresh) if j and f)
            w += turned_on * self.catchup_s / self.walls[batch].speed
        rate = sum(self.expected(a, j, c) for a, j, c in zip(alphas, mine, kinds)) / w
        if k and (batch > 1 or not self.scores_unverified):
            # tokens/s measured overrule per-request estimates lagging a change of workload;
            # a draft's, only over two steps in a row: its probes come a hundred or more steps
            # apart, and one whose first proposal was rejected (1 token of k + 1: 10% of
            # probes at 0.9 acceptance) would keep a paying draft off until the next one
            measured = self.walls[batch].rate(k, 2 if self.draft_cost else 1)
            rate = min(rate, measured or rate)
        return mine, rate, w

    def choose(self, seqs: list[Sequence], avail: list[int] | None = None,
               kinds: list[int] | None = None) -> list[int]:
        """Proposals for each decoding sequence this step. avail: how many each has (a free
        proposer looks first; None: as many as asked for); kinds: each one's kind."""
        ks = self._choose(seqs, avail, kinds)
        self._on = {s.seq_id for s, k in zip(seqs, ks) if k}
        return ks

    def _choose(self, seqs: list[Sequence], avail: list[int] | None,
                kinds: list[int] | None) -> list[int]:
        self._one_probe = False
        batch = len(seqs)
        if not self.enabled or not batch:
            return [self.max_k] * batch
        walls = self.walls.setdefault(batch, StepWalls())
        if 0 not in walls.steps:
            return [0] * batch  # a new batch size: plain decoding first
        kinds, avail = kinds or [0] * batch, avail or [self.max_k] * batch
        alphas = [self.seq_estimate(s, c) for s, c in zip(seqs, kinds)]
        ks = range(self.max_k + 1)
        fresh = [s.seq_id not in self._on for s in seqs]
        plans, rate, w = zip(*(self._plan(batch, k, alphas, avail, kinds, fresh) for k in ks))
        best = 0
        for k in ks[1:]:
            margin = (_MARGIN + _NOISE * (walls.spread(k) + walls.spread(0))
                      if k in walls.steps else _UNMEASURED_MARGIN)
            if rate[k] > rate[best] * (margin if best == 0 or k not in walls.steps else 1.0):
                best = k
        if walls.probing and self.draft_cost:  # a draft probe that did not pay: back off
            walls.backoff = 1 if best else min(2 * walls.backoff, MAX_BACKOFF)
        walls.probing = False
        if best:
            alt = max((j for j in ks[1:] if j != best), key=lambda j: rate[j], default=0)
            for j in (0, alt):  # re-measure plain decoding, then the runner-up
                if walls.since(j) >= _wait(w[j] / w[best], rate[best] / rate[j]):
                    return list(plans[j])
            return list(plans[best])
        probe = max(ks[1:], key=lambda j: rate[j])
        loss = _PROBE_LOSS / 4 if self.scores_unverified else _PROBE_LOSS  # they only re-time
        # a draft's probe also pays its catch-up on the context (in plain steps)
        catchup = self.catchup_s / walls.speed / w[0] if self.draft_cost and w[0] else 0.0
        wait = walls.backoff * _wait(w[probe] / w[0], rate[0] / rate[probe], loss, catchup)
        if min(walls.since(j) for j in ks[1:]) < wait:
            return [0] * batch
        walls.probing = True
        if batch == 1:
            return [probe]
        self._one_probe = True  # at B > 1 one sequence pays for a probe, not the batch
        key = ((lambda i: -seqs[i].num_tokens) if self.draft_cost  # the cheapest catch-up
               else (lambda i: (min(probe, avail[i]) > 0, alphas[i])))  # the likeliest hit
        one = max(range(batch), key=key)
        return [probe if i == one else 0 for i in range(batch)]

    def summary(self) -> dict:
        """The controller's state, for benchmarks and logs."""
        return {"alpha": self.alpha, "draft_round_s": self.draft_round_s,
                "alpha_by_kind": {c: self.kind_alpha(c) for c in sorted(self.kinds)},
                "step_wall_s": {b: {k: w.wall(k) * w.speed for k in sorted(w.steps)}
                                for b, w in sorted(self.walls.items())}}


def _wait(step_ratio: float, ratio: float, loss: float = _PROBE_LOSS, extra: float = 0.0) -> float:
    """Steps between probes of a side whose steps take step_ratio times as long as the ones in
    use and deliver `ratio` times fewer tokens per second: a probe loses
    step_ratio (1 - 1 / ratio) steps, plus `extra` steps it pays besides (a draft's catch-up),
    so that probes cost about `loss` of the time."""
    per_probe = (step_ratio * (1 - 1 / ratio) if ratio > 0 else step_ratio) + extra
    return min(max(MIN_PROBE_EVERY, per_probe / loss), MAX_PROBE_EVERY)
