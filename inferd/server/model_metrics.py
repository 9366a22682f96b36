"""/metrics of a server with several models: the pool's series (loads, unloads, load time,
resident bytes, swap waits) and each loaded model's engine series, one family per metric name.

Every series carries `model_name`, so the models' families merge by concatenating their samples.
A model's engine series appear while it is loaded and restart at zero when it loads again (as a
restarted process's would: Prometheus's `rate()` reads that as a counter reset).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from inferd.server.replicas import ReplicaSet


class _ModelSeries(Collector):
    def __init__(self, pool: CollectorRegistry, models: Mapping[str, ReplicaSet]) -> None:
        self.pool = pool
        self.models = models

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        registries = [self.pool]
        for replicas in self.models.values():
            for r in replicas.replicas:
                r.metrics.flush()
                registries.append(r.metrics.registry)
        for registry in registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)  # fmt: skip
                into.samples.extend(family.samples)
        yield from merged.values()


def render_models(pool: CollectorRegistry, models: Mapping[str, ReplicaSet]) -> bytes:
    """The exposition of the pool's registry and the loaded models' (keyed by model name)."""
    return generate_latest(_ModelSeries(pool, models))  # type: ignore[arg-type]
