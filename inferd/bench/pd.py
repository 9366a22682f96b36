"""`inferd bench pd MODEL`: prefill/decode disaggregation against one colocated server, on the
load PD exists for: long prompts arriving among many decoding streams.

Two setups run the same workload, one after the other, on this machine's first two CPUs:
- colocated: one `inferd serve` on both CPUs (two threads);
- PD: a `--kv-role prefill` worker on CPU 0 and a `--kv-role decode` worker on CPU 1 (one thread
  each) behind `inferd router --pd-disaggregation`.

The workload (bench/serve.py's streaming client): `--streams` closed-loop decode streams (a short
prompt, `--decode-tokens` tokens each, EOS ignored) and, every `--long-interval` seconds, a
`--long-prompt-tokens` prompt asking for a few tokens (each unique, so no prefix cache helps).
Reported: the decode streams' inter-token latency (p50, p99) and the long prompts' TTFT, per
setup and as PD / colocated ratios; from the decode worker's metrics, what the transfers cost
(seconds per token and per block pulled). The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import aiohttp

from inferd.bench.common import stats_ms
from inferd.bench.serve import Prompt, RequestResult, _send

_WORDS = ["river", "stone", "cloud", "light", "market", "garden", "winter", "paper", "signal", "orbit", "harbor", "lantern", "meadow", "engine", "copper", "violet", "thunder", "canyon"]  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    args: list[str], cpus: list[int], threads: int, log_path: str
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = open(log_path, "w")  # noqa: SIM115 — the server's lifetime
    cmd = [sys.executable, "-m", "inferd.cli", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    os.sched_setaffinity(proc.pid, cpus)  # before the engine starts its threads (they inherit it)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(inferd:kv_transfer\w*)(?:\{[^}]*\})?\s+(\S+)$", line)
        if m and 'le="' not in line:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _long_prompt(i: int, words: int) -> str:
    body = " ".join(_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(words))
    return f"Document {i}: {body}\nSummarise it."


async def _workload(url: str, args: argparse.Namespace) -> dict:
    endpoint = f"{url}/v1/completions"
    decodes: list[RequestResult] = []
    longs: list[RequestResult] = []
    stop_at = time.perf_counter() + args.duration
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:  # fmt: skip

        async def stream(k: int) -> None:
            n = 0
            while time.perf_counter() < stop_at:
                p = Prompt(
                    f"Stream {k}.{n}: tell a long story about the {_WORDS[k % len(_WORDS)]}.",
                    args.decode_tokens,
                )
                decodes.append(
                    await _send(session, endpoint, "completions", args.model, p, ignore_eos=True)
                )
                n += 1
                if not decodes[-1].ok:
                    break  # a failing setup: reported, not hammered

        async def long_prompts() -> None:
            i, tasks = 0, []
            await asyncio.sleep(args.long_interval / 2)  # the streams are decoding by then
            while time.perf_counter() < stop_at:
                p = Prompt(_long_prompt(i, args.long_prompt_tokens), args.long_output_tokens)
                tasks.append(
                    asyncio.create_task(
                        _send(session, endpoint, "completions", args.model, p, ignore_eos=True)
                    )
                )
                i += 1
                await asyncio.sleep(args.long_interval)
            longs.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(stream(k) for k in range(args.streams)))
    ok_d, ok_l = [r for r in decodes if r.ok], [r for r in longs if r.ok]
    return {
        "decode_requests": len(ok_d), "long_requests": len(ok_l),
        "failed": len(decodes) + len(longs) - len(ok_d) - len(ok_l),
        "errors": sorted({r.error for r in decodes + longs if not r.ok})[:3],
        "long_prompt_tokens": [r.prompt_tokens for r in ok_l][:3],
        "decode_itl_ms": stats_ms([x for r in ok_d for x in r.itls_s]),
        "decode_ttft_ms": stats_ms([r.ttft_s for r in ok_d]),
        "long_ttft_ms": stats_ms([r.ttft_s for r in ok_l]),
        "output_tps": sum(r.output_tokens for r in ok_d + ok_l) / args.duration,
    }  # fmt: skip


def _engine_args(args: argparse.Namespace) -> list[str]:
    engine = [args.model, "--max-model-len", str(args.long_prompt_tokens + 256), "--kv-cache-memory",
              args.kv_cache_memory, "--log-stats-interval", "0", "--max-num-seqs", str(args.streams + 4)]  # fmt: skip
    if args.long_prefill_token_threshold:
        engine += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    return engine


def run_pd(args: argparse.Namespace) -> dict:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        raise SystemExit("inferd bench pd needs two CPUs")
    logs = args.log_dir
    os.makedirs(logs, exist_ok=True)
    report: dict = {"cpus": cpus, "load_average_before": os.getloadavg()}
    procs: list[subprocess.Popen] = []
    try:
        proc, url = _start(["serve", *_engine_args(args)], cpus, 2, f"{logs}/colocated.log")
        procs.append(proc)
        _wait_healthy(url, proc)
        report["colocated"] = asyncio.run(_workload(url, args))
        proc.terminate()
        proc.wait(60)
        prefill, p_url = _start(["serve", *_engine_args(args), "--kv-role", "prefill"], cpus[:1], 1,
                                f"{logs}/prefill.log")  # fmt: skip
        decode, d_url = _start(["serve", *_engine_args(args), "--kv-role", "decode"], cpus[1:], 1,
                               f"{logs}/decode.log")  # fmt: skip
        procs += [prefill, decode]
        _wait_healthy(p_url, prefill)
        _wait_healthy(d_url, decode)
        router, r_url = _start(["router", "--pd-disaggregation", "--prefill", p_url, "--decode", d_url],
                               cpus, 1, f"{logs}/router.log")  # fmt: skip
        procs.append(router)
        _wait_healthy(r_url, router)
        report["pd"] = asyncio.run(_workload(r_url, args))
        m = _metrics(d_url)
        seconds = m.get("inferd:kv_transfer_latency_seconds_sum", 0.0)
        tokens = m.get("inferd:kv_transfer_received_tokens_total", 0.0)
        blocks = m.get("inferd:kv_transfer_received_blocks_total", 0.0)
        report["transfer"] = {
            "pulls": m.get("inferd:kv_transfer_latency_seconds_count", 0.0), "tokens": tokens,
            "blocks": blocks, "failures": m.get("inferd:kv_transfer_failures_total", 0.0),
            "seconds": seconds, "us_per_token": 1e6 * seconds / tokens if tokens else None,
            "us_per_block": 1e6 * seconds / blocks if blocks else None,
        }  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    report["load_average_after"] = os.getloadavg()
    c, p = report["colocated"], report["pd"]
    ratio = lambda k, q: (p[k][q] / c[k][q]) if p[k][q] and c[k][q] else None
    report["pd_over_colocated"] = {"decode_itl_p50": ratio("decode_itl_ms", "p50"),
                                   "decode_itl_p99": ratio("decode_itl_ms", "p99"),
                                   "long_ttft_p50": ratio("long_ttft_ms", "p50"),
                                   "long_ttft_p99": ratio("long_ttft_ms", "p99")}  # fmt: skip
    for name in ("colocated", "pd"):
        r = report[name]
        print(f"{name:>9}: decode ITL p50 {r['decode_itl_ms']['p50'] or 0:.1f} ms p99 "
              f"{r['decode_itl_ms']['p99'] or 0:.1f} ms; long-prompt TTFT p50 {r['long_ttft_ms']['p50'] or 0:.0f} ms "
              f"p99 {r['long_ttft_ms']['p99'] or 0:.0f} ms ({r['long_requests']} long, {r['decode_requests']} "
              f"decode requests, {r['failed']} failed)")  # fmt: skip
    print(f"PD / colocated: {report['pd_over_colocated']}; transfers: {report['transfer']}")
    print(json.dumps(report))
    return report


def add_pd_parser(sub) -> None:
    p = sub.add_parser("pd", help="prefill/decode disaggregation vs one colocated server, long "
                       "prompts among decoding streams")  # fmt: skip
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=16, help="concurrent decode streams")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode request")
    p.add_argument(
        "--long-prompt-tokens", type=int, default=2048, help="words in each long prompt (~tokens)"
    )
    p.add_argument("--long-output-tokens", type=int, default=4)
    p.add_argument("--long-interval", type=float, default=8.0, help="seconds between long prompts")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each setup runs")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="passed to every server: the largest chunk of one prompt per step, so short "
                   "prompts are not queued behind a long one's single step (default: the servers')")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="/tmp/inferd-bench-pd", help="the servers' logs")
    p.set_defaults(func=run_pd)
