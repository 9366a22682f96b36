"""The engines behind one front end: `inferd serve --data-parallel-size N` runs N replicas of the
engine, each with its own supervisor, metrics and KV cache, and routes each request to one.

    request ──► ReplicaSet.add_request ──► policy.select(prompt ids, in-flight per serving replica)
                                      └──► that replica's AsyncEngine (a retry elsewhere if it
                                           died before accepting)

A replica whose engine dies is restarted by its own supervisor while the others serve; requests it
had accepted but sent no news of yet (nothing streamed to a client) move to a serving replica
(`AsyncEngine.adopt`), so no client sees that death. One replica is exactly the single-engine
server: the same errors, /health and /metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from inferd.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineInfo,
    EngineNotReadyError,
    RequestStream,
)
from inferd.engine.core import EngineCore
from inferd.sampling.params import SamplingParams
from inferd.server.errors import APIError
from inferd.server.metrics import ServerMetrics
from inferd.server.replica_metrics import render_replicas
from inferd.router.policy import RoutingPolicy, make_policy
from inferd.server.supervisor import EngineSupervisor, SupervisionConfig

logger = logging.getLogger("inferd.server")

T = TypeVar("T")

# When no replica serves, the error that tells a client most: the first of these codes found.
_MOST_HOPEFUL = ("engine_restarting", "model_loading", "engine_stalled", "engine_dead")


def model_loading_error() -> APIError:
    return APIError(503, "the model is still loading; retry shortly", code="model_loading")


@dataclass(slots=True)
class Replica:
    id: str  # "0", "1", ...: the `replica` label on /metrics and /health
    engine: AsyncEngine
    metrics: ServerMetrics
    supervisor: EngineSupervisor
    placement: str = ""  # where it runs, for the start-up log and /health ("cores 0-1, ...")

    def request_error(self) -> APIError:
        """Why this replica takes no request now (it is not ready)."""
        engine = self.engine
        if (err := self.supervisor.request_error()) is not None:
            return err
        if engine.load_error is not None:
            return APIError(503, f"the model failed to load: {engine.load_error}", code="engine_dead")
        if engine.dead_reason is not None:
            return APIError(503, f"{engine.dead_reason}; restart the server", code="engine_dead")
        return model_loading_error()

    def health_error(self) -> APIError | None:
        """What /health says of this replica, or None when it serves."""
        if (err := self.supervisor.health_error()) is not None:
            return err
        return None if self.engine.ready else self.request_error()


class ReplicaSet:
    """Owns the replicas (their engines, supervisors and metrics) and routes requests to them.
    Lives on the event loop: `start()` from a running loop, `close()` then `shutdown()`."""

    def __init__(
        self,
        engines: Sequence[AsyncEngine],
        model_name: str,
        supervision: SupervisionConfig | None = None,
        policy: RoutingPolicy | None = None,
        placements: Sequence[str] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a server needs at least one engine")
        self.policy = policy or make_policy("cache_aware")
        self.replicas: list[Replica] = []
        for i, engine in enumerate(engines):
            metrics = ServerMetrics(model_name, lambda e=engine: e.stats)
            engine.observer = metrics
            supervisor = EngineSupervisor(
                engine, supervision or SupervisionConfig(), metrics.registry, model_name,
                f"replica {i}" if len(engines) > 1 else None,
            )  # fmt: skip
            replica = Replica(str(i), engine, metrics, supervisor,
                              placements[i] if placements else "")  # fmt: skip
            self.replicas.append(replica)
            self.policy.add_worker(replica.id)
            if len(engines) > 1:
                engine.reroute = lambda stream, dead=replica: self._reroute(dead, stream)
                engine.on_exit = self._forgetting(replica, engine.on_exit)
        self._by_id = {r.id: r for r in self.replicas}

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.engine.start()
            r.supervisor.start()

    def close(self) -> None:
        """The server is shutting down: no more restarts."""
        for r in self.replicas:
            r.supervisor.close()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        for r in self.replicas:
            r.engine.shutdown(timeout)

    # ---- state ----------------------------------------------------------------------------
    @property
    def serving(self) -> list[Replica]:
        """The replicas that take requests: the ready ones, less those stalled (no progress with
        work queued) while another one is not."""
        ready = [r for r in self.replicas if r.engine.ready]
        moving = [r for r in ready if r.supervisor.stalled_since is None]
        return moving or ready

    @property
    def ready(self) -> bool:
        return any(r.engine.ready for r in self.replicas)

    @property
    def info(self) -> EngineInfo | None:
        """The loaded model (every replica loads the same one)."""
        return next((r.engine.info for r in self.replicas if r.engine.info is not None), None)

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the queue of the least queued serving replica: the next request
        waits behind at least this many wherever it goes."""
        return min((r.engine.num_waiting for r in self.serving), default=0)

    def request_error(self) -> APIError:
        """Why no request can be taken now (no replica serves)."""
        if len(self.replicas) == 1:
            return self.replicas[0].request_error()
        return _combined([(r, r.request_error()) for r in self.replicas])

    def health(self) -> tuple[APIError | None, dict[str, Any]]:
        """(the 503 when no replica serves, else None; each replica's status)."""
        errors = [(r, r.health_error()) for r in self.replicas]
        statuses = {
            r.id: {"status": "ok" if e is None else e.code, **({"message": e.message} if e else {}),
                   **({"placement": r.placement} if r.placement else {})}
            for r, e in errors
        }  # fmt: skip
        if any(e is None for _, e in errors):
            return None, statuses
        if len(errors) == 1:
            return errors[0][1], statuses
        return _combined(errors), statuses  # type: ignore[arg-type]

    def supervisor_of(self, stream: RequestStream) -> EngineSupervisor:
        return next(r.supervisor for r in self.replicas if r.engine is stream.engine)

    def render_metrics(self) -> bytes:
        if len(self.replicas) == 1:
            return self.replicas[0].metrics.render()
        return render_replicas({r.id: r.metrics for r in self.replicas})

    # ---- requests -------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = True,
    ) -> RequestStream:
        """Submit to the replica the policy picks among those serving; one that dies before
        accepting is left for the next pick. Raises as `AsyncEngine.add_request` does."""
        tried: set[str] = set()
        died: EngineDeadError | None = None
        while True:
            candidates = [r for r in self.serving if r.id not in tried]
            if not candidates:
                raise died or EngineNotReadyError("no replica is serving")
            replica = self._pick(prompt, candidates)
            try:
                return await replica.engine.add_request(request_id, prompt, params, priority, stream)
            except EngineDeadError as e:
                if len(self.replicas) == 1:
                    raise
                tried.add(replica.id)
                died = e

    async def call_all(self, fn: Callable[[EngineCore], T]) -> list[T]:
        """`fn(engine_core)` on every serving replica's engine, between its steps."""
        return list(await asyncio.gather(*(r.engine.call(fn) for r in self.serving)))

    def _pick(self, prompt: str | list[int], candidates: list[Replica]) -> Replica:
        if len(candidates) == 1 and len(self.replicas) == 1:
            return candidates[0]
        loads = {r.id: r.engine.num_in_flight for r in candidates}
        return self._by_id[self.policy.select(prompt, loads)]

    def _reroute(self, dead: Replica, stream: RequestStream) -> bool:
        """`dead`'s engine died with `stream` accepted and silent: move it to a serving one."""
        candidates = [r for r in self.serving if r is not dead]
        if not candidates or stream.command is None:
            return False
        replica = self._pick(stream.command.prompt, candidates)
        try:
            replica.engine.adopt(stream)
        except Exception:
            logger.exception("could not move request %s to replica %s", stream.request_id,
                             replica.id)  # fmt: skip
            return False
        logger.warning("replica %s died; request %s moved to replica %s", dead.id,
                       stream.request_id, replica.id)  # fmt: skip
        return True

    def _forgetting(
        self, replica: Replica, on_exit: Callable[[str], None] | None
    ) -> Callable[[str], None]:
        """`on_exit` that first makes the policy forget what it routed to the dead replica (its
        restart starts with an empty cache)."""

        def exited(reason: str) -> None:
            self.policy.remove_worker(replica.id)
            self.policy.add_worker(replica.id)
            if on_exit is not None:
                on_exit(reason)

        return exited


def _combined(errors: list[tuple[Replica, APIError]]) -> APIError:
    codes = [e.code for _, e in errors]
    code = next((c for c in _MOST_HOPEFUL if c in codes), codes[0])
    detail = "; ".join(f"replica {r.id}: {e.message}" for r, e in errors)
    return APIError(503, f"no replica is serving ({detail})", code=code)
