"""Start-up measurement of what verification costs: the target's forward for B decoding sequences
with 1 + k query tokens each against 1 each. beta(B) = (t(B, 1 + k) / t(B, 1) - 1) / k is the
extra cost of one draft token per sequence in units of a plain decode step (inferd.spec.policy).
With draft-tree leaves, their own cost per leaf row on top of the chain's is measured the same
way: (t(B, 1 + k + L) / t(B, 1 + k) - 1) * (1 + k beta) / L. It is not beta: on a CPU the first
few rows ride along with the weights' stream, the next ones are paid in FLOPs (fp32 here: 0.04
of a step per draft at 1 + 3 rows, ~0.15 per leaf past them)."""

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
                        context: int = 128, repeats: int = 3,
                        leaves: int = 0) -> tuple[dict[int, float], dict[int, float]]:  # fmt: skip
    """beta per batch size, for the sizes the KV pool has room for (dummy sequences, freed after).
    Plain and verification steps alternate and the median ratio is kept, so that load from other
    processes hits both sides alike; beta is made non-decreasing in the batch size. Second: with
    `leaves` > 0, the cost of one leaf row by batch size (verifications of k drafts and `leaves`
    leaves against k drafts alone), else empty."""
    kv = runner.kv
    gen = torch.Generator().manual_seed(0)
    costs: dict[int, float] = {}
    leaf_costs: dict[int, float] = {}
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
                    return costs, leaf_costs  # the pool is smaller than this batch: as measured
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
            fresh = [s for s in batch if s.seq_id not in kv.scratch]
            if leaves and all(kv.allocate_scratch(s.seq_id, leaves) for s in fresh):
                for s in batch:
                    s.spec_leaves = sorted((1 + i % k, 0) for i in range(leaves))  # in depth order
                runner.execute(verify)  # warm-up
                ratios = []
                for _ in range(repeats):
                    with_leaves = _seconds(runner, verify)
                    for s in batch:
                        s.spec_leaves, leaves_of = [], s.spec_leaves
                    ratios.append(with_leaves / _seconds(runner, verify))
                    for s in batch:
                        s.spec_leaves = leaves_of
                for s in batch:
                    s.spec_leaves = []
                per_leaf = max(0.0, (statistics.median(ratios) - 1.0) * (1.0 + k * beta) / leaves)
                leaf_costs[size] = max([per_leaf, *leaf_costs.values()])
    finally:
        for s in seqs:
            s.spec_leaves = []
            kv.free(s.seq_id)
        runner.release_kv_pages()
    logger.info("speculation: verification cost per draft token by batch size: %s",
                ", ".join(f"{b}: {c:.2f}" for b, c in costs.items()))  # fmt: skip
    if leaf_costs:
        logger.info("speculation: per draft-tree leaf: %s",
                    ", ".join(f"{b}: {c:.2f}" for b, c in leaf_costs.items()))  # fmt: skip
    return costs, leaf_costs
