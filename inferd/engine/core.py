"""EngineCore: the synchronous step loop. schedule → forward → sample → detokenize/stop.

It knows nothing about HTTP or asyncio; `LLM` drives it for offline batches and `AsyncEngine`
runs it in a thread for servers.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch

from inferd.config import EngineConfig, resolve_device, resolve_dtype
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.model_runner import ModelRunner, StepBatch
from inferd.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SequenceDelta
from inferd.engine.stats import EngineStats, StatsLogger
from inferd.kv.kv_cache import describe as describe_kv_cache
from inferd.kv.kv_cache import kv_bytes_per_token
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.loader import LoadedModel, ModelLoadError, load_model
from inferd.models import build_model
from inferd.quantization.policy import describe as describe_quantization
from inferd.quantization.policy import resident_weight_bytes
from inferd.sampling.params import SamplingParams
from inferd.sampling.rejection import Verified, verify
from inferd.sampling.sampler import Sampler, TokenLogprob
from inferd.scheduler.scheduler import Scheduler
from inferd.scheduler.sequence import Logprob, Sequence
from inferd.spec.calibrate import measure_verify_cost
from inferd.spec.policy import SpecPolicy
from inferd.spec.proposer import build_proposer
from inferd.spec.step_times import MAX_BATCH as STEP_TIMES_MAX_BATCH
from inferd.structured.backend import GrammarError
from inferd.structured.manager import StructuredOutputManager

logger = logging.getLogger("inferd.engine")


def _uniform_extra_rows(scheduled: list[tuple[Sequence, int]]) -> int | None:
    """Rows per sequence beyond its one when every scheduled sequence decodes (one token, or one
    and its drafts and draft-tree leaves) with as many; else None (the step is no F(j) sample)."""
    rows = None
    for seq, n in scheduled:
        if seq.num_output_tokens == 0 or n != 1 + len(seq.spec_token_ids):
            return None  # a prompt chunk, or a recomputation after preemption
        extra = n - 1 + len(seq.spec_leaves)
        if rows is not None and extra != rows:
            return None
        rows = extra
    return rows


def _warn_without_cpu_kernels(device: torch.device) -> None:
    """A CPU engine whose kernels failed to build runs the PyTorch path: same outputs, ~3x slower
    decoding (fp32 chat 15 against ~50 tok/s). The build's own line on stderr is easy to miss in a
    server's log, so the engine says it too, as a warning, whatever `verbose`."""
    from inferd.kernels.build import cpu_supports_avx2_fma
    from inferd.kernels.quant_gemm import extension

    if device.type == "cpu" and cpu_supports_avx2_fma() and extension() is None:
        logger.warning("inferd's CPU kernels are not loaded (their build failed: see the line above "
                       "on stderr); running the PyTorch path, several times slower")  # fmt: skip


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad parameters); other requests are unaffected."""


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)  # by output index
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)  # by seq_id

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


def _kv_num_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    cache = config.cache
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1.0 - cache.gpu_memory_utilization))
    else:
        # The machine's available memory is shared with everything else: take a fraction, capped.
        available = psutil.virtual_memory().available
        budget = min(int(available * cache.gpu_memory_utilization * 0.5), cache.max_auto_kv_cache_memory)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is smaller than one block ({bytes_per_block} bytes)"
        )
    return num_blocks


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, verbose: bool = True) -> None:
        self.config = config
        loaded = loaded or load_model(config.model, verbose=verbose, quantization=config.quantization)
        self.model_config = mcfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.source = loaded.source
        self.file_type = loaded.file_type
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu" and self.dtype != torch.float32:
            logger.warning("--dtype %s on the CPU: inferd's CPU kernels (the fused decode step, the "
                           "int8 tiles, paged attention) take fp32, so decoding runs on slower "
                           "per-layer ATen ops; --dtype auto (fp32) decodes faster",
                           str(self.dtype).removeprefix("torch."))  # fmt: skip
        torch.manual_seed(config.seed)

        block_size = config.cache.block_size
        kv_cache_dtype = config.cache.kv_cache_dtype
        bytes_per_block = kv_bytes_per_token(mcfg, self.dtype, kv_cache_dtype) * block_size
        num_blocks = _kv_num_blocks(config, bytes_per_block, self.device)
        capacity = num_blocks * block_size
        wanted = config.scheduler.max_model_len
        if wanted is not None and wanted > capacity:
            raise ValueError(
                f"--max-model-len {wanted} needs more KV cache than the pool holds ({capacity} "
                "tokens); raise --kv-cache-memory or lower --max-model-len"
            )
        self.max_model_len = wanted or min(mcfg.max_position_embeddings, capacity)
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        try:
            model = build_model(mcfg, loaded.weights, max_positions=self.max_model_len,
                                dtype=self.dtype, device=self.device,
                                quantization=config.quantization,
                                quantization_group_size=config.quantization_group_size)  # fmt: skip
        except (KeyError, ValueError) as e:  # a tensor missing or misshapen: the file is at fault
            raise ModelLoadError(f"{loaded.source}: {e.args[0] if e.args else e}") from e
        self.runner = ModelRunner(model, mcfg, self.kv, self.dtype, self.device, kv_cache_dtype=kv_cache_dtype,
                                  kv_cache_prefault=config.cache.kv_cache_prefault)  # fmt: skip
        self.sampler = Sampler(mcfg.vocab_size, self.eos_token_ids)
        self.requests: dict[str, _RequestState] = {}
        # The clock of request metrics (arrival, first token, finish). A benchmark on a machine
        # shared with other jobs may set time.process_time (one thread) to time work, not waits.
        self.clock = time.monotonic
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self.stats_logger = StatsLogger(config.log_stats_interval)
        self.weight_bytes = resident_weight_bytes(model)
        self._structured: StructuredOutputManager | None = None  # built on first use (~0.3 s)
        self._structured_lock = threading.Lock()
        self.proposer = build_proposer(self)
        self._forked: dict[int, list[Sequence]] = {}  # a step's n > 1 children, by parent
        self.spec_policy: SpecPolicy | None = None
        if self.proposer is not None:
            spec = config.speculative
            k = spec.num_speculative_tokens
            leaves = (spec.draft_topk - 1) * k
            context = max(1, min(128, self.max_model_len - k - 1))
            cost, leaf_cost = measure_verify_cost(self.runner, k, min(config.scheduler.max_num_seqs, 64),
                                                  mcfg.vocab_size, context=context, leaves=leaves)  # fmt: skip
            self.spec_policy = SpecPolicy(k, spec.disable_by_batch_size, cost, leaf_width=spec.draft_topk - 1,
                                          leaf_cost=leaf_cost,
                                          ranked=self.proposer.ranks_drafts)  # fmt: skip
            self.stats.spec_method = spec.method
        _warn_without_cpu_kernels(self.device)
        if verbose:
            logger.info("weights: %.1f MiB resident (--quantization %s: %s)", self.weight_bytes / 2**20,
                        config.quantization, describe_quantization(model))  # fmt: skip
            logger.info("KV cache: %d blocks, %d tokens (%.1f MiB, %s)", num_blocks, capacity,
                        num_blocks * bytes_per_block / 2**20, describe_kv_cache(kv_cache_dtype, self.dtype))  # fmt: skip

    # ---- requests -------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((*self.model_config.eos_token_ids, *self.tokenizer.eos_token_ids)))

    @property
    def structured(self) -> StructuredOutputManager:
        """Grammar compilation and masks; thread-safe (the async front compiles through it)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(
                    self.tokenizer.hf.to_str(), self.model_config.vocab_size, self.eos_token_ids,
                    self.config.structured_output_timeout,
                )  # fmt: skip
            return self._structured

    def prepare_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (blocking the caller) so adding it is a cache hit;
        raises RequestError naming the problem (bad schema, unsupported feature, timeout)."""
        if params.structured is not None:
            try:
                self.structured.prepare(params.structured)
            except GrammarError as e:
                raise RequestError(str(e)) from e

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request; raises RequestError naming the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        # `type(t) is int` first: the ABC check alone costs ~2 ms per 1,000 tokens.
        elif isinstance(prompt, (list, tuple)) and all(type(t) is int or (isinstance(t, numbers.Integral) and not isinstance(t, bool)) for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy / torch integers welcome
        else:
            raise RequestError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} is out of range (vocab size {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt is {len(token_ids)} tokens, {len(token_ids) - self.max_model_len + 1} "
                f"over the limit: max_model_len is {self.max_model_len} and at least one token "
                "must be generated"
            )
        try:
            params.check_vocab(vocab)
        except ValueError as e:
            raise RequestError(str(e)) from e
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. `prompt_token_ids`, when the caller already tokenized `prompt`
        (with `validate`), saves tokenizing it twice."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids = self.validate(prompt_token_ids if prompt_token_ids is not None else prompt, params)
        now = arrival_time if arrival_time is not None else self.clock()
        matcher = None
        if params.structured is not None:
            try:  # a cache hit when the caller prepared it off the loop (AsyncEngine, LLM)
                matcher = self.structured.matcher(params.structured)
            except GrammarError as e:
                raise RequestError(str(e)) from e
        seq = Sequence(
            request_id=request_id,
            index=0,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            params=params,
            priority=priority,
            arrival_time=now,
            generator=self._generator(params, 0),
            pending_forks=params.n - 1,
            logprobs=[] if params.logprobs is not None else None,
            matcher=matcher,
        )
        state = _RequestState(request_id, prompt if isinstance(prompt, str) else None, list(token_ids),
                              params, RequestMetrics(arrival_time=now))  # fmt: skip
        state.seqs.append(seq)
        state.detoks[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.requests[request_id] = state
        self.scheduler.add(seq)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed + index)
        return gen

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks return to the pool now. False if unknown."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        propose_seconds = self._propose()
        out = self.scheduler.schedule()
        if out.is_empty:
            self._refresh_stats()
            return []
        step_start = time.perf_counter()
        # Grammar masks of the sequences that sample one token this step, filled while the
        # forward runs (sequences with grammars never speculate).
        will_sample = [s for s, n in out.scheduled
                       if s.num_computed_tokens + n == s.num_tokens and not s.spec_token_ids]  # fmt: skip
        masks = None
        if self._structured is not None and any(s.matcher is not None for s in will_sample):
            masks = self._structured.fill_async([s.matcher for s in will_sample])
        self._forked = {}
        observing = self.proposer is not None and self.proposer.needs_hidden
        # Each scheduled sequence's first position this step (its rows follow in order).
        starts = [seq.num_computed_tokens for seq, _ in out.scheduled] if observing else None
        # Only small batches' forwards re-measure F (inferd.spec.step_times): larger ones skip the
        # per-sequence look (their step still breaks a pair, as None).
        timed = self.spec_policy is not None and len(out.scheduled) <= STEP_TIMES_MAX_BATCH
        extra_rows = _uniform_extra_rows(out.scheduled) if timed else None
        forward_start = time.perf_counter()
        logits, hidden, batch = self.runner.execute(out, all_hidden=observing)
        if self.spec_policy is not None:
            self.spec_policy.record_forward(len(out.scheduled), extra_rows, time.perf_counter() - forward_start)
        for seq, n in out.scheduled:
            if seq.spec_token_ids:
                continue  # a verification: advanced below, once the accepted drafts are known
            # Prefill work (prompt, or recomputation after preemption) vs. a plain decode step.
            is_prefill = n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens
            self.stats.prompt_tokens_total += n if is_prefill else 0
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

        # Rows of the logits: each sampling sequence owns sample_counts[i] consecutive ones.
        plain_rows: list[int] = []  # logits rows of sequences sampling one token
        plain_seqs: list[Sequence] = []
        spec_rows: list[int] = []
        spec_seqs: list[Sequence] = []
        row = 0
        for seq, count in zip(batch.sample_seqs, batch.sample_counts):
            if seq.spec_token_ids:
                spec_rows.extend(range(row, row + count))
                spec_seqs.append(seq)
            else:
                plain_rows.append(row)
                plain_seqs.append(seq)
            row += count
        now_deltas = self._sample_plain(logits, plain_rows, plain_seqs, batch, will_sample, masks)
        verify_start = time.perf_counter()
        deltas = now_deltas + self._verify(logits, spec_rows, spec_seqs, batch)
        verify_seconds = time.perf_counter() - verify_start
        if starts is not None:
            self._observe(out.scheduled, starts, batch.hidden)
        if self.spec_policy is not None and spec_seqs:
            depth = max(s.spec_depth for s in spec_seqs)
            step_seconds = time.perf_counter() - step_start
            own = propose_seconds + verify_seconds  # speculation's own work beyond the forward
            self.spec_policy.record_speculation_time(own, depth, step_seconds)
        for seq in spec_seqs:
            seq.set_drafts([])
        self._refresh_stats()
        self.stats_logger.maybe_log(self.stats)
        return deltas

    def _sample_plain(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], batch,
                      will_sample: list[Sequence], masks) -> list[SequenceDelta]:  # fmt: skip
        """Sequences that sample one token (decodes, ends of prefills; forks of n > 1 here)."""
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:  # verification rows are in the batch too
            logits = logits[torch.tensor(rows, device=logits.device)]
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for r, seq in enumerate(seqs):
            sample_rows.append(r)
            sample_seqs.append(seq)
            if seq.pending_forks:
                for child in self._fork(seq):
                    sample_rows.append(r)
                    sample_seqs.append(child)
        bitmask = masks.result() if masks is not None else None
        if bitmask is not None and seqs != will_sample:  # never expected
            bitmask = self.structured.fill([s.matcher for s in seqs])
        result = self.sampler(logits, sample_rows, sample_seqs, bitmask)
        now = self.clock()
        self.stats.generation_tokens_total += len(sample_seqs)
        deltas = [self._append_tokens(seq, [tok], [lp], now)
                  for seq, tok, lp in zip(sample_seqs, result.token_ids, result.logprobs)]  # fmt: skip
        return deltas

    def _verify(
        self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], batch: StepBatch
    ) -> list[SequenceDelta]:
        """Sequences that verified draft tokens: keep the accepted ones plus the target's next
        token, and roll the KV of the rejected ones back."""
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:  # plain decodes are in the batch too
            logits = logits[torch.tensor(rows, device=logits.device)]
        results = verify(logits, seqs, self.eos_token_ids, self.model_config.vocab_size)
        self._take_leaves(seqs, results, batch)
        now = self.clock()
        deltas: list[SequenceDelta] = []
        stats = self.stats
        for seq, res in zip(seqs, results):
            k = len(seq.spec_token_ids)
            # The last real token and the accepted drafts now have K/V; the rest is rolled back.
            seq.num_computed_tokens += 1 + res.num_accepted
            if self.spec_policy.leaf_width:  # a fixed draft tree: the leaves' hit rate kept apart
                chain = res.num_accepted - (res.leaf is not None)
                self.spec_policy.record(seq, k, chain, seq.spec_leaves, res.leaf is not None)
            else:  # a chain, or a dynamic tree in a chain's rows: what its rows accepted
                rows = k + len(seq.spec_leaves)
                self.spec_policy.record(seq, rows, res.num_accepted, expected=seq.spec_expected)
            stats.spec_num_drafts += 1
            stats.spec_draft_tokens += k + len(seq.spec_leaves)
            stats.spec_accepted_tokens += res.num_accepted
            stats.spec_leaf_tokens += len(seq.spec_leaves)
            stats.spec_accepted_leaves += res.leaf is not None
            _count_positions(stats.spec_draft_tokens_per_position, k)
            # (an accepted leaf counts at its depth)
            _count_positions(stats.spec_accepted_per_position, res.num_accepted)
            delta = self._append_tokens(seq, res.token_ids, res.logprobs, now)
            stats.spec_emitted_tokens += len(delta.new_token_ids)
            stats.generation_tokens_total += len(delta.new_token_ids)
            deltas.append(delta)
            if not seq.is_finished:
                self.kv.truncate(seq.seq_id, seq.num_computed_tokens)
                self.kv.cache_computed_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return deltas

    @torch.inference_mode()  # the step's hidden states are inference tensors
    def _take_leaves(self, seqs: list[Sequence], results: list[Verified], batch: StepBatch) -> None:
        """An accepted draft-tree leaf takes the place of the draft it displaced: its K/V moves
        from its scratch block to its position in the sequence's blocks, and its hidden state
        into that draft's row (what `_observe` hands the proposer). Every scratch block is freed."""
        src, dst = [], []
        for seq, res in zip(seqs, results):
            if res.leaf is None:
                continue
            depth = seq.spec_leaves[res.leaf][0]
            pos = seq.num_computed_tokens + depth
            bs = self.kv.block_size
            src.append(self.kv.scratch[seq.seq_id][res.leaf] * bs + pos % bs)
            dst.append(self.kv.slot(seq.seq_id, pos))
            if batch.hidden is not None:
                row0, first_leaf = batch.leaf_rows[seq.seq_id]
                batch.hidden[row0 + depth] = batch.hidden[first_leaf + res.leaf]
        if src:
            as_tensor = self.runner.as_tensor
            self.runner.kv_cache.copy_slots(as_tensor(src), as_tensor(dst))
        for seq in seqs:
            if seq.spec_leaves:
                self.kv.free_scratch(seq.seq_id)

    def _observe(self, scheduled: list[tuple[Sequence, int]], starts: list[int], hidden: torch.Tensor) -> None:
        """Hand the proposer the hidden states of the positions each still-running sequence got
        this step: all its rows, but of a verification only the last real token and the accepted
        drafts (num_computed_tokens has moved past exactly those)."""
        seqs, firsts, rows = [], [], []
        row = 0
        for (seq, n), start in zip(scheduled, starts):
            done = min(n, seq.num_computed_tokens - start)
            # Children forked this step share the parent's prompt rows (each its own next token).
            for s in (seq, *self._forked.get(seq.seq_id, ())):
                if not s.is_finished and done > 0:
                    seqs.append(s)
                    firsts.append(start)
                    rows.append(hidden[row : row + done])
            row += n
        if seqs:
            self.proposer.observe(seqs, firsts, rows)

    def _propose(self) -> float:
        """Ask the proposer for drafts for the running decodes the policy lets speculate;
        returns the seconds it took."""
        if self.proposer is None:
            return 0.0
        start = time.perf_counter()
        decoding = [s for s in self.scheduler.running
                    if s.num_uncomputed == 1 and s.num_output_tokens > 0]  # fmt: skip
        for seq in decoding:  # drafts of a step that had no room for them are stale
            seq.set_drafts([])
        # Not speculating: grammar-constrained sequences (their masks are per position), and
        # seeded sampling, whose promise is the same output whatever the batch — how many drafts
        # a step verifies depends on the batch, and so would the random draws.
        eligible = [s for s in decoding if s.matcher is None and not s.pending_forks and s.generator is None]
        ks = self.spec_policy.depths(eligible, len(decoding))
        chosen, depths = [], []
        for seq, k in zip(eligible, ks):
            k = min(k, self.max_model_len - seq.num_tokens - 1)
            if k > 0:
                chosen.append(seq)
                depths.append(k)
        if chosen:
            policy, batch_size = self.spec_policy, len(decoding)
            widths = policy.leaf_widths(chosen, depths, batch_size)
            self.proposer.propose(chosen, depths, widths,
                                  rows=lambda values: policy.verified_rows(values, batch_size))
        return time.perf_counter() - start

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: children share the parent's prompt blocks and sample their own first token."""
        state = self.requests[parent.request_id]
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = parent.fork(index, self._generator(parent.params, index))
            self.kv.fork(parent.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            state.seqs.append(child)
            state.detoks[child.seq_id] = IncrementalDetokenizer(self.tokenizer, parent.params)
            children.append(child)
            if self.proposer is not None:
                self.proposer.fork(parent, child)
        parent.pending_forks = 0
        self._forked[parent.seq_id] = children
        return children

    def _append_tokens(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
    ) -> SequenceDelta:
        """Append the step's tokens one by one (several after a verification), stopping at the
        first that ends the sequence; the rest are dropped. One delta for all of them."""
        state = self.requests[seq.request_id]
        detok = state.detoks[seq.seq_id]
        appended: list[int] = []
        new_logprobs: list[dict[int, Logprob]] = []
        for token, logprob in zip(tokens, logprobs):
            appended.append(token)
            self._append_one(state, seq, detok, token, logprob, new_logprobs)
            if seq.finish_reason is not None:
                break
        if seq.finish_reason is not None:
            self._finish(seq)
            self.stats.requests_finished_total += state.finished
            if state.finished:
                state.metrics.finished_time = now
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            state.metrics.num_cached_tokens = seq.num_cached_tokens
        return SequenceDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=appended,
            text_delta=detok.delta(seq.finish_reason is not None),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            new_logprobs=new_logprobs,
        )

    def _append_one(self, state: _RequestState, seq: Sequence, detok: IncrementalDetokenizer,
                    token: int, logprob: TokenLogprob | None, new_logprobs: list) -> None:  # fmt: skip
        p = seq.params
        seq.token_ids.append(token)
        if logprob is not None and seq.logprobs is not None:
            entry = self._logprob_entry(token, *logprob)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += logprob[0]
            new_logprobs.append(entry)
        stop_str = detok.add_token(token)
        grammar_done = seq.matcher is not None and seq.matcher.advance(token)
        can_stop = seq.num_output_tokens >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif can_stop and p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif can_stop and stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif grammar_done:  # the grammar is complete: nothing but EOS could follow
            seq.finish_reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _logprob_entry(self, token: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry = {tid: Logprob(val, r + 1, decode([tid], skip_special_tokens=False))
                 for r, (tid, val) in enumerate(top)}  # fmt: skip
        if token not in entry:
            entry = {token: Logprob(lp, rank, decode([token], skip_special_tokens=False)), **entry}
        return entry

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_preemptions_total = self.scheduler.num_preemptions
        s.num_free_blocks = self.kv.pool.num_free
        s.kv_cache_usage = self.kv.pool.usage()
        s.prefix_cache_queries_total = self.scheduler.prefix_queries_tokens
        s.prefix_cache_hits_total = self.scheduler.prefix_hits_tokens
        s.num_cached_blocks = self.kv.prefix_cache.num_nodes

    def get_stats(self) -> EngineStats:
        self._refresh_stats()
        self.stats_logger.update_rates(self.stats, force=False)
        return self.stats

    # ---- results --------------------------------------------------------------------------
    def request_output(self, request_id: str) -> RequestOutput:
        state = self.requests[request_id]
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=state.detoks[seq.seq_id].text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in sorted(state.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, outputs,
                             state.finished, state.metrics)  # fmt: skip

    def pop_finished(self, request_id: str) -> RequestOutput:
        """The final output of a finished request; forgets the request."""
        output = self.request_output(request_id)
        del self.requests[request_id]
        return output

    def reset_prefix_cache(self) -> bool:
        """Flush the prefix cache (blocks in use by running requests stay); True if now empty."""
        return self.kv.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """The invariant tests pin: with no request in flight, every block is free or held by the
        prefix cache alone, and flushing the cache leaves the pool entirely free."""
        self.kv.check_integrity()
        assert not self.scheduler.running and not self.scheduler.waiting
        assert not self.kv.block_tables, f"block tables left: {list(self.kv.block_tables)}"
        cached = set(self.kv.prefix_cache.blocks())
        for b, rc in enumerate(self.kv.pool.ref_counts):
            assert rc == 0 or (rc == 1 and b in cached), f"block {b}: ref {rc}, cached {b in cached}"
        if self.proposer is not None:
            self.proposer.check_no_leaks()
        assert self.reset_prefix_cache(), "prefix cache could not be flushed"
        assert self.kv.pool.num_free == self.kv.pool.num_blocks, (
            f"{self.kv.pool.num_blocks - self.kv.pool.num_free} KV blocks leaked"
        )


def _count_positions(counts: list[int], n: int) -> None:
    """One more at each of the positions 0 .. n - 1, the list grown as needed."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
