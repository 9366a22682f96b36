"""Scheduling cost alone, no model: N requests sharing a hot P-token prefix (+32 tokens of their
own) arrive together; prints the CPU time of the `Scheduler.schedule()` calls that admit them all
(each step then "computes" what was scheduled and caches its full blocks, as the engine does).

    python benchmarks/scheduler_admission.py            # from the repository root
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferd.config import SchedulerConfig  # noqa: E402
from inferd.kv.kv_cache_manager import KVCacheManager  # noqa: E402
from inferd.sampling.params import SamplingParams  # noqa: E402
from inferd.scheduler.scheduler import Scheduler  # noqa: E402
from inferd.scheduler.sequence import Sequence  # noqa: E402


def admission_cpu_seconds(n: int, prefix_len: int, budget: int, block_size: int = 16) -> float:
    kv = KVCacheManager(num_blocks=(n + 2) * (prefix_len // block_size + 4), block_size=block_size)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=1024), kv)
    rng = random.Random(0)
    prefix = [rng.randrange(50_000) for _ in range(prefix_len)]
    warm = prefix + [1]  # an earlier request made the prefix hot
    kv.attach_cached_prefix(-1, warm)
    kv.allocate_slots(-1, 0, len(warm))
    kv.cache_computed_blocks(-1, warm, len(warm))
    kv.free(-1)
    for i in range(n):
        tokens = prefix + [rng.randrange(50_000) for _ in range(32)]
        sched.add(Sequence(f"r{i}", 0, tokens, len(tokens), SamplingParams(), 0, float(i)))
    total = 0.0
    while sched.waiting:
        start = time.process_time()
        out = sched.schedule()
        total += time.process_time() - start
        for seq, k in out.scheduled:
            seq.num_computed_tokens += k
            kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            seq.token_ids.append(1)  # its first output token
    return total


def main() -> None:
    for n, prefix_len, budget in [(16, 1024, 2048), (64, 1024, 2048), (64, 4096, 2048), (256, 2048, 8192)]:
        t = sorted(admission_cpu_seconds(n, prefix_len, budget) for _ in range(3))[1]
        print(f"{n} requests x ({prefix_len} shared + 32): admitting them costs {t * 1000:.1f} ms of scheduling CPU")


if __name__ == "__main__":
    main()
