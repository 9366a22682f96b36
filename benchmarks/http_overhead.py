"""Single-stream decode through HTTP against the offline API, paired request by request.

    python benchmarks/http_overhead.py [--rounds 16] [--threads 2] [-q Q] [-- SERVE_ARGS...]

Starts `inferd serve -q Q` (default `auto`: the GGUF as shipped; plus SERVE_ARGS, e.g.
`--no-engine-process`) and an offline worker that keeps one engine loaded (`LLM`, as `inferd
bench latency` builds it). Each round runs one request on each side while the other idles (the
order alternates), with the same prompt: offline, the mean time per output token after the
first, from the engine's step stamps; through HTTP, the TPOT of one `inferd bench serve
--concurrency 1` request, (end - first token) / (tokens - 1). Both are means, so their inverse
is each side's decode tokens/s. A shared machine's speed can drift by tens of percent within
minutes: only requests run side by side compare, so the result is the median of the per-round
ratios (tokens/s through HTTP over tokens/s offline), with the ratio of the medians beside it.
Prints one JSON line.

The bench client runs on the same machine. Left to the OS it can land on the CPU of the engine's
main thread (bound there by `inferd serve`) and take ~0.2 ms of it per token; a remote client
never would, so by default it is pinned to the last CPU, beside the server's front end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_all import _free_port  # (after the path is set)

CLI = [sys.executable, "-m", "inferd.cli", "--log-level", "WARNING"]


def _offline_worker(args: argparse.Namespace) -> None:
    """`--offline-worker`: load the engine once, then for each seed read from stdin run one
    request and print its mean decode step (ms)."""
    from inferd import LLM
    from inferd.bench.common import set_threads
    from inferd.bench.peers import inferd_generate_timed
    from inferd.bench.prompts import synthetic_prompt

    set_threads(args.threads)
    llm = LLM(quantization=args.quantization, verbose=False, max_num_seqs=1,
              enable_prefix_caching=False, kv_cache_memory=256 << 20)  # fmt: skip
    engine = llm.engine
    engine.runner.wait_kv_prefault()
    inferd_generate_timed(engine, [synthetic_prompt(engine.tokenizer, 16, seed=0)], 8)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        prompt = synthetic_prompt(engine.tokenizer, args.input_len, seed=line.strip())
        stamps = inferd_generate_timed(engine, [prompt], args.output_len).stamps
        print((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, flush=True)


def _offline_ms(worker: subprocess.Popen, seed: int) -> float:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(f"{seed}/0\n")  # the prompt `bench serve --seed SEED` sends first
    worker.stdin.flush()
    return float(worker.stdout.readline())


def _http_tpot_ms(args: argparse.Namespace, url: str, result: Path, seed: int) -> float:
    pin = None
    if args.client_cpu >= 0:  # the client runs here too: keep it off the engine's main core

        def pin() -> None:
            os.sched_setaffinity(0, {args.client_cpu})

    subprocess.run(
        [*CLI, "bench", "serve", "--base-url", url, "--concurrency", "1",
         "--num-prompts", "1", "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(seed),
         "--result-file", str(result)],
        capture_output=True, text=True, check=True, cwd=ROOT, preexec_fn=pin,
    )  # fmt: skip
    return json.loads(result.read_text())["points"][0]["tpot_ms"]["p50"]  # one request: its TPOT


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "-q", "--quantization", default="auto", help="both sides' weights (default: auto)"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--client-cpu",
        type=int,
        default=max(os.sched_getaffinity(0)),
        help="CPU for the bench client (default: the last, where `inferd serve` puts its HTTP "
        "front end; the engine's main thread is bound to the first); -1: let the OS choose",
    )
    p.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("serve_args", nargs="*", help="after --: extra `inferd serve` arguments")
    args = p.parse_args(argv)
    if args.offline_worker:
        _offline_worker(args)
        return {}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*CLI, "serve", "-q", args.quantization, "--port", str(port), "--disable-log-requests",
             *args.serve_args]  # fmt: skip
    server = subprocess.Popen(
        serve, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    )
    worker = subprocess.Popen(
        [sys.executable, __file__, "--offline-worker", "-q", args.quantization,
         "--threads", str(args.threads), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    rounds: list[tuple[float, float]] = []
    try:
        assert worker.stdout is not None
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the offline worker did not start")
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break  # 200 (an error status raises)
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "serve.json"
            _http_tpot_ms(args, url, result, -1)  # warm-up: first-request imports, caches
            for i in range(args.rounds):
                if i % 2 == 0:  # the order alternates: a drift in speed hits both sides alike
                    offline = _offline_ms(worker, i)
                    http = _http_tpot_ms(args, url, result, i)
                else:
                    http = _http_tpot_ms(args, url, result, i)
                    offline = _offline_ms(worker, i)
                rounds.append((offline, http))
                print(f"round {i + 1}: offline {offline:.2f} ms/token, HTTP {http:.2f} ms/token "
                      f"({offline / http:.3f}×)", file=sys.stderr)  # fmt: skip
    finally:
        server.terminate()
        worker.terminate()
        server.wait(60)
        worker.wait(60)
    offline = statistics.median(r[0] for r in rounds)
    http = statistics.median(r[1] for r in rounds)
    report = {
        "bench": "http_overhead",
        "serve": serve[len(CLI) :],
        "threads": args.threads,
        "client_cpu": args.client_cpu,
        "rounds": [{"offline_ms": o, "http_ms": h} for o, h in rounds],
        "offline_ms_per_token": offline,
        "http_ms_per_token": http,
        "ratio_of_medians": offline / http,
        "median_of_ratios": statistics.median(o / h for o, h in rounds),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
