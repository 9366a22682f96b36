"""/metrics of a server with several replicas: each replica's series with a `replica` label, and
the server's totals under the same names without it (what a one-replica server exposes, so a
dashboard made for one engine shows the totals unchanged).

A total is the sum over replicas (counters, histogram buckets, counts and sums, and the gauges
that count things), except a `_created` timestamp (the earliest) and the ratio gauges, which are
averaged with the weight their own replica gives them (`_WEIGHTED`). Select the replicas' own
series with `{replica!=""}`: `sum()` over every series would count everything twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from inferd.server.metrics import ServerMetrics

# Ratio gauge -> the sample whose value (same labels, same replica) weighs it in the total.
_WEIGHTED = {
    "inferd:kv_cache_usage_perc": "inferd:num_total_kv_blocks",
    "inferd:spec_decode_mean_acceptance_length": "inferd:spec_decode_num_drafts_total",
}

_Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


def _key(name: str, labels: Mapping[str, str]) -> _Key:
    return name, tuple(sorted(labels.items()))


class _ReplicaSeries(Collector):
    def __init__(self, metrics: Mapping[str, ServerMetrics]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        per_replica: dict[str, list] = {}  # family name -> samples with a `replica` label
        sums: dict[_Key, float] = {}
        weights: dict[_Key, float] = {}  # ratio samples: the sum of their weights
        for replica, metrics in self.metrics.items():
            families = list(metrics.registry.collect())
            values = {_key(s.name, s.labels): s.value for f in families for s in f.samples}
            for family in families:
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                 family.unit)  # fmt: skip
                    per_replica[family.name] = []
                for s in family.samples:
                    per_replica[family.name].append(s._replace(labels={**s.labels,
                                                                       "replica": replica}))  # fmt: skip
                    key = _key(s.name, s.labels)
                    if s.name.endswith("_created"):
                        sums[key] = min(sums.get(key, s.value), s.value)
                    elif family.name in _WEIGHTED:
                        w = values.get(_key(_WEIGHTED[family.name], s.labels), 0.0)
                        sums[key] = sums.get(key, 0.0) + s.value * w
                        weights[key] = weights.get(key, 0.0) + w
                    else:
                        sums[key] = sums.get(key, 0.0) + s.value
        for key, value in sums.items():
            if key in weights:
                sums[key] = value / weights[key] if weights[key] else 0.0
        for name, family in merged.items():
            for s in per_replica[name]:
                labels = {k: v for k, v in s.labels.items() if k != "replica"}
                key = _key(s.name, labels)
                if key in sums:  # the total, once, before the replicas' own
                    family.samples.append(s._replace(labels=labels, value=sums.pop(key)))
            family.samples.extend(per_replica[name])
            yield family


def render_replicas(metrics: Mapping[str, ServerMetrics]) -> bytes:
    """The exposition of several replicas' metrics, keyed by replica id."""
    for m in metrics.values():
        m.flush()
    return generate_latest(_ReplicaSeries(metrics))  # type: ignore[arg-type]
