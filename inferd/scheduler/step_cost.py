"""What a step costs, learnt from the engine's own step times: a linear model per kind of token.

    seconds(step) ≈ fixed + per_decode · decode rows + per_prefill · prefill tokens
                    + per_attention · query-key pairs / 1024

A decode row is a running stream's token (a verification's 1 + k rows count as decode rows); a
prefill token is a prompt token computed this step; the query-key pairs are what attention reads,
Σ over the step's sequences of n · (start + (n + 1) / 2) for n tokens from position `start` (long
contexts make a decode row dearer than at the start of a stream).

Fitted by least squares with forgetting (the last ~`memory` steps weigh the most: the machine's
speed moves, other processes come and go), with every coefficient kept >= 0 (a negative
per-token cost would let the step budget grant unlimited tokens), and a step that took more than
`outlier` times its prediction is left out once the model is fitted (a step that lost the CPU to
another process says nothing about what the tokens cost), unless `max_outliers` in a row were:
then the machine itself has slowed, the past is mostly forgotten (weighed 1/16) and the run of
slow steps taken in.

`FixedStepCost` is a model whose coefficients are given: the tests' and anyone who measured once.
"""

from __future__ import annotations

from dataclasses import dataclass

_FEATURES = 4  # fixed, decode rows, prefill tokens, query-key pairs / 1024
_RIDGE = 1e-9  # keeps the normal equations solvable before the features have varied
_FORGET_ON_SHIFT = 1 / 16  # weight of the past once a run of slow steps shows the machine slowed


def attention_pairs(start: int, n: int) -> float:
    """Query-key pairs of `n` tokens at positions [start, start + n), causal: Σ (start + i + 1)."""
    return n * (start + (n + 1) / 2)


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step's work as the cost model sees it."""

    decode_rows: int = 0
    prefill_tokens: int = 0
    attention_pairs: float = 0.0

    def features(self) -> tuple[float, float, float, float]:
        return (
            1.0,
            float(self.decode_rows),
            float(self.prefill_tokens),
            self.attention_pairs / 1024,
        )


