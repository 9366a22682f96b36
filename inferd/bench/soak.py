"""`inferd bench soak --duration 20m`: mixed, hostile-ish traffic against a real `inferd serve`
for a long time, then the checks that say nothing was lost.

It starts its own server (a small KV pool so that requests are preempted, prompt-lookup
speculation, debug endpoints on) and runs `--concurrency` clients, each picking one of:

    complete   non-streamed completion            stream   streamed chat, read to [DONE]
    cancel     a stream dropped at a random point  n        chat with n = 2..3
    json       response_format json_schema         long     a long repetitive prompt (preemption)
    timeout    a `timeout` shorter than the work   bad      a request that must be refused (4xx)

and then checks: 0 unexpected errors (a 5xx, a refusal of the wrong kind, a stream that ends
without its finish), every accepted request answered or cancelled, 0 leaked KV blocks
(POST /debug/check_no_leaks once idle), and RSS of the server and of the engine process grown by
less than 5 % between the end of the warm-up and the end. The warm-up is work, then time: each
client first sends one request of each kind (the heaviest first: they make the engine's largest
allocations, and the first grammar starts its compiler threads), then `--warmup` s of traffic.
It prints a summary, then one JSON line; it exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from inferd.bench.prompts import _WORDS

SCENARIOS = {"complete": 3, "stream": 3, "cancel": 2, "n": 1, "json": 1, "long": 1, "timeout": 1,
             "bad": 2}  # fmt: skip
# Each client's first requests: the heaviest shapes first (they warm up the engine's largest
# allocations before RSS is measured), then the other kinds, rotated per client so that a few
# requests of each client cover every kind.
HEAVY = ("long", "n")
REST = ("json", "stream", "cancel", "bad", "timeout", "complete")
RSS_LIMIT = 0.05

_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
           "required": ["name", "age"]}  # fmt: skip
# (body or raw bytes, expected status): requests every server must refuse, never 5xx.
_BAD: list[tuple[Any, int]] = [
    ({"prompt": "hi", "temperature": -1}, 400),
    ({"prompt": "hi", "n": 0}, 400),
    ({"prompt": "hi", "model": "no-such-model"}, 404),
    ({"prompt": [10**8]}, 400),
    ({"prompt": "hi", "max_tokens": 10**6}, 400),
    ({"prompt": "hi", "timeout": -1}, 400),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, 400),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (b'{"prompt": "hi", ', 400),
]


def parse_duration(text: str) -> float:
    """'20m', '45s', '1h', '1.5m' or plain seconds → seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 45s, 20m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class Tally:
    sent: collections.Counter = field(default_factory=collections.Counter)  # by scenario
    ok: int = 0
    cancelled: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)  # expected, by code
    unexpected: collections.Counter = field(default_factory=collections.Counter)  # by kind
    accepted: int = 0  # answered with 200
    answered: int = 0  # of those: ran to their finish (or were cancelled by us)
    examples: list[str] = field(default_factory=list)

    def bad(self, kind: str, detail: str) -> None:
        self.unexpected[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail[:300]}")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


