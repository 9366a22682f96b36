"""`inferd bench structured`: decode throughput with a JSON schema vs unconstrained, batch 1 and N.

Generated tokens per second of wall time for the same chat prompts, grammar compiled before the
timed run (compile time reported separately)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "city", "hobbies", "notes"],
    "additionalProperties": False,
}


def _tps(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / secs


def run_structured(args: argparse.Namespace) -> dict:
    from inferd import LLM, SamplingParams
    from inferd.structured import StructuredOutputsParams

    llm = LLM(args.model, verbose=False, quantization=args.quantization)
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": f"Describe person number {i} as a JSON record."} for i in range(args.batch)]
    prompts = [tok.encode(tok.apply_chat_template([m]), add_special_tokens=False) for m in msgs]
    spec = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(temperature=0.7, seed=1, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0.7, seed=1, max_tokens=args.max_tokens, structured=spec)
    t0 = time.perf_counter()
    llm.generate([prompts[0]], constrained, use_tqdm=False)  # first use: tokenizer setup + compile
    first_use = time.perf_counter() - t0
    report = {"first_use_s": round(first_use, 3), "batches": {}}
    for b in (1, args.batch):
        runs = {"free": [], "json_schema": []}
        for _ in range(args.runs):
            runs["free"].append(_tps(llm, prompts[:b], free))
            runs["json_schema"].append(_tps(llm, prompts[:b], constrained))
        f, s = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
        report["batches"][b] = {"free_tps": round(f, 1), "json_schema_tps": round(s, 1), "ratio": round(s / f, 3)}
        print(f"batch {b}: unconstrained {f:.1f} tok/s, JSON schema {s:.1f} tok/s → {s / f:.2f}×")
    print(f"first structured request (tokenizer setup + compile + generate): {first_use:.2f} s")
    print(json.dumps(report))
    return report


def add_structured_parser(sub) -> None:
    p = sub.add_parser("structured", help="JSON-schema decoding vs unconstrained throughput")
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", "-q", default="none")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.set_defaults(func=run_structured)
