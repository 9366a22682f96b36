"""Routing policies: which worker gets a request, behind one interface.

`make_policy(name, **options)` builds one; the router (app.py) and the in-process data-parallel
front end use the same objects. A policy knows its workers by id (any string: a URL, a replica
index) and is told their loads (requests in flight) at each choice; it is not thread-safe.

- round_robin: each worker in turn.
- least_load: fewest requests in flight (ties: in turn).
- random: uniformly at random (seeded).
- cache_aware: cost per worker = uncached prompt tokens × `prefix_weight` + load (Dynamo's form),
  lowest wins; where the busiest worker's load exceeds the least's by more than
  `balance_abs_threshold` and by a factor `balance_rel_threshold`, the least loaded wins instead
  (SGLang's rule); and where no worker caches at least `cache_threshold` of the prompt (a new
  conversation sharing only a system prompt), the least loaded wins, ties to the smallest tree,
  which spreads new prefixes over the workers (SGLang's rule too). The cached prefix is the worker's KV index (exact: from its KV events) where it
  publishes them and the key is token ids, else an approximate radix tree of what was sent there.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.router.kv_index import KVIndex
from inferd.router.radix import Key, RadixTree


@dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    matched: int = 0  # elements of the key the policy believes the worker caches (estimate)
    key_len: int = 0


class RoutingPolicy(ABC):
    """Picks a worker for a request key (token ids or text) given each worker's load."""

    name = ""

    def __init__(self) -> None:
        self.workers: list[str] = []  # in the order added

    def add_worker(self, worker_id: str) -> None:
        if worker_id not in self.workers:
            self.workers.append(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        if worker_id in self.workers:
            self.workers.remove(worker_id)

    def select(self, key: Sequence[int] | str, loads: Mapping[str, int]) -> str:
        """The worker for a request whose prompt is `key`; recorded as sent there."""
        return self.choose(key, loads).worker_id

    def choose(self, key: Sequence[int] | str, loads: Mapping[str, int]) -> Choice:
        """`select`, with the policy's estimate of the prefix the chosen worker caches."""
        if not self.workers:
            raise LookupError("no worker to route to")
        return self._choose(key if isinstance(key, str) else tuple(key), loads)

    def candidates(self, loads: Mapping[str, int]) -> list[str]:
        """The workers a request may go to: those `loads` names (the callers pass the healthy,
        serving ones), in the order added; every worker where it names none of them."""
        named = [w for w in self.workers if w in loads]
        return named or self.workers

    @abstractmethod
    def _choose(self, key: Key, loads: Mapping[str, int]) -> Choice: ...

    def on_kv_event(self, worker_id: str, event: Mapping[str, Any]) -> None:
        """A KV event batch from `worker_id` (inferd/kv/kv_events.py's payload); most ignore it."""


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = itertools.count()

    def _choose(self, key: Key, loads: Mapping[str, int]) -> Choice:
        workers = self.candidates(loads)
        return Choice(workers[next(self._next) % len(workers)], 0, len(key))


class LeastLoadPolicy(RoundRobinPolicy):
    name = "least_load"

    def _choose(self, key: Key, loads: Mapping[str, int]) -> Choice:
        workers = self.candidates(loads)
        start = next(self._next)
        order = [workers[(start + i) % len(workers)] for i in range(len(workers))]  # ties go in turn
        return Choice(min(order, key=lambda w: loads.get(w, 0)), 0, len(key))


class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def _choose(self, key: Key, loads: Mapping[str, int]) -> Choice:
        return Choice(self._rng.choice(self.candidates(loads)), 0, len(key))


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(
        self,
        prefix_weight: float = 0.1,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        cache_threshold: float = 0.3,
        max_tree_size: int = 1 << 22,
    ) -> None:
        super().__init__()
        if prefix_weight < 0:
            raise ValueError(f"prefix_weight must be >= 0, got {prefix_weight}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {max_tree_size}")
        self.prefix_weight = prefix_weight
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[str, RadixTree] = {}
        self.kv_index = KVIndex()

    def add_worker(self, worker_id: str) -> None:
        super().add_worker(worker_id)
        self.trees.setdefault(worker_id, RadixTree(self.max_tree_size))

    def remove_worker(self, worker_id: str) -> None:
        super().remove_worker(worker_id)
        self.trees.pop(worker_id, None)
        self.kv_index.remove_worker(worker_id)

    def on_kv_event(self, worker_id: str, event: Mapping[str, Any]) -> None:
        if worker_id in self.trees:
            self.kv_index.apply(worker_id, event)

    def matched(self, key: Key) -> dict[str, int]:
        """Per worker, the prefix of `key` it is believed to cache: exact where it publishes KV
        events and the key is token ids, else from the tree of what was sent there."""
        exact = [w for w in self.workers if w in self.kv_index.block_size]
        out = self.kv_index.matched_tokens(key, exact) if exact and not isinstance(key, str) else {}
        for w in self.workers:
            if w not in out:
                out[w] = self.trees[w].match_len(key)
        return out

    def _choose(self, key: Key, loads: Mapping[str, int]) -> Choice:
        matched = self.matched(key)
        workers = self.candidates(loads)
        load = {w: loads.get(w, 0) for w in workers}
        lo, hi = min(load.values()), max(load.values())
        imbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        cold = max(matched[w] for w in workers) < self.cache_threshold * len(key)

        def cost(w: str) -> tuple[float, int]:
            # Ties (equal loads): the smaller tree, which spreads new prefixes over the workers;
            # then the order workers were added (min keeps the first).
            if imbalanced or cold:
                return (load[w], self.trees[w].size)
            return ((len(key) - matched[w]) * self.prefix_weight + load[w], self.trees[w].size)

        best = min(workers, key=cost)
        self.trees[best].insert(key)
        return Choice(best, matched[best], len(key))


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadPolicy, RandomPolicy)
}


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """The policy `name` (a key of POLICIES) with its options (keyword arguments of its class);
    ValueError names what is wrong."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: {e}") from None
