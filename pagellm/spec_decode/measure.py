"""What the speculation controller (adaptive.py) measures: acceptance per kind of proposal,
and whole-step wall times per batch size and k."""
from __future__ import annotations

import math
import statistics
from collections import deque

EMA = 0.2  # weight of a new observation in the forgetting averages (~5 observations' memory)
PRIOR_WEIGHT = 2.0  # observations the prior acceptance counts for: one bad draft moves it far
_WINDOW = 9  # steps per (batch size, k) whose median is its wall: outliers do not move it
STALE_AFTER = 8  # steps after which a k's average tokens per step start anew
# The speed drifts back to 1 over ~1 / REVERT steps: the walls of the k in use follow it
# within their window, and without the pull speed and walls could wander together for good
# (a scale nothing else fixes), taking the stale walls of the other k with them.
REVERT = 1 / 256
_RATIOS = 5  # steps whose median ratio to their walls moves the speed (a slow one does not)


class KindAcceptance:
    """Acceptance of one kind of proposal: forgetting sums of accepted and tried proposals,
    and per position j >= 2 how often it was reached (j - 1 accepted) and accepted."""

    def __init__(self, max_k: int):
        self.acc = self.tried = 0.0
        self.reach, self.hit = [0.0] * (max_k + 1), [0.0] * (max_k + 1)

    def observe(self, accepted: int, tried: int) -> None:
        self.acc = (1 - EMA) * self.acc + accepted
        self.tried = (1 - EMA) * self.tried + tried
        for j in range(2, tried + 1):
            self.reach[j] = (1 - EMA / 4) * self.reach[j] + 1
            self.hit[j] = (1 - EMA / 4) * self.hit[j] + (j <= accepted)

    def rate(self, prior: float) -> float:
        return (self.acc + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)


class StepWalls:
    """Whole-step wall times at one batch size, per k: the latest _WINDOW (seconds in units of
    the machine's speed, proposals verified), and the tokens a step emits (averaged)."""

    def __init__(self):
        self.steps: dict[int, deque] = {}
        self._median: dict[int, tuple[float, float]] = {}  # k -> (wall, rows) of its window
        self.tokens: dict[int, float] = {}
        self.token_steps: dict[int, int] = {}  # steps in k's tokens average since it restarted
        self.last: dict[int, int] = {}  # step number of each k's latest measurement
        self.num = 0
        self.speed = 1.0  # the machine's slowness now, relative to the walls kept
        self._ratios: deque = deque(maxlen=_RATIOS)  # latest log(step / (speed * wall))
        self.backoff, self.probing = 1, False

    def observe(self, k: int, seconds: float, rows: int, tokens: float) -> None:
        # Each step's ratio to its k's wall moves a speed common to every k: the side not in
        # use is measured rarely, and walls from two moods of a shared machine do not compare.
        if k in self.steps:
            # the median of the latest steps' log ratios, not this step's: a wall is a
            # median, so a speed moved by the mean would drift with every slow outlier (1% of
            # steps at 3x: a factor 1,000 in 8,000 plain steps, and a stale k's wall with it)
            self._ratios.append(math.log(seconds / (self.speed * self.wall(k))))
            self.speed = math.exp((1 - REVERT) * math.log(self.speed)
                                  + EMA * statistics.median(self._ratios))
        window = self.steps.setdefault(k, deque(maxlen=_WINDOW))
        window.append((seconds / self.speed, rows))
        self._median[k] = (statistics.median(s for s, _ in window),
                           statistics.median(r for _, r in window))
        # Tokens follow the workload, a step's time does not: after a pause they start anew.
        old = self.tokens.get(k) if self.since(k) <= STALE_AFTER else None
        self.tokens[k] = tokens if old is None else old + EMA * (tokens - old)
        self.token_steps[k] = 1 if old is None else self.token_steps[k] + 1
        self.tick(k)

    def tick(self, k: int) -> None:
        self.num += 1
        self.last[k] = self.num

    def since(self, k: int) -> int:  # steps since k was last measured
        return self.num - self.last.get(k, 0)

    def wall(self, k: int) -> float:
        return self._median[k][0]

    def rows(self, k: int) -> float:
        return self._median[k][1]

    def rate(self, k: int, in_a_row: int = 1) -> float | None:
        """Tokens/s measured, once measured twice and its tokens average `in_a_row` steps
        since they last restarted (after a pause they start from one step)."""
        if len(self.steps.get(k, ())) < 2 or self.token_steps.get(k, 0) < in_a_row:
            return None
        return self.tokens[k] / self.wall(k)

    def spread(self, k: int) -> float:
        """Relative standard error of k's median: ~1.25 sigma / sqrt(n), sigma = 1.4826 MAD."""
        got = [s for s, _ in self.steps.get(k, ())]
        if len(got) < 2:
            return 0.0
        mid = self.wall(k)
        mad = statistics.median(abs(x - mid) for x in got)
        return 1.25 * 1.4826 * mad / (len(got) ** 0.5 * mid) if mid > 0 else 0.0

    def row_cost(self, batch: int, draft_round: float) -> float | None:
        """A verified row's extra time over the measured k, in rows of a plain step, less
        its k draft rounds (draft_round: seconds now; the walls are in units of the speed)."""
        if 0 not in self.steps:
            return None
        w0, draft = self.wall(0), draft_round / self.speed
        costs = [(self.wall(k) - w0 - k * draft) / self.rows(k) / (w0 / batch)
                 for k in self.steps if k and self.rows(k)]
        return max(0.0, statistics.fmean(costs)) if costs else None
