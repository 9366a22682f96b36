"""`inferd bench data-parallel`: one batch of prompts through the offline API with one engine on
every core (`LLM(...)`) and with N replicas of cores / N threads each (`LLM(...,
data_parallel_size=N)`), run by run interleaved so that other jobs' load hits both alike.

Reports each setup's median wall time and output tokens/s, the ratio, whether the greedy outputs
agreed, and the load average before and after. The last line printed is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from inferd.bench.common import add_model_args, set_threads


def run_data_parallel(args: argparse.Namespace) -> dict:
    from inferd import LLM, SamplingParams
    from inferd.bench.prompts import synthetic_prompt
    from inferd.loader import load_tokenizer, resolve_model_path

    n, size = args.num_prompts, args.data_parallel_size
    if n < 1 or args.input_len < 1 or args.output_len < 1 or args.runs < 1 or size < 2:
        raise ValueError("--num-prompts, --input-len, --output-len and --runs must be ≥ 1 and "
                         "--data-parallel-size ≥ 2")  # fmt: skip
    set_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # No prefix cache: every run computes its prompts (each run's prompts are new anyway).
    common = {"verbose": False, "quantization": args.quantization, "dtype": args.dtype,
              "enable_prefix_caching": False, "max_num_seqs": n}  # fmt: skip
    load_before = os.getloadavg()
    setups = {"1 engine": LLM(str(path), **common),
              f"{size} replicas": LLM(str(path), data_parallel_size=size, **common)}  # fmt: skip
    threads = torch.get_num_threads()
    print(f"{n} prompts of {args.input_len} tokens, {args.output_len} new tokens each; one engine "
          f"with {threads} torch threads vs {size} replicas; median of {args.runs} runs",
          file=sys.stderr)  # fmt: skip
    walls: dict[str, list[float]] = {name: [] for name in setups}
    agree = True
    try:
        for llm in setups.values():  # warm-up: kernels built, pages touched
            llm.generate([synthetic_prompt(tokenizer, 8, seed="warm-up")],
                         SamplingParams(max_tokens=2), use_tqdm=False)  # fmt: skip
        for r in range(args.runs):
            prompts = [synthetic_prompt(tokenizer, args.input_len, seed=f"{r}/{i}") for i in range(n)]
            tokens = []
            for name, llm in setups.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls[name].append(time.perf_counter() - start)
                tokens.append([o.outputs[0].token_ids for o in outs])
            agree = agree and all(t == tokens[0] for t in tokens)
            print(f"run {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in walls.items()),
                  file=sys.stderr)  # fmt: skip
    finally:
        for llm in setups.values():
            llm.close()
    generated = n * args.output_len
    results = {name: {"wall_s": round(statistics.median(w), 3),
                      "output_tps": round(generated / statistics.median(w), 1)}
               for name, w in walls.items()}  # fmt: skip
    one, many = (results[k]["output_tps"] for k in setups)
    report = {
        "bench": "data-parallel", "model": str(path), "quantization": args.quantization,
        "num_prompts": n, "input_len": args.input_len, "output_len": args.output_len,
        "runs": args.runs, "threads": threads, "data_parallel_size": size,
        "results": results, "ratio_replicas_vs_one": round(many / one, 2),
        "greedy_outputs_agree": agree,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    for name, r in results.items():
        print(f"{name:<12} {r['wall_s']:>8.2f} s {r['output_tps']:>8.1f} tok/s")
    print(f"ratio {report['ratio_replicas_vs_one']}; outputs agree: {agree}")
    print(json.dumps(report))
    return report


def add_data_parallel_parser(sub) -> None:
    p = sub.add_parser(
        "data-parallel",
        help="offline throughput: one engine on every core vs LLM(data_parallel_size=N)",
    )
    add_model_args(p, peers=False)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians (noisy machines)")
    p.set_defaults(func=run_data_parallel)
