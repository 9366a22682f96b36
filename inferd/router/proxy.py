"""Forwarding one request: choose a worker, send the body as it came, pass the answer back.

A worker that cannot be reached, or drops the connection before the router has passed a byte of
its answer on, is marked down and the request goes to the next choice; once a byte has gone to
the client the request stays where it is (a stream cut then ends with an OpenAI-shaped error
event). Streams (SSE) are passed through chunk by chunk as they arrive, usage chunks included.
Workers' own answers, errors included, are passed through as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
from fastapi.responses import Response, StreamingResponse

from inferd.router.keys import Key
from inferd.router.metrics import RouterMetrics
from inferd.router.workers import Worker, WorkerPool
from inferd.server.errors import APIError, error_body

logger = logging.getLogger("inferd.router")

# Request headers passed on to the worker (auth for workers that require a key).
_FORWARDED = ("authorization", "content-type", "accept", "x-request-id")
# Response headers passed back to the client besides the content type (bodies are not decoded).
_PASSED_BACK = ("content-encoding", "retry-after", "x-request-id")
_UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, TimeoutError)


def _passed_back(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k in _PASSED_BACK if (v := resp.headers.get(k)) is not None}


class Forwarder:
    def __init__(
        self, pool: WorkerPool, metrics: RouterMetrics, session: aiohttp.ClientSession
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.session = session

    def _pick(self, key: Key) -> tuple[Worker, int, int]:
        try:
            choice = self.pool.policy.choose(key, self.pool.loads())
        except LookupError:
            raise APIError(503, "no healthy worker to route to", code="no_healthy_worker") from None
        return self.pool.workers[choice.worker_id], choice.matched, choice.key_len

    async def forward(self, path: str, body: bytes, headers: dict[str, str], key: Key,
                      started: float) -> Response:  # fmt: skip
        """The worker's answer to POST `path` with `body`; `started`: perf_counter at receipt."""
        headers = {k: v for k, v in headers.items() if k.lower() in _FORWARDED}
        attempt = 0
        while True:
            worker, matched, key_len = self._pick(key)
            if attempt == 0:
                self.metrics.routing_seconds.observe(time.perf_counter() - started)
            else:
                self.metrics.retries.inc()
            attempt += 1
            self.metrics.routed(worker.url, key_len, matched)
            worker.load += 1
            try:
                resp = await self.session.post(worker.url + path, data=body, headers=headers)
            except _UPSTREAM_ERRORS as e:
                worker.load -= 1
                self.pool.mark_down(worker, f"{type(e).__name__}: {e}")
                continue
            if resp.content_type != "text/event-stream":
                try:
                    data = await resp.read()
                except _UPSTREAM_ERRORS as e:
                    self.pool.mark_down(worker, f"{type(e).__name__}: {e}")
                    continue
                finally:
                    resp.release()
                    worker.load -= 1
                return Response(data, status_code=resp.status, headers=_passed_back(resp),
                                media_type=resp.headers.get("content-type"))  # fmt: skip
            try:
                first = await resp.content.readany()
                if not first:
                    raise aiohttp.ServerDisconnectedError("the stream ended before its first byte")
            except _UPSTREAM_ERRORS as e:
                resp.release()
                worker.load -= 1
                self.pool.mark_down(worker, f"{type(e).__name__}: {e}")
                continue
            return StreamingResponse(self._relay(worker, resp, first), status_code=resp.status,
                                     headers=_passed_back(resp), media_type="text/event-stream")  # fmt: skip

    async def _relay(
        self, worker: Worker, resp: aiohttp.ClientResponse, first: bytes
    ) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in resp.content.iter_any():
                yield chunk
        except _UPSTREAM_ERRORS as e:
            self.pool.mark_down(worker, f"{type(e).__name__} mid-stream: {e}")
            err = error_body(502, f"worker {worker.url} failed mid-stream: {type(e).__name__}",
                             code="worker_failed")  # fmt: skip
            yield b"data: " + orjson.dumps(err) + b"\n\n"
        finally:
            resp.release()
            worker.load -= 1
