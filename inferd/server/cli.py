"""`inferd serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names."""

from __future__ import annotations

import argparse
import functools
import logging
from typing import TYPE_CHECKING

from inferd import envs
from inferd.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from inferd.server.data_parallel import add_data_parallel_args, data_parallel_config
from inferd.server.http_timeouts import add_timeout_args, uvicorn_options
from inferd.server.limits import add_limit_args, limits_from_args
from inferd.server.privacy import PREFIX_CACHE_ISOLATION
from inferd.server.served_models import (
    add_model_pool_args,
    model_pool_config,
    parse_model_arg,
    uses_pool,
)
from inferd.server.supervisor import add_supervision_args, supervision_config
from inferd.structured.tool_parsers import TOOL_PARSER_CHOICES

if TYPE_CHECKING:
    from inferd.config import EngineConfig
    from inferd.engine.core import EngineCore

logger = logging.getLogger("inferd.server")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_positional=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model argument)",
    )
    g.add_argument(
        "--api-key",
        nargs="+",
        default=envs.INFERD_API_KEY,
        help="require 'Authorization: Bearer KEY', one of these keys (default: $INFERD_API_KEY)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="characters (or token ids) of each prompt to log (with --enable-log-requests)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's prompt and parameters at INFO (off by default: prompts are "
        "private; API keys are never logged)",
    )
    g.add_argument("--disable-log-requests", action="store_true", help="the default; accepted "
                   "for vLLM compatibility")  # fmt: skip
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=1024,
        help="engine requests allowed to wait for the engine before 503s (0: no limit)",
    )
    g.add_argument(
        "--prefix-cache-isolation",
        choices=PREFIX_CACHE_ISOLATION,
        default="none",
        help="api-key: each API key (tenant) sees only its own prefix cache and cached_tokens; "
        "the request field `cache_salt` separates further",
    )
    g.add_argument(
        "--allow-control-tokens-in-content",
        action="store_true",
        help="tokenize control-token spellings in message content (e.g. <|im_end|>) as the "
        "control tokens themselves, as the raw template would: lets a user forge turns",
    )
    g.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default="10MiB",
        help="largest request body accepted (413 above it)",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine loop in a process of its own (vLLM V1's layout), its OpenMP "
        "threads bound to cores and the HTTP front end on the last CPU: the event loop no "
        "longer shares the engine's GIL, and an engine crash leaves the server up to say so "
        "(--no-engine-process: on a thread of the server process)",
    )
    g.add_argument(
        "--stream-interval",
        type=_at_least_one,
        default=1,
        help="tokens per streamed chunk after the first, which always goes at once (SGLang's "
        "flag): fewer, larger chunks cost the server and its clients less CPU per token",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_CHOICES,
        default="auto",
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), mistral "
        '([TOOL_CALLS][...]), llama3_json ({"name": ..., "parameters": ...}); auto: from '
        "the chat template's markers, hermes when it shows none",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on",
    )
    add_supervision_args(g)
    g.add_argument("--uvicorn-log-level", default="warning")
    add_data_parallel_args(p)
    add_model_pool_args(p)
    add_limit_args(p)
    add_timeout_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def served_names(args: argparse.Namespace) -> list[str]:
    """A single model's names: --served-model-name, its NAME=, or its path."""
    from inferd.loader.default_model import DEFAULT_MODEL_NAME

    name, path = parse_model_arg(args.models[0]) if args.models else (None, None)
    return args.served_model_name or [name or path or DEFAULT_MODEL_NAME]


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.server.app import build_app
    from inferd.server.data_parallel import build_replicas
    from inferd.server.model_pool import ModelPool
    from inferd.server.replicas import Replica, ReplicaSet
    from inferd.server.stream_guards import with_transport_in_scope

    # Everything is validated here, before the port opens.
    limits = limits_from_args(args)
    pool_config = model_pool_config(args) if uses_pool(args) else None
    names = served_names(args) if pool_config is None else [m.name for m in pool_config.models]
    if pool_config is None:
        args.model = parse_model_arg(args.models[0])[1] if args.models else None
        configs = {names[0]: engine_config_from_args(args)}
    else:
        if args.chat_template:
            raise ValueError("--chat-template serves one model; with several, each uses its own")
        configs = {m.name: engine_config_from_args(argparse.Namespace(**{**vars(args),
                                                                         "model": m.path}))
                   for m in pool_config.models}  # fmt: skip
    lora = configs[names[0]].lora
    if lora.enable_lora and pool_config is not None:
        raise ValueError("--enable-lora serves the adapters of one base model; "
                         "with several models it is not supported")
    supervision = supervision_config(args)
    data_parallel = data_parallel_config(args)
    template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()
    url = f"http://{args.host}:{args.port}"

    def on_ready(replica: Replica, shown: list[str]) -> None:
        config = configs[shown[0]]
        e = replica.engine.info
        assert e is not None
        stats = replica.engine.stats
        logger.info(
            "%sserving %s (%s) as %s: dtype %s on %s, max_model_len %d, KV cache %d blocks "
            "× %d tokens = %d tokens; API at %s/v1 (auth %s)",
            f"replica {replica.id} ({replica.placement}): " if replica.placement else "",
            e.source,
            e.file_type,
            ", ".join(shown),
            e.dtype,
            e.device,
            e.max_model_len,
            stats.num_total_blocks,
            config.cache.block_size,
            stats.num_total_blocks * config.cache.block_size,
            url,
            "on" if args.api_key else "off",
        )

    def replicas_of(name: str) -> ReplicaSet:
        return build_replicas(
            data_parallel,
            functools.partial(_build_engine, configs[name], template),
            name,
            supervision,
            engine_process=args.engine_process,
            stream_interval=args.stream_interval,
            max_stream_buffer_tokens=supervision.max_stream_buffer_tokens or None,
            parallel=configs[name].parallel,
        )

    # The front end admits by --max-queue-len (limits.py): the engines keep no queue limit.
    def on_model_ready(name: str, replicas: ReplicaSet) -> None:
        for replica in replicas.replicas:
            on_ready(replica, [name])

    served: ReplicaSet | ModelPool
    if pool_config is not None:
        served = ModelPool(pool_config, lambda spec: replicas_of(spec.name), on_model_ready)
        logger.info("serving %d models (%s), each loaded on first use%s", len(names),
                    ", ".join(names), f"; pinned: {', '.join(pool_config.pins)}"
                    if pool_config.pins else "")  # fmt: skip
    else:
        served = replicas = replicas_of(names[0])
    if data_parallel.size > 1 and isinstance(served, ReplicaSet):
        logger.info("%d replicas (%s backend, routed by %s): %s; HTTP front end unpinned",
                    data_parallel.size, data_parallel.backend, data_parallel.router_policy,
                    "; ".join(f"replica {r.id} on {r.placement}" for r in replicas.replicas))  # fmt: skip
    app = build_app(
        served,
        names,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_log_len=args.max_log_len,
        log_requests=args.enable_log_requests,
        on_ready=lambda replica: on_ready(replica, names),
        tool_call_parser=args.tool_call_parser,
        limits=limits,
        body_timeout=args.body_timeout,
        prefix_cache_isolation=args.prefix_cache_isolation,
        allow_control_tokens_in_content=args.allow_control_tokens_in_content,
        supervision=supervision,
        enable_debug_endpoints=args.enable_debug_endpoints,
        lora_modules=lora.modules if lora.enable_lora else None,
    )
    logger.info("starting the server on %s%s", url, "" if pool_config else "; loading the model")
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        **with_transport_in_scope(uvicorn_options(args)),
    )
    return 0


def _build_engine(config: EngineConfig, template: str | None) -> EngineCore:
    """An engine for `config` (in its engine process: this travels by cloudpickle)."""
    from inferd.engine.core import EngineCore

    engine = EngineCore(config)
    if template is not None:
        engine.tokenizer.set_chat_template(template)
    return engine
