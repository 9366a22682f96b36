"""Speculative decoding behind one seam: `SpecDecoder.propose` drafts for the running decodes
before a step is scheduled, `verify` turns a step's verification rows into accepted tokens, and
`observe` hands the proposer what the step computed. The engine core calls only these;
`NoSpecDecoder` is the same seam with speculation off.

    propose ─► (scheduler: 1 + k rows for a sequence with k drafts) ─► forward ─► verify
                                                                                    │
    observe ◄── (scheduler.update_from_output: accepted tokens appended, rest rolled back) ◄┘

Acceptance itself is the sampler's (`inferd.sampling.rejection.verify`, lossless); how deep to
draft is the policy's (`SpecPolicy`), fed with the step times measured here.
"""

from __future__ import annotations

import time

import torch

from inferd.engine.model_runner import ModelRunner, StepBatch
from inferd.engine.readbacks import HostReadbacks
from inferd.engine.stats import EngineStats
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.sampling.rejection import verify
from inferd.scheduler.scheduler import SampledTokens, SchedulerOutput
from inferd.scheduler.sequence import Sequence
from inferd.spec.calibrate import measure_verify_cost
from inferd.spec.policy import FixedDepthPolicy, SpecPolicy
from inferd.spec.proposer import Proposer, ProposerContext, build_proposer
from inferd.spec.step_times import MAX_BATCH as STEP_TIMES_MAX_BATCH


class NoSpecDecoder:
    """Speculation off: every call is free and does nothing."""

    needs_hidden = False
    proposer: Proposer | None = None
    policy: SpecPolicy | None = None

    def propose(self, running: list[Sequence]) -> None:
        pass

    def begin_step(self, out: SchedulerOutput) -> None:
        pass

    def end_forward(self, out: SchedulerOutput) -> None:
        pass

    def verify(self, logits: torch.Tensor, batch: StepBatch) -> list[SampledTokens]:
        return []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        pass

    def observe(self, out: SchedulerOutput, sampled: list[SampledTokens], batch: StepBatch) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def check_no_leaks(self) -> None:
        pass


