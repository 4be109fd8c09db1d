"""Per step size, whether a model with packed 4-bit weights multiplies them packed or dense.

The packed kernels (layers/quant.py) read 8x fewer weight bytes but are compute-bound per row
(~3 cycles per 32 weights and row on AVX2); the dense products (float32, or bf16 on CPUs with
bf16 units) stream every weight but then cost far less per row. Which is faster at 6-40 rows
depends on the CPU and its load: on an EPYC with AVX-512 bf16 units a 16-row decode step took
56 ms packed and 43 dense, and a 31-row one 94 against 60, where earlier measurements on an
AVX2-only EPYC had packed ahead up to 40 rows. So the runner measures both on the steps themselves, per row count, and keeps the
faster: each side twice, alternating, then the other side again every RECHECK steps of that
size (a loser 1.3x as slow then costs ~0.5% of those steps). A size is not tried where a
smaller one ran faster dense or a larger one packed. Below MIN_ROWS packed wins by
3x or more and is not tried; from the packed limit on every product is dense anyway.
"""
from __future__ import annotations

import os
import statistics

MIN_ROWS = 6
SAMPLES = 2  # steps per side before choosing
WINDOW = 5  # latest steps per side whose median counts
RECHECK = 64  # steps of one size between re-measurements of the side not in use


class PackedRowChoice:
    def __init__(self, limit: int, min_rows: int = MIN_ROWS):
        """limit: the most rows every packed kernel takes (layers.linear.packed_row_limit)."""
        self.limit, self.min_rows = limit, min_rows
        self._times: dict[tuple[int, bool], list[float]] = {}  # (rows, dense) -> seconds
        self._steps: dict[int, int] = {}  # steps seen per row count
        self._last: dict[tuple[int, bool], int] = {}  # (rows, dense) -> its latest step

    @classmethod
    def for_model(cls, model) -> PackedRowChoice | None:
        """None where the model has no packed weights or PAGELLM_PACKED_ROWS=fixed (each
        packed form's own limit, for comparisons)."""
        from pagellm.layers.linear import packed_row_limit

        limit = packed_row_limit(model)
        if limit is None or limit < MIN_ROWS or os.environ.get("PAGELLM_PACKED_ROWS") == "fixed":
            return None
        return cls(limit)

    def choose(self, rows: int) -> int | None:
        """The dense_from row count for a step of `rows` rows: `rows` (dense) or None."""
        return rows if self._dense(rows) else None

    def _dense(self, rows: int) -> bool:
        if not self.min_rows <= rows <= self.limit:
            return False
        if self._measured(rows):
            best = self._best(rows)
            if self._steps.get(rows, 0) - self._last.get((rows, not best), 0) >= RECHECK:
                return not best
            return best
        settled = self._settled(rows)
        if settled is not None:
            return settled
        packed, dense = self._times.get((rows, False), []), self._times.get((rows, True), [])
        return len(dense) < len(packed)  # alternate: packed, dense, packed, dense

    def _settled(self, rows: int) -> bool | None:
        """For a size not measured on both sides: dense (True) or packed where its neighbours
        say so. A packed product's time grows with its rows, a dense one's far less, so dense
        winning at fewer rows, or packed at more, settles a size without trying both. None:
        unknown."""
        decided = {n: self._best(n) for n in self._steps if self._measured(n)}
        if any(d for n, d in decided.items() if n < rows):
            return True
        if any(not d for n, d in decided.items() if n > rows):
            return False
        return None

    def _measured(self, rows: int) -> bool:
        return all(len(self._times.get((rows, d), [])) >= SAMPLES for d in (False, True))

    def _best(self, rows: int) -> bool:
        return (statistics.median(self._times[(rows, True)])
                < statistics.median(self._times[(rows, False)]))

    def observe(self, rows: int, dense_from: int | None, seconds: float) -> None:
        if not self.min_rows <= rows <= self.limit:
            return
        side = (rows, dense_from is not None)
        times = self._times.setdefault(side, [])
        times.append(seconds)
        del times[:-WINDOW]
        self._steps[rows] = self._steps.get(rows, 0) + 1
        self._last[side] = self._steps[rows]

    def summary(self) -> dict[int, str]:
        """Per row count measured on both sides, the side in use."""
        return {n: "dense" if self._best(n) else "packed" for n in sorted(self._steps)
                if self._measured(n)}
