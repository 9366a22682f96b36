"""`inferd bench serve`: drive any OpenAI-compatible server (inferd, vLLM, llama-server) over
streaming HTTP and report TTFT, TPOT, inter-token and end-to-end latency, throughput and goodput.

The client knows nothing about the server but its OpenAI API: prompts are sent as text, output
tokens are read from the final usage chunk (`stream_options.include_usage`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

try:  # the client shares the machine with the server it measures: the lighter event loop
    from uvloop import run as _run_loop
except ImportError:  # Windows
    _run_loop = asyncio.run

from inferd.bench.common import stats_ms


class BenchServeError(ValueError):
    """The benchmark cannot run (server unreachable, every request failed); `inferd` exits 2."""


@dataclass(slots=True)
class Prompt:
    text: str
    output_len: int
    messages: list[dict] | None = None  # a whole chat history (sent as is; `text` unused)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0  # send → first chunk that carries text
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server says
    text: list[str] | None = None  # the streamed text, kept when asked (`_send(keep_text=True)`)

    @property
    def tpot_s(self) -> float | None:
        """(e2e − ttft) / (tokens − 1): undefined for a single token."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE body, from whatever bytes each read brings.

    Reading whole chunks and splitting them here costs the client less CPU per streamed token than
    aiohttp's line iterator (two lines per event). The client shares the machine with the server
    it measures, so its CPU is the server's loss."""
    pending = b""
    async for chunk in content.iter_any():
        pending = (pending + chunk).replace(b"\r\n", b"\n")  # either line ending
        *events, pending = pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()
    for line in pending.split(b"\n"):  # a body that does not end with a blank line
        if line.startswith(b"data:"):
            yield line[5:].strip()


async def _send(
    session: aiohttp.ClientSession, url: str, endpoint: str, model: str, p: Prompt, ignore_eos: bool,
    keep_text: bool = False,
) -> RequestResult:
    payload: dict = {"model": model, "max_tokens": p.output_len, "temperature": 0.0,
                     "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extra; inferd and llama-server accept it too
    if endpoint == "chat":
        payload["messages"] = p.messages or [{"role": "user", "content": p.text}]
    else:
        payload["prompt"] = p.text
    res = RequestResult(ok=False, text=[] if keep_text else None)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=payload) as r:
            if r.status != 200:
                body = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {body[:200]}"
                return res
            async for data in _sse_data(r.content):
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    details = msg["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                choices = msg.get("choices") or []
                text = ""
                if choices:
                    c = choices[0]
                    text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if not text:
                    continue  # a role-only, finish-only or usage chunk: no token timing
                now = time.perf_counter()
                if res.text is not None:
                    res.text.append(text)
                if chunks == 0:
                    res.ttft_s = now - start
                else:
                    res.itls_s.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e_s = time.perf_counter() - start
    if res.output_tokens == 0:
        res.output_tokens = chunks  # no usage chunk: one token per chunk is the best guess
    res.ok = chunks > 0 or res.output_tokens > 0
    if not res.ok:
        res.error = "no tokens streamed"
    return res


async def _run_point(
    args: argparse.Namespace, model: str, prompts: PromptSource, concurrency: int
) -> tuple[list[RequestResult], float]:
    """Closed loop at `concurrency`, or Poisson arrivals at `--request-rate` capped by it."""
    from tqdm import tqdm

    url = args.base_url.rstrip("/") + (
        "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    )
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=args.num_prompts if args.duration is None else None, file=sys.stderr,
               desc=f"concurrency {concurrency}", leave=False)  # fmt: skip
    results: list[RequestResult] = []

    async def one(p: Prompt) -> None:
        try:
            results.append(await _send(session, url, args.endpoint, model, p, args.ignore_eos))
        finally:
            sem.release()
            bar.update(1)

    tasks = []
    # aiohttp, as vLLM's benchmark client: its C parser spends about half the CPU per streamed
    # token that httpx does, CPU the server under test would otherwise lose on a small machine.
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=args.request_timeout),
        connector=aiohttp.TCPConnector(limit=concurrency),
    ) as session:
        start = time.perf_counter()
        i = 0
        while args.duration is not None or i < args.num_prompts:
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
            await sem.acquire()
            if args.duration is not None and time.perf_counter() - start >= args.duration:
                sem.release()
                break
            tasks.append(asyncio.create_task(one(prompts.take())))
            i += 1
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def _summarize(
    args: argparse.Namespace, concurrency: int, results: list[RequestResult], secs: float
) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    # Goodput (DistServe's): requests that met every SLO given, per second and as a share of the
    # requests sent (a failed request meets none). A request of one token has no TPOT: only its
    # TTFT is judged. None without SLOs.
    met = good = share = None
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        ttft_slo = math.inf if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000
        tpot_slo = math.inf if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000
        met = sum(1 for r in ok if r.ttft_s <= ttft_slo and (r.tpot_s or 0.0) <= tpot_slo)
        good = met / secs
        share = met / len(results) if results else 0.0
    return {
        "concurrency": concurrency,
        "request_rate": None if args.request_rate == math.inf else args.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": secs,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_request": [r.output_tokens for r in ok],
        "requests_per_s": len(ok) / secs,
        "output_tps": out_tokens / secs,
        "total_tps": (in_tokens + out_tokens) / secs,
        "slo_met": met,
        "goodput_rps": good,
        "goodput_share": share,
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itls_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in ok]),
        # Kept out of the JSON (large); the plots use them.
        "_raw": {
            "ttft": [r.ttft_s for r in ok],
            "itl": [x for r in ok for x in r.itls_s],
            "e2e": [r.e2e_s for r in ok],
        },
    }


