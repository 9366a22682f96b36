"""`inferd serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names."""

from __future__ import annotations

import argparse
import logging

from inferd import envs
from inferd.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from inferd.server.data_parallel import add_data_parallel_args, data_parallel_config
from inferd.server.http_timeouts import add_timeout_args, uvicorn_options
from inferd.server.limits import add_limit_args, limits_from_args
from inferd.server.privacy import PREFIX_CACHE_ISOLATION
from inferd.server.supervisor import add_supervision_args, supervision_config
from inferd.structured.tool_parsers import TOOL_PARSER_CHOICES

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
    from inferd.loader.default_model import DEFAULT_MODEL_NAME

    return args.served_model_name or [args.model or DEFAULT_MODEL_NAME]


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.engine.core import EngineCore
    from inferd.server.app import build_app
    from inferd.server.data_parallel import build_replicas
    from inferd.server.replicas import Replica
    from inferd.server.stream_guards import with_transport_in_scope

    limits = limits_from_args(args)  # validated here, before the port opens
    config = engine_config_from_args(args)  # validated here, before the port opens
    supervision = supervision_config(args)
    data_parallel = data_parallel_config(args)
    template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            template = f.read()

    def build_engine() -> EngineCore:
        engine = EngineCore(config)
        if template is not None:
            engine.tokenizer.set_chat_template(template)
        return engine

    url = f"http://{args.host}:{args.port}"
    names = served_names(args)

    def on_ready(replica: Replica) -> None:
        e = replica.engine.info
        assert e is not None
        stats = replica.engine.stats
        logger.info(
            "%sserving %s (%s) as %s: dtype %s on %s, max_model_len %d, KV cache %d blocks "
            "× %d tokens = %d tokens; API at %s/v1 (auth %s)",
            f"replica {replica.id} ({replica.placement}): " if replica.placement else "",
            e.source,
            e.file_type,
            ", ".join(names),
            e.dtype,
            e.device,
            e.max_model_len,
            stats.num_total_blocks,
            config.cache.block_size,
            stats.num_total_blocks * config.cache.block_size,
            url,
            "on" if args.api_key else "off",
        )

    # The front end admits by --max-queue-len (limits.py): the engines keep no queue limit.
    replicas = build_replicas(
        data_parallel,
        build_engine,
        names[0],
        supervision,
        engine_process=args.engine_process,
        stream_interval=args.stream_interval,
        max_stream_buffer_tokens=supervision.max_stream_buffer_tokens or None,
        parallel=config.parallel,
    )
    if data_parallel.size > 1:
        logger.info("%d replicas (%s backend, routed by %s): %s; HTTP front end unpinned",
                    data_parallel.size, data_parallel.backend, data_parallel.router_policy,
                    "; ".join(f"replica {r.id} on {r.placement}" for r in replicas.replicas))  # fmt: skip
    app = build_app(
        replicas,
        names,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_log_len=args.max_log_len,
        log_requests=args.enable_log_requests,
        on_ready=on_ready,
        tool_call_parser=args.tool_call_parser,
        limits=limits,
        body_timeout=args.body_timeout,
        prefix_cache_isolation=args.prefix_cache_isolation,
        allow_control_tokens_in_content=args.allow_control_tokens_in_content,
        supervision=supervision,
        enable_debug_endpoints=args.enable_debug_endpoints,
    )
    logger.info("starting the server on %s; loading the model", url)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        **with_transport_in_scope(uvicorn_options(args)),
    )
    return 0
