"""The router's workers: their URLs, health, and requests in flight.

A worker is routed to only while healthy. It starts unhealthy and turns healthy once its /health
answers 200; `failure_threshold` failed probes in a row, or one failed request (the connection
refused or dropped), take it out until a probe passes again. The policy (policy.py) is told as
workers enter and leave the healthy set, so a worker that comes back starts with an empty tree:
a restarted engine's prefix cache is empty too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from inferd.router.policy import RoutingPolicy

logger = logging.getLogger("inferd.router")


def normalize_worker_url(url: str) -> str:
    """`http(s)://host:port` of a worker; ValueError naming what is wrong with `url`."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a worker URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"worker URL {url!r}: the scheme must be http or https")
    try:
        port = parts.port  # ValueError for a port out of range or not a number
    except ValueError as e:
        raise ValueError(f"worker URL {url!r}: {e}") from None
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r}: no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"worker URL {url!r}: give the server's root (no path), e.g. http://host:8000"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


@dataclass(slots=True)
class Worker:
    url: str
    kv_events_endpoint: str | None = None
    healthy: bool = False
    load: int = 0  # requests in flight through the router
    failed_probes: int = 0


class WorkerPool:
    """Workers by URL, their health probed every `interval` seconds."""

    def __init__(self, policy: RoutingPolicy, interval: float = 5.0, failure_threshold: int = 2,
                 probe_timeout: float = 5.0) -> None:  # fmt: skip
        self.policy = policy
        self.interval = interval
        self.failure_threshold = failure_threshold
        self.probe_timeout = probe_timeout
        self.workers: dict[str, Worker] = {}
        # Called with a worker as it turns healthy / unhealthy / is removed (KV subscriptions).
        self.on_up: list[Callable[[Worker], None]] = []
        self.on_down: list[Callable[[Worker], None]] = []

    def add(self, url: str, kv_events_endpoint: str | None = None) -> Worker:
        """A new worker (unhealthy until probed); ValueError for a bad or known URL."""
        url = normalize_worker_url(url)
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        worker = Worker(url, kv_events_endpoint)
        self.workers[url] = worker
        return worker

    def remove(self, url: str) -> Worker:
        """Take a worker out for good; KeyError if unknown."""
        worker = self.workers.pop(normalize_worker_url(url))
        self.mark_down(worker, "removed")
        return worker

    def loads(self) -> dict[str, int]:
        return {url: w.load for url, w in self.workers.items() if w.healthy}

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def mark_up(self, worker: Worker) -> None:
        worker.failed_probes = 0
        if not worker.healthy and worker.url in self.workers:
            worker.healthy = True
            self.policy.add_worker(worker.url)
            logger.info("worker %s is up", worker.url)
            for f in self.on_up:
                f(worker)

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.healthy:
            worker.healthy = False
            logger.warning("worker %s is down: %s", worker.url, why)
        self.policy.remove_worker(worker.url)
        for f in self.on_down:
            f(worker)

    async def probe(self, session: aiohttp.ClientSession, worker: Worker) -> None:
        try:
            async with session.get(f"{worker.url}/health",
                                   timeout=aiohttp.ClientTimeout(total=self.probe_timeout)) as r:  # fmt: skip
                ok, why = r.status == 200, f"/health answered {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, why = False, f"/health: {type(e).__name__}: {e}"
        if ok:
            self.mark_up(worker)
            return
        worker.failed_probes += 1
        if worker.healthy and worker.failed_probes >= self.failure_threshold:
            self.mark_down(worker, why)

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.probe(session, w) for w in list(self.workers.values())))

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Probe every worker now and every `interval` seconds, until cancelled."""
        while True:
            await self.probe_all(session)
            await asyncio.sleep(self.interval)
