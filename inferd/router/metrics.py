"""The router's Prometheus metrics (`inferd_router:` prefix), in a registry of its own.

Counters per worker: requests routed, prompt tokens routed and the policy's estimate of those
already cached there (their ratio is the routed prefix-hit estimate; characters when routing by
text), KV event batches received and gaps seen. Router-wide: retries, and the seconds the router
spends on a request before forwarding it. Gauges (load, health) are read from the pool at scrape.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.router.workers import WorkerPool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ROUTING_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0]


class _PoolGauges(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        load = GaugeMetricFamily(
            "inferd_router:worker_load", "requests in flight per worker", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "inferd_router:worker_healthy", "1 while routed to", labels=["worker"]
        )
        for url, w in self.pool.workers.items():
            load.add_metric([url], w.load)
            healthy.add_metric([url], 1.0 if w.healthy else 0.0)
        yield load
        yield healthy


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inferd_router:requests", "requests routed per worker", ["worker"], registry=r
        )
        self.prompt_tokens = Counter("inferd_router:routed_prompt_tokens",
                                     "prompt tokens (or characters) routed per worker", ["worker"],
                                     registry=r)  # fmt: skip
        self.prefix_hits = Counter("inferd_router:routed_prefix_hit_tokens",
                                   "of those, the policy's estimate already cached on the worker",
                                   ["worker"], registry=r)  # fmt: skip
        self.retries = Counter("inferd_router:retries", "requests sent again to another worker after "
                               "one failed before streaming a byte", registry=r)  # fmt: skip
        self.kv_events = Counter("inferd_router:kv_event_batches", "KV event batches received",
                                 ["worker"], registry=r)  # fmt: skip
        self.kv_event_gaps = Counter("inferd_router:kv_event_gaps", "KV event batches missed "
                                     "(sequence gaps)", ["worker"], registry=r)  # fmt: skip
        self.routing_seconds = Histogram("inferd_router:routing_seconds", "router time per request "
                                         "before it is forwarded (parse, key, policy)",
                                         buckets=_ROUTING_BUCKETS, registry=r)  # fmt: skip
        r.register(_PoolGauges(pool))
        self._per_worker: dict[str, tuple[Counter, Counter, Counter]] = {}

    def routed(self, worker: str, key_len: int, matched: int) -> None:
        children = self._per_worker.get(worker)
        if children is None:  # `labels()` looks its child up on every call: once per worker here
            children = (self.requests.labels(worker), self.prompt_tokens.labels(worker),
                        self.prefix_hits.labels(worker))  # fmt: skip
            self._per_worker[worker] = children
        requests, prompt_tokens, prefix_hits = children
        requests.inc()
        prompt_tokens.inc(key_len)
        prefix_hits.inc(matched)

    def render(self) -> bytes:
        return generate_latest(self.registry)
