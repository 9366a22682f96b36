"""Several models behind one server, each in engine processes of its own, loaded on first use and
unloaded least-recently-used to stay under a budget (`inferd serve a=PATH b=PATH ...`).

    use(name) ──► loaded? ── yes ──────────────────────────────────────────► its ReplicaSet
                      └─ no: wait in the swap queue (bounded) for the swap lock, then
                         evict LRU idle unpinned models until it fits, load it (a fresh
                         engine process: `build_replicas`, as a single-model server starts one)

Invariants: a model with requests in flight (a `use` lease held, or its engine owes news of a
request or call) is never unloaded; a pinned model is loaded at start and never unloaded; swaps
run one at a time (the lock), so the budget is checked against settled state. Requests for a model
already loaded never wait for a swap. Unloading stops the engine process, which returns its memory
to the OS. A model's per-engine metrics live with its engine (they restart at zero on reload); the
pool's own metrics (loads, unloads, load time, resident bytes, swap waits) live here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferd.server.errors import APIError
from inferd.server.replicas import ReplicaSet
from inferd.server.served_models import ModelPoolConfig, ModelSpec

logger = logging.getLogger("inferd.server")

_LOAD_BUCKETS = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]
_WAIT_POLL_S = 0.05  # how often a waiting swap looks whether a busy model has drained


@dataclass(slots=True)
class _Entry:
    spec: ModelSpec
    pinned: bool
    replicas: ReplicaSet | None = None  # set while loaded
    leases: int = 0  # `use` contexts open on it (handlers between admission and response)
    last_used: float = field(default_factory=time.monotonic)
    resident_bytes: int = 0  # as its engine reported at its last load; 0: never loaded
    load_seconds: float = 0.0  # its last load's duration (the Retry-After of a full queue)

    @property
    def busy(self) -> bool:
        """Requests in flight: a lease, or an engine that owes news of a request or call."""
        rs = self.replicas
        return self.leases > 0 or (rs is not None and any(r.engine.has_work for r in rs.replicas))


class PoolMetrics:
    """The pool's series, labelled by `model_name` as vLLM labels per-model series."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]
        self.loads = Counter("inferd:model_loads", "Model loads (engine processes started).",
                             lbl, registry=reg)  # fmt: skip
        self.unloads = Counter("inferd:model_unloads", "Model unloads, by reason (lru, ttl, "
                               "admin).", [*lbl, "reason"], registry=reg)  # fmt: skip
        self.load_time = Histogram("inferd:model_load_time_seconds", "Seconds from starting a "
                                   "model's engine to its first readiness.", lbl,
                                   buckets=_LOAD_BUCKETS, registry=reg)  # fmt: skip
        self.unload_time = Histogram("inferd:model_unload_time_seconds", "Seconds to stop a "
                                     "model's engine processes.", lbl, buckets=_LOAD_BUCKETS,
                                     registry=reg)  # fmt: skip
        self.resident = Gauge("inferd:model_resident_bytes", "Bytes of weights and KV pool of "
                              "a loaded model (0: not loaded).", lbl, registry=reg)  # fmt: skip
        self.loaded = Gauge("inferd:model_loaded", "1 while the model is loaded.", lbl,
                            registry=reg)  # fmt: skip
        self.swap_queued = Counter("inferd:model_swap_queued_requests", "Requests that waited "
                                   "for their model to load.", lbl, registry=reg)  # fmt: skip
        self.swap_waiting = Gauge("inferd:model_swap_queue_len", "Requests waiting now for "
                                  "their model to load.", registry=reg)  # fmt: skip


