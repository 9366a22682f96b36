"""`inferd bench prefix`: the prefix-cache scenarios of the seeds, cache on vs off in one run.

- multi-turn: a 5-turn chat whose history grows to ~1,500 tokens; time to first token of the fifth
  turn when its history was served before (cache on) vs the same history unseen (cache off).
- kv-tier: the multi-turn chat's fifth turn after a restart, served from the disk KV tier, vs
  cold recompute and warm memory (inferd/bench/kv_tier.py).
- shared-prefix: 16 requests sharing a 1,024-token prefix with distinct 32-token suffixes, sent
  together after one request that makes the prefix hot; mean time to first token and prefill
  tokens computed (after one untimed round of the same).

The two engines (cache on, cache off) share the weights and take turns run by run, so that a change
in the machine's load during the benchmark hits both alike. On a machine shared with other jobs,
`--threads 1 --clock cpu` times requests in the process's CPU time: the work, not the waits for a
core (with one thread, CPU time is the time the work would take on an idle core).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from inferd.bench.common import add_threads_arg, set_threads
from inferd.bench.prompts import synthetic_prompt


def _ttfts(llm, prompts: list[list[int]], max_tokens: int = 1) -> tuple[list[float], int]:
    """Send all prompts at once; per-request TTFT (s) and prompt tokens computed."""
    from inferd import SamplingParams

    before = llm.get_stats().prompt_tokens_total
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)  # fmt: skip
    computed = llm.get_stats().prompt_tokens_total - before
    return [o.metrics.first_token_time - o.metrics.arrival_time for o in outs], computed


def multi_turn(llm, tok, turns: int, turn_tokens: int, answer_tokens: int) -> dict:
    """Build the conversation turn by turn (the engine answers each); return TTFT per turn."""
    from inferd import SamplingParams

    history: list[int] = []
    ttft = []
    for t in range(turns):
        user = synthetic_prompt(tok, turn_tokens, seed=1000 + t)
        prompt = history + user
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True),
                              use_tqdm=False)  # fmt: skip
        ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
        history = prompt + out.outputs[0].token_ids
    return {"ttft_per_turn_s": [round(x, 4) for x in ttft], "final_prompt_tokens": len(prompt),
            "final_prompt": prompt}  # fmt: skip


def run_prefix(args: argparse.Namespace) -> dict:
    from inferd import LLM
    from inferd.loader import load_model

    set_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        # CPU time sums every thread's: it is a duration only with one thread.
        raise ValueError(f"--clock cpu needs --threads 1 (torch runs {torch.get_num_threads()} threads)")
    loaded = load_model(args.model, verbose=False)
    tok = loaded.tokenizer
    report: dict = {"scenario": args.scenario, "threads": torch.get_num_threads(), "clock": args.clock}
    if args.scenario == "kv-tier":
        from inferd.bench.kv_tier import run_kv_tier

        report.update(run_kv_tier(args, loaded, tok, time.process_time if args.clock == "cpu" else None))
        print(json.dumps(report))
        return report
    llms = {}
    for cache in (True, False):
        llms[cache] = LLM(loaded=loaded, verbose=False, enable_prefix_caching=cache,
                          max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
        if args.clock == "cpu":
            llms[cache].engine.clock = time.process_time
        llms[cache].generate([[1, 2, 3]], use_tqdm=False)  # warm-up
    results: dict[str, list[dict]] = {"cache_on": [], "cache_off": []}
    # Shared-prefix: one untimed round first, so the timed ones do not pay for the first use of
    # each shape (the cache-on step is the only one of its kind in a round).
    first = -1 if args.scenario == "shared-prefix" else 0
    for r in range(first, args.runs):
        for cache, llm in llms.items():
            llm.reset_prefix_cache()
            if args.scenario == "multi-turn":
                run = multi_turn(llm, tok, turns=5, turn_tokens=args.turn_tokens,
                                 answer_tokens=args.answer_tokens)  # fmt: skip
            else:
                prefix = synthetic_prompt(tok, args.prefix_len, seed=7 + r)
                suffixes = [synthetic_prompt(tok, args.suffix_len, seed=100 + i) for i in range(args.num_requests)]
                _ttfts(llm, [prefix + synthetic_prompt(tok, args.suffix_len, seed=99)])  # warm-up: the prefix is hot
                ttfts, computed = _ttfts(llm, [prefix + s for s in suffixes])
                run = {"mean_ttft_s": statistics.mean(ttfts), "prefill_tokens_computed": computed}
            if r >= 0:
                results["cache_on" if cache else "cache_off"].append(run)
    del llms
    if args.scenario == "multi-turn":
        last_on = statistics.median(r["ttft_per_turn_s"][-1] for r in results["cache_on"])
        last_off = statistics.median(r["ttft_per_turn_s"][-1] for r in results["cache_off"])
        report.update(final_prompt_tokens=results["cache_on"][0]["final_prompt_tokens"],
                      turn5_ttft_on_s=round(last_on, 4), turn5_ttft_off_s=round(last_off, 4),
                      ratio=round(last_on / last_off, 4),
                      ttft_per_turn_on=results["cache_on"][0]["ttft_per_turn_s"],
                      ttft_per_turn_off=results["cache_off"][0]["ttft_per_turn_s"])  # fmt: skip
        print(f"5-turn chat ({report['final_prompt_tokens']} tokens at turn 5): TTFT turn 5 "
              f"cache on {last_on:.3f} s, off {last_off:.3f} s → {report['ratio']}×")  # fmt: skip
    else:
        on = statistics.median(r["mean_ttft_s"] for r in results["cache_on"])
        off = statistics.median(r["mean_ttft_s"] for r in results["cache_off"])
        computed = statistics.median(r["prefill_tokens_computed"] for r in results["cache_on"])
        ideal = args.num_requests * args.suffix_len
        pairs = zip(results["cache_on"], results["cache_off"])
        per_run = [a["mean_ttft_s"] / b["mean_ttft_s"] for a, b in pairs]
        report.update(mean_ttft_on_s=round(on, 4), mean_ttft_off_s=round(off, 4), ratio=round(on / off, 4),
                      ratio_per_run=[round(x, 4) for x in per_run],
                      prefill_tokens_computed_on=computed, distinct_tokens=ideal,
                      computed_over_ideal=round(computed / (args.prefix_len + ideal), 3))  # fmt: skip
        print(f"{args.num_requests} requests sharing a {args.prefix_len}-token prefix (+{args.suffix_len} each): "
              f"mean TTFT cache on {on:.3f} s, off {off:.3f} s → {report['ratio']}×; prefill tokens "
              f"computed with cache: {computed} (prefix + suffixes = {args.prefix_len + ideal}; "
              f"{report['computed_over_ideal']}×)")  # fmt: skip
    print(json.dumps(report))
    return report


def add_prefix_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix-cache scenarios: multi-turn, shared-prefix (cache on vs off), "
                       "kv-tier (after a restart: disk vs cold vs warm)")
    p.add_argument("--scenario", choices=["multi-turn", "shared-prefix", "kv-tier"], default="shared-prefix")
    p.add_argument("--model", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--turn-tokens", type=int, default=60, help="tokens per user turn (multi-turn)")
    p.add_argument("--answer-tokens", type=int, default=300, help="tokens per answer (multi-turn)")
    add_threads_arg(p)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="what TTFT is measured in: wall time, or the process's CPU time (needs "
                        "--threads 1; the work alone, for a machine shared with other jobs)")  # fmt: skip
    p.set_defaults(func=run_prefix)
