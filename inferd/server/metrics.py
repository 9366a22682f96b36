"""Prometheus metrics, named like vLLM's with an `inferd:` prefix so existing dashboards port.

`AsyncEngine` reports every engine step (an `EngineObserver`): per-request metrics go in at once,
the per-token counters and latencies when /metrics is scraped; gauges read the engine's latest
stats snapshot then too. Each app
has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from inferd.engine.async_engine import StepReport
from inferd.engine.stats import EngineStats

# Buckets as vLLM chose them (seconds / tokens), so percentiles compare across the two.
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]

_MAX_PENDING = 4096  # inter-token latencies held before they go into the histogram anyway

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



# What each KV connector counter means (docs/kv-connectors.md); the KV tier's are inferd's own.
_CONNECTOR_DOCS = {
    "kv_offload_hits": "Prompt tokens loaded from the KV tier instead of computed.",
    "kv_offload_bytes_written": "Bytes of KV block files the KV tier wrote.",
    "kv_offload_bytes_read": "Bytes of KV block files the KV tier read.",
    "kv_offload_evictions": "KV blocks the tier dropped to stay within its size limits.",
    "kv_offload_dropped_writes": "Evicted KV blocks not written because the writer's queue was full.",
    "kv_offload_rejected_files": "KV block files skipped as corrupt, truncated or foreign.",
    "kv_transfer_sent_tokens": "Prompt tokens whose KV a prefill worker sent (PD).",
    "kv_transfer_sent_blocks": "KV blocks a prefill worker sent (PD).",
    "kv_transfer_received_tokens": "Prompt tokens whose KV a decode worker pulled instead of computing (PD).",
    "kv_transfer_received_blocks": "KV blocks a decode worker pulled (PD).",
    "kv_transfer_failures": "KV pulls that failed; their prompts were computed locally (PD).",
    "kv_transfer_timeouts": "Of those, pulls the sending worker never answered (PD).",
    "kv_transfer_latency_seconds": "One KV pull: request to blocks in the pool (PD).",
}

class _EngineGauges(Collector):
    """Gauges (and the engine's own counters) read from the stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"inferd:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            s.kv_cache_usage,
        )
        yield gauge("num_free_kv_blocks", "KV cache blocks free in the pool.", s.num_free_blocks)
        yield gauge("num_total_kv_blocks", "KV cache blocks in the pool.", s.num_total_blocks)
        c = CounterMetricFamily(
            "inferd:num_preemptions", "Preemptions since start.", labels=["model_name"]
        )
        c.add_metric(labels, s.num_preemptions_total)
        yield c
        c = CounterMetricFamily("inferd:kv_events_dropped", "KV cache events dropped because the "
                                "publisher's queue was full (--kv-events-endpoint).",
                                labels=["model_name"])  # fmt: skip
        c.add_metric(labels, s.kv_events_dropped_total)
        yield c
        for name, value in s.kv_connector.items():  # the KV connector's counters
            c = CounterMetricFamily(f"inferd:{name}", _CONNECTOR_DOCS.get(name, "KV connector counter."),
                                    labels=["model_name"])  # fmt: skip
            c.add_metric(labels, value)
            yield c
        for name, (bounds, counts, total) in s.kv_connector_histograms.items():
            h = HistogramMetricFamily(f"inferd:{name}", _CONNECTOR_DOCS.get(name, "KV connector histogram."),
                                      labels=["model_name"])  # fmt: skip
            cumulative = list(itertools.accumulate(counts))
            h.add_metric(labels, [(floatToGoString(b), c) for b, c in zip((*bounds, math.inf), cumulative)], total)
            yield h
        c = CounterMetricFamily("inferd:prompt_tokens_computed", "Prompt tokens the engine computed "
                                "(recomputation included; not those served by the prefix cache or "
                                "a KV connector).", labels=["model_name"])  # fmt: skip
        c.add_metric(labels, s.prompt_tokens_total)
        yield c
        if s.spec_method:  # speculative decoding on: its counters, labelled by proposer method
            for name, doc, value in (
                ("spec_decode_num_drafts", "Verification steps of speculative drafts.", s.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens),
                ("spec_decode_num_emitted_tokens",
                 "Tokens emitted by verification steps (accepted drafts + one of the target's).",
                 s.spec_emitted_tokens),
                ("spec_decode_num_leaf_tokens",
                 "Draft-tree leaves verified (among the draft tokens).", s.spec_leaf_tokens),
                ("spec_decode_num_accepted_leaves",
                 "Draft-tree leaves accepted (among the accepted tokens).", s.spec_accepted_leaves),
            ):  # fmt: skip
                c = CounterMetricFamily(f"inferd:{name}", doc, labels=["model_name", "method"])
                c.add_metric([self.model_name, s.spec_method], value)
                yield c
            for name, doc, values in (
                ("spec_decode_num_draft_tokens_per_pos",
                 "Draft tokens verified at each chain position (0: the first draft).",
                 s.spec_draft_tokens_per_position),
                ("spec_decode_num_accepted_tokens_per_pos",
                 "Draft tokens accepted at each chain position (0: the first draft).",
                 s.spec_accepted_per_position),
            ):  # fmt: skip
                by_position = ["model_name", "method", "position"]
                c = CounterMetricFamily(f"inferd:{name}", doc, labels=by_position)
                for position, value in enumerate(values):
                    c.add_metric([self.model_name, s.spec_method, str(position)], value)
                yield c
            g = GaugeMetricFamily("inferd:spec_decode_mean_acceptance_length",
                                  "Tokens per verification step since start (accepted drafts + 1).",
                                  labels=["model_name", "method"])  # fmt: skip
            g.add_metric([self.model_name, s.spec_method], s.spec_mean_acceptance_length)
            yield g


