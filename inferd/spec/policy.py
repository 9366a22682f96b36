"""How many draft tokens each sequence verifies this step, and when speculation stops paying.

A verification step of 1 + k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average when
each draft is accepted with probability a, and costs 1 + F(k) + P(k) plain decode steps, where
- F(k): the target's forward with k more query rows per sequence at the current batch size,
  measured at start-up for every depth (inferd.spec.calibrate) and re-measured from the engine's
  own steps at small batches (inferd.spec.step_times). It is not linear in k: on a CPU the first
  extra rows ride along with the weights' stream and later ones are paid in FLOPs, towards k when
  the batch is large enough to be compute-bound;
- P(k): speculation's own work for chains of depth k, relative to a step, measured online: the
  proposer drafting them and the verification's bookkeeping (acceptance, the rejected drafts'
  KV rolled back), fitted as a fixed part per step plus a part per depth. Charging the fixed part
  per draft, as a cost per token would, makes depth 1 look cheap and deep chains dear, the reverse
  of the truth; leaving the bookkeeping out makes speculating look free where it is not. Only
  drafting at a depth re-measures it, so a depth's point leaves the fit once it is stale beside a
  shallower one's, and a sequence that P alone keeps at k = 0 still probes now and then: without
  both, one slow step could keep an engine from speculating for good.
a is the sequence's running acceptance rate, shrunk towards what recent drafts of every sequence
were worth: a few verifications are a noisy estimate, and a sequence that just failed twice
usually does not stay worse than the rest.
Each sequence takes the k in [0, k_max] that maximizes E(k) / cost(k); k = 0 (plain decoding)
wins by itself when the batch grows or acceptance drops, and a sequence at k = 0 probes with one
draft now and then so that its estimate can recover. `disable_by_batch_size` overrides the
batch-size side: no speculation while more sequences than that decode.

A proposer that ranks its drafts (eagle's dynamic tree, greedy sequences) knows more than a: the
head's probability that each node it could verify is the target's. Such a sequence drafts k_max
whenever any depth pays, and once its nodes are ranked verifies the b >= 1 likeliest that maximize
(1 + c * (v_1 + ... + v_b)) / (1 + F(b)), the deepest within `_TRIM_MARGIN` of the best (F is
noisy); v: the nodes' values, c: how many accepted tokens a unit of predicted value has brought
recently, across sequences (close to 1 when the head's probabilities are well calibrated).
Why: the geometric E(k) underprices the deep rows of a ranked chain (the runner-ups, and
acceptance that rises along a chain the head is sure of); with a noisy start-up F it sends
sequences to shallow depths and keeps them there, nothing ever re-measuring the deeper ones.
Drafting deep is cheap; the verified rows are what is dear, and those follow each step's own
confidence.

A draft tree (`draft_topk` > 1: w = draft_topk - 1 leaves at each of the k depths) adds w * k rows
at a leaf row's own measured cost lambda (not F's: on a CPU a step's first rows ride along with
the weights' stream and the later ones are paid in FLOPs); the leaves pay when the chain stops
before its end (1 - a^k) and a leaf at that depth is the target's token (h, the leaves' running
hit rate across sequences): a sequence verifies leaves when (E(k) + (1 - a^k) h) /
(cost(k) + lambda w k) beats E(k) / cost(k).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from inferd.scheduler.sequence import Sequence
from inferd.spec.step_times import StepTimes

_PRIOR_ACCEPTED, _PRIOR_TRIED = 1.4, 2.0  # a = 0.7 until a sequence has evidence of its own
_DECAY = 0.8  # weight of the past in the acceptance estimate, per verification step
_POOL_WEIGHT = 4.0  # drafts' worth of the shared estimate added to a sequence's own
_SPEC_TIME_DECAY = 0.8  # speculation's own time at each depth: ~5 steps' memory
# Steps after which a depth's measured own time leaves the fit, when a shallower depth was
# measured since. Only drafting at a depth re-measures it: one slow step there (the head's first
# call, a page-fault storm) would price drafting out, the sequences would sit at k = 0, and their
# probes at depth 1 could not move the stale deeper point the fitted line passes through.
# (Shallower points stay: chains at k_max are what runs, and the line through them keeps the
# fixed part.)
_SPEC_TIME_EXPIRES = 256
# Steps between probes where drafting looks too dear to ever pay (a cost per draft >= 1) but
# only by the part measured online, which a probe re-measures; the start-up F is not.
_STALE_PROBE_EVERY = 64
_TRUST_PRIOR_BELOW = 0.3  # cost per draft under which a new sequence tries at the prior
_SHARED_DECAY = 0.98  # the same for the estimate across sequences (~50 verifications' memory)
_PROBE_EVERY = 8  # steps a sequence at k = 0 waits before trying one draft again
_MAX_PROBES_PER_STEP = 0.25  # probes of the whole batch per step, on average
_PRIOR_LEAF_HITS, _PRIOR_LEAF_CHANCES = 0.6, 2.0  # h = 0.3 until leaves have been verified
_LEAF_DECAY = 0.98  # the leaves' hit rate: ~50 chances' memory
_LEAF_PROBE_EVERY = 16  # verifications between tries of the leaves while they do not pay
_CALIBRATION_DECAY = 0.98  # accepted over predicted for ranked drafts: ~50 verifications' memory
_PRIOR_CALIBRATION_WEIGHT = 2.0  # predicted tokens' worth of the prior c = 1
# How much better fewer ranked rows must do than more before the policy trims them: F is a
# noisy measurement (a deep row's cost can come out several times too dear), and trimming on a
# mispriced F verifies fewer rows and emits fewer tokens. Where rows truly are dear, 5 % still
# keeps a good part of what trimming gains.
_TRIM_MARGIN = 0.05


@dataclass(slots=True)
class SpecState:
    accepted: float = _PRIOR_ACCEPTED  # decayed count of accepted drafts
    tried: float = _PRIOR_TRIED  # ... of drafts the verifier looked at
    steps_off: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verification of k drafts emits when each is accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_depth(a: float, k_max: int, cost: float | Callable[[int], float]) -> int:
    """The depth maximizing E(k) / cost(k): `cost(k)` the cost of verifying k drafts in plain
    steps, or a number: each draft costs that much (cost(k) = 1 + cost * k). Plain decoding must
    win by a margin (ties go to it); between depths the better rate wins."""
    cost_of = cost if callable(cost) else (lambda k: 1.0 + cost * k)
    best_k, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(a, k) / cost_of(k)
        if rate > best_rate * (1.02 if best_k == 0 else 1.0):
            best_k, best_rate = k, rate
    return best_k


def probe_interval(cost_per_draft: float, batch_size: int = 1) -> int:
    """Steps between probes of a sequence at k = 0, 0 for none. A probe costs `cost_per_draft` of
    a decode step and is wasted when acceptance really is low, so probes space out as the cost
    grows (_PROBE_EVERY steps when drafts are free, _PROBE_EVERY / (1 - cost) otherwise); from
    cost 1 on no depth can pay even if every draft were accepted (E(k) <= k + 1 <= 1 + cost * k):
    no probing. Each sequence probing on its own clock, a batch of B makes B / interval probes per
    step, each a verification row and its bookkeeping, which at large batches would cost more than
    the probes can win back: at most _MAX_PROBES_PER_STEP probes per step across the batch."""
    if cost_per_draft >= 1.0:
        return 0
    own = max(_PROBE_EVERY, round(_PROBE_EVERY / (1.0 - cost_per_draft)))
    return max(own, math.ceil(batch_size / _MAX_PROBES_PER_STEP))


class SpecPolicy:
    """Chooses each decoding sequence's depth per step (`depths`), how many ranked nodes and draft
    tree leaves it verifies (`verified_rows`, `leaf_widths`), and learns from each verification's
    outcome and timing (`record`, `record_speculation_time`, `record_forward`)."""

    def __init__(self, k_max: int, disable_by_batch_size: int | None,
                 verify_cost: dict[int, float | list[float]] | None = None, leaf_width: int = 0,
                 leaf_cost: dict[int, float] | None = None,
                 ranked: bool = False) -> None:  # fmt: skip
        """`verify_cost`: by batch size, F(1..k_max) (the forward's extra cost of verifying 1..k_max
        drafts per sequence, in plain steps), or one number: each draft costs that much.
        `ranked`: the proposer ranks greedy sequences' drafts (`verified_rows` picks how many)."""
        self.k_max = k_max
        self.ranked = ranked
        self.trim_margin = _TRIM_MARGIN
        # Accepted tokens and the ranked nodes' predicted value, over recent verifications.
        self._calib_accepted = self._calib_predicted = _PRIOR_CALIBRATION_WEIGHT
        self.leaf_width = leaf_width  # leaves per depth of a draft tree (draft_topk - 1)
        # A leaf row's cost by batch size (inferd.spec.calibrate); none measured: per draft's.
        self.leaf_cost = dict(sorted((leaf_cost or {}).items()))
        self._leaf_hits, self._leaf_chances = _PRIOR_LEAF_HITS, _PRIOR_LEAF_CHANCES
        self._leaves_off = 0  # verifications since the leaves last paid
        self.disable_by_batch_size = disable_by_batch_size
        # F by batch size (sorted keys), one entry per depth 1..k_max; empty: verification is free.
        self.verify_cost = {
            b: list(c) if isinstance(c, (list, tuple)) else [c * j for j in range(1, k_max + 1)]
            for b, c in sorted((verify_cost or {}).items())
        }
        # Speculation's own time relative to a step, by the step's deepest chain: a decayed sum
        # and weight per depth, from which `speculation_cost` fits a fixed part and a per-depth one.
        self._spec_time_sum = [0.0] * (k_max + 1)
        self._spec_time_weight = [0.0] * (k_max + 1)
        self._spec_time_line: tuple[float, float] | None = None  # (fixed, per depth), once fitted
        self._spec_time_step = [0] * (k_max + 1)  # the step each depth was last measured at
        self._step = 0  # calls of `depths`
        self._fitted_depths: tuple[int, ...] = ()  # the depths the fitted line went through
        self._seen_accepted = self._seen_tried = 0.0  # every sequence's verifications, decayed
        # F re-measured from the engine's own steps at small batches (inferd.spec.step_times).
        self.step_times = StepTimes() if self.verify_cost else None

    def forward_cost(self, batch_size: int, k: int) -> float:
        """F(k) at this batch size: the forward's extra cost of k drafts per sequence (rows), as
        recent steps measured it where they did, else as the start-up calibration did."""
        if k <= 0 or not self.verify_cost:
            return 0.0
        measured = self.step_times.extra_cost(batch_size, k) if self.step_times else None
        if measured is not None:
            return measured
        k = min(k, self.k_max)
        return _interpolate({b: c[k - 1] for b, c in self.verify_cost.items()}, batch_size)

    def record_forward(self, batch_size: int, extra_rows: int | None, seconds: float) -> None:
        """A decode step's forward took `seconds`: `batch_size` sequences, `extra_rows` rows each
        beyond their one (None: rows differ between sequences, or some prefill)."""
        if self.step_times is not None:
            self.step_times.record(batch_size, extra_rows, seconds)

    def beta(self, batch_size: int) -> float:
        """The forward's extra cost per draft at k_max drafts (F(k_max) / k_max)."""
        return self.forward_cost(batch_size, self.k_max) / self.k_max

    def speculation_cost(self, k: int) -> float:
        """P(k): speculation's own time for chains of depth k, relative to a step. A line through
        the depths measured so far (fixed part >= 0, slope >= 0); from one depth alone, all of it
        per depth (P(k) = k * measured / depth), which never favours deeper chains unmeasured."""
        if k <= 0:
            return 0.0
        if self._spec_time_line is None:
            self._spec_time_line = self._fit_spec_time()
        fixed, per_depth = self._spec_time_line
        return fixed + per_depth * k

    def _measured_depths(self) -> tuple[int, ...]:
        """The depths whose own time enters the fit: every measured one but those measured more
        than _SPEC_TIME_EXPIRES steps ago that are deeper than one measured since."""
        measured = [d for d, w in enumerate(self._spec_time_weight) if w > 1e-9]
        fresh = [d for d in measured if self._step - self._spec_time_step[d] <= _SPEC_TIME_EXPIRES]
        shallowest = min(fresh, default=self.k_max + 1)
        return tuple(d for d in measured if d in fresh or d < shallowest)

    def _fit_spec_time(self) -> tuple[float, float]:
        self._fitted_depths = depths = self._measured_depths()
        pts = [(d, self._spec_time_sum[d] / self._spec_time_weight[d], self._spec_time_weight[d])
               for d in depths]  # fmt: skip
        if not pts:
            return 0.0, 0.0
        if len(pts) == 1:
            d, r, _ = pts[0]
            return 0.0, r / d
        total = sum(w for *_, w in pts)
        md = sum(d * w for d, _, w in pts) / total
        mr = sum(r * w for _, r, w in pts) / total
        var = sum(w * (d - md) ** 2 for d, _, w in pts)
        slope = max(0.0, sum(w * (d - md) * (r - mr) for d, r, w in pts) / var)
        return max(0.0, mr - slope * md), slope

    def cost(self, batch_size: int, k: int) -> float:
        """A step verifying k drafts per sequence, in plain steps: 1 + F(k) + P(k)."""
        return 1.0 + self.forward_cost(batch_size, k) + self.speculation_cost(k)

    def leaf_beta(self, batch_size: int) -> float:
        return _interpolate(self.leaf_cost, batch_size) if self.leaf_cost else self.beta(batch_size)

    def acceptance(self, state: SpecState) -> float:
        """The sequence's acceptance rate, shrunk towards every sequence's recent one (itself
        from the prior until there is evidence)."""
        pooled = (self._seen_accepted + _PRIOR_ACCEPTED) / (self._seen_tried + _PRIOR_TRIED)
        return (state.accepted + _POOL_WEIGHT * pooled) / (state.tried + _POOL_WEIGHT)

    def depths(self, seqs: list[Sequence], batch_size: int) -> list[int]:
        """k per sequence for this step (0: no drafts); `batch_size`: sequences decoding."""
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return [0] * len(seqs)
        if self.step_times is not None and self.step_times.wants_reference(batch_size):
            return [0] * len(seqs)  # a plain step, timed beside its neighbours (step_times)
        self._step += 1
        if self._spec_time_line is not None and self._measured_depths() != self._fitted_depths:
            self._spec_time_line = None  # a depth's measurement expired: refitted without it
        costs = [self.cost(batch_size, k) for k in range(self.k_max + 1)]
        probe_every = probe_interval(costs[1] - 1.0, batch_size)
        if not probe_every and self.forward_cost(batch_size, 1) < 1.0:
            probe_every = max(_STALE_PROBE_EVERY, probe_interval(0.0, batch_size))
        ks = []
        for seq in seqs:
            state = seq.spec.policy_state
            if state is None:
                state = seq.spec.policy_state = self._fresh_state(costs[1] - 1.0)
            k = best_depth(self.acceptance(state), self.k_max, costs.__getitem__)
            if k == 0:
                state.steps_off += 1
                if probe_every and state.steps_off % probe_every == 0:
                    k = 1
            else:
                state.steps_off = 0
                if self.ranked and seq.params.greedy:  # the rows follow the ranked nodes
                    k = self.k_max
            remaining = _remaining_tokens(seq)
            ks.append(max(0, min(k, remaining - 1)))
        return ks

    @property
    def calibration(self) -> float:
        """c: accepted tokens per unit of the ranked nodes' predicted value, recently."""
        return self._calib_accepted / self._calib_predicted

    def verified_rows(self, values: list[float], batch_size: int) -> int:
        """How many of a ranked chain's nodes to verify: values, descending, are each node's
        probability of being the target's (the proposer's own). The deepest b whose rate is
        within `trim_margin` of the best. At least one: `depths` already found that speculating
        pays, and c is only measured on verified nodes (at 0 a low c would never be corrected)."""
        c = self.calibration
        rates, expected = [], 1.0
        for b, v in enumerate(values, start=1):
            expected += c * v
            rates.append(expected / (1.0 + self.forward_cost(batch_size, b)))
        if not rates:
            return 0
        best = max(rates)
        # The deepest b within the margin of the best rate
        floor = best / (1.0 + self.trim_margin)
        return max(b for b, rate in enumerate(rates, start=1) if rate >= floor)

    def leaf_widths(self, seqs: list[Sequence], ks: list[int], batch_size: int) -> list[int]:
        """Leaves per depth for each sequence's chain of k drafts (0: a chain alone)."""
        if not self.leaf_width:
            return [0] * len(seqs)
        leaf_cost = self.leaf_beta(batch_size)
        h = self._leaf_hits / self._leaf_chances
        widths = []
        for seq, k in zip(seqs, ks):
            pays = False
            if k > 0 and seq.params.greedy:
                a = self.acceptance(seq.spec.policy_state)
                tokens, cost = expected_tokens(a, k), self.cost(batch_size, k)
                with_leaves = (tokens + (1.0 - a**k) * h) / (cost + leaf_cost * self.leaf_width * k)
                pays = with_leaves > tokens / cost * 1.02
                if not pays:  # try now and then: the hit rate only moves when leaves are verified
                    self._leaves_off += 1
                    pays = self._leaves_off % _LEAF_PROBE_EVERY == 0
            widths.append(self.leaf_width if pays else 0)
        return widths

    def _fresh_state(self, cost: float) -> SpecState:
        """A new sequence's estimate. Where a draft costs little (under _TRUST_PRIOR_BELOW of a
        step) the optimistic prior (a = 0.7) lets it try at once; where it costs more it starts
        at the acceptance recent sequences saw, with the prior's weight (the prior itself until
        there are some): with the prior alone, every request of a large batch would verify a few
        times at a loss before its own evidence stopped it."""
        if cost < _TRUST_PRIOR_BELOW or self._seen_tried < _PRIOR_TRIED:
            return SpecState()
        a = self._seen_accepted / self._seen_tried
        return SpecState(accepted=a * _PRIOR_TRIED, tried=_PRIOR_TRIED)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int,
               leaves: list[tuple[int, int]] = (), leaf_hit: bool = False,
               expected: float | None = None) -> None:  # fmt: skip
        """A verification's outcome: drafts 1..num_accepted matched, the next one (if any) did not;
        `leaves` (depth, token) were verified too, and one was accepted if `leaf_hit`. `expected`:
        the proposer's predicted accepted count, for ranked drafts."""
        state = seq.spec.policy_state
        if state is None or num_drafts == 0:
            return
        if expected is not None:
            self._calib_accepted = _CALIBRATION_DECAY * self._calib_accepted + num_accepted
            self._calib_predicted = _CALIBRATION_DECAY * self._calib_predicted + expected
        if num_accepted < num_drafts and any(d == num_accepted + 1 for d, _ in leaves):
            self._leaf_hits = _LEAF_DECAY * self._leaf_hits + leaf_hit
            self._leaf_chances = _LEAF_DECAY * self._leaf_chances + 1.0
        looked_at = min(num_accepted + 1, num_drafts)
        state.accepted = _DECAY * state.accepted + num_accepted
        state.tried = _DECAY * state.tried + looked_at
        # Across sequences, decayed per verification: what recent drafts of this proposer were
        # worth.
        self._seen_accepted = _SHARED_DECAY * self._seen_accepted + num_accepted
        self._seen_tried = _SHARED_DECAY * self._seen_tried + looked_at

    def record_speculation_time(self, seconds: float, depth: int, step_seconds: float) -> None:
        """Drafting chains of at most `depth` tokens (for every sequence that speculated) and
        verifying them took `seconds` beyond the forward; the step took `step_seconds`."""
        if 0 < depth <= self.k_max and step_seconds > 0:
            sums, weights = self._spec_time_sum, self._spec_time_weight
            sums[depth] = _SPEC_TIME_DECAY * sums[depth] + seconds / step_seconds
            weights[depth] = _SPEC_TIME_DECAY * weights[depth] + 1.0
            self._spec_time_step[depth] = self._step
            self._spec_time_line = None  # refitted when next asked


