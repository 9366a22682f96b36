"""Single-stream decode through HTTP against the offline API, interleaved round by round.

    python benchmarks/http_overhead.py [--rounds 8] [--threads 2] [-q Q] [-- SERVE_ARGS...]

Starts `inferd serve -q Q` (default `auto`: the GGUF as shipped; plus SERVE_ARGS, e.g.
`--no-engine-process`), then alternates one offline run (`inferd bench latency`: the median
decode step) with one HTTP run (`inferd bench serve --concurrency 1`: the median time per output
token) while the other side sits idle. On a shared machine the speed drifts by tens of percent within minutes, so only rounds taken side by
side are compared: the result is the ratio of the medians (tokens/s through HTTP over tokens/s
offline) and the median of the per-round ratios. Prints one JSON line.

The bench client runs on this machine too. Left to the OS it sometimes landed on the CPU of the
engine's main thread (bound there by `inferd serve`) and took ~0.2 ms of it per token; a remote
client never would, so by default it is pinned to the last CPU, beside the server's front end.
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


def _offline_step_ms(args: argparse.Namespace) -> float:
    out = subprocess.run(
        [*CLI, "bench", "latency", "-q", args.quantization, "--threads", str(args.threads), "--runs", "1",
         "--peers", "", "--input-len", str(args.input_len), "--output-len", str(args.output_len)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["engines"]["inferd"]["decode_step_ms"]["p50"]


def _http_tpot_ms(args: argparse.Namespace, url: str, result: Path, seed: int) -> float:
    pin = None
    if args.client_cpu >= 0:  # the client runs here too: keep it off the engine's main core

        def pin() -> None:
            os.sched_setaffinity(0, {args.client_cpu})

    subprocess.run(
        [*CLI, "bench", "serve", "--base-url", url, "--concurrency", "1",
         "--num-prompts", str(args.requests), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(seed),
         "--result-file", str(result)],
        capture_output=True, text=True, check=True, cwd=ROOT, preexec_fn=pin,
    )  # fmt: skip
    return json.loads(result.read_text())["points"][0]["tpot_ms"]["p50"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "-q", "--quantization", default="auto", help="both sides' weights (default: auto)"
    )
    p.add_argument("--requests", type=int, default=3, help="HTTP requests per round")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--client-cpu",
        type=int,
        default=max(os.sched_getaffinity(0)),
        help="CPU for the bench client (default: the last, where `inferd serve` puts its HTTP "
        "front end; the engine's main thread is bound to the first); -1: let the OS choose",
    )
    p.add_argument("serve_args", nargs="*", help="after --: extra `inferd serve` arguments")
    args = p.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*CLI, "serve", "-q", args.quantization, "--port", str(port), "--disable-log-requests",
             *args.serve_args]  # fmt: skip
    server = subprocess.Popen(
        serve, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    )
    rounds: list[tuple[float, float]] = []
    try:
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
                offline, http = _offline_step_ms(args), _http_tpot_ms(args, url, result, i)
                rounds.append((offline, http))
                print(f"round {i + 1}: offline {offline:.2f} ms/token, HTTP {http:.2f} ms/token "
                      f"({offline / http:.3f}×)", file=sys.stderr)  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
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
