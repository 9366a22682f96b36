"""`inferd bench router-overhead`: the latency `inferd router` adds to a request.

A trivial upstream (answers every completion at once with a fixed body) runs in this process;
a real `inferd router` process runs in front of it. Requests alternate between the upstream
directly and through the router, one at a time over kept-alive connections, so drift in the
machine's load falls on both alike; the added latency is the difference of their percentiles.
Beside it: the router's own `inferd_router:routing_seconds` (parse, key, policy), and the CPU time
its process spent per request, which waiting to be scheduled on a busy machine does not inflate.
The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import psutil
from aiohttp import web

_ANSWER = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "trivial",
           "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_upstream(port: int) -> int:
    """The trivial upstream, on a thread with its own event loop (daemon: ends with the process);
    returns the thread's native id (its CPU time is read from psutil)."""
    body = json.dumps(_ANSWER).encode()

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "trivial", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    started = threading.Event()
    native_id: list[int] = []

    def serve() -> None:
        native_id.append(threading.get_native_id())
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True, name="trivial-upstream").start()
    started.wait(30)
    return native_id[0]


def _thread_cpu(tid: int) -> float:
    t = next(t for t in psutil.Process().threads() if t.id == tid)
    return t.user_time + t.system_time


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the router did not become healthy")


def _pcts(a: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(a * 1000, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def run_router_overhead(args: argparse.Namespace) -> dict:
    up_port, router_port = _free_port(), _free_port()
    upstream_tid = _start_upstream(up_port)
    upstream, router = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
    cmd = [sys.executable, "-m", "inferd.cli", "router", "--worker-urls", upstream, "--port",
           str(router_port), "--policy", args.policy]  # fmt: skip
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(router, proc)
        words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
        payload = {"model": "trivial", "max_tokens": 1,
                   "prompt": " ".join(words[i % len(words)] for i in range(args.prompt_words))}  # fmt: skip
        times: dict[str, list[float]] = {"direct": [], "router": []}
        router_proc = psutil.Process(proc.pid)
        with httpx.Client(timeout=30) as c:
            for i in range(args.warmup + args.requests):
                if i == args.warmup:
                    cpu = router_proc.cpu_times()
                    cpu_start = cpu.user + cpu.system
                    upstream_cpu_start = _thread_cpu(upstream_tid)
                for name, base in (("direct", upstream), ("router", router)):
                    start = time.perf_counter()
                    r = c.post(f"{base}/v1/completions", json=payload)
                    elapsed = time.perf_counter() - start
                    if r.status_code != 200:
                        raise RuntimeError(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
                    if i >= args.warmup:
                        times[name].append(elapsed)
            cpu = router_proc.cpu_times()
            cpu_ms = 1000 * (cpu.user + cpu.system - cpu_start) / args.requests
            # The upstream answers each request twice (direct and through the router).
            upstream_ms = (
                1000 * (_thread_cpu(upstream_tid) - upstream_cpu_start) / (2 * args.requests)
            )
            metrics = c.get(f"{router}/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    direct, routed = np.asarray(times["direct"]), np.asarray(times["router"])
    routing = {k: float(line.split()[-1]) for line in metrics.splitlines()
               for k in ("_sum", "_count") if line.startswith(f"inferd_router:routing_seconds{k} ")}  # fmt: skip
    report = {
        "policy": args.policy,
        "tokenizer": args.tokenizer,
        "prompt_words": args.prompt_words,
        "requests": args.requests,
        "direct_ms": _pcts(direct),
        "via_router_ms": _pcts(routed),
        "added_ms_p50": float(np.percentile(routed * 1000, 50) - np.percentile(direct * 1000, 50)),
        "added_ms_p90": float(np.percentile(routed * 1000, 90) - np.percentile(direct * 1000, 90)),
        # CPU the router process spent per request: what the added latency comes to on an idle
        # machine (plus loopback), where on a loaded one waiting to be scheduled dominates.
        "router_cpu_ms_per_request": cpu_ms,
        # A minimal aiohttp server's CPU per request on the same machine: a yardstick for how
        # much the machine's load inflates CPU time (on an idle core it is a few tens of µs).
        "upstream_cpu_ms_per_request": upstream_ms,
        "router_routing_ms_mean": 1000 * routing["_sum"] / routing["_count"]
        if routing.get("_count")
        else None,
    }
    print(f"router overhead ({args.policy}, {'token ids' if args.tokenizer else 'text'} keys, "
          f"{args.prompt_words}-word prompt, {args.requests} requests each way): p50 direct "
          f"{report['direct_ms']['p50']:.3f} ms, via router {report['via_router_ms']['p50']:.3f} ms, "
          f"added {report['added_ms_p50']:.3f} ms (p90 {report['added_ms_p90']:.3f} ms); router's "
          f"own routing time mean {report['router_routing_ms_mean'] or 0:.3f} ms; router CPU "
          f"{cpu_ms:.3f} ms per request (the trivial upstream's: {upstream_ms:.3f} ms)")  # fmt: skip
    print(json.dumps(report))
    return report


def add_router_overhead_parser(sub) -> None:
    p = sub.add_parser(
        "router-overhead", help="latency `inferd router` adds, against a trivial upstream"
    )
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer the router keys requests with (default: text keys)")  # fmt: skip
    p.add_argument("--requests", type=int, default=1000, help="timed requests each way")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--prompt-words", type=int, default=200)
    p.set_defaults(func=run_router_overhead)
