"""Continuous batching under a token budget: which sequences run this step and with how many tokens.

Each step: running decodes first (one token each, or 1 + k when verifying k speculative draft
tokens; so a long prompt never starves them), then
running partial prefills, then waiting sequences by (priority, arrival). A prefill takes at most
what is left of the budget (chunked prefill), and next to decodes at most what the step's latency
budget allows (inferd.scheduler.step_budget: a step's predicted cost within a factor of the same
step without prefill). When the KV pool is full the lowest-priority running
sequence is preempted: its blocks are freed and it is recomputed later (prompt + what it generated),
which yields the same output as if it had never stopped.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from inferd.config import SchedulerConfig
from inferd.kv.connectors.base import KVConnectorBase, KVConnectorMetadata, NullConnector
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.sampling.sampler import TokenLogprob
from inferd.scheduler.sequence import Sequence, SequenceStatus
from inferd.scheduler.step_budget import StepBudget
from inferd.scheduler.step_cost import StepCost, attention_pairs
from inferd.scheduler.stop import StopCriteria


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work and everything the model runner needs to run it; the runner never sees
    the KV manager.

    - `scheduled[i] = (seq, n)`: `seq` computes positions [num_computed, num_computed + n) this
      step (a prompt chunk, a decode, or a verification of 1 + k with its drafts), in batch order;
    - `starts[i]`: its first position this step (its num_computed_tokens when scheduled);
    - `block_tables[i]`: its block table per KV cache group (each covers at least those
      positions; read-only; inferd/kv/kv_groups.py);
    - `scratch[seq_id]`: per group, the scratch blocks its draft-tree leaves are verified in;
    - `block_copies` / `slot_copies`: (src, dst) KV copies to apply before the forward pass
      (copy-on-write of shared blocks; accepted leaves moved out of last step's scratch blocks);
    - `kv_high_water`: blocks of the pool ever handed out (the runner pre-faults ahead of it);
    - `kv_connector_meta`: the KV connector's work for this step (loads, saves; None: none).
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    starts: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    scratch: dict[int, list[list[int]]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    slot_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_high_water: int = 0
    kv_connector_meta: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]], kv: KVCacheManager) -> SchedulerOutput:
        """A step of `scheduled`, whose slots `kv` has allocated, with what the runner needs of
        `kv` (its pending copies are taken: they run with this step)."""
        out = cls(scheduled)
        out.attach_kv(kv)
        return out

    def attach_kv(self, kv: KVCacheManager) -> None:
        self.starts = [seq.num_computed_tokens for seq, _ in self.scheduled]
        self.block_tables = [kv.tables(seq.seq_id) for seq, _ in self.scheduled]
        if kv.scratch:
            self.scratch = {seq.seq_id: kv.scratch[seq.seq_id] for seq, _ in self.scheduled
                            if seq.seq_id in kv.scratch}  # fmt: skip
        self.block_copies, self.slot_copies = kv.take_pending_copies()
        self.kv_high_water = kv.pool.high_water


@dataclass(slots=True)
class SampledTokens:
    """What sampling or verification produced for one sequence in a step."""

    seq: Sequence
    token_ids: list[int]  # one sampled token; or accepted drafts then the target's own token
    logprobs: list[TokenLogprob | None]
    num_accepted: int | None = None  # a verification: drafts accepted (an accepted leaf counts)
    leaf: int | None = None  # a verification: index of the accepted draft-tree leaf
    forked_from: Sequence | None = None  # n > 1: a child sampling its first token off the parent
    num_appended: int = 0  # set by `update_from_output`: tokens kept (up to the one that stopped)


class Scheduler:
    """Owns the request states and the KV manager: nothing else allocates, frees or caches
    blocks. `schedule()` picks a step's work; `update_from_output()` applies what it produced."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, stop: StopCriteria | None = None,
                 cost: StepCost | None = None, clock: Callable[[], float] | None = None,
                 connector: KVConnectorBase | None = None, max_loras: int = 0) -> None:  # fmt: skip
        """`cost`: the step cost model the latency budget predicts with (default: learnt from the
        steps the engine times); `clock`: the clock of the sequences' arrival times (for the TTFT
        target); `connector`: the KV connector's scheduler side (inferd/kv/connectors/base.py);
        `max_loras`: the most LoRA adapters (`seq.lora`) running at once."""
        self.config = config
        self.kv = kv
        self.connector = connector or NullConnector(None, None)
        # Sequences whose external KV arrives asynchronously (admitted with their blocks, not yet
        # runnable), and finished ones whose blocks stay until the connector's send completes.
        self.loading: dict[int, Sequence] = {}
        self.sending: dict[int, Sequence] = {}
        self.external_hits_tokens = 0  # prompt tokens a connector supplied (within prefix_hits)
        self.stop = stop
        self.budget = StepBudget(config.max_step_latency_factor, config.ttft_slo_ms,
                                 min_chunk=kv.block_size, cost=cost, clock=clock)  # fmt: skip
        self.num_prompt_tokens_computed = 0  # prefill work, recomputation after preemption included
        self.num_generation_tokens = 0  # tokens appended to outputs
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits_tokens = 0  # ... and found there
        self.lpm_window = 16  # how far back cache-aware admission looks
        self.max_skips = 8  # bounded wait for a request passed over by cache-aware admission
        # seq_id → (prefix cache version, tokens it could serve) for waiting sequences: a lookup
        # walks the tree block by block, and its answer only changes when the tree does.
        self._cached_len_memo: dict[int, tuple[int, int]] = {}
        self.max_loras = max_loras

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running set directly: its prompt is already in the cache."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks; `reason`
        (e.g. "abort") is its finish reason unless it has one."""
        if reason is not None and seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._cached_len_memo.pop(seq.seq_id, None)
        self.loading.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        tables = self.kv.tables(seq.seq_id) if seq.seq_id in self.kv.block_tables else []
        keep, seq.kv_transfer_params = self.connector.request_finished(seq, tables)
        if keep:
            self.sending[seq.seq_id] = seq  # freed once the connector reports the send done
        else:
            self.kv.free(seq.seq_id)

    def finish_kv_transfers(self, sent: set[int], received: set[int],
                            failed: set[int] = frozenset()) -> tuple[list[SampledTokens], list[Sequence]]:  # fmt: skip
        """The connector's completed asynchronous transfers (`get_finished`, `get_failed_loads`):
        free the blocks of finished sequences whose send is done; sequences whose KV arrived wait
        to run, after the tokens the sending engine already sampled for them (PD's first token,
        `remote_output_tokens`) are appended as if sampled here; sequences whose load failed give
        their blocks back and are computed here from their local prefix hit. Returns the tokens
        so appended, and the sequences they finished."""
        for seq_id in sent:
            if self.sending.pop(seq_id, None) is not None:
                self.kv.free(seq_id)
        for seq_id in failed:
            seq = self.loading.pop(seq_id, None)
            if seq is not None:
                self.kv.free(seq_id)
                seq.num_computed_tokens = 0
                self.add(seq)
        appended: list[SampledTokens] = []
        finished: list[Sequence] = []
        for seq_id in received:
            seq = self.loading.pop(seq_id, None)
            if seq is None:
                continue
            tokens = self.connector.remote_output_tokens(seq_id)
            if tokens:
                s = SampledTokens(seq, tokens, [None] * len(tokens))
                for token in tokens:
                    self.stop.append(seq, token)
                    s.num_appended += 1
                    if seq.finish_reason is not None:
                        break
                self.num_generation_tokens += s.num_appended
                appended.append(s)
                if seq.finish_reason is not None:
                    self.finish(seq)
                    finished.append(seq)
                    continue
            self.add(seq)
        return appended, finished

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if seq.spec.token_ids:  # a decode verifying its drafts: 1 + k tokens, drafts cut to fit
            n = min(1 + len(seq.spec.token_ids), budget)
            seq.spec.trim(n - 1)
            if len(seq.spec.leaves) > budget - n:  # a tree's leaves take rows of the budget too
                seq.spec.leaves = seq.spec.leaves[: budget - n]
            return n
        n = min(seq.num_uncomputed, budget)
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _prefill_room(self, num_decodes: int) -> int:
        """Prefill tokens this step may still add next to `num_decodes` scheduled decodes."""
        cap = self.config.prefill_chunk_with_decodes
        if num_decodes == 0 or cap == 0:
            return self.config.max_num_batched_tokens
        return max(cap, num_decodes)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.spec.clear()
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes before partial prefills; within each, priority then arrival.
        order = sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.sort_key))
        scheduled_ids: set[int] = set()
        num_decodes = 0
        decode_rows, decode_pairs = 0, 0.0  # the decodes' work, for the latency budget
        prefill_room: int | None = None  # fixed once the decodes are placed
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            is_prefill = seq.num_uncomputed > 1 and not seq.spec.token_ids
            if is_prefill and prefill_room is None:
                prefill_room = self._prefill_room(num_decodes)
                self.budget.open(decode_rows, decode_pairs)
            room = min(budget, prefill_room) if is_prefill else budget
            n = self._chunk(seq, room) if room > 0 else 0
            if is_prefill:
                n = self.budget.chunk(seq, n)
            if n == 0:
                continue  # nothing new to compute (its next token is not sampled yet), or no room
            while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, n):
                victim = self._pick_victim(seq, scheduled_ids)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                # Each leaf of a draft tree verifies in a scratch block of its own (freed once
                # verified). Leaves are optional: they never take the blocks another running
                # sequence may need this step (one per KV group, which would preempt someone);
                # then the chain alone is verified.
                leaves = len(seq.spec.leaves)
                keep = len(self.running) * self.kv.num_groups
                if leaves and not self.kv.allocate_scratch(seq.seq_id, leaves, keep=keep):
                    seq.spec.leaves = []
                out.scheduled.append((seq, n))
                scheduled_ids.add(seq.seq_id)
                budget -= n + len(seq.spec.leaves)
                if is_prefill:
                    self.budget.take(seq, n)
                    prefill_room -= n
                else:
                    num_decodes += 1
                    decode_rows += n + len(seq.spec.leaves)
                    decode_pairs += attention_pairs(seq.num_computed_tokens, n + len(seq.spec.leaves))
        if prefill_room is None:
            prefill_room = self._prefill_room(num_decodes)
            self.budget.open(decode_rows, decode_pairs)

        # Admit waiting sequences, unless this step already had to preempt (the pool is full).
        deferred: set[int] = set()  # seq_ids that wait for a prefix another sequence computes
        # Running sequences still computing their prompt: they may be computing blocks a waiting
        # sequence could reuse next step. (No preemption below: built once, grown on admission.)
        prefilling = [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]
        # LoRA adapters of the running sequences: at most max_loras (the step's slots). Once an
        # adapted sequence waits for a slot, no adapted sequence behind it is admitted (base ones
        # still are): running ones finish, an adapter leaves, and it takes the slot first.
        adapters = {id(s.lora) for s in self.running if s.lora is not None}
        lora_blocked = False
        while (
            len(self.waiting) > len(deferred)
            and min(budget, prefill_room) > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self._pick_waiting(deferred)
            if seq.lora is not None and (lora_blocked or (id(seq.lora) not in adapters
                                                          and len(adapters) >= self.max_loras)):  # fmt: skip
                lora_blocked = True
                deferred.add(seq.seq_id)
                continue
            if self._prefix_in_flight(seq, prefilling):
                deferred.add(seq.seq_id)  # wait for the running prefill to cache it, then reuse it
                continue
            if seq.seq_id in self.kv.block_tables:  # its external KV arrived (`finish_kv_transfers`)
                cached, external = seq.num_computed_tokens, 0
            else:
                # Reuse the longest cached prefix, then what the connector holds beyond it: only
                # the rest is computed.
                cached = self.kv.attach_cached_prefix(seq.seq_id, seq.token_ids, seq.params.cache_salt)
                seq.num_computed_tokens = cached
                external, load_async = self.connector.get_num_new_matched_tokens(seq, cached)
                if external and load_async:  # wait for it outside the queue, holding its blocks
                    if self.kv.allocate_slots(seq.seq_id, cached, external):
                        self.connector.update_state_after_alloc(seq, self.kv.tables(seq.seq_id), external)
                        seq.num_computed_tokens = cached + external
                        if seq.num_preemptions == 0:
                            seq.num_cached_tokens = cached  # its own hit; the rest came from outside
                        self.waiting.remove(seq)
                        self._cached_len_memo.pop(seq.seq_id, None)
                        self.loading[seq.seq_id] = seq
                        continue
                    external = 0  # no room to receive it: compute it
                seq.num_computed_tokens = cached + external
            n = self.budget.chunk(seq, self._chunk(seq, min(budget, prefill_room)))
            if n == 0:  # the latency budget is spent: admit it next step
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            if not self.kv.allocate_slots(seq.seq_id, cached, external + n):
                self.kv.free(seq.seq_id)  # give the cached prefix back; retry in a later step
                seq.num_computed_tokens = 0
                break
            if external:  # loaded before this step's forward (the connector's start_load_kv)
                seq.num_computed_tokens = cached
                self.connector.update_state_after_alloc(seq, self.kv.tables(seq.seq_id), external)
                seq.num_computed_tokens = cached = cached + external
                self.external_hits_tokens += external
            self.prefix_queries_tokens += seq.num_tokens
            self.prefix_hits_tokens += cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.waiting.remove(seq)
            self._cached_len_memo.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora is not None:
                adapters.add(id(seq.lora))
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prefilling.append(seq)
            out.scheduled.append((seq, n))
            self.budget.take(seq, n)
            budget -= n
            prefill_room -= n
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.attach_kv(self.kv)
        if out.scheduled:  # else no forward runs: what is pending waits for the next step's
            out.kv_connector_meta = self.connector.build_connector_meta()
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledTokens]) -> list[Sequence]:
        """Apply a step's results: advance each scheduled sequence past what it computed, register
        forked children, append the sampled and verified tokens (each stopped at the first that
        ends it), roll back the KV of rejected drafts, offer completed blocks to the prefix
        cache, free finished sequences. Returns the sequences that finished."""
        for seq, n in out.scheduled:
            if seq.spec.token_ids:
                continue  # a verification: advanced below, once the accepted drafts are known
            if n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += n  # a prompt chunk or a recomputation
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.params.cache_salt
            )
        for s in sampled:
            if s.forked_from is not None:  # shares every block of its parent's prompt
                s.seq.num_computed_tokens = s.forked_from.num_computed_tokens
                self.kv.fork(s.forked_from.seq_id, s.seq.seq_id)
                self.add_running(s.seq)
        finished: list[Sequence] = []
        for s in sampled:
            seq = s.seq
            if s.num_accepted is not None:
                if s.leaf is not None:  # the leaf's K/V takes the place of the draft it displaced
                    pos = seq.num_computed_tokens + seq.spec.leaves[s.leaf][0]
                    self.kv.move_slot(seq.seq_id, s.leaf, pos)
                self.kv.free_scratch(seq.seq_id)
                # The last real token and the accepted drafts now have K/V.
                seq.num_computed_tokens += 1 + s.num_accepted
            for token in s.token_ids:
                self.stop.append(seq, token)
                s.num_appended += 1
                if seq.finish_reason is not None:
                    break
            self.num_generation_tokens += s.num_appended
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
            elif s.num_accepted is not None:
                self.kv.truncate(seq.seq_id, seq.num_computed_tokens)  # rejected drafts' K/V
                self.kv.cache_computed_blocks(
                    seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.params.cache_salt
                )
            if s.num_accepted is not None:
                seq.spec.clear()
        return finished

    def reset_prefix_cache(self) -> bool:
        """Flush the prefix cache (blocks in use by running requests stay); True if now empty."""
        return self.kv.reset_prefix_cache()

    def _cached_prefix_len(self, seq: Sequence) -> int:
        """Tokens of a waiting `seq` the prefix cache could serve now, looked up once per change
        of the tree (not once per candidate per admission: that was O(waiting × prompt blocks)
        for every sequence admitted)."""
        version = self.kv.prefix_cache.version
        memo = self._cached_len_memo.get(seq.seq_id)
        if memo is None or memo[0] != version:
            memo = (version, self.kv.cached_prefix_len(seq.token_ids, seq.params.cache_salt))
            self._cached_len_memo[seq.seq_id] = memo
        return memo[1]

    def _prefix_in_flight(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """True when a running sequence is still prefilling blocks `seq` could reuse beyond what the
        cache already has. Admitting `seq` now would compute the same prefix twice; a step or a few
        later it is served from the cache instead."""
        if not self.kv.prefix_cache.enabled or not prefilling:
            return False
        bs = self.kv.block_size
        cached = self._cached_prefix_len(seq) // bs  # blocks the cache serves now
        limit = (seq.num_tokens - 1) // bs  # blocks seq could ever take from the cache
        # `other` shares more than the cache holds iff their first cached + 1 blocks agree (and
        # that many blocks lie within both prompts). Block `cached` alone first: where a common
        # prefix is cached, that is where sequences part, so the full comparison rarely runs.
        end = (cached + 1) * bs
        tokens = seq.token_ids
        for other in prefilling:
            if cached >= min(limit, other.num_prompt_tokens // bs):
                continue
            if other.params.cache_salt != seq.params.cache_salt:
                continue  # another tenant's blocks: never shared
            theirs = other.token_ids
            if theirs[end - bs : end] == tokens[end - bs : end] and theirs[:end] == tokens[:end]:
                return True
        return False

    def _pick_waiting(self, deferred: set[int]) -> Sequence:
        """The next waiting sequence to admit: the head of the queue, unless a request of the same
        priority a little further back has a longer cached prefix (SGLang's longest-prefix-match,
        which keeps the hot prefix in cache). A head passed over `max_skips` times goes first, so
        nobody starves."""
        waiting = self.waiting
        if deferred:
            waiting = [s for s in waiting if s.seq_id not in deferred]
        head = waiting[0]
        if not self.kv.prefix_cache.enabled or len(waiting) == 1 or head.num_skips >= self.max_skips:
            return head
        window = [s for s in waiting[: self.lpm_window] if s.priority == head.priority]
        # Longest cached prefix; among equals, the earliest in the queue.
        best_i = max(range(len(window)), key=lambda i: (self._cached_prefix_len(window[i]), -i))
        for s in window[:best_i]:
            s.num_skips += 1
        return window[best_i]

    def _pick_victim(self, seq: Sequence, scheduled_ids: set[int]) -> Sequence:
        """The lowest-priority, latest running sequence not already scheduled; else `seq` itself."""
        candidates = [s for s in self.running if s is not seq and s.seq_id not in scheduled_ids]
        if not candidates:
            return seq
        return max(candidates, key=lambda s: s.sort_key)
