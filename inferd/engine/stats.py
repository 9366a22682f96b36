"""Engine counters and the periodic stats line (like vLLM's "Avg prompt throughput: ...")."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

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
    prompt_throughput: float = 0.0  # tokens/s over the last logging interval
    generation_throughput: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries_total
        return self.prefix_cache_hits_total / q if q else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


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