class SpecDecoder(NoSpecDecoder):
    """A proposer, its depth policy and the step's speculation bookkeeping."""

    def __init__(self, proposer: Proposer, policy: SpecPolicy, ctx: ProposerContext,
                 stats: EngineStats, readbacks: HostReadbacks | None = None) -> None:  # fmt: skip
        self.proposer = proposer
        self.readbacks = readbacks or HostReadbacks()  # the runner's: verification reads tokens back
        self.policy = policy
        self.needs_hidden = proposer.needs_hidden
        self.max_model_len = ctx.max_model_len
        self.eos_token_ids = ctx.eos_token_ids
        self.vocab_size = ctx.model_config.vocab_size
        self.stats = stats
        stats.spec_method = ctx.spec.method
        self._propose_seconds = 0.0
        self._step_start = self._forward_start = 0.0
        self._extra_rows: int | None = None
        self._verify_seconds = 0.0
        self._depth = 0  # the deepest chain verified this step (0: none)

    @classmethod
    def build(cls, ctx: ProposerContext, runner: ModelRunner, kv: KVCacheManager, max_num_seqs: int,
              stats: EngineStats) -> SpecDecoder:  # fmt: skip
        """The proposer `ctx.spec` names, and a policy priced by measuring what verifying
        drafts costs this target on this machine (`measure_verify_cost`, at start-up), or the
        fixed depth when `adaptive_depth` is off."""
        spec = ctx.spec
        proposer = build_proposer(ctx)
        k = spec.num_speculative_tokens
        leaves = (spec.draft_topk - 1) * k
        context = max(1, min(128, ctx.max_model_len - k - 1))
        if not spec.adaptive_depth:
            policy = FixedDepthPolicy(k, spec.disable_by_batch_size, leaf_width=spec.draft_topk - 1,
                                      ranked=proposer.ranks_drafts)  # fmt: skip
            return cls(proposer, policy, ctx, stats, runner.readbacks)
        cost, leaf_cost = measure_verify_cost(runner, kv, k, min(max_num_seqs, 64),
                                              ctx.model_config.vocab_size, context=context,
                                              leaves=leaves)  # fmt: skip
        policy = SpecPolicy(k, spec.disable_by_batch_size, cost, leaf_width=spec.draft_topk - 1,
                            leaf_cost=leaf_cost, ranked=proposer.ranks_drafts)  # fmt: skip
        return cls(proposer, policy, ctx, stats, runner.readbacks)

    # ---- before the step -----------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Drafts for the running decodes the policy lets speculate."""
        start = time.perf_counter()
        decoding = [s for s in running if s.num_uncomputed == 1 and s.num_output_tokens > 0]
        for seq in decoding:  # drafts of a step that had no room for them are stale
            seq.spec.clear()
        # Not speculating: grammar-constrained sequences (their masks are per position), seeded
        # sampling, whose promise is the same output whatever the batch — how many drafts a step
        # verifies depends on the batch, and so would the random draws — and LoRA requests (the
        # proposers draft for the base model).
        eligible = [s for s in decoding if s.matcher is None and not s.pending_forks
                    and s.generator is None and s.lora is None]  # fmt: skip
        ks = self.policy.depths(eligible, len(decoding))
        chosen, depths = [], []
        for seq, k in zip(eligible, ks):
            k = min(k, self.max_model_len - seq.num_tokens - 1)
            if k > 0:
                chosen.append(seq)
                depths.append(k)
        if chosen:
            policy, batch_size = self.policy, len(decoding)
            widths = policy.leaf_widths(chosen, depths, batch_size)
            self.proposer.propose(chosen, depths, widths,
                                  rows=lambda values: policy.verified_rows(values, batch_size))  # fmt: skip
        self._propose_seconds = time.perf_counter() - start

    def begin_step(self, out: SchedulerOutput) -> None:
        """The scheduled step's forward starts now."""
        self._step_start = time.perf_counter()
        # Only small batches' forwards re-measure F (inferd.spec.step_times): larger ones skip the
        # per-sequence look (their step still breaks a pair, as None).
        small = len(out.scheduled) <= STEP_TIMES_MAX_BATCH
        self._extra_rows = _uniform_extra_rows(out.scheduled) if small else None
        self._forward_start = time.perf_counter()

    def end_forward(self, out: SchedulerOutput) -> None:
        seconds = time.perf_counter() - self._forward_start
        self.policy.record_forward(len(out.scheduled), self._extra_rows, seconds)

    # ---- after the forward ---------------------------------------------------------------
    @torch.inference_mode()  # the step's hidden states are inference tensors
    def verify(self, logits: torch.Tensor, batch: StepBatch) -> list[SampledTokens]:
        """The verifying sequences' accepted drafts and the target's next token; records what
        the policy and the stats learn from them. An accepted draft-tree leaf's hidden state
        takes its displaced draft's row (what `observe` hands the proposer)."""
        start = time.perf_counter()
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for seq, count in zip(batch.sample_seqs, batch.sample_counts):
            if seq.spec.token_ids:
                rows.extend(range(row, row + count))
                seqs.append(seq)
            row += count
        self._depth = 0
        if not seqs:
            self._verify_seconds = 0.0
            return []
        if len(rows) != logits.shape[0]:  # plain decodes are in the batch too
            logits = logits[torch.tensor(rows, device=logits.device)]
        results = verify(logits, seqs, self.eos_token_ids, self.vocab_size, self.readbacks)
        sampled = []
        for seq, res in zip(seqs, results):
            if res.leaf is not None and batch.hidden is not None:
                row0, first_leaf = batch.leaf_rows[seq.seq_id]
                depth = seq.spec.leaves[res.leaf][0]
                batch.hidden[row0 + depth] = batch.hidden[first_leaf + res.leaf]
            if self.proposer.wants_row_argmax:
                self.proposer.verified(seq, res.row_argmax)
            self._record(seq, res.num_accepted, res.leaf is not None)
            sampled.append(SampledTokens(seq, res.token_ids, res.logprobs, res.num_accepted, res.leaf))
        self._depth = max(s.spec.depth for s in seqs)
        self._verify_seconds = time.perf_counter() - start
        return sampled

    def _record(self, seq: Sequence, num_accepted: int, leaf_accepted: bool) -> None:
        k, leaves = len(seq.spec.token_ids), len(seq.spec.leaves)
        if self.policy.leaf_width:  # a fixed draft tree: the leaves' hit rate kept apart
            self.policy.record(seq, k, num_accepted - leaf_accepted, seq.spec.leaves, leaf_accepted)
        else:  # a chain, or a dynamic tree in a chain's rows: what its rows accepted
            self.policy.record(seq, k + leaves, num_accepted, expected=seq.spec.expected)
        stats = self.stats
        stats.spec_num_drafts += 1
        stats.spec_draft_tokens += k + leaves
        stats.spec_accepted_tokens += num_accepted
        stats.spec_leaf_tokens += leaves
        stats.spec_accepted_leaves += leaf_accepted
        _count_positions(stats.spec_draft_tokens_per_position, k)
        _count_positions(stats.spec_accepted_per_position, num_accepted)  # a leaf at its depth

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.proposer.fork(parent, child)

    # ---- after the step ------------------------------------------------------------------
    def observe(self, out: SchedulerOutput, sampled: list[SampledTokens], batch: StepBatch) -> None:
        """Hand the proposer the hidden states of the positions each still-running sequence got
        this step (of a verification only the last real token and the accepted drafts), and the
        policy the step's own speculation time. Call after `scheduler.update_from_output`."""
        stats = self.stats
        for s in sampled:
            if s.num_accepted is not None:
                stats.spec_emitted_tokens += s.num_appended
        if self.needs_hidden:
            self._observe(out, sampled, batch.hidden)
        if self._depth:
            own = self._propose_seconds + self._verify_seconds  # beyond the forward
            self.policy.record_speculation_time(own, self._depth, time.perf_counter() - self._step_start)

    def _observe(self, out: SchedulerOutput, sampled: list[SampledTokens], hidden: torch.Tensor) -> None:
        forked: dict[int, list[Sequence]] = {}
        for s in sampled:
            if s.forked_from is not None:
                forked.setdefault(s.forked_from.seq_id, []).append(s.seq)
        seqs, firsts, rows = [], [], []
        row = 0
        for (seq, n), start in zip(out.scheduled, out.starts):
            done = min(n, seq.num_computed_tokens - start)
            # Children forked this step share the parent's prompt rows (each its own next token).
            for s in (seq, *forked.get(seq.seq_id, ())):
                if not s.is_finished and done > 0:
                    seqs.append(s)
                    firsts.append(start)
                    rows.append(hidden[row : row + done])
            row += n
        if seqs:
            self.proposer.observe(seqs, firsts, rows)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def check_no_leaks(self) -> None:
        self.proposer.check_no_leaks()


def _uniform_extra_rows(scheduled: list[tuple[Sequence, int]]) -> int | None:
    """Rows per sequence beyond its one when every scheduled sequence decodes (one token, or one
    and its drafts and draft-tree leaves) with as many; else None (the step is no F(j) sample)."""
    rows = None
    for seq, n in scheduled:
        if seq.num_output_tokens == 0 or n != 1 + len(seq.spec.token_ids):
            return None  # a prompt chunk, or a recomputation after preemption
        extra = n - 1 + len(seq.spec.leaves)
        if rows is not None and extra != rows:
            return None
        rows = extra
    return rows


def _count_positions(counts: list[int], n: int) -> None:
    """One more at each of the positions 0 .. n - 1, the list grown as needed."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
