"""The forward's extra cost of verification rows, re-measured from the engine's own steps.

The start-up calibration (inferd.spec.calibrate) times a few pairs of steps per depth. At small
batches, on a machine whose speed moves from step to step, that is too few: one calibration's F(j)
can be several times what the engine's real steps cost. The policy trims a ranked chain's rows
and decides whether to speculate at all from F, so an overpriced F leaves it verifying too few
drafts, or none.

So decode steps are timed as they run. Each plain step (no drafts) next to a verification step of
j extra rows per sequence, at the same batch size, gives one sample of t(j) / t(0): neighbours
ran milliseconds apart, so a change of the machine's speed hits both. The median of the recent
samples replaces the start-up F(j) once there are enough. Plain steps are rare where speculation
pays (at batch 1: a request's last token), so the policy asks for one now and then
(`wants_reference`): one step in _REFERENCE_EVERY emits one token instead of several.
"""

from __future__ import annotations

import statistics
from collections import deque

# Batch sizes re-measured online: larger batches' steps are long enough for the start-up
# calibration to be steady, and there a plain reference step would cost more tokens.
MAX_BATCH = 8
_WINDOW = 31  # samples kept per (batch size, extra rows): the recent ones (one pair alone is noisy)
_MIN_SAMPLES = 8  # before which the start-up figure stands
_REFERENCE_EVERY = 48  # steps at a batch size without a plain one before the policy asks for one


class StepTimes:
    """Ratios t(j) / t(0) of neighbouring decode steps, by batch size and extra rows j."""

    def __init__(self, reference_every: int = _REFERENCE_EVERY) -> None:
        self.reference_every = reference_every
        self._ratios: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}
        self._prev: tuple[int, int, float] | None = None  # the last step: (batch, rows, seconds)
        # Decode steps at each batch size since its last plain one.
        self._since_plain: dict[int, int] = {}

    def record(self, batch_size: int, extra_rows: int | None, seconds: float) -> None:
        """A step's forward: `batch_size` decoding sequences with `extra_rows` rows each beyond
        their one (None: not a uniform decode step, which pairs with nothing)."""
        prev, self._prev = self._prev, None
        if extra_rows is None or batch_size > MAX_BATCH or seconds <= 0:
            return
        self._prev = (batch_size, extra_rows, seconds)
        self._since_plain[batch_size] = (
            0 if extra_rows == 0 else self._since_plain.get(batch_size, 0) + 1
        )
        if prev is None or prev[0] != batch_size or (prev[1] == 0) == (extra_rows == 0):
            return  # a pair needs one plain step and one verification at the same batch size
        (j, t_rows), t_plain = (
            ((extra_rows, seconds), prev[2]) if prev[1] == 0 else ((prev[1], prev[2]), seconds)
        )
        key = (batch_size, j)
        self._ratios.setdefault(key, deque(maxlen=_WINDOW)).append(t_rows / t_plain)
        self._medians.pop(key, None)

    def extra_cost(self, batch_size: int, extra_rows: int) -> float | None:
        """F(extra_rows) at this batch size as measured from recent steps; None: too few."""
        key = (batch_size, extra_rows)
        if key not in self._medians:
            ratios = self._ratios.get(key, ())
            if len(ratios) < _MIN_SAMPLES:
                return None
            self._medians[key] = max(0.0, statistics.median(ratios) - 1.0)
        return self._medians[key]

    def wants_reference(self, batch_size: int) -> bool:
        """Whether this step should be a plain one (no drafts), to pair with its neighbours."""
        return (
            batch_size <= MAX_BATCH and self._since_plain.get(batch_size, 0) >= self.reference_every
        )