class StepCost:
    """The interface: predicted seconds of a step, and the cost of `n` more prefill tokens."""

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(fixed, per decode row, per prefill token, per 1024 query-key pairs) in seconds, or
        None while the model knows too little to predict."""
        raise NotImplementedError

    def seconds(self, shape: StepShape) -> float | None:
        c = self.coefficients()
        if c is None:
            return None
        return sum(a * x for a, x in zip(c, shape.features()))

    def prefill_seconds(self, start: int, n: int) -> float:
        """What `n` prefill tokens from position `start` add to a step (0 while unfitted)."""
        c = self.coefficients()
        if c is None:
            return 0.0
        return c[2] * n + c[3] * attention_pairs(start, n) / 1024

    def max_prefill_tokens(self, start: int, seconds: float, limit: int) -> int:
        """The most prefill tokens from position `start`, at most `limit`, that add at most
        `seconds` to a step (cost grows with n, so a bisection finds it)."""
        if self.prefill_seconds(start, limit) <= seconds:
            return limit
        lo, hi = 0, limit  # prefill_seconds(lo) <= seconds < prefill_seconds(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.prefill_seconds(start, mid) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo

    def record(self, shape: StepShape, seconds: float) -> None:
        """A step of `shape` took `seconds` (no-op for a fixed model)."""


class FixedStepCost(StepCost):
    """Given coefficients (seconds): fixed, per decode row, per prefill token, per 1024 pairs."""

    def __init__(
        self, fixed: float, per_decode: float, per_prefill: float, per_attention: float = 0.0
    ) -> None:
        self._c = (fixed, per_decode, per_prefill, per_attention)

    def coefficients(self) -> tuple[float, float, float, float]:
        return self._c


class LearnedStepCost(StepCost):
    """Fitted online to the steps the engine times. Unfitted (None) until `min_samples` steps
    have been seen, among them steps with and without prefill tokens (otherwise the per-token
    prices cannot be told from the fixed part)."""

    def __init__(self, memory: int = 256, min_samples: int = 16, outlier: float = 3.0,
                 max_outliers: int = 8, refit_every: int = 8) -> None:  # fmt: skip
        self.max_outliers = max_outliers
        self._slow_run: list[tuple[tuple[float, ...], float]] = []  # outliers in a row: (x, y)
        self.refit_every = refit_every
        self._since_fit = 0
        self.decay = 1.0 - 1.0 / memory
        self.min_samples = min_samples
        self.outlier = outlier
        # Normal equations, decayed: gram = Σ w x xᵀ, moment = Σ w x y.
        self._gram = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._moment = [0.0] * _FEATURES
        self._coef: list[float] = [0.0] * _FEATURES
        self._fresh = False  # whether _coef is the fit of the sums (refitted every few samples)
        self.num_samples = 0
        self.num_with_prefill = 0
        self.num_without_prefill = 0
        self.num_outliers = 0

    @property
    def fitted(self) -> bool:
        return (self.num_samples >= self.min_samples and self.num_with_prefill >= 2
                and self.num_without_prefill >= 2)  # fmt: skip

    def record(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or (shape.decode_rows == 0 and shape.prefill_tokens == 0):
            return
        shifted = False
        if self.fitted:
            predicted = self.seconds(shape)
            if predicted is not None and predicted > 0 and seconds > self.outlier * predicted:
                self.num_outliers += 1
                self._slow_run.append((shape.features(), seconds))
                if len(self._slow_run) < self.max_outliers:
                    return
                # The machine has slowed: forget most of the past, take the slow run in.
                self._add(self._slow_run[:-1], decay=_FORGET_ON_SHIFT)
                shifted = True
        self._add([(shape.features(), seconds)], decay=self.decay)
        self._slow_run = []
        self.num_samples += 1
        if shape.prefill_tokens:
            self.num_with_prefill += 1
        else:
            self.num_without_prefill += 1
        self._since_fit += 1
        if shifted or self._since_fit >= self.refit_every or not self.fitted:
            self._fresh = False

    def _add(self, samples: list[tuple[tuple[float, ...], float]], decay: float) -> None:
        """Scale the sums by `decay`, then add `samples` (each decayed by the ones after it)."""
        for i in range(_FEATURES):
            self._moment[i] *= decay
            for j in range(_FEATURES):
                self._gram[i][j] *= decay
        for n, (x, y) in enumerate(samples):
            d = 1.0 if n == 0 else self.decay
            for i in range(_FEATURES):
                row = self._gram[i]
                for j in range(_FEATURES):
                    row[j] = d * row[j] + x[i] * x[j]
                self._moment[i] = d * self._moment[i] + x[i] * y

    def coefficients(self) -> tuple[float, float, float, float] | None:
        if not self.fitted:
            return None
        if not self._fresh:
            self._coef = _nonnegative_least_squares(self._gram, self._moment)
            self._fresh = True
            self._since_fit = 0
        c = self._coef
        return (c[0], c[1], c[2], c[3])


def _nonnegative_least_squares(gram: list[list[float]], moment: list[float]) -> list[float]:
    """argmin_{c >= 0} cᵀ G c / 2 - cᵀ m, exactly: the optimum is the unconstrained optimum on its
    own support, so of every support (16 for 4 unknowns) whose solution is >= 0 the one with the
    least objective wins. A few hundred microseconds, run once per `refit_every` samples."""
    n = len(moment)
    scale = max(gram[i][i] for i in range(n)) or 1.0
    best, best_f = [0.0] * n, 0.0
    for mask in range(1, 1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        sub = [[gram[i][j] + (_RIDGE * scale if i == j else 0.0) for j in idx] for i in idx]
        sol = _solve(sub, [moment[i] for i in idx])
        if sol is None or min(sol) < 0:
            continue
        c = [0.0] * n
        for i, v in zip(idx, sol):
            c[i] = v
        f = 0.5 * sum(c[i] * gram[i][j] * c[j] for i in range(n) for j in range(n)) - sum(
            c[i] * moment[i] for i in range(n)
        )
        if f < best_f:
            best, best_f = c, f
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b by Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
