"""How many prompt tokens a step may take next to running decodes, so streams keep their pace.

A step that carries a prompt chunk lasts longer than a pure decode step, and every running stream
waits for it: that is the inter-token latency's tail. While decodes run, the prefill tokens of a
step are capped so that its predicted cost (inferd.scheduler.step_cost) stays within
`max_step_latency_factor` × the cost of the same step without them:

    room (seconds) = (factor - 1) · cost(decodes alone)

and each prefill takes the most tokens whose added cost fits what is left of the room. Two
exceptions keep prompts moving:
- the step's first prefill always gets at least `min_chunk` tokens (one KV block), so a waiting
  prompt advances every step however large the batch (prefill is never starved, and total
  throughput stays close to the uncapped schedule's);
- with `ttft_slo_ms` set, a prompt whose first token would come too late at the capped pace
  (waited + steps still needed × capped step ≥ target) takes its chunk uncapped.
With no decodes scheduled, or before the cost model has seen enough steps, nothing is capped here.
The cap never changes what a request computes, only how its prompt is chunked: outputs are the
same (a row's arithmetic depends on that row alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from inferd.scheduler.sequence import Sequence
from inferd.scheduler.step_cost import LearnedStepCost, StepCost, StepShape, attention_pairs


def step_shape(scheduled: list[tuple[Sequence, int]], starts: list[int]) -> StepShape:
    """The cost model's view of a scheduled step (`starts[i]`: the first position of entry i).
    A chunk of more than one prompt token is prefill; a decode or a verification's 1 + k rows
    are decode rows."""
    decode = prefill = 0
    pairs = 0.0
    for (seq, n), start in zip(scheduled, starts):
        if n > 1 and not seq.spec.token_ids:
            prefill += n
        else:
            decode += n
        pairs += attention_pairs(start, n)
    return StepShape(decode, prefill, pairs)


class StepBudget:
    """One step's prefill room, opened with the step's decodes (`open`), spent prefill by prefill
    (`chunk`). `cost` learns from every step the engine times (`record`)."""

    def __init__(self, factor: float, ttft_slo_ms: float | None, min_chunk: int,
                 cost: StepCost | None = None, clock: Callable[[], float] | None = None) -> None:  # fmt: skip
        self.factor = factor
        self.ttft_slo_s = None if ttft_slo_ms is None else ttft_slo_ms / 1000
        self.min_chunk = min_chunk
        self.cost = cost if cost is not None else LearnedStepCost()
        self.clock = clock
        self._room: float | None = None  # seconds of prefill left this step; None: uncapped
        self._decode_s = 0.0  # the step's predicted cost without prefill
        self._granted_min = False  # the step's first prefill had its minimum chunk
        # Counters (the engine's stats): steps whose prefill the cap cut, and prompts it let
        # through uncapped because their TTFT target was at risk.
        self.num_capped_steps = 0
        self.num_slo_rescues = 0
        self._capped = False

    @property
    def enabled(self) -> bool:
        return math.isfinite(self.factor)

    def open(self, decode_rows: int, decode_pairs: float) -> None:
        """Start a step whose decodes (`decode_rows` rows, attention over `decode_pairs`
        query-key pairs) are scheduled."""
        self._room, self._granted_min, self._capped = None, False, False
        if not self.enabled or decode_rows == 0:
            return
        decode_s = self.cost.seconds(StepShape(decode_rows, 0, decode_pairs))
        if decode_s is None:
            return  # the model is still learning: today's schedule
        self._decode_s = decode_s
        self._room = (self.factor - 1.0) * decode_s

    def chunk(self, seq: Sequence, want: int) -> int:
        """Prompt tokens `seq` may take this step, at most `want` (what the token budget and the
        other caps leave); the caller spends them with `take`."""
        if self._room is None or want <= 0:
            return want
        start = seq.num_computed_tokens
        n = self.cost.max_prefill_tokens(start, self._room, want)
        if not self._granted_min:
            n = max(n, min(want, self.min_chunk))
        if n < want and self._ttft_at_risk(seq, n):
            self.num_slo_rescues += 1
            return want
        if n < want and not self._capped:
            self._capped = True
            self.num_capped_steps += 1
        return n

    def take(self, seq: Sequence, n: int) -> None:
        """`seq` was scheduled `n` prompt tokens from its current position."""
        if n <= 0:
            return
        self._granted_min = True
        if self._room is not None:
            self._room = max(
                0.0, self._room - self.cost.prefill_seconds(seq.num_computed_tokens, n)
            )

    def _ttft_at_risk(self, seq: Sequence, n: int) -> bool:
        """Whether `seq`'s first token would miss the TTFT target if its prompt went on at `n`
        tokens per capped step (each lasting `factor` decode steps)."""
        if self.ttft_slo_s is None or self.clock is None:
            return False
        if seq.num_computed_tokens >= seq.num_prompt_tokens or seq.num_output_tokens:
            return False  # past its first token (a recomputation after preemption)
        pace = max(n, self.min_chunk)  # what it gets in a later step where it comes first
        steps = math.ceil((seq.num_prompt_tokens - seq.num_computed_tokens) / pace)
        waited = self.clock() - seq.arrival_time
        return waited + steps * self.factor * self._decode_s >= self.ttft_slo_s

    def record(self, shape: StepShape, seconds: float) -> None:
        """A step of `shape` took `seconds`, end to end as the streams felt it."""
        self.cost.record(shape, seconds)