class PromptSource:
    """The prompts of a run, handed out in order across every point of a sweep.

    Synthetic prompts are never sent twice: a repeat would be served from the server's prefix
    cache, so a sweep's later points (and a second run with the next --seed) would measure cache
    hits instead of prefill. Each prompt's seed is "<--seed>/<index>". A --dataset file is what
    the user chose to send: it is cycled as given."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.made: list[Prompt] = []
        self.next = 0
        self.tok = None
        if args.dataset:
            for line in Path(args.dataset).read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.made.append(Prompt(row["prompt"], int(row.get("output_len", args.output_len))))
            if not self.made:
                raise BenchServeError(f"no prompts in {args.dataset}")
        else:
            from inferd.loader import load_model

            self.tok = load_model(args.tokenizer, verbose=False).tokenizer  # None: the default model's

    def _make(self, i: int) -> Prompt:
        from inferd.bench.prompts import synthetic_prompt

        ids = synthetic_prompt(self.tok, self.args.input_len, seed=f"{self.args.seed}/{i}")
        return Prompt(self.tok.decode(ids), self.args.output_len)

    def prepare(self, n: int) -> None:
        """Make the next `n` prompts now, outside the timed loop."""
        while self.tok is not None and len(self.made) < self.next + n:
            self.made.append(self._make(len(self.made)))

    def take(self) -> Prompt:
        if self.tok is None:  # a dataset: cycled
            p = self.made[self.next % len(self.made)]
        else:
            self.prepare(1)
            p = self.made[self.next]
        self.next += 1
        return p


def _server_model(args: argparse.Namespace) -> str:
    """`--model`, or the first model the server lists; a clear error if the server is not there."""
    try:
        with urllib.request.urlopen(args.base_url.rstrip("/") + "/v1/models", timeout=10) as r:
            listing = json.loads(r.read())
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise BenchServeError(
            f"cannot reach the server at {args.base_url}: {type(e).__name__}: {e}"
        ) from e
    if args.model:
        return args.model
    data = listing.get("data") or []
    if not data:
        raise BenchServeError(f"{args.base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _plot(points: list[dict], plot_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "note: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr
        )
        return
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots()
    ax.plot([p["concurrency"] for p in points], [p["output_tps"] for p in points], marker="o")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs concurrency")
    fig.savefig(out / "throughput_vs_concurrency.png")
    plt.close(fig)
    for key, label in (
        ("ttft", "TTFT"),
        ("itl", "inter-token latency"),
        ("e2e", "end-to-end latency"),
    ):
        fig, ax = plt.subplots()
        for p in points:
            xs = np.sort(np.asarray(p["_raw"][key]) * 1000)
            if len(xs):
                ax.plot(
                    xs, np.arange(1, len(xs) + 1) / len(xs), label=f"concurrency {p['concurrency']}"
                )
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("CDF")
        ax.legend()
        fig.savefig(out / f"{key}_cdf.png")
        plt.close(fig)
    print(f"plots written to {out}/", file=sys.stderr)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def run_serve(args: argparse.Namespace) -> dict:
    if args.scenario == "multi-turn":
        from inferd.bench.serve_multiturn import run_multi_turn

        return run_multi_turn(args)
    if args.num_prompts is not None and args.duration is not None:
        raise BenchServeError("give --num-prompts or --duration, not both")
    if args.num_prompts is None and args.duration is None:
        args = argparse.Namespace(**{**vars(args), "num_prompts": 100})
    sweep = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not sweep or min(sweep) < 1:
        raise BenchServeError(f"--concurrency must be positive integers, got {args.concurrency!r}")
    model = _server_model(args)
    prompts = PromptSource(args)
    points = []
    for c in sweep:
        if args.num_prompts is not None:
            prompts.prepare(args.num_prompts)
        results, secs = _run_loop(_run_point(args, model, prompts, c))
        points.append(_summarize(args, c, results, secs))
        if points[-1]["completed"] == 0:
            raise BenchServeError(
                f"every request failed at concurrency {c}: {points[-1]['errors']}"
            )
    print(f"\nserver {args.base_url}, model {model}, endpoint {args.endpoint}, "
          f"{'dataset ' + args.dataset if args.dataset else f'{args.input_len} in / {args.output_len} out'}")  # fmt: skip
    head = (f"{'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9} "
            f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99':>15} {'ITL p50/p99':>15} {'E2E p50/p99 ms':>17} {'goodput':>7} {'SLO met':>7}")  # fmt: skip
    print(head)
    for p in points:
        pair = {
            k: f"{_fmt(p[k]['p50'])}/{_fmt(p[k]['p99'])}"
            for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
        }
        share = "-" if p["goodput_share"] is None else f"{100 * p['goodput_share']:.0f}%"
        print(f"{p['concurrency']:>5} {p['completed']:>5} {p['failed']:>4} {p['requests_per_s']:>7.2f} "
              f"{p['output_tps']:>9.1f} {p['total_tps']:>9.1f} {pair['ttft_ms']:>17} {pair['tpot_ms']:>15} "
              f"{pair['itl_ms']:>15} {pair['e2e_ms']:>17} {_fmt(p['goodput_rps']):>7} {share:>7}")  # fmt: skip
    if args.plot_dir and len(points) > 1:
        _plot(points, args.plot_dir)
    report = {"base_url": args.base_url, "model": model, "endpoint": args.endpoint,
              "input_len": None if args.dataset else args.input_len, "output_len": args.output_len,
              "dataset": args.dataset, "ignore_eos": args.ignore_eos, "seed": args.seed,
              "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
              "points": [{k: v for k, v in p.items() if k != "_raw"} for p in points]}  # fmt: skip
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return report


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="latency and throughput of any OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--scenario", choices=["sweep", "multi-turn"], default="sweep",
                   help="sweep: independent prompts at each --concurrency; multi-turn: chat "
                   "conversations whose history grows (--conversations × --turns, --input-len "
                   "tokens per user turn, --concurrency conversations at once): TTFT per turn and "
                   "the share of history served from the server's cache")  # fmt: skip
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=5, help="multi-turn: turns per conversation")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--tokenizer", default=None,
                   help="model path whose tokenizer sizes synthetic prompts (default: inferd's default model)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=None, help="requests per point (default 100)")
    p.add_argument(
        "--duration", type=float, default=None, help="seconds per point instead of a count"
    )
    p.add_argument("--concurrency", default="1", help="max in flight; a comma list is a sweep")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second"
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", default=None, help='JSONL with "prompt" and optional "output_len"')
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos extra")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token target: goodput counts the requests that meet it")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="time-per-output-token target: goodput counts the requests that meet it")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--result-file", default=None)
    p.add_argument("--plot-dir", default=None, help="PNG plots for a sweep (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_serve)
