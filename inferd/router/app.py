"""The router's FastAPI app: an OpenAI-compatible front over inferd (or vLLM-shaped) workers.

Generation requests are read once (to compute the routing key) and forwarded byte for byte
(proxy.py). /v1/models is answered by a healthy worker. /health is 200 while any worker is
healthy (and, at the start, once the routing key's tokenizer is settled). `POST /workers`, `DELETE /workers/{url}`, `GET /workers` manage the workers at run time;
/metrics is the router's own (metrics.py).

With `prefill_urls` (`--pd-disaggregation`), the workers are the decode pool and each request
goes through a prefill worker first (pd.py); /health then needs a healthy decode worker (a
request whose prefill leg cannot run is decoded alone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import inferd
from inferd.loader import load_tokenizer
from inferd.router.keys import RequestKeys
from inferd.router.kv_subscriber import KVEventSubscriber
from inferd.router.metrics import CONTENT_TYPE, RouterMetrics
from inferd.router.pd import PDForwarder
from inferd.router.policy import RoutingPolicy
from inferd.router.proxy import Forwarder
from inferd.router.workers import Worker, WorkerPool
from inferd.server.errors import APIError, api_errors, install_error_handlers

logger = logging.getLogger("inferd.router")


@dataclass(slots=True)
class RouterConfig:
    worker_urls: list[str]
    kv_events: list[str] | None = None  # per worker URL, in order: its KV events endpoint
    tokenizer: str | None = None  # a model path; None: the workers' (/v1/models `root`), if local
    health_check_interval: float = 5.0
    health_failure_threshold: int = 2
    max_request_bytes: int = 10 << 20
    # PD disaggregation: the prefill pool (worker_urls are then the decode pool).
    prefill_urls: list[str] | None = None

    def __post_init__(self) -> None:
        if self.prefill_urls is not None and (not self.prefill_urls or not self.worker_urls):
            raise ValueError("--pd-disaggregation needs at least one --prefill and one --decode URL")
        if self.kv_events is not None and len(self.kv_events) != len(self.worker_urls):
            raise ValueError(f"--kv-events gives {len(self.kv_events)} endpoints for "
                             f"{len(self.worker_urls)} --worker-urls: give one per worker, in order")  # fmt: skip
        bad = [e for e in self.kv_events or () if "://" not in e]
        if bad:
            raise ValueError(f"--kv-events: {bad[0]!r} is not a ZMQ endpoint such as tcp://host:5557")
        if self.health_check_interval <= 0 or self.health_failure_threshold < 1:
            raise ValueError(
                "--health-check-interval must be > 0 and --health-failure-threshold >= 1"
            )


def _worker_json(w: Worker, role: str | None = None) -> dict[str, Any]:
    d = {"url": w.url, "healthy": w.healthy, "load": w.load, "kv_events_endpoint": w.kv_events_endpoint}
    return d if role is None else {**d, "role": role}


def _json_object(body: bytes) -> dict:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(parsed, dict):
        raise APIError(400, "the request body must be a JSON object")
    return parsed


def build_router_app(config: RouterConfig, policy: RoutingPolicy,
                     prefill_policy: RoutingPolicy | None = None) -> FastAPI:  # fmt: skip
    """The app; workers are probed from its start (none is routed to before its /health is 200).
    `prefill_policy`: how the prefill pool is chosen from (PD; default: as `policy`, a copy)."""
    pool = WorkerPool(policy, config.health_check_interval, config.health_failure_threshold)
    prefill_pool: WorkerPool | None = None
    if config.prefill_urls is not None:
        prefill_pool = WorkerPool(prefill_policy or type(policy)(), config.health_check_interval,
                                  config.health_failure_threshold)  # fmt: skip
        for url in config.prefill_urls:
            prefill_pool.add(url)
    endpoints = config.kv_events or [None] * len(config.worker_urls)
    for url, endpoint in zip(config.worker_urls, endpoints):
        pool.add(url, endpoint)  # ValueError for a bad or repeated URL, before the port opens
    metrics = RouterMetrics(pool)
    keys = RequestKeys(load_tokenizer(config.tokenizer) if config.tokenizer else None)
    state: dict[str, Any] = {}

    async def tokenizer_from_workers(worker: Worker) -> None:
        """Without --tokenizer: the model file a worker serves, when it lies on this machine."""
        try:
            async with state["session"].get(f"{worker.url}/v1/models") as r:
                root = ((await r.json()).get("data") or [{}])[0].get("root")
            if root:
                keys.tokenizer = await asyncio.to_thread(load_tokenizer, root)
                logger.info("routing by token ids (the tokenizer of %s)", root)
        except Exception as e:  # noqa: BLE001 — routing by text still works
            logger.info("routing by text: no tokenizer from %s (%s)", worker.url, e)

    def on_worker_up(worker: Worker) -> None:
        if keys.tokenizer is None and "tokenizer_task" not in state:  # one try, the first worker
            state["tokenizer_task"] = asyncio.get_running_loop().create_task(
                tokenizer_from_workers(worker)
            )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            auto_decompress=False,  # bodies pass through as the worker sent them
        )
        state["session"] = session
        subscriber = KVEventSubscriber(policy, metrics)
        pool.on_up.append(subscriber.subscribe)
        pool.on_down.append(subscriber.unsubscribe)
        pool.on_up.append(on_worker_up)
        app.state.forwarder = Forwarder(pool, metrics, session)
        prefill_health = None
        if prefill_pool is not None:
            app.state.pd = PDForwarder(Forwarder(prefill_pool, metrics, session), app.state.forwarder)
            await prefill_pool.probe_all(session)
            prefill_health = asyncio.create_task(prefill_pool.run(session))
        await pool.probe_all(session)  # healthy workers route from the first request
        if "tokenizer_task" in state:  # the keys of the first requests are already token ids
            await state["tokenizer_task"]
        health = asyncio.create_task(pool.run(session))
        try:
            yield
        finally:
            health.cancel()
            if prefill_health is not None:
                prefill_health.cancel()
            subscriber.close()
            await session.close()

    app = FastAPI(title="inferd router", version=inferd.__version__, lifespan=lifespan)
    app.state.pool = pool
    app.state.prefill_pool = prefill_pool
    install_error_handlers(app)

    async def generate(raw: Request, key_of) -> Response:
        started = time.perf_counter()
        body = await raw.body()
        if len(body) > config.max_request_bytes:
            raise APIError(413, f"the request body is over {config.max_request_bytes} bytes")
        parsed = _json_object(body)
        key = key_of(parsed)
        if prefill_pool is not None:
            return await raw.app.state.pd.forward(raw.url.path, body, parsed, dict(raw.headers), key, started)
        return await raw.app.state.forwarder.forward(
            raw.url.path, body, dict(raw.headers), key, started
        )

    @api_errors
    async def completions(raw: Request) -> Response:
        return await generate(raw, keys.completion)

    @api_errors
    async def chat_completions(raw: Request) -> Response:
        return await generate(raw, keys.chat)

    # Plain Starlette routes: the body is read as bytes anyway, and FastAPI's dependency
    # solving would add to every request's latency through the router.
    app.add_route("/v1/completions", completions, methods=["POST"], include_in_schema=False)
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models", response_model=None)
    @api_errors
    async def models(raw: Request) -> Response:
        for w in pool.healthy():
            try:
                async with state["session"].get(f"{w.url}/v1/models", headers={
                        k: v for k, v in raw.headers.items() if k.lower() == "authorization"}) as r:  # fmt: skip
                    return Response(await r.read(), status_code=r.status,
                                    media_type=r.headers.get("content-type"))  # fmt: skip
            except (aiohttp.ClientError, TimeoutError) as e:
                pool.mark_down(w, f"{type(e).__name__}: {e}")
        raise APIError(503, "no healthy worker to ask", code="no_healthy_worker")

    @app.get("/health", response_model=None)
    async def health() -> Response:
        # Ready once a worker is and the routing key is settled (the workers' tokenizer loaded,
        # or found missing): keys do not change kind under the first requests.
        task = state.get("tokenizer_task")
        if pool.healthy() and (task is None or task.done()):
            return Response(status_code=200)
        return JSONResponse({"error": {"message": "no healthy worker", "type": "server_error",
                                       "param": None, "code": "no_healthy_worker"}}, status_code=503)  # fmt: skip

    @app.get("/workers")
    async def list_workers() -> dict[str, Any]:
        if prefill_pool is None:
            return {"workers": [_worker_json(w) for w in pool.workers.values()]}
        return {"workers": [_worker_json(w, "prefill") for w in prefill_pool.workers.values()]
                + [_worker_json(w, "decode") for w in pool.workers.values()]}  # fmt: skip

    @app.post("/workers", response_model=None)
    @api_errors
    async def add_worker(raw: Request) -> JSONResponse:
        spec = _json_object(await raw.body())
        endpoint = spec.get("kv_events_endpoint")
        if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
            raise APIError(400, f"kv_events_endpoint must be a ZMQ endpoint such as "
                           f"tcp://host:5557, got {endpoint!r}", param="kv_events_endpoint")  # fmt: skip
        try:
            worker = pool.add(spec.get("url"), endpoint)  # type: ignore[arg-type]
        except ValueError as e:
            status = 409 if "already registered" in str(e) else 400
            raise APIError(status, str(e), param="url") from None
        await pool.probe(state["session"], worker)
        return JSONResponse(_worker_json(worker), status_code=201)

    @app.delete("/workers/{url:path}", response_model=None)
    @api_errors
    async def remove_worker(url: str) -> JSONResponse:
        try:
            worker = pool.remove(unquote(url))
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None
        except KeyError:
            raise APIError(404, f"no worker {unquote(url)}", param="url") from None
        return JSONResponse(_worker_json(worker))

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
