"""`inferd bench swap`: the time to swap models in one server (`--max-loaded-models 1`).

A real `inferd serve A=PATH B=PATH --max-loaded-models 1` runs in a subprocess. Requests (one
token each) alternate A, B, A, B, ...: each one unloads the other model and loads its own. After
each swapping request a second request to the same model runs warm, so the swap's cost is the
difference of the two. Beside the end-to-end figures: the server's own
`inferd:model_unload_time_seconds` (stopping the engine process) and
`inferd:model_load_time_seconds` (a fresh engine process to readiness) per model. The last line
is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx
import numpy as np

from inferd.bench.router_overhead import _free_port, _wait_healthy

_PROMPT = "The capital of France is"


def _default_models() -> list[str]:
    from inferd.loader.default_model import default_model_path
    from inferd.loader.gemma3_model import gemma3_model_path

    return [f"smol={default_model_path()}", f"gemma={gemma3_model_path(fetch=False)}"]


def _histogram_means(metrics: str, name: str) -> dict[str, float]:
    """model_name -> mean of the histogram `name` (its _sum over its _count)."""
    sums: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        for part in ("_sum", "_count"):
            prefix = f"{name}{part}{{"
            if line.startswith(prefix):
                model = line[len(prefix):].split('model_name="', 1)[1].split('"', 1)[0]
                sums.setdefault(model, {})[part] = float(line.split()[-1])
    return {m: v["_sum"] / v["_count"] for m, v in sums.items() if v.get("_count")}


def run_swap(args: argparse.Namespace) -> dict:
    models = args.models or _default_models()
    names = [m.partition("=")[0] for m in models]
    if len(models) != 2 or any("=" not in m for m in models):
        raise SystemExit("give two models as NAME=PATH NAME=PATH")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", *models, "--port", str(port),
           "--max-loaded-models", "1", "--kv-cache-memory", args.kv_cache_memory,
           "--max-model-len", "512", "--log-stats-interval", "0"]  # fmt: skip
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    swap: dict[str, list[float]] = {n: [] for n in names}
    warm: dict[str, list[float]] = {n: [] for n in names}
    try:
        _wait_healthy(url, proc, timeout=3600)
        with httpx.Client(timeout=3600) as c:  # a load on a busy machine can take minutes

            def once(model: str) -> float:
                body = {"model": model, "prompt": _PROMPT, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                r = c.post(f"{url}/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.text[:200]}")
                return time.perf_counter() - start

            once(names[1])  # the first load has no unload before it
            for _ in range(args.rounds):
                for name in names:
                    swap[name].append(once(name))
                    warm[name].append(once(name))
            metrics = c.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        proc.wait(60)
        if args.server_log:
            log.close()  # type: ignore[union-attr]
    load = _histogram_means(metrics, "inferd:model_load_time_seconds")
    unload = _histogram_means(metrics, "inferd:model_unload_time_seconds")
    report: dict = {"rounds": args.rounds, "kv_cache_memory": args.kv_cache_memory, "models": {}}
    for i, name in enumerate(names):
        other = names[1 - i]
        s, w = float(np.median(swap[name])), float(np.median(warm[name]))
        report["models"][name] = {
            "swap_request_s_p50": s,  # unload `other` + load `name` + one token
            "warm_request_s_p50": w,
            "swap_cost_s": s - w,
            "load_s_mean": load.get(name),
            "unload_of_other_s_mean": unload.get(other),
        }
        print(f"swap to {name} (unloading {other}): request {s:.2f} s vs {w:.3f} s warm; "
              f"load {load.get(name, 0):.2f} s + unload of {other} {unload.get(other, 0):.2f} s "
              f"(server's own timings, means over {args.rounds} swaps)")  # fmt: skip
    print(json.dumps(report))
    return report


def add_swap_parser(sub) -> None:
    p = sub.add_parser("swap", help="time of a model swap (unload + load) in one server")
    p.add_argument("models", nargs="*",
                   help="two models as NAME=PATH (default: smol and gemma, the two real models)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="swaps to each model")
    p.add_argument("--kv-cache-memory", default="64MiB", help="each model's KV pool")
    p.add_argument("--server-log", default=None, help="write the server's output here")
    p.set_defaults(func=run_swap)