class ServerMetrics:
    """All the server's metrics; `on_step` is the `EngineObserver` hook."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, lbl = self.registry, ["model_name"]
        self.registry.register(_EngineGauges(model_name, stats))
        self.prompt_tokens = Counter(
            "inferd:prompt_tokens", "Prefilled prompt tokens.", lbl, registry=reg
        )
        self.generation_tokens = Counter(
            "inferd:generation_tokens", "Generated tokens.", lbl, registry=reg
        )
        self.request_success = Counter(
            "inferd:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.prefix_cache_queries = Counter(
            "inferd:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            lbl,
            registry=reg,
        )
        self.prefix_cache_hits = Counter(
            "inferd:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            lbl,
            registry=reg,
        )
        self.ttft = Histogram(
            "inferd:time_to_first_token_seconds",
            "Time to first token.",
            lbl,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "inferd:inter_token_latency_seconds",
            "Time between output tokens.",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "inferd:e2e_request_latency_seconds",
            "Arrival to finish.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "inferd:request_queue_time_seconds",
            "Arrival to first scheduled step.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.request_prompt_tokens = Histogram(
            "inferd:request_prompt_tokens",
            "Prompt tokens per request.",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "inferd:request_generation_tokens",
            "Generated tokens per request.",
            lbl,
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):  # present (at 0) from the first scrape
            self.request_success.labels(model_name, reason)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
        ):
            metric.labels(model_name)
        # The children fed every step, looked up once (labels() takes a lock and a dict lookup).
        self._step_children = tuple(
            metric.labels(model_name)
            for metric in (self.prompt_tokens, self.generation_tokens, self.queue_time, self.ttft, self.itl)
        )
        # What steps brought since the last flush: per token, prometheus' locked counters and
        # histogram buckets cost the front end ~10 µs (more on the cold caches of a process that
        # wakes once per token, on the CPU the engine's last OpenMP worker shares); plain sums and
        # lists cost ~1. They reach the metrics when /metrics is scraped (or the lists grow long).
        self._num_prompt = self._num_generation = 0
        self._pending: tuple[list[float], list[float], list[float]] = ([], [], [])

    def on_step(self, report: StepReport) -> None:
        self._num_prompt += report.num_prompt_tokens
        self._num_generation += report.num_generation_tokens
        queue_times, ttfts, itls = self._pending
        queue_times += report.queue_times
        ttfts += report.ttfts
        itls += report.inter_token_latencies
        if len(itls) >= _MAX_PENDING:
            self.flush()
        m = self.model_name
        for done in report.finished:
            self.request_success.labels(m, done.finish_reason).inc()
            self.e2e.labels(m).observe(done.finished_time - done.arrival_time)
            out = done.output
            self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
            self.request_generation_tokens.labels(m).observe(
                sum(len(o.token_ids) for o in out.outputs)
            )
            self.prefix_cache_queries.labels(m).inc(len(out.prompt_token_ids))
            if out.metrics is not None and out.metrics.num_cached_tokens:
                self.prefix_cache_hits.labels(m).inc(out.metrics.num_cached_tokens)

    def flush(self) -> None:
        prompt_tokens, generation_tokens, *histograms = self._step_children
        if self._num_prompt:
            prompt_tokens.inc(self._num_prompt)
        if self._num_generation:
            generation_tokens.inc(self._num_generation)
        self._num_prompt = self._num_generation = 0
        for histogram, values in zip(histograms, self._pending):
            for value in values:
                histogram.observe(value)
            values.clear()

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)
