"""`inferd bench offline`: the offline engine against its peers on the seeds' scenarios.

`--scenario throughput` (the default) is single-stream decode plus the aggregate throughput of N
requests; `multi-turn`, `shared-prefix` and `long-context` are the seeds' other tables (see
inferd/bench/scenarios.py). Flags a scenario does not use are ignored; flags left unset take the
scenario's defaults. The last line printed is one JSON document with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from inferd.bench.common import add_model_args, set_threads
from inferd.bench.scenarios import SCENARIOS, BenchContext
from inferd.engine_args import parse_bytes


def run_offline(args: argparse.Namespace) -> dict:
    from inferd.bench.peers import PeerSet, parse_peers
    from inferd.loader import load_model, resolve_model_path

    scenario = SCENARIOS[args.scenario]
    for key, value in scenario.defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("num_prompts", "input_len", "output_len", "runs", "turns", "prefix_len"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be ≥ 1, got {value}")
    if args.output_len < 2:
        raise ValueError("--output-len must be ≥ 2 (decode speed needs a token after the first)")
    wanted = parse_peers(args.peers)
    set_threads(args.threads)
    path = resolve_model_path(args.model)
    loaded = load_model(path, verbose=False, quantization=args.quantization)
    pad = loaded.tokenizer.eos_token_id or 0
    peers = PeerSet(path, wanted, args.quantization, pad)
    llm_kwargs = {"dtype": args.dtype, "quantization": args.quantization,
                  "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    if args.kv_cache_memory is not None:
        llm_kwargs["kv_cache_memory"] = args.kv_cache_memory
    ctx = BenchContext(path, loaded, peers, llm_kwargs)
    used = {k: getattr(args, k) for k in scenario.defaults}
    print(f"scenario {scenario.name}: {scenario.summary}; {used}; torch threads "
          f"{torch.get_num_threads()}; peers: {', '.join(sorted(wanted)) or 'none'}", file=sys.stderr)  # fmt: skip
    try:
        result = scenario.run(ctx, args)
    finally:
        peers.close()
    for note in peers.notes:
        print(note)
    report = {"bench": "offline", "scenario": scenario.name, "model": str(path),
              "quantization": args.quantization, "threads": torch.get_num_threads(), **used,
              "notes": peers.notes, **result}  # fmt: skip
    print(json.dumps(report))
    return report


def add_offline_parser(sub) -> None:
    p = sub.add_parser(
        "offline", help="the offline engine vs peers on the seeds' scenarios (--scenario)"
    )
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="throughput",
                   help="; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values()))  # fmt: skip
    add_model_args(p)
    p.add_argument(
        "--runs", type=int, default=None, help="repeat and report medians (noisy machines)"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests (throughput, shared-prefix)"
    )
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (throughput), user turn (multi-turn), suffix (shared-prefix)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None, help="shared system prompt tokens")
    p.add_argument("--turns", type=int, default=None, help="turns of the conversation (multi-turn)")
    p.add_argument("--context-lens", default=None,
                   help="comma list of context lengths, 'max' = the model's (long-context)")  # fmt: skip
    p.add_argument("--lora-adapters", type=int, default=None, help="adapters the requests spread over (lora)")
    p.add_argument("--lora-rank", type=int, default=None, help="the adapters' rank (lora)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV pool size, e.g. 1GiB (default: the engine's own)",
    )
    p.set_defaults(func=run_offline)
