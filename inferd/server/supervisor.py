"""Engine supervision: the front end restarts a dead engine process (with backoff, up to a limit),
watches a heartbeat that turns /health 503 when the engine makes no progress with work queued,
and counts what it did on /metrics.

    engine process dies ──► AsyncEngine._on_exit: in-flight requests fail (503 engine_dead)
                       └──► EngineSupervisor._on_exit: restart k (k = 0, 1, ...) after
                            backoff · 2^k s; meanwhile requests get 503 engine_restarting;
                            once k == max_restarts, the engine stays dead (503 engine_dead)

The heartbeat is the engine's own messages: while a stepping engine has requests in flight it
sends news after every step, so no message for `heartbeat_timeout_s` with work queued means the
engine is stuck (a hung kernel, a stopped process), unless it is in one long step. A step can
outlast the timeout honestly (a 2k-token prompt in one chunk on one slow core, a prefill worker's
whole job), so past the timeout the engine's CPU time decides: an engine that keeps computing
(at least `_BUSY_CORES` of a core since the last look) is busy, up to `max_step_s`; one that
does not (stopped, deadlocked, waiting on a peer that is gone) is stuck. Only /health says so
(`engine_stalled`): requests still queue, and the engine's news resumes them if it recovers.
Where the engine's CPU time cannot be read (a Ray actor), the timeout alone decides.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from inferd.engine.async_engine import AsyncEngine, RequestStream
from inferd.server.errors import APIError

logger = logging.getLogger("inferd.server")

_BUSY_CORES = 0.25  # CPU time per second of wall time that counts as an engine computing


@dataclass(frozen=True, slots=True)
class SupervisionConfig:
    restart_backoff_s: float = 1.0  # before the first restart; doubles for each one after
    max_restarts: int = 5  # over the server's lifetime; 0: a dead engine stays dead
    heartbeat_timeout_s: float = 30.0  # 0: no heartbeat
    max_step_s: float = 300.0  # a step that computes longer than this is stalled all the same
    max_stream_buffer_tokens: int = 8192  # 0: unbounded

    def __post_init__(self) -> None:
        for name in ("restart_backoff_s", "max_restarts", "heartbeat_timeout_s", "max_step_s",
                     "max_stream_buffer_tokens"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def add_supervision_args(g: argparse._ArgumentGroup) -> None:
    d = SupervisionConfig()
    g.add_argument("--max-engine-restarts", type=int, default=d.max_restarts,
                   help="times a dead engine process is restarted over the server's lifetime "
                   "(0: it stays dead and /health says so)")  # fmt: skip
    g.add_argument("--engine-restart-backoff", type=float, default=d.restart_backoff_s,
                   help="seconds before the first restart of a dead engine process; doubles "
                   "for each restart after it")  # fmt: skip
    g.add_argument("--engine-heartbeat-timeout", type=float, default=d.heartbeat_timeout_s,
                   help="seconds without engine progress, with requests in flight, after which "
                   "/health answers 503 engine_stalled, unless the engine is computing one "
                   "long step (0: off)")  # fmt: skip
    g.add_argument("--engine-max-step-seconds", type=float, default=d.max_step_s,
                   help="seconds one step may compute without news before /health answers 503 "
                   "engine_stalled all the same (a long prompt on a slow CPU is one such step)")  # fmt: skip
    g.add_argument("--max-stream-buffer-tokens", type=int, default=d.max_stream_buffer_tokens,
                   help="tokens a streamed request may hold for a client that reads too slowly; "
                   "past it the client is disconnected and its request aborted (0: unbounded)")  # fmt: skip
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve POST /debug/check_no_leaks (the engine's KV integrity check, when "
                   "idle); for tests and soaks, never for the open internet")  # fmt: skip


def supervision_config(args: argparse.Namespace) -> SupervisionConfig:
    return SupervisionConfig(
        restart_backoff_s=args.engine_restart_backoff,
        max_restarts=args.max_engine_restarts,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
        max_step_s=args.engine_max_step_seconds,
        max_stream_buffer_tokens=args.max_stream_buffer_tokens,
    )


class EngineSupervisor:
    """Restarts `engine` when its process dies, keeps its heartbeat and the reliability counters.
    Lives on the event loop: `start()` after `engine.start()`, `close()` before its shutdown."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: SupervisionConfig,
        registry: CollectorRegistry,
        model_name: str,
        replica: str | None = None,
    ) -> None:
        """`replica`: its name in the log lines, when there are several ("replica 1")."""
        self.engine = engine
        self._log = f"{replica}: " if replica else ""
        self.config = config
        lbl = ["model_name"]
        self.restarts_total = Counter("inferd:engine_restarts", "Engine process restarts.",
                                      lbl, registry=registry).labels(model_name)  # fmt: skip
        self.stream_overflows_total = Counter(
            "inferd:stream_overflows",
            "Streams whose client read too slowly (disconnected, request aborted).",
            lbl, registry=registry).labels(model_name)  # fmt: skip
        self.request_timeouts_total = Counter(
            "inferd:request_timeouts", "Requests aborted at their `timeout`.",
            lbl, registry=registry).labels(model_name)  # fmt: skip
        self.restarts = 0
        self.restarting: str | None = None  # why the engine is being restarted, meanwhile
        self.gave_up: str | None = None  # set once the restart limit is reached
        self.stalled_since: float | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        engine.on_exit = self._on_exit
        engine.on_stream_overflow = self._on_overflow

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.config.heartbeat_timeout_s > 0:
            self._spawn(self._heartbeat())

    def close(self) -> None:
        """The server is shutting down: the engine's exit is no death to restart from."""
        self._closing = True
        for task in self._tasks:
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what the server answers ----------------------------------------------------------
    def request_error(self) -> APIError | None:
        """The 503 for a request while the engine is not ready because of a death, or None."""
        max_restarts = self.config.max_restarts
        if self.gave_up is not None:
            return APIError(503, self.gave_up, code="engine_dead")
        if self.restarting is not None:
            return APIError(
                503,
                f"{self.restarting}; restarting it (restart {self.restarts + 1} of at most "
                f"{max_restarts}); retry shortly",
                code="engine_restarting",
            )
        return None

    def health_error(self) -> APIError | None:
        """What /health answers instead of 200, or None to let it judge as before."""
        if not self.engine.ready:
            return self.request_error()
        if self.stalled_since is not None:
            stalled = time.monotonic() - self.stalled_since + self.config.heartbeat_timeout_s
            return APIError(
                503,
                f"the engine has made no progress for {stalled:.0f} s with requests in flight "
                f"(--engine-heartbeat-timeout {self.config.heartbeat_timeout_s:g})",
                code="engine_stalled",
            )
        return None

    # ---- restarts -------------------------------------------------------------------------
    def _on_exit(self, reason: str) -> None:
        engine = self.engine
        # Only an engine that served (or a restart) is restarted: a model that fails to load at
        # start-up fails the same way again.
        if self._closing or not engine.engine_process:
            return
        if engine.info is None and self.restarting is None:
            return
        if self.restarts >= self.config.max_restarts:
            self.restarting = None
            self.gave_up = (
                f"{reason}, and it has been restarted {self.restarts} times already "
                f"(--max-engine-restarts {self.config.max_restarts}); restart the server"
            )
            logger.error("%s%s", self._log, self.gave_up)
            return
        delay = self.config.restart_backoff_s * 2**self.restarts
        self.restarting = reason
        logger.error("%s%s; restarting it in %.1f s", self._log, reason, delay)
        self._spawn(self._restart(delay))

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._closing:
            return
        self.restarts += 1
        self.restarts_total.inc()
        self.engine.restart()
        try:
            await self.engine.wait_ready()
        except Exception:  # noqa: BLE001 — it died again: `_on_exit` has scheduled the next
            return
        self.restarting = None
        logger.warning("%sengine restarted (%d of at most %d); serving again", self._log,
                       self.restarts, self.config.max_restarts)  # fmt: skip

    # ---- heartbeat ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        period = min(1.0, timeout / 4)
        engine = self.engine
        seen, since = engine.num_messages, time.monotonic()  # last news, and when it came
        cpu, looked = engine.cpu_seconds(), since  # the engine's CPU time at the last look
        busy_logged = False
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            cpu_was, cpu = cpu, engine.cpu_seconds()
            computing = (cpu is not None and cpu_was is not None
                         and cpu - cpu_was >= _BUSY_CORES * (now - looked))  # fmt: skip
            looked = now
            if engine.num_messages != seen or not engine.has_work or not engine.ready:
                seen, since = engine.num_messages, now
                busy_logged = False
                if self.stalled_since is not None:
                    logger.warning("%sthe engine is making progress again", self._log)
                    self.stalled_since = None
                continue
            quiet = now - since
            if quiet <= timeout:
                continue
            if computing and quiet <= self.config.max_step_s:
                if not busy_logged:
                    busy_logged = True
                    logger.info("%sone step has computed for %.0f s with no news yet: busy, not "
                                "stalled", self._log, quiet)  # fmt: skip
                if self.stalled_since is not None:
                    logger.warning("%sthe engine is computing again", self._log)
                    self.stalled_since = None
            elif self.stalled_since is None:
                self.stalled_since = now - (quiet - timeout)
                logger.error("%sthe engine has made no progress for %.0f s with requests in "
                             "flight%s", self._log, quiet,
                             " (one step past --engine-max-step-seconds)" if computing else "")  # fmt: skip

    # ---- counters -------------------------------------------------------------------------
    def _on_overflow(self, stream: RequestStream) -> None:
        self.stream_overflows_total.inc()
        logger.warning("request %s: the client read its stream too slowly; disconnected and "
                       "aborted", stream.request_id)  # fmt: skip
