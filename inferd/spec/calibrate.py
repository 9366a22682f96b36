"""Start-up measurement of what verification costs: the target's forward for B decoding sequences
with 1 + j query tokens each against 1 each, for every depth j up to k. F(B, j) = t(B, 1 + j) /
t(B, 1) - 1 is the extra cost of j drafts per sequence in units of a plain decode step
(inferd.spec.policy). It is measured per depth because it is not linear in j: on a CPU the first
extra rows ride along with the weights' stream and the next ones are paid in FLOPs. With
draft-tree leaves, their own cost per leaf row on top of the chain's is measured the same way:
(t(B, 1 + k + L) / t(B, 1 + k) - 1) * (1 + F(B, k)) / L."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from inferd.engine.model_runner import ModelRunner
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence
from inferd.spec import verify_prices

logger = logging.getLogger("inferd.spec")

# The policy interpolates linearly in between. 32 is measured, not interpolated: between 16 and
# 64 sequences a step turns from riding on the weights' stream to compute-bound, and the line
# between those two points prices a draft at batch 32 at less than half its cost.
BATCH_SIZES = (1, 4, 16, 32, 64)


def _seconds(runner: ModelRunner, out: SchedulerOutput) -> float:
    """The step's forward, timed to its end on the device (a GPU runs it asynchronously)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda *_: None)
    sync(runner.device)
    start = time.perf_counter()
    runner.execute(out)
    sync(runner.device)
    return time.perf_counter() - start


# Small batches' steps are short, and a median of a few pairs of them is too noisy to choose
# depths by. There, pairs are taken until they span about this long (at most _MAX_PAIRS).
_MIN_SECONDS = 0.2
_MAX_PAIRS = 15


def _pairs(
    runner: ModelRunner, verify: SchedulerOutput, plain: SchedulerOutput, repeats: int
) -> int:
    """How many (verification, plain) pairs to time: `repeats`, or more where a pair is short."""
    pair = _seconds(runner, verify) + _seconds(runner, plain)  # also the plain step's warm-up
    return min(_MAX_PAIRS, max(repeats, int(_MIN_SECONDS / max(pair, 1e-6))))


def measure_verify_cost(
    runner: ModelRunner, kv: KVCacheManager, k: int, max_batch: int, vocab_size: int,
    context: int = 128, repeats: int = 3, leaves: int = 0,
) -> tuple[dict[int, list[float]], dict[int, float]]:  # fmt: skip
    """`_measure`'s prices, or those it measured at an earlier start with the same target,
    weights, KV cache, depth, batch bound, threads, machine and code (inferd.spec.verify_prices),
    and kept on disk since."""
    key = verify_prices.price_key(runner, kv, k, leaves, max_batch, context)
    kept = verify_prices.load(key) if key is not None else None
    if kept is not None:
        return kept
    prices = _measure(runner, kv, k, max_batch, vocab_size, context, repeats, leaves)
    if key is not None:
        verify_prices.save(key, prices)
    return prices


def _measure(
    runner: ModelRunner, kv: KVCacheManager, k: int, max_batch: int, vocab_size: int,
    context: int, repeats: int, leaves: int,
) -> tuple[dict[int, list[float]], dict[int, float]]:  # fmt: skip
    """F per batch size: [F(1), ..., F(k)], for the sizes the KV pool has room for (dummy
    sequences, freed after). Plain and verification steps alternate and the median ratio is kept,
    so that load from other processes hits both sides alike; F is made non-decreasing in the
    depth and in the batch size. Second: with `leaves` > 0, the cost of one leaf row by batch size
    (verifications of k drafts and `leaves` leaves against k drafts alone), else empty."""
    gen = torch.Generator().manual_seed(0)
    costs: dict[int, list[float]] = {}
    leaf_costs: dict[int, float] = {}
    seqs: list[Sequence] = []
    drafts: dict[int, list[int]] = {}
    try:
        for size in BATCH_SIZES:
            if size > max_batch:
                break
            while len(seqs) < size:
                tokens = torch.randint(vocab_size, (context + k,), generator=gen).tolist()
                params = SamplingParams(max_tokens=None)
                seq = Sequence("calibration", 0, tokens[:context], context, params)
                if not kv.allocate_slots(seq.seq_id, 0, context + k):
                    kv.free(seq.seq_id)
                    return costs, leaf_costs  # the pool is smaller than this batch: as measured
                seq.num_computed_tokens = context - 1
                drafts[seq.seq_id] = tokens[context:]
                seqs.append(seq)
            batch = seqs[:size]
            plain = SchedulerOutput.of([(s, 1) for s in batch], kv)
            below = costs[max(costs)] if costs else [0.0] * k  # the next smaller batch's
            by_depth: list[float] = []
            for j in range(1, k + 1):
                for s in batch:
                    s.spec.set(drafts[s.seq_id][:j])
                verify = SchedulerOutput.of([(s, 1 + j) for s in batch], kv)
                runner.execute(verify)  # warm-up
                ratios = [_seconds(runner, verify) / _seconds(runner, plain)
                          for _ in range(_pairs(runner, verify, plain, repeats))]  # fmt: skip
                f = max(0.0, statistics.median(ratios) - 1.0, below[j - 1], *by_depth[-1:])
                by_depth.append(f)
            costs[size] = by_depth
            fresh = [s for s in batch if s.seq_id not in kv.scratch]
            if leaves and all(kv.allocate_scratch(s.seq_id, leaves) for s in fresh):
                for s in batch:
                    s.spec.leaves = sorted((1 + i % k, 0) for i in range(leaves))  # in depth order
                verify = SchedulerOutput.of([(s, 1 + k) for s in batch], kv)  # with the scratch
                runner.execute(verify)  # warm-up
                ratios = []
                for _ in range(repeats):
                    with_leaves = _seconds(runner, verify)
                    for s in batch:
                        s.spec.leaves, leaves_of = [], s.spec.leaves
                    ratios.append(with_leaves / _seconds(runner, verify))
                    for s in batch:
                        s.spec.leaves = leaves_of
                for s in batch:
                    s.spec.leaves = []
                extra = statistics.median(ratios) - 1.0
                per_leaf = max(0.0, extra * (1.0 + by_depth[-1]) / leaves)
                leaf_costs[size] = max([per_leaf, *leaf_costs.values()])
    finally:
        for s in seqs:
            s.spec.leaves = []
            kv.free(s.seq_id)
        assert kv.pool.num_available == kv.pool.num_blocks, "KV blocks still in use"
        runner.release_kv_pages()
    by_size = (f"{b}: {'/'.join(f'{f:.2f}' for f in c)}" for b, c in costs.items())
    logger.info("speculation: verification cost of 1..%d drafts by batch size: %s", k,
                ", ".join(by_size))  # fmt: skip
    if leaf_costs:
        logger.info("speculation: per draft-tree leaf: %s",
                    ", ".join(f"{b}: {c:.2f}" for b, c in leaf_costs.items()))  # fmt: skip
    return costs, leaf_costs
