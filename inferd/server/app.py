"""The FastAPI app: routes only. The work lives in serving_*.py, the guards in middleware.py.

The engine starts loading when the app starts; until it is ready /health answers 503 and so does
every generation request, so an orchestrator can route traffic by the health probe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import inferd
from inferd.engine.async_engine import AsyncEngine
from inferd.server.debug import install_debug_routes
from inferd.server.errors import APIError, api_errors, error_response, install_error_handlers
from inferd.server.http_timeouts import BodyTimeoutMiddleware
from inferd.server.limits import AdmissionLimits
from inferd.server.metrics import CONTENT_TYPE
from inferd.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from inferd.server.model_pool import ModelPool
from inferd.server.privacy import bearer_token
from inferd.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelAdminRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from inferd.server.replicas import Replica, ReplicaSet, model_loading_error
from inferd.server.served_models import ServedModels
from inferd.server.serving_chat import create_chat_completion, render_chat
from inferd.server.serving_common import ServerState, encode
from inferd.server.serving_completions import create_completion
from inferd.server.serving_lora import adapter_cards, install_lora_routes
from inferd.server.supervisor import SupervisionConfig

logger = logging.getLogger("inferd.server")

DEFAULT_MAX_REQUEST_BYTES = 10 << 20


def build_app(
    engine: AsyncEngine | ReplicaSet | ModelPool,
    served_model_names: list[str],
    *,
    api_key: str | list[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_log_len: int | None = None,
    log_requests: bool = False,
    on_ready: Any = None,
    tool_call_parser: str = "auto",
    limits: AdmissionLimits | None = None,
    body_timeout: float = 30.0,
    prefix_cache_isolation: str = "none",
    allow_control_tokens_in_content: bool = False,
    supervision: SupervisionConfig | None = None,
    enable_debug_endpoints: bool = False,
    lora_modules: dict[str, str] | None = None,
) -> FastAPI:
    """An app serving `engine`, or several replicas of it (not started yet: the app's lifespan
    starts and stops them).

    `on_ready(replica)` is called once each replica has loaded (the CLI logs the startup lines).
    `tool_call_parser`: how tool calls are read from outputs (a name in TOOL_PARSERS, or "auto").
    `limits`: admission limits (limits.py); `body_timeout`: seconds to read a body (408 after);
    `prefix_cache_isolation` (privacy.py), `allow_control_tokens_in_content` (control_tokens.py).
    `supervision`: restarts of a dead engine process, its heartbeat (supervisor.py; None: the
    defaults), for a lone `engine` (a `ReplicaSet` has its own); `enable_debug_endpoints`:
    /debug/* (debug.py). A `ModelPool` serves the several models it names (served_models.py),
    each loaded on demand; `on_ready` is then the pool's own. `lora_modules`: LoRA adapters
    (name → path) the engines were started with, None when LoRA is off (serving_lora.py).
    """
    if isinstance(engine, AsyncEngine):
        engine = ReplicaSet([engine], served_model_names[0], supervision)
    pool = engine if isinstance(engine, ModelPool) else None
    replicas = engine if isinstance(engine, ReplicaSet) else None
    state = ServerState(
        replicas, served_model_names, max_log_len, log_requests, tool_call_parser,  # type: ignore[arg-type]
        limits=limits or AdmissionLimits(), prefix_cache_isolation=prefix_cache_isolation,
        allow_control_tokens_in_content=allow_control_tokens_in_content,
        enable_lora=lora_modules is not None, lora_modules=dict(lora_modules or {}),
    )  # fmt: skip
    served = ServedModels(state, pool)
    # Set once every replica's startup line is logged: /health says 200 only then, so whatever
    # waits for it (a supervisor, a test) finds the lines (on uvloop the health request could
    # run first).
    started = threading.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        if pool is not None:  # /health judges by the pinned models (ServedModels.health)
            pool.start()
            started.set()
            try:
                yield
            finally:
                pool.close()
                await pool.shutdown()
            return
        assert replicas is not None
        replicas.start()

        async def announce(replica: Replica) -> None:
            try:
                await replica.engine.wait_ready()
            except Exception as e:  # noqa: BLE001 — a failed load is reported by /health
                logger.error("%s", e)
                return
            if on_ready is not None:
                on_ready(replica)

        async def announce_all() -> None:
            await asyncio.gather(*(announce(r) for r in replicas.replicas))
            if replicas.ready:
                started.set()

        task = asyncio.create_task(announce_all())
        try:
            yield
        finally:
            task.cancel()
            replicas.close()
            await asyncio.get_running_loop().run_in_executor(None, replicas.shutdown)

    app = FastAPI(
        title="inferd",
        version=inferd.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible LLM serving",
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout=body_timeout)
    if api_key:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if state.limits.admin_api_key:
            keys.append(state.limits.admin_api_key)
        app.add_middleware(APIKeyMiddleware, api_key=keys)  # outermost: refuse before reading
    if enable_debug_endpoints:
        install_debug_routes(app, served)
    if pool is not None:
        install_model_admin_routes(app, pool, state.limits.admin_api_key)
    install_lora_routes(app, state)

    @app.post("/v1/completions", response_model=None)
    @api_errors
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        async with served.serving(req.model) as model_state:
            return await create_completion(model_state, req, raw)

    @app.post("/v1/chat/completions", response_model=None)
    @api_errors
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        async with served.serving(req.model) as model_state:
            return await create_chat_completion(model_state, req, raw)

    @app.get("/v1/models")
    @api_errors
    async def models() -> ModelList:
        cards = served.cards()
        if state.enable_lora:  # a single model's server (several models refuse --enable-lora)
            cards += adapter_cards(state, state.created, state.max_model_len)
        return ModelList(data=cards)

    @app.get("/health", response_model=None)
    @api_errors
    async def health() -> Response:
        """200 while a replica serves (several replicas: each one's status in the body); else
        the 503 that says why none does."""
        error, statuses = served.health()
        if error is not None:
            return error_response(error)
        if not started.is_set():
            return error_response(model_loading_error())  # the startup lines are not out yet
        if pool is not None:
            return JSONResponse({"status": "ok", "models": statuses})
        if len(statuses) == 1:
            return Response(status_code=200)
        return JSONResponse({"status": "ok", "replicas": statuses})

    @app.get("/metrics", response_model=None)
    @api_errors
    async def prometheus() -> Response:
        return Response(served.render_metrics(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    @api_errors
    async def reset_prefix_cache() -> dict[str, bool]:
        """Flush the prefix cache (blocks running requests use stay); `reset` says if it emptied
        (on every serving replica of every loaded model)."""
        done = [d for s in served.loaded()
                for d in await s.ready_replicas().call_all(lambda core: core.reset_prefix_cache())]  # fmt: skip
        return {"reset": all(done)}

    @app.get("/version")
    @api_errors
    async def version() -> dict[str, str]:
        return {"version": inferd.__version__}

    @app.post("/tokenize")
    @api_errors
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        async with served.serving(req.model) as model_state:
            return await _tokenize(model_state, req)

    @app.post("/detokenize")
    @api_errors
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        async with served.serving(req.model) as model_state:
            vocab = model_state.tokenizer.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(
                    400, f"token id {bad} is out of range (vocab size {vocab})", param="tokens"
                )
            return DetokenizeResponse(prompt=model_state.tokenizer.decode(req.tokens))

    return app


async def _tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
    if req.messages is not None:
        ids = await render_chat(state, req.messages, add_generation_prompt=req.add_generation_prompt)
    else:
        ids = await encode(state.tokenizer, req.prompt or "", req.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)


def install_model_admin_routes(app: FastAPI, pool: ModelPool, admin_key: str | None) -> None:
    """POST /v1/models/load and /v1/models/unload {"model": NAME}: behind --api-key like every
    route, and behind --admin-api-key alone when it is set."""

    def check_admin(raw: Request) -> None:
        if admin_key and bearer_token(raw) != admin_key:
            raise APIError(403, "loading and unloading models needs the admin API key "
                           "(--admin-api-key)", code="admin_key_required")  # fmt: skip

    @app.post("/v1/models/load")
    @api_errors
    async def load_model(req: ModelAdminRequest, raw: Request) -> dict[str, Any]:
        check_admin(raw)
        done = await pool.load(req.model)
        return {"model": req.model, "loaded": True, "changed": done}

    @app.post("/v1/models/unload")
    @api_errors
    async def unload_model(req: ModelAdminRequest, raw: Request) -> dict[str, Any]:
        check_admin(raw)
        done = await pool.unload(req.model)
        return {"model": req.model, "loaded": False, "changed": done}