class Client:
    def __init__(self, url: str, model: str, tally: Tally, max_tokens: int | None) -> None:
        self.url, self.model, self.tally = url, model, tally
        self.cap = max_tokens or 1 << 30  # caps every request's max_tokens

    def _tokens(self, rng: random.Random, low: int, high: int) -> int:
        return min(rng.randint(low, high), self.cap)

    async def one(self, session: aiohttp.ClientSession, rng: random.Random, kind: str) -> None:
        self.tally.sent[kind] += 1
        try:
            await getattr(self, f"_{kind}")(session, rng)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
            self.tally.bad(f"{kind}:{type(e).__name__}", str(e))

    # ---- scenarios ------------------------------------------------------------------------
    async def _complete(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": _text(rng, rng.randint(4, 60)),
                "max_tokens": self._tokens(rng, 1, 48), "temperature": rng.choice([0.0, 0.8]),
                "seed": rng.randint(0, 1000)}  # fmt: skip
        await self._unary(s, "completions", body, 1)

    async def _n(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        n = rng.randint(2, 3)
        body = {"model": self.model, "messages": [{"role": "user", "content": _text(rng, 12)}],
                "n": n, "max_tokens": self._tokens(rng, 8, 32), "temperature": 0.9}  # fmt: skip
        await self._unary(s, "chat/completions", body, n)

    async def _json(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": _SCHEMA}}
        body = {"model": self.model, "max_tokens": min(64, self.cap), "temperature": 0.0, "response_format": fmt,
                "messages": [{"role": "user", "content": "Describe a person as JSON: "
                              + _text(rng, 5)}]}  # fmt: skip
        choices = await self._unary(s, "chat/completions", body, 1)
        if choices and choices[0]["finish_reason"] == "stop":
            try:
                json.loads(choices[0]["message"]["content"])
            except (json.JSONDecodeError, TypeError):
                self.tally.bad("json:invalid", choices[0]["message"]["content"] or "")

    async def _long(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        # Repetitive: prompt lookup finds its drafts; long: the small KV pool preempts.
        chunk = _text(rng, 20)
        body = {"model": self.model, "prompt": " ".join([chunk] * rng.randint(4, 8)),
                "max_tokens": self._tokens(rng, 64, 192), "temperature": 0.0}  # fmt: skip
        await self._unary(s, "completions", body, 1)

    async def _timeout(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": _text(rng, 8), "max_tokens": 200,  # not capped
                "ignore_eos": True, "timeout": rng.choice([0.05, 0.2, 0.5])}  # fmt: skip
        async with s.post(f"{self.url}/v1/completions", json=body) as r:
            data = await r.json(content_type=None)
        if r.status == 200:
            self.tally.accepted += 1
            self.tally.answered += 1
            self.tally.ok += 1
        elif r.status == 408 and data.get("error", {}).get("code") == "request_timeout":
            self.tally.refused["request_timeout"] += 1
        else:
            self.tally.bad(f"timeout:{r.status}", json.dumps(data))

    async def _bad(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        body, want = rng.choice(_BAD)
        endpoint = (
            "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
        )
        kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {
            "data": body, "headers": {"content-type": "application/json"}}  # fmt: skip
        async with s.post(f"{self.url}/v1/{endpoint}", **kwargs) as r:
            data = await r.json(content_type=None)
        err = data.get("error") if isinstance(data, dict) else None
        if (
            r.status == want
            and isinstance(err, dict)
            and set(err) == {"message", "type", "param", "code"}
        ):
            self.tally.refused[f"{want}:{err.get('code') or err.get('param') or 'invalid'}"] += 1
        else:
            self.tally.bad(f"bad:{r.status}", f"{body!r} -> {json.dumps(data)}")

    async def _stream(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        await self._streamed(s, rng, cancel_after=None)

    async def _cancel(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        await self._streamed(s, rng, cancel_after=rng.randint(0, 12))

    # ---- plumbing -------------------------------------------------------------------------
    async def _unary(
        self, s: aiohttp.ClientSession, endpoint: str, body: dict, n: int
    ) -> list[dict] | None:
        async with s.post(f"{self.url}/v1/{endpoint}", json=body) as r:
            data = await r.json(content_type=None)
        if r.status != 200:
            self.tally.bad(f"{endpoint}:{r.status}", json.dumps(data))
            return None
        self.tally.accepted += 1
        choices = data.get("choices") or []
        if len(choices) != n or any(
            c.get("finish_reason") not in ("stop", "length") for c in choices
        ):
            self.tally.bad("unanswered", json.dumps(data))
            return None
        self.tally.answered += 1
        self.tally.ok += 1
        return choices

    async def _streamed(
        self, s: aiohttp.ClientSession, rng: random.Random, cancel_after: int | None
    ) -> None:
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": self.model, "max_tokens": self._tokens(rng, 8, 64),
                                "temperature": rng.choice([0.0, 0.7]), "stream": True}  # fmt: skip
        if chat:
            body["messages"] = [{"role": "user", "content": _text(rng, rng.randint(4, 30))}]
        else:
            body["prompt"] = _text(rng, rng.randint(4, 60))
        endpoint = "chat/completions" if chat else "completions"
        async with s.post(f"{self.url}/v1/{endpoint}", json=body) as r:
            if r.status != 200:
                self.tally.bad(f"stream:{r.status}", (await r.read()).decode(errors="replace"))
                return
            self.tally.accepted += 1
            finished = done = False
            events = 0
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    self.tally.bad(f"stream:{msg['error'].get('code')}", data.decode())
                    return
                events += 1
                finished |= any(c.get("finish_reason") for c in msg.get("choices") or [])
                if cancel_after is not None and events > cancel_after and not finished:
                    r.close()  # drop the connection mid-stream: the server must abort and free
                    self.tally.answered += 1
                    self.tally.cancelled += 1
                    return
        if not (done and finished):
            self.tally.bad("unanswered", f"stream ended: [DONE] {done}, finish {finished}")
            return
        self.tally.answered += 1
        self.tally.ok += 1


# ---- the server under test ------------------------------------------------------------------


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.port = args.port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="inferd-soak-", suffix=".log",  # noqa: SIM115
                                               delete=False)  # fmt: skip
        spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
        cmd = [sys.executable, "-m", "inferd.cli", "serve", *([args.model] if args.model else []),
               "--port", str(self.port), "--kv-cache-memory", args.kv_cache_memory,
               "--max-model-len", "512", "--log-stats-interval", "0", "--speculative-config", spec,
               "--enable-debug-endpoints", "--disable-log-requests", *args.server_arg]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.proc.returncode}); log: {self.log.name}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy in {timeout} s; log: {self.log.name}")

    def rss(self) -> tuple[int, int]:
        """(server RSS, engine process RSS) in bytes."""
        me = psutil.Process(self.proc.pid)
        engines = [c for c in me.children() if "spawn_main" in " ".join(c.cmdline())]
        return me.memory_info().rss, sum(c.memory_info().rss for c in engines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _drive(server: Server, args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    """Warm-up (every client sends one request of each kind, heaviest first, then traffic for
    `--warmup` s), the RSS baseline, traffic until `--duration` s from the start, the checks."""
    duration, warmup = args.duration, args.warmup if args.warmup is not None else min(
        max(args.duration * 0.25, 10.0), 300.0)  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"{server.url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        client = Client(server.url, model, tally, args.max_tokens)
        start = time.monotonic()
        rss: dict[str, Any] = {"samples": []}
        rngs = [random.Random(f"{args.seed}/{i}") for i in range(args.concurrency)]

        async def first(i: int) -> None:
            k = 2 * i % len(REST)
            for kind in [*HEAVY, *REST[k:], *REST[:k]]:
                await client.one(s, rngs[i], kind)

        async def traffic(i: int, until: float) -> None:
            rng, deck = rngs[i], []
            while time.monotonic() < until:
                if not deck:  # shuffled decks of the weighted mix
                    deck = [k for k, w in SCENARIOS.items() for _ in range(w)]
                    rng.shuffle(deck)
                await client.one(s, rng, deck.pop())

        async def sample(until: float) -> None:
            while time.monotonic() < until:
                await asyncio.sleep(min(5.0, max(duration / 20, 0.5)))
                rss["samples"].append((round(time.monotonic() - start, 1), *server.rss()))

        await asyncio.gather(*(first(i) for i in range(args.concurrency)))
        warm_until = time.monotonic() + warmup
        await asyncio.gather(*(traffic(i, warm_until) for i in range(args.concurrency)))
        rss["start"], rss["start_s"] = server.rss(), round(time.monotonic() - start, 1)
        end = max(start + duration, time.monotonic() + 1.0)
        await asyncio.gather(*(traffic(i, end) for i in range(args.concurrency)), sample(end))
        rss["end"] = server.rss()
        # Idle: nothing running or waiting, then the leak check (the engine says busy until then).
        leak: dict[str, Any] = {"ok": False, "error": "the engine never became idle"}
        for _ in range(120):
            async with s.post(f"{server.url}/debug/check_no_leaks") as r:
                body = await r.json(content_type=None)
            if r.status == 409:
                await asyncio.sleep(0.5)
                continue
            leak = body if r.status == 200 else {"ok": False, "error": body.get("error")}
            break
        async with s.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
    return {"rss": rss, "leak": leak, "metrics": metrics, "elapsed_s": time.monotonic() - start,
            "warmup_s": rss.get("start_s")}  # fmt: skip


def run_soak(args: argparse.Namespace) -> int:
    server = Server(args)
    tally = Tally()
    try:
        server.wait_healthy(args.startup_timeout)
        out = asyncio.run(_drive(server, args, tally))
    finally:
        server.close()
    rss = out["rss"]
    start = rss["start"]
    growth = [(e - s) / s * 100 if s else 0.0 for s, e in zip(start, rss["end"])]
    m = out["metrics"]
    summary = {
        "duration_s": round(out["elapsed_s"], 1),
        "warmup_s": out["warmup_s"],  # when the RSS baseline was taken
        "concurrency": args.concurrency,
        "requests": sum(tally.sent.values()),
        "by_scenario": dict(tally.sent),
        "ok": tally.ok,
        "cancelled": tally.cancelled,
        "refused_as_expected": dict(tally.refused),
        "unexpected_errors": sum(tally.unexpected.values()),
        "unexpected_by_kind": dict(tally.unexpected),
        "accepted": tally.accepted,
        "accepted_not_answered": tally.accepted - tally.answered,
        "leak_check": out["leak"],
        "rss_mib": {
            "server": [round(start[0] / 2**20, 1), round(rss["end"][0] / 2**20, 1)],
            "engine": [round(start[1] / 2**20, 1), round(rss["end"][1] / 2**20, 1)],
        },
        "rss_growth_pct": {"server": round(growth[0], 2), "engine": round(growth[1], 2)},
        "preemptions": _metric(m, "inferd:num_preemptions_total"),
        "spec_drafts": _metric(m, "inferd:spec_decode_num_drafts_total"),
        "spec_accepted_tokens": _metric(m, "inferd:spec_decode_num_accepted_tokens_total"),
        "engine_restarts": _metric(m, "inferd:engine_restarts_total"),
        "stream_overflows": _metric(m, "inferd:stream_overflows_total"),
        "request_timeouts": _metric(m, "inferd:request_timeouts_total"),
        "generation_tokens": _metric(m, "inferd:generation_tokens_total"),
    }
    summary["passed"] = (
        summary["unexpected_errors"] == 0
        and summary["accepted_not_answered"] == 0
        and bool(out["leak"].get("ok"))
        and max(growth) < RSS_LIMIT * 100
    )
    print(f"soak: {summary['requests']} requests in {summary['duration_s']} s "
          f"(concurrency {args.concurrency}): {tally.ok} ok, {tally.cancelled} cancelled, "
          f"{sum(tally.refused.values())} refused as expected")  # fmt: skip
    print(f"  by scenario: {dict(tally.sent)}")
    print(f"  refused as expected: {dict(tally.refused)}")
    print(f"  unexpected errors: {summary['unexpected_errors']} {dict(tally.unexpected)}")
    for example in tally.examples:
        print(f"    {example}")
    print(f"  accepted {tally.accepted}, not answered {summary['accepted_not_answered']}")
    print(f"  leak check: {out['leak']}")
    print(f"  RSS after {summary['warmup_s']} s warm-up → end: server {summary['rss_mib']['server']} "
          f"MiB ({growth[0]:+.2f} %), engine {summary['rss_mib']['engine']} MiB ({growth[1]:+.2f} %)")  # fmt: skip
    print(f"  preemptions {summary['preemptions']:.0f}, spec accepted tokens "
          f"{summary['spec_accepted_tokens']:.0f}, generated tokens {summary['generation_tokens']:.0f}, "
          f"timeouts {summary['request_timeouts']:.0f}, restarts {summary['engine_restarts']:.0f}")  # fmt: skip
    print(f"  {'PASSED' if summary['passed'] else 'FAILED'}; server log: {server.log.name}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({**summary, "rss_samples": rss["samples"]}, f, indent=1)
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


def add_soak_parser(sub) -> None:
    p = sub.add_parser("soak", help="long mixed traffic against inferd serve; checks for lost "
                       "requests, leaked KV blocks and memory growth")  # fmt: skip
    p.add_argument("--duration", type=parse_duration, default=parse_duration("20m"),
                   help="how long traffic runs: 45s, 20m, 1h")  # fmt: skip
    p.add_argument("--warmup", type=parse_duration, default=None,
                   help="traffic after each client's first requests (one of each kind) before "
                   "the RSS baseline is taken (default: a quarter of the duration, 10 s to 5 min)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap every request's max_tokens (a quicker soak on a busy machine)")  # fmt: skip
    p.add_argument("--model", default=None, help="the model to serve (default: inferd's default)")
    p.add_argument("--kv-cache-memory", default="24MiB",
                   help="small on purpose: long prompts and n > 1 get preempted")  # fmt: skip
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more argument for `inferd serve` (repeatable)")  # fmt: skip
    p.add_argument("--result-file", default=None, help="write the summary and RSS samples here")
    p.set_defaults(func=run_soak)
