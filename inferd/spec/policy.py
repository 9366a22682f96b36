"""How many draft tokens each sequence verifies this step, and when speculation stops paying.

A verification step of 1 + k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average when
each draft is accepted with probability a (the sequence's running acceptance rate), and costs
1 + (beta + delta) * k plain decode steps, where
- beta: the extra cost of one more query token per sequence in the target's forward at the
  current batch size — nearly 0 at batch 1 on a memory-bound machine, towards 1 when the batch is
  large enough to be compute-bound (measured at start-up, inferd.spec.calibrate);
- delta: what the proposer spends per draft token, relative to a target step (measured online).
Each sequence takes the k in [0, k_max] that maximizes E(k) / cost(k); k = 0 (plain decoding)
wins by itself when the batch grows or acceptance drops, and a sequence at k = 0 probes with one
draft now and then so that its estimate can recover. `disable_by_batch_size` overrides the
batch-size side: no speculation while more sequences than that decode.

A draft tree (`draft_topk` > 1: w = draft_topk - 1 leaves at each of the k depths) adds w * k rows
at a leaf row's own measured cost lambda (not beta: on a CPU a step's first rows ride along with
the weights' stream and the later ones are paid in FLOPs); the leaves pay when the chain stops
before its end (1 - a^k) and a leaf at that depth is the target's token (h, the leaves' running
hit rate across sequences): a sequence verifies leaves when (E(k) + (1 - a^k) h) /
(cost(k) + lambda w k) beats E(k) / cost(k).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from inferd.scheduler.sequence import Sequence

_PRIOR_ACCEPTED, _PRIOR_TRIED = 1.4, 2.0  # a = 0.7 until a sequence has evidence of its own
_DECAY = 0.8  # weight of the past in the acceptance estimate, per verification step
_TRUST_PRIOR_BELOW = 0.3  # cost per draft under which a new sequence tries at the prior
_SHARED_DECAY = 0.98  # the same for the estimate across sequences (~50 verifications' memory)
_PROBE_EVERY = 8  # steps a sequence at k = 0 waits before trying one draft again
_MAX_PROBES_PER_STEP = 0.25  # probes of the whole batch per step, on average
_PRIOR_LEAF_HITS, _PRIOR_LEAF_CHANCES = 0.6, 2.0  # h = 0.3 until leaves have been verified
_LEAF_DECAY = 0.98  # the leaves' hit rate: ~50 chances' memory
_LEAF_PROBE_EVERY = 16  # verifications between tries of the leaves while they do not pay


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


def best_depth(a: float, k_max: int, cost_per_draft: float) -> int:
    best_k, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(a, k) / (1.0 + cost_per_draft * k)
        if rate > best_rate * 1.02:  # a margin: ties go to plain decoding
            best_k, best_rate = k, rate
    return best_k


def probe_interval(cost_per_draft: float, batch_size: int = 1) -> int:
    """Steps between probes of a sequence at k = 0, 0 for none. A probe costs `cost_per_draft` of
    a decode step and is wasted when acceptance really is low, so probes space out as the cost
    grows (8 steps when drafts are free, 27 at 0.7, measured at batch 32 here); from cost 1 on no
    depth can pay even if every draft were accepted (E(k) <= k + 1 <= 1 + cost * k): no probing.
    (At batch 32 on chat, probing every 8 steps cost 9 % of throughput.) Each sequence probing on
    its own clock, a batch of B makes B / interval probes per step, each a verification row and
    its bookkeeping: at most one every 1 / _MAX_PROBES_PER_STEP steps across the batch (at batch 32
    with cost ~0.6, every 20 steps per sequence would be 1.6 probes a step)."""
    if cost_per_draft >= 1.0:
        return 0
    own = max(_PROBE_EVERY, round(_PROBE_EVERY / (1.0 - cost_per_draft)))
    return max(own, math.ceil(batch_size / _MAX_PROBES_PER_STEP))


class SpecPolicy:
    def __init__(self, k_max: int, disable_by_batch_size: int | None,
                 verify_cost: dict[int, float] | None = None, leaf_width: int = 0,
                 leaf_cost: dict[int, float] | None = None) -> None:  # fmt: skip
        self.k_max = k_max
        self.leaf_width = leaf_width  # leaves per depth of a draft tree (draft_topk - 1)
        # A leaf row's cost by batch size (inferd.spec.calibrate); none measured: beta's.
        self.leaf_cost = dict(sorted((leaf_cost or {}).items()))
        self._leaf_hits, self._leaf_chances = _PRIOR_LEAF_HITS, _PRIOR_LEAF_CHANCES
        self._leaves_off = 0  # verifications since the leaves last paid
        self.disable_by_batch_size = disable_by_batch_size
        # beta by batch size (sorted keys); empty: assume verification is free.
        self.verify_cost = dict(sorted((verify_cost or {}).items()))
        self.proposer_cost = 0.0  # delta, an exponential moving average
        self._seen_accepted = self._seen_tried = 0.0  # every sequence's verifications, decayed

    def beta(self, batch_size: int) -> float:
        return _interpolate(self.verify_cost, batch_size)

    def leaf_beta(self, batch_size: int) -> float:
        return _interpolate(self.leaf_cost, batch_size) if self.leaf_cost else self.beta(batch_size)

    def depths(self, seqs: list[Sequence], batch_size: int) -> list[int]:
        """k per sequence for this step (0: no drafts); `batch_size`: sequences decoding."""
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return [0] * len(seqs)
        cost = self.beta(batch_size) + self.proposer_cost
        probe_every = probe_interval(cost, batch_size)
        ks = []
        for seq in seqs:
            state = seq.spec_state
            if state is None:
                state = seq.spec_state = self._fresh_state(cost)
            k = best_depth(state.acceptance, self.k_max, cost)
            if k == 0:
                state.steps_off += 1
                if probe_every and state.steps_off % probe_every == 0:
                    k = 1
            else:
                state.steps_off = 0
            remaining = _remaining_tokens(seq)
            ks.append(max(0, min(k, remaining - 1)))
        return ks

    def leaf_widths(self, seqs: list[Sequence], ks: list[int], batch_size: int) -> list[int]:
        """Leaves per depth for each sequence's chain of k drafts (0: a chain alone)."""
        if not self.leaf_width:
            return [0] * len(seqs)
        draft_cost = self.beta(batch_size) + self.proposer_cost
        leaf_cost = self.leaf_beta(batch_size)
        h = self._leaf_hits / self._leaf_chances
        widths = []
        for seq, k in zip(seqs, ks):
            pays = False
            if k > 0 and seq.params.greedy:
                a = seq.spec_state.acceptance
                tokens, cost = expected_tokens(a, k), 1.0 + draft_cost * k
                with_leaves = (tokens + (1.0 - a**k) * h) / (cost + leaf_cost * self.leaf_width * k)
                pays = with_leaves > tokens / cost * 1.02
                if not pays:  # try now and then: the hit rate only moves when leaves are verified
                    self._leaves_off += 1
                    pays = self._leaves_off % _LEAF_PROBE_EVERY == 0
            widths.append(self.leaf_width if pays else 0)
        return widths

    def _fresh_state(self, cost: float) -> SpecState:
        """A new sequence's estimate. Where a draft costs little (batch 1: ~0.15 of a step) the
        optimistic prior (a = 0.7) lets it try at once; where it costs more it starts at the
        acceptance recent sequences saw, with the prior's weight (the prior itself until there
        are some). With the prior alone, every request of a batch of 32 chat requests verified
        k = 1 two or three times before its own evidence stopped it (~75 verifications in 64
        steps at a cost of ~0.6 per draft: 0.96x of speculation off)."""
        if cost < _TRUST_PRIOR_BELOW or self._seen_tried < _PRIOR_TRIED:
            return SpecState()
        a = self._seen_accepted / self._seen_tried
        return SpecState(accepted=a * _PRIOR_TRIED, tried=_PRIOR_TRIED)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int,
               leaves: list[tuple[int, int]] = (), leaf_hit: bool = False) -> None:  # fmt: skip
        """A verification's outcome: drafts 1..num_accepted matched, the next one (if any) did not;
        `leaves` (depth, token) were verified too, and one was accepted if `leaf_hit`."""
        state = seq.spec_state
        if state is None or num_drafts == 0:
            return
        if num_accepted < num_drafts and any(d == num_accepted + 1 for d, _ in leaves):
            self._leaf_hits = _LEAF_DECAY * self._leaf_hits + leaf_hit
            self._leaf_chances = _LEAF_DECAY * self._leaf_chances + 1.0
        looked_at = min(num_accepted + 1, num_drafts)
        state.accepted = _DECAY * state.accepted + num_accepted
        state.tried = _DECAY * state.tried + looked_at
        # Across sequences, decayed per verification: what recent drafts of this proposer were worth.
        self._seen_accepted = _SHARED_DECAY * self._seen_accepted + num_accepted
        self._seen_tried = _SHARED_DECAY * self._seen_tried + looked_at

    def record_proposer_time(self, seconds: float, num_seqs: int, num_drafts: int, step_seconds: float) -> None:
        """The proposer took `seconds` for `num_drafts` tokens over `num_seqs` sequences; the step
        that verified them took `step_seconds`. Per draft, per sequence, relative to the step."""
        if num_drafts and step_seconds > 0:
            sample = seconds / step_seconds * num_seqs / num_drafts
            self.proposer_cost = 0.8 * self.proposer_cost + 0.2 * sample


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
