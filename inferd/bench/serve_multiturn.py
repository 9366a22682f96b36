"""`inferd bench serve --scenario multi-turn`: chat conversations whose history grows turn by
turn, against any OpenAI-compatible server (an `inferd serve`, an `inferd router`, vLLM ...).

Each conversation sends its turns one after another, each turn the whole history so far plus a
new user message (synthetic, `--input-len` tokens), and appends the streamed reply; up to
`--concurrency` conversations run at once. A server that reuses history KV answers the later
turns faster: the report gives TTFT per turn, the first turn's against the later ones', and the
share of the later turns' prompt tokens the server says came from its cache
(`usage.prompt_tokens_details.cached_tokens`). The last line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp

from inferd.bench.common import stats_ms
from inferd.bench.serve import (
    BenchServeError,
    Prompt,
    RequestResult,
    _fmt,
    _run_loop,
    _send,
    _server_model,
)


def _user_turns(args: argparse.Namespace) -> list[list[str]]:
    """Per conversation, its user messages: synthetic, made before anything is timed."""
    from inferd.bench.prompts import synthetic_prompt
    from inferd.loader import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    return [[tok.decode(synthetic_prompt(tok, args.input_len, seed=f"{args.seed}/mt{c}/{t}"))
             for t in range(args.turns)] for c in range(args.conversations)]  # fmt: skip


async def _conversations(args: argparse.Namespace, model: str, users: list[list[str]]):
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(args.multi_turn_concurrency)
    by_turn: list[list[RequestResult]] = [[] for _ in range(args.turns)]
    conv_seconds: list[float] = []

    async def one(turns: list[str]) -> None:
        async with sem:
            start = time.perf_counter()
            history: list[dict] = []
            for t, text in enumerate(turns):
                history.append({"role": "user", "content": text})
                p = Prompt("", args.output_len, messages=list(history))
                res = await _send(session, url, "chat", model, p, args.ignore_eos, keep_text=True)
                by_turn[t].append(res)
                if not res.ok:
                    return  # the rest of this conversation would not be the same workload
                history.append({"role": "assistant", "content": "".join(res.text or ())})
            conv_seconds.append(time.perf_counter() - start)

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=args.request_timeout),
        connector=aiohttp.TCPConnector(limit=args.multi_turn_concurrency),
    ) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(turns) for turns in users))
        elapsed = time.perf_counter() - start
    return by_turn, conv_seconds, elapsed


def run_multi_turn(args: argparse.Namespace) -> dict:
    if args.turns < 2 or args.conversations < 1:
        raise BenchServeError("--scenario multi-turn needs --turns >= 2 and --conversations >= 1")
    args.multi_turn_concurrency = int(str(args.concurrency).split(",")[0])
    if args.multi_turn_concurrency < 1:
        raise BenchServeError(f"--concurrency must be a positive integer, got {args.concurrency!r}")
    model = _server_model(args)
    users = _user_turns(args)
    by_turn, conv_seconds, elapsed = _run_loop(_conversations(args, model, users))
    done = [[r for r in turn if r.ok] for turn in by_turn]
    failed = sum(len(turn) - len(ok) for turn, ok in zip(by_turn, done))
    if not done[0]:
        errors = sorted({r.error for r in by_turn[0]})[:5]
        raise BenchServeError(f"every first turn failed: {errors}")
    later = [r for turn in done[1:] for r in turn]
    later_prompt = sum(r.prompt_tokens for r in later)
    report = {
        "scenario": "multi-turn",
        "base_url": args.base_url,
        "model": model,
        "conversations": args.conversations,
        "turns": args.turns,
        "concurrency": args.multi_turn_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "completed_requests": sum(map(len, done)),
        "failed_requests": failed,
        "duration_s": elapsed,
        "ttft_ms_first_turn": stats_ms([r.ttft_s for r in done[0]]),
        "ttft_ms_later_turns": stats_ms([r.ttft_s for r in later]),
        "ttft_ms_p50_per_turn": [stats_ms([r.ttft_s for r in turn])["p50"] for turn in done],
        "cached_share_later_turns": (sum(r.cached_tokens for r in later) / later_prompt)
        if later_prompt
        else None,
        "prompt_tokens_later_turns": later_prompt,
        "conversation_s": stats_ms(conv_seconds),
        "output_tps": sum(r.output_tokens for turn in done for r in turn) / elapsed,
    }
    first, rest = report["ttft_ms_first_turn"], report["ttft_ms_later_turns"]
    share = report["cached_share_later_turns"]
    print(f"\nmulti-turn against {args.base_url} ({model}): {args.conversations} conversations × "
          f"{args.turns} turns, {args.multi_turn_concurrency} at once, {args.input_len} tokens "
          f"per user turn, {args.output_len} out")  # fmt: skip
    print(f"TTFT p50/p90 ms: first turn {_fmt(first['p50'])}/{_fmt(first['p90'])}, later turns "
          f"{_fmt(rest['p50'])}/{_fmt(rest['p90'])}; per turn p50 "
          f"{', '.join(_fmt(v) for v in report['ttft_ms_p50_per_turn'])}")  # fmt: skip
    print(f"later turns' prompt tokens from cache: {'-' if share is None else f'{100 * share:.1f} %'};"
          f" {report['completed_requests']} requests ok, {failed} failed, {elapsed:.1f} s")  # fmt: skip
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return report
