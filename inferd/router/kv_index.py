"""Exact mode: which worker caches which KV block, from the workers' own KV events.

Workers publish stored / removed / cleared events with chained block hashes
(inferd/kv/kv_events.py, inferd/kv/block_hash.py); this index maps each hash to the workers that
hold it. A prompt's cached prefix on a worker is then the run of its block hashes, from the first,
that the worker holds: the prefix cache serves a prefix only, so a later block without the earlier
ones would not be reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from inferd.kv.block_hash import chain_hashes
from inferd.kv.kv_events import CLEARED, REMOVED, STORED


class KVIndex:
    """Block hash → workers holding it, fed by `apply`. The router's event loop owns it."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}
        self.block_size: dict[str, int] = {}  # per worker, from its events

    def apply(self, worker_id: str, payload: Mapping) -> None:
        """Apply one event batch (kv_events' payload) from `worker_id`."""
        size = payload.get("block_size")
        if isinstance(size, int) and size > 0:
            self.block_size[worker_id] = size
        held = self._by_worker.setdefault(worker_id, set())
        for event in payload.get("events", ()):
            kind = event.get("type")
            if kind == STORED:
                for h in event.get("hashes", ()):
                    self._holders.setdefault(h, set()).add(worker_id)
                    held.add(h)
            elif kind == REMOVED:
                for h in event.get("hashes", ()):
                    self._discard(h, worker_id)
                    held.discard(h)
            elif kind == CLEARED:
                self.remove_worker(worker_id)
                held = self._by_worker.setdefault(worker_id, set())

    def _discard(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything `worker_id` held (it left, or restarted empty)."""
        for h in self._by_worker.pop(worker_id, ()):
            self._discard(h, worker_id)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def matched_tokens(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Per worker, the tokens of `token_ids`' longest prefix it caches (whole blocks)."""
        out: dict[str, int] = {}
        hashes_by_size: dict[int, list[int]] = {}
        for w in workers:
            size = self.block_size.get(w)
            if size is None:
                out[w] = 0
                continue
            if size not in hashes_by_size:
                hashes_by_size[size] = chain_hashes(token_ids, size)
            n = 0
            for h in hashes_by_size[size]:
                holders = self._holders.get(h)
                if holders is None or w not in holders:
                    break
                n += 1
            out[w] = n * size
        return out
