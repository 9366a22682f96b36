"""A 512-token prefill and 32 × (128, 128) offline, timed in the process's own CPU time.

    python benchmarks/batched_step_cpu_time.py TREE_NAME      # from the checkout to measure

On a machine oversubscribed by other jobs the wall clock measures them; the process's CPU time
(one thread) still shows what a change to the kernels did. Default model, `-q auto`, prefix caching
off: one 512-token prompt with max_tokens=1 (best of 3), then 32 distinct 128-token prompts × 128
new tokens, greedy, ignore_eos. Prints one JSON line, with an md5 of every generated token so
two checkouts can be checked for the same output.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's inferd

import inferd
from inferd.loader import resolve_model_path


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    torch.set_num_threads(1)
    llm = inferd.LLM(str(resolve_model_path(None)), quantization="auto", enable_prefix_caching=False, verbose=False)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]} for _ in range(32)]
    long = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(512)]}]
    batch = inferd.SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    one = inferd.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(long, one, use_tqdm=False)  # warm-up
    prefill = [timed(lambda: llm.generate(long, one, use_tqdm=False))[:2] for _ in range(3)]
    wall, cpu, outs = timed(lambda: llm.generate(prompts, batch, use_tqdm=False))
    tokens = [o.outputs[0].token_ids for o in outs]
    print(json.dumps({
        "tree": sys.argv[1] if len(sys.argv) > 1 else "", "load": Path("/proc/loadavg").read_text().split()[0],
        "prefill512_wall_s": min(w for w, _ in prefill), "prefill512_cpu_s": min(c for _, c in prefill),
        "batch32_wall_tok_s": 4096 / wall, "batch32_cpu_tok_s": 4096 / cpu,
        "tokens_md5": hashlib.md5(str(tokens).encode()).hexdigest(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
