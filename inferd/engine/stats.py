"""Engine counters and the periodic stats line (like vLLM's "Avg prompt throughput: ...")."""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import asdict, dataclass, field, fields

logger = logging.getLogger("inferd.engine")


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions_total: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (recomputation included)
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # ... and served from it
    num_cached_blocks: int = 0  # blocks the prefix cache holds
    kv_events_dropped_total: int = 0  # KV events a full publisher queue dropped (kv_events.py)
    # The KV connector's counters (inferd/kv/connectors/base.py `stats`): name → count since start.
    kv_connector: dict[str, int] = field(default_factory=dict)
    # ... and its histograms (`histograms`): name → (bucket bounds, counts per bucket and +Inf, sum).
    kv_connector_histograms: dict[str, tuple] = field(default_factory=dict)
    prompt_throughput: float = 0.0  # tokens/s over the last logging interval
    generation_throughput: float = 0.0
    # Speculative decoding ("" when off): verification steps, draft tokens proposed / accepted,
    # and tokens emitted by verification steps (accepted drafts + the target's own token).
    spec_method: str = ""
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    # Of those, the leaves of draft trees (eagle's draft_topk > 1) verified and accepted.
    spec_leaf_tokens: int = 0
    spec_accepted_leaves: int = 0
    # By position in the chain (0: the first draft): drafts verified there and accepted there
    # (vLLM's num_accepted_tokens_per_pos), to see how deep drafting pays.
    spec_draft_tokens_per_position: list[int] = field(default_factory=list)
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # The step's latency budget (inferd/scheduler/step_budget.py): steps whose prefill it cut,
    # prompts it let through uncapped for their TTFT target, and the fitted step cost in ms
    # (fixed, per decode row, per prefill token, per 1024 query-key pairs; empty until fitted).
    step_budget_capped_steps_total: int = 0
    step_budget_ttft_rescues_total: int = 0
    step_cost_ms: tuple[float, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verification step (accepted drafts + 1), vLLM's "mean acceptance length"."""
        return self.spec_emitted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def spec_acceptance_rate_per_position(self) -> list[float]:
        pairs = zip(self.spec_accepted_per_position, self.spec_draft_tokens_per_position)
        return [a / d if d else 0.0 for a, d in pairs]

    def as_dict(self) -> dict[str, float | int | str | list[int]]:
        return asdict(self)

    def snapshot(self) -> EngineStats:
        """A copy the engine will not change afterwards (its lists copied too): what goes to the
        front end. By hand: `dataclasses.replace` took ~20 µs, a visible part of a 3 ms step."""
        copy = EngineStats(*_field_values(self))
        copy.spec_draft_tokens_per_position = list(self.spec_draft_tokens_per_position)
        copy.spec_accepted_per_position = list(self.spec_accepted_per_position)
        return copy


_field_values = operator.attrgetter(*(f.name for f in fields(EngineStats)))


class StatsLogger:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0

    def update_rates(self, stats: EngineStats, force: bool = False) -> bool:
        """Refresh the per-interval throughputs; True when an interval has passed."""
        now = time.monotonic()
        elapsed = now - self._last_time
        if not force and (self.interval <= 0 or elapsed < self.interval):
            return False
        if elapsed > 0:
            stats.prompt_throughput = (stats.prompt_tokens_total - self._last_prompt) / elapsed
            stats.generation_throughput = (stats.generation_tokens_total - self._last_gen) / elapsed
        self._last_time, self._last_prompt = now, stats.prompt_tokens_total
        self._last_gen = stats.generation_tokens_total
        return True

    def maybe_log(self, stats: EngineStats) -> None:
        if self.update_rates(stats):
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, Preemptions: %d, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                stats.prompt_throughput, stats.generation_throughput, stats.num_running,
                stats.num_waiting, stats.num_preemptions_total, 100 * stats.kv_cache_usage,
                100 * stats.prefix_cache_hit_rate,
            )  # fmt: skip
            if stats.step_cost_ms:
                logger.info(
                    "Step cost: %.2f ms + %.3f ms per decode row + %.3f ms per prefill token + "
                    "%.3f ms per 1024 attention pairs; prefill capped in %d steps, %d prompts "
                    "uncapped for their TTFT target",
                    *stats.step_cost_ms, stats.step_budget_capped_steps_total,
                    stats.step_budget_ttft_rescues_total,
                )  # fmt: skip
            if stats.spec_method:
                logger.info(
                    "Speculative decoding (%s): mean acceptance length %.2f, acceptance rate "
                    "%.1f%% (by position: %s), drafts %d, draft tokens %d, accepted %d",
                    stats.spec_method, stats.spec_mean_acceptance_length,
                    100 * stats.spec_acceptance_rate,
                    ", ".join(f"{100 * r:.0f}%" for r in stats.spec_acceptance_rate_per_position),
                    stats.spec_num_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens,
                )  # fmt: skip
