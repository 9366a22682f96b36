"""Start-up measurement of what verification costs: the target's forward for B decoding sequences
with 1 + k query tokens each against 1 each. beta(B) = (t(B, 1 + k) / t(B, 1) - 1) / k is the
extra cost of one draft token per sequence in units of a plain decode step (inferd.spec.policy)."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from inferd.engine.model_runner import ModelRunner
from inferd.sampling.params import SamplingParams
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence

logger = logging.getLogger("inferd.spec")

BATCH_SIZES = (1, 4, 16, 64)  # the policy interpolates linearly in between


def _seconds(runner: ModelRunner, out: SchedulerOutput) -> float:
    start = time.perf_counter()
    runner.execute(out)
    return time.perf_counter() - start


def measure_verify_cost(runner: ModelRunner, k: int, max_batch: int, vocab_size: int,
                        context: int = 128, repeats: int = 3) -> dict[int, float]:  # fmt: skip
    """beta per batch size, for the sizes the KV pool has room for (dummy sequences, freed after).
    Plain and verification steps alternate and the median ratio is kept, so that load from other
    processes hits both sides alike; beta is made non-decreasing in the batch size."""
    kv = runner.kv
    gen = torch.Generator().manual_seed(0)
    costs: dict[int, float] = {}
    seqs: list[Sequence] = []
    try:
        for size in BATCH_SIZES:
            if size > max_batch:
                break
            while len(seqs) < size:
                tokens = torch.randint(vocab_size, (context + k,), generator=gen).tolist()
                seq = Sequence("calibration", 0, tokens[:context], context, SamplingParams(max_tokens=None))
                if not kv.allocate_slots(seq.seq_id, 0, context + k):
                    kv.free(seq.seq_id)
                    return costs  # the pool is smaller than this batch: use what was measured
                seq.num_computed_tokens = context - 1
                seq.set_drafts(tokens[context:])
                seqs.append(seq)
            batch = seqs[:size]
            plain = SchedulerOutput([(s, 1) for s in batch])
            verify = SchedulerOutput([(s, 1 + k) for s in batch])
            runner.execute(verify)  # warm-up
            ratios = [_seconds(runner, verify) / _seconds(runner, plain) for _ in range(repeats)]
            beta = max(0.0, (statistics.median(ratios) - 1.0) / k)
            costs[size] = max([beta, *costs.values()])
    finally:
        for s in seqs:
            kv.free(s.seq_id)
        runner.release_kv_pages()
    logger.info("speculation: verification cost per draft token by batch size: %s",
                ", ".join(f"{b}: {c:.2f}" for b, c in costs.items()))  # fmt: skip
    return costs
