"""What suffix decoding's drafting costs per sequence per step, on real text.

    PYTHONPATH=. python benchmarks/suffix_propose_cost.py [--cached-tokens 16384] [--steps 400]

Fills the shared index with finished "requests": the project's own docs/*.md and README.md,
tokenized with the default model's tokenizer and cut into 400-token documents (~38,000 tokens:
more than the default bound here holds, so evictions are timed too). Then one sequence grows token by token through a document
of its own (a docs page the index never saw, then one it holds: misses and hits), and each step
times what the engine's `propose` does for it: index the new token, find the longest match,
draft up to k = 16. Times are the thread's CPU time (what the work costs, not what a loaded
machine's other jobs add to it). Prints the mean and p99 in microseconds and one JSON line; a
decode step of the default model is milliseconds (`inferd bench latency`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

from inferd.config import SpeculativeConfig
from inferd.loader import load_model
from inferd.sampling.params import SamplingParams
from inferd.scheduler.sequence import Sequence
from inferd.spec.suffix import SuffixProposer

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cached-tokens", type=int, default=1 << 14, help="the index's token bound")
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    tok = load_model(None, verbose=False).tokenizer
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    held, unseen = pages[1:], pages[0]
    spec = SpeculativeConfig(method="suffix", suffix_decoding_max_cached_tokens=args.cached_tokens)
    proposer = SuffixProposer(spec)
    params = SamplingParams(temperature=0, max_tokens=None)
    start = time.thread_time()
    indexed = 0
    for page in held:
        ids = tok.encode(page.read_text(), add_special_tokens=False)
        for i in range(0, len(ids), 400):
            seq = Sequence("fill", 0, ids[i : i + 400], len(ids[i : i + 400]), params)
            proposer.release(seq)  # a finished request: its text joins the index
            indexed += len(seq.token_ids)
    fill = time.thread_time() - start
    times, drafted = [], 0
    for page in (unseen, held[0]):
        ids = tok.encode(page.read_text(), add_special_tokens=False)[: args.steps]
        seq = Sequence("probe", 0, ids[:16], 16, params)
        for t in ids[16:]:
            seq.token_ids.append(t)
            start = time.thread_time()
            proposer.propose([seq], [16])
            times.append(time.thread_time() - start)
            drafted += len(seq.spec.token_ids)
        proposer.release(seq)
    times_us = sorted(t * 1e6 for t in times)
    report = {
        "bench": "suffix_propose_cost",
        "tokens_written": indexed,
        "tokens_held": proposer.cache.num_tokens,
        "fill_us_per_token": round(fill / indexed * 1e6, 2),
        "propose_us_mean": round(statistics.mean(times_us), 1),
        "propose_us_p50": round(times_us[len(times_us) // 2], 1),
        "propose_us_p99": round(times_us[int(len(times_us) * 0.99)], 1),
        "steps": len(times_us),
        "drafted_per_step": round(drafted / len(times_us), 2),
    }
    print(f"index: {indexed} tokens written, {proposer.cache.num_tokens} held at the end "
          f"({report['fill_us_per_token']} µs a token to index and evict)")  # fmt: skip
    print(f"propose, one sequence, k = 16: mean {report['propose_us_mean']} µs, "
          f"p50 {report['propose_us_p50']} µs, p99 {report['propose_us_p99']} µs")  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
