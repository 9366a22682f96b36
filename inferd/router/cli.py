"""`inferd router --worker-urls URL [URL ...]`: the cache-aware router, flags as SGLang's router;
`inferd router --pd-disaggregation --prefill URL [URL ...] --decode URL [URL ...]`: prefill/decode
disaggregation (inferd/router/pd.py)."""

from __future__ import annotations

import argparse
import inspect
import logging

from inferd.router.policy import POLICIES, CacheAwarePolicy, make_policy

logger = logging.getLogger("inferd.router")


def add_router_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="route OpenAI requests over several inferd servers "
                              "(cache-aware: to the worker that likely caches the prompt's prefix)")  # fmt: skip
    p.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                   help="the workers' base URLs, e.g. http://127.0.0.1:8001")  # fmt: skip
    pd = p.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--pd-disaggregation", action="store_true",
                    help="send each request to a --prefill worker, then stream it from a --decode "
                    "worker that pulls the prompt's KV blocks (workers started with `inferd serve "
                    "--kv-role prefill` / `--kv-role decode`)")  # fmt: skip
    pd.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                    help="the prefill workers' base URLs (with --pd-disaggregation)")
    pd.add_argument("--decode", nargs="+", default=None, metavar="URL",
                    help="the decode workers' base URLs (with --pd-disaggregation)")
    p.add_argument("--policy", choices=list(POLICIES), default="cache_aware",
                   help="how a worker is chosen (default: %(default)s)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    g = p.add_argument_group("cache_aware")
    params = inspect.signature(CacheAwarePolicy).parameters
    d = {name: params[name].default for name in params}
    g.add_argument("--prefix-weight", type=float, default=d["prefix_weight"],
                   help="cost of one uncached prompt token, in requests in flight: a worker's "
                   "cost is uncached tokens × this + its load (default: %(default)s)")  # fmt: skip
    g.add_argument("--balance-abs-threshold", type=int, default=d["balance_abs_threshold"],
                   help="when the busiest worker has more than this many requests more than the "
                   "least busy (and --balance-rel-threshold times as many), the least busy wins "
                   "(default: %(default)s)")  # fmt: skip
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=d["balance_rel_threshold"],
        help="(default: %(default)s)",
    )
    g.add_argument("--cache-threshold", type=float, default=d["cache_threshold"],
                   help="a worker must cache at least this share of the prompt for the prefix to "
                   "count; below it the least busy worker, then the one with the smallest tree, "
                   "takes the request (spreads new conversations) (default: %(default)s)")  # fmt: skip
    g.add_argument("--max-tree-size", type=int, default=d["max_tree_size"],
                   help="tokens (or characters) each worker's approximate tree keeps, least "
                   "recently used pruned first (default: %(default)s)")  # fmt: skip
    g.add_argument("--kv-events", nargs="+", default=None, metavar="ENDPOINT",
                   help="exact mode: each worker's KV events endpoint (its `inferd serve "
                   "--kv-events-endpoint`, e.g. tcp://host:5557), one per --worker-urls in order; "
                   "the router then knows which blocks each worker caches")  # fmt: skip
    g.add_argument("--tokenizer", "--model", dest="tokenizer", default=None,
                   help="model file or directory whose tokenizer and chat template key the "
                   "routing (default: the workers' model when it is on this machine, else the "
                   "prompt text)")  # fmt: skip
    g.add_argument("--random-seed", type=int, default=None, help="seed of --policy random")
    h = p.add_argument_group("health")
    h.add_argument("--health-check-interval", type=float, default=5.0,
                   help="seconds between /health probes of each worker (default: %(default)s)")  # fmt: skip
    h.add_argument("--health-failure-threshold", type=int, default=2,
                   help="failed probes in a row that take a worker out (a failed request takes "
                   "it out at once; a passing probe brings it back) (default: %(default)s)")  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="warning")
    p.set_defaults(func=cmd_router)
    return p


def policy_from_args(args: argparse.Namespace):
    if args.policy == "cache_aware":
        return make_policy("cache_aware", prefix_weight=args.prefix_weight,
                           balance_abs_threshold=args.balance_abs_threshold,
                           balance_rel_threshold=args.balance_rel_threshold,
                           cache_threshold=args.cache_threshold,
                           max_tree_size=args.max_tree_size)  # fmt: skip
    if args.policy == "random":
        return make_policy("random", seed=args.random_seed)
    return make_policy(args.policy)


def _worker_urls(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(the workers routed to, the prefill pool or None); SystemExit naming a bad combination."""
    if args.pd_disaggregation:
        if args.worker_urls:
            raise SystemExit("inferd router: --pd-disaggregation takes --prefill and --decode, "
                             "not --worker-urls")  # fmt: skip
        if not args.prefill or not args.decode:
            raise SystemExit("inferd router: --pd-disaggregation needs --prefill URL [URL ...] "
                             "and --decode URL [URL ...]")  # fmt: skip
        return args.decode, args.prefill
    if args.prefill or args.decode:
        raise SystemExit("inferd router: --prefill / --decode need --pd-disaggregation")
    if not args.worker_urls:
        raise SystemExit("inferd router: give --worker-urls URL [URL ...] (or --pd-disaggregation "
                         "with --prefill and --decode)")  # fmt: skip
    return args.worker_urls, None


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.router.app import RouterConfig, build_router_app

    workers, prefill = _worker_urls(args)
    config = RouterConfig(worker_urls=workers, prefill_urls=prefill, kv_events=args.kv_events,
                          tokenizer=args.tokenizer,
                          health_check_interval=args.health_check_interval,
                          health_failure_threshold=args.health_failure_threshold)  # fmt: skip
    app = build_router_app(config, policy_from_args(args), policy_from_args(args) if prefill else None)
    if prefill:
        logger.info("PD router on http://%s:%d (%s): prefill %s, decode %s", args.host, args.port,
                    args.policy, ", ".join(app.state.prefill_pool.workers), ", ".join(app.state.pool.workers))  # fmt: skip
    else:
        logger.info("router on http://%s:%d (%s) over %s", args.host, args.port, args.policy,
                    ", ".join(app.state.pool.workers))  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=5)  # fmt: skip
    return 0
