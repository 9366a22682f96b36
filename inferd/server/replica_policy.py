"""Which replica takes a request: routing policies behind the router's interface.

    policy = make_policy("least_load")
    policy.add_worker("0"); policy.add_worker("1")
    policy.select(prompt_token_ids, {"0": 3, "1": 1})  # -> "1"; records the prompt as routed

`select` sees the workers that can take a request now (the keys of `loads`, each with its
requests in flight) and returns one of them. `on_kv_event` takes a worker's KV-cache news
(stored / evicted blocks); these policies keep no cache model and ignore it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

# A routed prefix is remembered per chunk of this many tokens (characters, for a text key).
_TOKEN_CHUNK = 16
_CHAR_CHUNK = 64
_MAX_REMEMBERED_CHUNKS = 1 << 16  # least recently routed ones are forgotten first


class RoutingPolicy(Protocol):
    def add_worker(self, id: str) -> None: ...

    def remove_worker(self, id: str) -> None: ...

    def select(self, key: Sequence[int] | str, loads: Mapping[str, int]) -> str:
        """One of `loads`' workers for a request whose prompt is `key`; records it as routed."""

    def on_kv_event(self, id: str, event: Any) -> None: ...


def _chunk_hashes(key: Sequence[int] | str) -> Iterator[int]:
    """Hashes of the key's whole chunks, each one naming the entire prefix up to its end."""
    size = _CHAR_CHUNK if isinstance(key, str) else _TOKEN_CHUNK
    h = 0
    for end in range(size, len(key) + 1, size):
        h = hash((h, tuple(key[end - size : end])))
        yield h


class _Workers:
    """The workers in the order they were added."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add_worker(self, id: str) -> None:
        if id not in self.ids:
            self.ids.append(id)

    def remove_worker(self, id: str) -> None:
        if id in self.ids:
            self.ids.remove(id)

    def candidates(self, loads: Mapping[str, int]) -> list[str]:
        found = [w for w in self.ids if w in loads]
        if not found:
            raise ValueError(f"no worker to route to: none of {sorted(loads)} is known")
        return found

    def on_kv_event(self, id: str, event: Any) -> None:
        pass


class RoundRobinPolicy(_Workers):
    """Each request to the next worker in turn."""

    def __init__(self) -> None:
        super().__init__()
        self._turn = itertools.count()

    def select(self, key: Sequence[int] | str, loads: Mapping[str, int]) -> str:
        found = self.candidates(loads)
        return found[next(self._turn) % len(found)]


class LeastLoadPolicy(_Workers):
    """The worker with the fewest requests in flight. Among the least loaded, the one that took
    the longest prefix of this prompt before (a conversation's next turn goes where its history
    is cached, whenever that worker is no busier than the rest); else the next in turn."""

    def __init__(self, max_remembered_chunks: int = _MAX_REMEMBERED_CHUNKS) -> None:
        super().__init__()
        self._turn = itertools.count()
        self._owner: OrderedDict[int, str] = OrderedDict()  # chunk hash -> worker, LRU order
        self._max_chunks = max_remembered_chunks

    def select(self, key: Sequence[int] | str, loads: Mapping[str, int]) -> str:
        found = self.candidates(loads)
        least = min(loads[w] for w in found)
        tied = [w for w in found if loads[w] == least]
        hashes = list(_chunk_hashes(key))
        chosen = next((w for h in reversed(hashes) if (w := self._owner.get(h)) in tied), None)
        if chosen is None:
            chosen = tied[next(self._turn) % len(tied)]
        for h in hashes:
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_chunks:
            self._owner.popitem(last=False)
        return chosen

    def remove_worker(self, id: str) -> None:
        super().remove_worker(id)
        for h in [h for h, w in self._owner.items() if w == id]:
            del self._owner[h]


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "least_load": LeastLoadPolicy,
    "round_robin": RoundRobinPolicy,
}


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(**options)