class ModelPool:
    """The served models and their engines. Lives on the event loop: `start()` from a running
    loop (loads the pinned models), `close()` then `await shutdown()`.

    `make_replicas(spec)`: a not-yet-started `ReplicaSet` serving `spec` (one per load).
    `on_ready(name, replicas)`: called after each load (the CLI logs its line).
    """

    def __init__(
        self,
        config: ModelPoolConfig,
        make_replicas: Callable[[ModelSpec], ReplicaSet],
        on_ready: Callable[[str, ReplicaSet], None] | None = None,
    ) -> None:
        self.config = config
        self._make = make_replicas
        self._on_ready = on_ready
        self.entries = {s.name: _Entry(s, s.name in config.pins) for s in config.models}
        self.metrics = PoolMetrics()
        for name in self.entries:
            self.metrics.loaded.labels(name).set(0)
            self.metrics.resident.labels(name).set(0)
        self._lock: asyncio.Lock | None = None
        self._waiting = 0  # requests in the swap queue
        self._tasks: set[asyncio.Task[None]] = set()
        self._swaps: dict[str, asyncio.Task[None]] = {}  # a swap in progress, by model name
        self._closing = False
        self.pin_errors: dict[str, str] = {}  # a pinned model that failed to load, and why

    @property
    def default_name(self) -> str:
        return self.config.models[0].name

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._lock = asyncio.Lock()
        for name in self.config.pins:
            self._spawn(self._load_pinned(name))
        if self.config.model_ttl is not None:
            self._spawn(self._expire_idle(self.config.model_ttl))

    def close(self) -> None:
        self._closing = True
        for task in [*self._tasks, *self._swaps.values()]:
            task.cancel()
        for e in self.entries.values():
            if e.replicas is not None:
                e.replicas.close()

    async def shutdown(self) -> None:
        loaded = [e.replicas for e in self.entries.values() if e.replicas is not None]
        await asyncio.gather(*(asyncio.to_thread(rs.shutdown) for rs in loaded))

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load_pinned(self, name: str) -> None:
        try:
            await self.load(name)
        except APIError as e:
            self.pin_errors[name] = e.message
            logger.error("%s", e.message)

    # ---- what requests and admins call ----------------------------------------------------
    def entry(self, name: str | None) -> _Entry:
        """The model a request names (None: the first one); 404 for a name not served."""
        entry = self.entries.get(name or self.default_name)
        if entry is None:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.entries)}",
                param="model",
                code="model_not_found",
            )
        return entry

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[tuple[str, ReplicaSet]]:
        """The model's name and replicas, loaded, held against unloading until the block ends
        (its engine's own in-flight count covers the streams that outlive the block)."""
        entry = self.entry(name)
        entry.leases += 1
        try:
            if entry.replicas is None:
                await self._queue_for_load(entry)
            assert entry.replicas is not None
            entry.last_used = time.monotonic()
            yield entry.spec.name, entry.replicas
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()

    async def load(self, name: str) -> bool:
        """Load `name` now (evicting as for a request); False if it was loaded already."""
        entry = self.entry(name)
        if entry.replicas is not None:
            return False
        entry.leases += 1  # loaded for the admin: no eviction may take it before it is counted
        try:
            await self._ensure_loaded(entry)
        finally:
            entry.leases -= 1
        return True

    async def unload(self, name: str) -> bool:
        """Unload `name` now; False if it was not loaded. 409 if pinned or busy."""
        entry = self.entry(name)
        if entry.pinned:
            raise APIError(409, f"the model `{name}` is pinned (--pin); it stays loaded",
                           code="model_pinned")  # fmt: skip
        if entry.busy:  # at once: a swap may hold the lock while it waits for others to drain
            raise APIError(409, f"the model `{name}` has requests in flight; unload it once "
                           "they end", code="model_busy")  # fmt: skip
        assert self._lock is not None
        async with self._lock:
            if entry.replicas is None:
                return False
            if entry.busy:
                raise APIError(409, f"the model `{name}` has requests in flight; unload it "
                               "once they end", code="model_busy")  # fmt: skip
            await self._unload(entry, "admin")
        return True

    # ---- loading and eviction -------------------------------------------------------------
    async def _queue_for_load(self, entry: _Entry) -> None:
        bound = self.config.max_swap_queue_len
        if bound is not None and self._waiting >= bound:
            retry = max(1, math.ceil(entry.load_seconds or 1.0))
            raise APIError(
                503,
                f"the server is overloaded: {self._waiting} requests are waiting for a model to "
                f"load (--max-queue-len {bound}); retry later",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        self._waiting += 1
        self.metrics.swap_waiting.set(self._waiting)
        self.metrics.swap_queued.labels(entry.spec.name).inc()
        try:
            await self._ensure_loaded(entry)
        finally:
            self._waiting -= 1
            self.metrics.swap_waiting.set(self._waiting)

    async def _ensure_loaded(self, entry: _Entry) -> None:
        """Wait for `entry`'s swap: one task per model, which its waiters share and shield, so a
        client that leaves mid-swap never leaves an engine process started and unrecorded."""
        name = entry.spec.name
        task = self._swaps.get(name)
        if task is None:
            task = self._swaps[name] = asyncio.get_running_loop().create_task(self._swap_in(entry))
            task.add_done_callback(lambda _: self._swaps.pop(name, None))
        await asyncio.shield(task)

    async def _swap_in(self, entry: _Entry) -> None:
        assert self._lock is not None
        async with self._lock:
            while entry.replicas is None:
                victim = self._victim(entry)
                if victim is None:
                    await self._load(entry)
                elif victim is _WAIT:
                    await asyncio.sleep(_WAIT_POLL_S)  # a busy model must drain first
                else:
                    await self._unload(victim, "lru")  # type: ignore[arg-type]
            await self._trim(keep=entry)

    def _victim(self, entry: _Entry) -> _Entry | object | None:
        """None: `entry` fits now; the LRU idle unpinned model to evict first; or `_WAIT` while
        only busy models could make room."""
        loaded = [e for e in self.entries.values() if e.replicas is not None]
        if self._fits(loaded, self._estimate(entry)):
            return None
        idle = [e for e in loaded if not e.pinned and not e.busy]
        if idle:
            return min(idle, key=lambda e: e.last_used)
        if not [e for e in loaded if not e.pinned]:
            # Nothing evictable will ever make room (pins only, or nothing loaded): load anyway
            # rather than wait forever; `ModelPoolConfig` refuses pins that fill the count.
            logger.warning("loading %s exceeds --models-memory with nothing left to evict",
                           entry.spec.name)  # fmt: skip
            return None
        return _WAIT

    def _fits(self, loaded: list[_Entry], more_bytes: int) -> bool:
        cfg = self.config
        if cfg.max_loaded_models is not None and len(loaded) + 1 > cfg.max_loaded_models:
            return False
        if cfg.models_memory is not None:
            return sum(e.resident_bytes for e in loaded) + more_bytes <= cfg.models_memory
        return True

    def _estimate(self, entry: _Entry) -> int:
        """Bytes `entry` will hold once loaded: as measured at its last load, else its file's
        size plus the KV pool the config fixes (if it fixes one)."""
        return entry.resident_bytes or entry.spec.estimated_bytes

    async def _trim(self, keep: _Entry) -> None:
        """After a load measured more than estimated: evict idle models until under budget."""
        budget = self.config.models_memory
        if budget is None:
            return
        while True:
            loaded = [e for e in self.entries.values() if e.replicas is not None]
            if sum(e.resident_bytes for e in loaded) <= budget:
                return
            idle = [e for e in loaded if e is not keep and not e.pinned and not e.busy]
            if not idle:
                return
            await self._unload(min(idle, key=lambda e: e.last_used), "lru")

    async def _load(self, entry: _Entry) -> None:
        name = entry.spec.name
        logger.info("loading model %s (%s)", name, entry.spec.path)
        started = time.monotonic()
        replicas = self._make(entry.spec)
        replicas.start()
        try:
            await asyncio.gather(*(r.engine.wait_ready() for r in replicas.replicas))
        except BaseException as e:  # its own load error (for the client), or the server closing
            replicas.close()
            await asyncio.to_thread(replicas.shutdown)
            if not isinstance(e, Exception):
                raise
            raise APIError(503, f"the model `{name}` failed to load: {e}",
                           code="model_load_failed") from e  # fmt: skip
        entry.load_seconds = time.monotonic() - started
        entry.replicas = replicas
        entry.last_used = time.monotonic()
        entry.resident_bytes = sum(
            r.engine.info.resident_bytes for r in replicas.replicas if r.engine.info is not None
        )
        m = self.metrics
        m.loads.labels(name).inc()
        m.load_time.labels(name).observe(entry.load_seconds)
        m.resident.labels(name).set(entry.resident_bytes)
        m.loaded.labels(name).set(1)
        logger.info("model %s loaded in %.1f s (%.1f MiB resident)", name, entry.load_seconds,
                    entry.resident_bytes / 2**20)  # fmt: skip
        if self._on_ready is not None:
            self._on_ready(name, replicas)

    async def _unload(self, entry: _Entry, reason: str) -> None:
        replicas, entry.replicas = entry.replicas, None
        assert replicas is not None
        name = entry.spec.name
        started = time.monotonic()
        replicas.close()  # its supervisors: this exit is no death to restart from
        await asyncio.to_thread(replicas.shutdown)  # stops and reaps the engine processes
        m = self.metrics
        m.unload_time.labels(name).observe(time.monotonic() - started)
        m.unloads.labels(name, reason).inc()
        m.resident.labels(name).set(0)
        m.loaded.labels(name).set(0)
        logger.info("model %s unloaded (%s)", name, reason)

    async def _expire_idle(self, ttl: float) -> None:
        """Unload a model idle for `ttl` seconds (pinned ones stay)."""
        assert self._lock is not None
        while True:
            await asyncio.sleep(min(1.0, ttl / 4))
            now = time.monotonic()
            for e in self.entries.values():
                if e.replicas is None or e.pinned:
                    continue
                if e.busy:
                    e.last_used = now  # idle counts from the end of its last request
                elif now - e.last_used >= ttl and not self._lock.locked():
                    async with self._lock:
                        if e.replicas is not None and not e.busy:
                            await self._unload(e, "ttl")


_WAIT = object()  # `_victim`'s answer while only busy models could make room