class FixedDepthPolicy(SpecPolicy):
    """`adaptive_depth: false`: every sequence drafts k_max each step (fewer only where max_tokens
    ends it sooner), verifies every ranked node and, for greedy requests, every leaf; no cost is
    measured (outcomes are still recorded, for the metrics). Above `disable_by_batch_size` sequences still decode plainly."""

    def __init__(self, k_max: int, disable_by_batch_size: int | None, leaf_width: int = 0,
                 ranked: bool = False) -> None:  # fmt: skip
        super().__init__(k_max, disable_by_batch_size, None, leaf_width=leaf_width, ranked=ranked)

    def depths(self, seqs: list[Sequence], batch_size: int) -> list[int]:
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return [0] * len(seqs)
        return [max(0, min(self.k_max, _remaining_tokens(seq) - 1)) for seq in seqs]

    def verified_rows(self, values: list[float], batch_size: int) -> int:
        return len(values)

    def leaf_widths(self, seqs: list[Sequence], ks: list[int], batch_size: int) -> list[int]:
        return [self.leaf_width if k > 0 and seq.params.greedy else 0 for seq, k in zip(seqs, ks)]


def _interpolate(costs: dict[int, float], batch_size: int) -> float:
    """A cost measured at some batch sizes (sorted keys), linear in between; 0 when none."""
    sizes = list(costs)
    if not sizes:
        return 0.0
    i = bisect.bisect_right(sizes, batch_size) - 1
    if i < 0:
        return costs[sizes[0]]
    if i == len(sizes) - 1:
        return costs[sizes[-1]]
    lo, hi = sizes[i], sizes[i + 1]
    t = (batch_size - lo) / (hi - lo)
    return (1 - t) * costs[lo] + t * costs[hi]


def _remaining_tokens(seq: Sequence) -> int:
    """Tokens the sequence may still emit before max_tokens ends it."""
    max_tokens = seq.params.max_tokens
    return 1 << 30 if max_tokens is None else max_tokens - seq.num_output_tokens
