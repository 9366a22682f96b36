"""EngineCore: the synchronous step loop.

    step():  spec.propose ─► scheduler.schedule ─► runner.execute ─► sample / spec.verify
             ─► scheduler.update_from_output ─► spec.observe ─► outputs (text deltas, metrics)

The scheduler owns the requests' sequences and the KV manager; the runner owns the model and the
KV tensors; `SpecDecoder` owns speculation. The core holds one `Request` record per request and
the glue between the stages. It knows nothing about HTTP or asyncio: `LLM` drives it for offline
batches and `AsyncEngine` runs it on a thread or in a process of its own for servers.
"""

from __future__ import annotations

import copy
import logging
import numbers
import threading
import time
import weakref

import torch

from inferd.config import EngineConfig, resolve_device, resolve_dtype
from inferd.distributed.executor import TensorParallelExecutor, check_placement
from inferd.distributed.shard import check_tensor_parallel, shard_config
from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.memory_plan import (
    MemoryPlan,
    estimate_activation_bytes,
    plan_kv_memory,
    profile_activation_bytes,
    profile_blocks,
)
from inferd.engine.model_runner import ModelRunner, StepBatch
from inferd.engine.outputs import RequestMetrics, RequestOutput, SequenceDelta
from inferd.engine.request import Request, RequestError
from inferd.engine.stats import EngineStats, StatsLogger
from inferd.host_to_device import upload
from inferd.kv.connectors.factory import connector_class, make_connector
from inferd.kv.connectors.layout import KVBlockLayout, model_fingerprint
from inferd.kv.kv_cache import describe as describe_kv_cache
from inferd.kv.kv_cache import kv_bytes_per_token
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.kv.kv_events import make_publisher
from inferd.kv.kv_groups import KVLayout
from inferd.loader import LoadedModel, ModelLoadError, load_model
from inferd.lora.adapter import LoRAError
from inferd.lora.manager import LoRAManager, NoLoRA
from inferd.lora.request import LoRARequest
from inferd.models import build_model, model_spec
from inferd.quantization.policy import describe as describe_quantization
from inferd.quantization.policy import resident_weight_bytes, weight_bytes_by_mode
from inferd.sampling.params import SamplingParams
from inferd.sampling.sampler import Sampler, TokenLogprob, skip_draws
from inferd.scheduler.scheduler import SampledTokens, Scheduler, SchedulerOutput
from inferd.scheduler.sequence import Logprob, Sequence
from inferd.scheduler.step_budget import step_shape
from inferd.scheduler.stop import StopCriteria
from inferd.spec.decoder import NoSpecDecoder, SpecDecoder
from inferd.spec.proposer import ProposerContext
from inferd.structured.backend import GrammarError
from inferd.structured.manager import StructuredOutputManager

__all__ = ["EngineCore", "RequestError"]

logger = logging.getLogger("inferd.engine")

# While nothing runs but KV transfers (a load into blocks a request waits on, a send holding
# blocks): how often the engine asks the connector whether they are done (seconds).
KV_POLL_S = 0.005


def _warn_without_cpu_kernels(device: torch.device) -> None:
    """A CPU engine whose kernels failed to build runs the PyTorch path: same outputs, ~3x slower
    decoding (fp32 chat 15 against ~50 tok/s). The build's own line on stderr is easy to miss in a
    server's log, so the engine says it too, as a warning, whatever `verbose`."""
    from inferd.kernels.build import cpu_supports_avx2_fma
    from inferd.kernels.quant_gemm import extension

    if device.type == "cpu" and cpu_supports_avx2_fma() and extension() is None:
        logger.warning("inferd's CPU kernels are not loaded (their build failed: see the line above "
                       "on stderr); running the PyTorch path, several times slower")  # fmt: skip


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
        # What KV transfers must agree on (inferd/kv/connectors/layout.py): hashed from the
        # weights as loaded, before the runner repacks any of them.
        fingerprint = ""
        if config.kv_transfer.connector_name is not None:
            if config.parallel.tensor_parallel_size > 1:  # each rank would need its worker side
                raise ValueError("a KV connector (--kv-transfer-config, --kv-offload-*) with "
                                 "--tensor-parallel-size > 1 is not supported")  # fmt: skip
            fingerprint = model_fingerprint(mcfg, loaded.weights,
                                            f"{self.dtype} {config.quantization} {loaded.file_type}")  # fmt: skip

        block_size = config.cache.block_size
        kv_cache_dtype = config.cache.kv_cache_dtype
        # KV cache groups: a block holds one group's layers (inferd/kv/kv_groups.py).
        layout = KVLayout.of(model_spec(mcfg), hybrid=not config.cache.disable_hybrid_kv_cache_manager)
        if layout.num_groups > 1 and not connector_class(config.kv_transfer).supports_kv_groups:
            logger.warning("%s moves one KV cache group: this sliding-window model keeps every "
                           "token's KV in its window layers too (as --disable-hybrid-kv-cache-manager)",
                           config.kv_transfer.connector_name)  # fmt: skip
            layout = KVLayout.of(model_spec(mcfg), hybrid=False)
        tp = config.parallel.tensor_parallel_size
        if tp > 1 and config.lora.enable_lora:
            raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not supported")
        if tp > 1:  # before anything is built: heads or vocabulary that do not split
            check_tensor_parallel(mcfg, tp)
            check_placement(tp, self.device, config.parallel.distributed_executor_backend)
            if config.speculative is not None and config.speculative.method in ("eagle", "medusa"):
                raise ValueError("--tensor-parallel-size > 1 with a learned draft head is not supported "
                                 "(the head reads the target's whole LM head)")  # fmt: skip
        # Per rank: each tensor-parallel rank's pool holds its KV heads of every block.
        bytes_per_block = (kv_bytes_per_token(shard_config(mcfg, tp), self.dtype, kv_cache_dtype) * layout.group_size
                           // mcfg.num_layers * block_size)  # fmt: skip
        # The model first, then the pool from what is left (inferd/engine/memory_plan.py). The
        # rotary tables cover the longest context asked for; cut to the plan's below.
        wanted = config.scheduler.max_model_len
        sched = config.scheduler
        self._model_positions = wanted or mcfg.max_position_embeddings  # the RoPE tables' length
        self.tp_executor: TensorParallelExecutor | None = None
        if tp > 1:
            # The ranks build their pools as they start, so the plan comes first: from the weights
            # still to load (every rank's slice, on this one host) and estimated activations, each
            # block counted once per rank (each holds its KV heads of every block).
            self.weight_bytes = weight_bytes_by_mode(loaded.weights, mcfg.tie_word_embeddings)[config.quantization]
            self._draft_loaded = self._load_draft()
            num_tokens = sched.max_num_batched_tokens
            self.memory_plan = plan_kv_memory(
                config.cache, self.device, weight_bytes=self.weight_bytes, to_load_bytes=self.weight_bytes,
                activation_bytes=estimate_activation_bytes(mcfg, self.dtype, num_tokens,
                                                           min(sched.max_num_seqs, num_tokens)),
                activation_source="estimated", bytes_per_block=bytes_per_block * tp)  # fmt: skip
            num_blocks = self.memory_plan.num_blocks
            self.max_model_len = self._max_model_len(layout, num_blocks, block_size)
            try:
                self.tp_executor = TensorParallelExecutor(
                    config, mcfg, loaded.weights, num_blocks, block_size, layout,
                    self.max_model_len, self.dtype, self.device)  # fmt: skip
            except (KeyError, ValueError) as e:  # a tensor missing or misshapen: the file is at fault
                raise ModelLoadError(f"{loaded.source}: {e.args[0] if e.args else e}") from e
            # Workers outlive nothing: an engine dropped without close() stops them too.
            self._finalizer = weakref.finalize(self, self.tp_executor.close)
            self.runner = self.tp_executor.runner
            model = self.runner.model
        else:
            try:
                model = build_model(mcfg, loaded.weights, max_positions=self._model_positions,
                                    dtype=self.dtype, device=self.device,
                                    quantization=config.quantization,
                                    quantization_group_size=config.quantization_group_size)  # fmt: skip
            except (KeyError, ValueError) as e:  # a tensor missing or misshapen: the file is at fault
                raise ModelLoadError(f"{loaded.source}: {e.args[0] if e.args else e}") from e
            profiling = self.device.type == "cuda" and config.cache.kv_cache_memory is None
            first_blocks = (profile_blocks(sched.max_num_batched_tokens, sched.max_num_seqs, block_size,
                                           layout.num_groups, self._model_positions) if profiling else 1)  # fmt: skip
            self.runner = ModelRunner(model, mcfg, first_blocks, block_size, self.dtype, self.device,
                                      kv_cache_dtype=kv_cache_dtype,
                                      kv_cache_prefault=config.cache.kv_cache_prefault,
                                      layout=layout)  # fmt: skip
            self.weight_bytes = resident_weight_bytes(model)
            self._draft_loaded = self._load_draft()
            self.memory_plan = self._plan_memory(bytes_per_block, layout, profiling)
            num_blocks = self.memory_plan.num_blocks
            self.runner.resize_kv(num_blocks)
            self.max_model_len = self._max_model_len(layout, num_blocks, block_size)
            if self.max_model_len != self._model_positions:
                model.set_rotary(self.max_model_len, loaded.weights.get("rope_freq_factors"), self.device)
        self.lora = NoLoRA()
        if config.lora.enable_lora:  # adapters' slots next to the model (docs/lora.md)
            self.lora = LoRAManager(config.lora, model, mcfg, self.device)
        self.kv_events = make_publisher(config.cache.kv_events_endpoint, block_size)
        # One connector serves both sides here: the scheduler's and the runner's (its worker side).
        self.kv_block_layout = KVBlockLayout.of(fingerprint, mcfg, layout, block_size, kv_cache_dtype, self.dtype)
        self.connector = make_connector(config.kv_transfer, self.kv_block_layout)
        self.runner.set_connector(self.connector)
        kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, layout,
                            self.kv_events, self.connector)  # fmt: skip
        self.scheduler = Scheduler(config.scheduler, kv, StopCriteria(self.eos_token_ids, self.max_model_len),
                                   clock=lambda: self.clock(), connector=self.connector,
                                   max_loras=self.lora.max_loras)  # fmt: skip
        self._finished_seq_ids: list[int] = []  # last step's, for the connector's get_finished
        self.sampler = Sampler(mcfg.vocab_size, self.eos_token_ids, self.runner.readbacks)
        self.requests: dict[str, Request] = {}
        # The clock of request metrics (arrival, first token, finish). A benchmark on a machine
        # shared with other jobs may set time.process_time (one thread) to time work, not waits.
        self.clock = time.monotonic
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self.stats_logger = StatsLogger(config.log_stats_interval)
        self._structured: StructuredOutputManager | None = None  # built on first use (~0.3 s)
        self._structured_lock = threading.Lock()
        self.spec: NoSpecDecoder = NoSpecDecoder()
        if config.speculative is not None:
            self.spec = SpecDecoder.build(self._proposer_context(), self.runner, kv,
                                          config.scheduler.max_num_seqs, self.stats)  # fmt: skip
        self._draft_loaded = None  # the proposer holds what it kept of it
        if self.device.type == "cuda" and self.tp_executor is None:
            # Decode-only steps padded to buckets over persistent inputs, replayed as CUDA graphs
            # unless --enforce-eager (inferd/engine/cuda_graphs.py): after the plan and any
            # calibration, with no block in use.
            self.runner.enable_decode_buckets(sched.max_num_seqs, self.max_model_len,
                                              cuda_graphs=not config.enforce_eager)  # fmt: skip
        _warn_without_cpu_kernels(self.device)
        if verbose:
            logger.info("memory plan: %s", self.memory_plan.describe())
            if self.runner.graphs is not None:
                logger.info("%s", self.runner.graphs.describe())
            logger.info("weights: %.1f MiB resident (--quantization %s: %s)", self.weight_bytes / 2**20,
                        config.quantization, describe_quantization(model))  # fmt: skip
            logger.info("KV cache: %d blocks, %d tokens (%.1f MiB, %s; %s)", num_blocks,
                        num_blocks * block_size * layout.group_size // mcfg.num_layers,
                        num_blocks * bytes_per_block / 2**20, describe_kv_cache(kv_cache_dtype, self.dtype),
                        layout.describe())  # fmt: skip

    def _max_model_len(self, layout: KVLayout, num_blocks: int, block_size: int) -> int:
        """--max-model-len, or the longest sequence the model and the pool hold (windowed groups
        hold their window and a step's queries only); ValueError where the pool is too small."""
        wanted, mcfg = self.config.scheduler.max_model_len, self.model_config
        limit = max(mcfg.max_position_embeddings, wanted or 0)
        capacity = layout.max_tokens(num_blocks, block_size, self.config.scheduler.max_num_batched_tokens, limit)
        if wanted is not None and wanted > capacity:
            raise ValueError(
                f"--max-model-len {wanted} needs more KV cache than the pool holds ({capacity} "
                "tokens); raise --kv-cache-memory or --gpu-memory-utilization, or lower "
                "--max-model-len"
            )
        return wanted or min(mcfg.max_position_embeddings, capacity)

    def _load_draft(self) -> LoadedModel | None:
        """A draft model's weights, loaded before the plan so that it counts them and its pool."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        return load_model(spec.model, verbose=False, quantization=spec.quantization or self.config.quantization)

    def _plan_memory(self, bytes_per_block: int, layout: KVLayout, profiling: bool) -> MemoryPlan:
        """The KV pool's size from what the loaded weights left (`plan_kv_memory`)."""
        sched, mcfg = self.config.scheduler, self.model_config
        num_tokens, num_seqs = sched.max_num_batched_tokens, min(sched.max_num_seqs, sched.max_num_batched_tokens)
        released = 0
        if profiling:
            activations = profile_activation_bytes(self.runner, num_tokens, num_seqs, mcfg.vocab_size,
                                                   self._model_positions)  # fmt: skip
            released = self.runner.kv_cache.nbytes
            source = "profiled"
        else:
            activations = estimate_activation_bytes(mcfg, self.dtype, num_tokens, num_seqs)
            source = "estimated"
        draft_per_block = draft_weights = 0
        if self._draft_loaded is not None:
            spec, draft = self.config.speculative, self._draft_loaded
            mode = spec.quantization or self.config.quantization
            draft_weights = weight_bytes_by_mode(draft.weights, draft.config.tie_word_embeddings)[mode]
            if mode == "none":  # counted as fp32 there
                draft_weights = draft_weights * self.dtype.itemsize // 4
            # The draft's pool: as many tokens as the target's blocks of every layer hold.
            draft_per_block = (kv_bytes_per_token(draft.config, self.dtype) * self.config.cache.block_size
                               // layout.num_groups)  # fmt: skip
        return plan_kv_memory(self.config.cache, self.device, weight_bytes=self.weight_bytes,
                              activation_bytes=activations, activation_source=source,
                              bytes_per_block=bytes_per_block, draft_bytes_per_block=draft_per_block,
                              draft_weight_bytes=draft_weights, released_bytes=released)  # fmt: skip

    def _proposer_context(self) -> ProposerContext:
        c = self.config
        return ProposerContext(
            spec=c.speculative, target=self.runner.model, model_config=self.model_config,
            tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len, dtype=self.dtype, device=self.device,
            quantization=c.quantization, quantization_group_size=c.quantization_group_size,
            # In blocks of every layer (a draft model's pool holds as many tokens as the target's
            # would without KV cache groups).
            num_kv_blocks=max(1, self.kv.pool.num_blocks // self.kv.layout.num_groups),
            block_size=self.kv.block_size,
            enable_prefix_caching=c.cache.enable_prefix_caching,
            draft_loaded=self._draft_loaded,
        )  # fmt: skip

    @property
    def kv(self) -> KVCacheManager:
        """The scheduler's KV manager, for inspection (stats, tests); only the scheduler changes it."""
        return self.scheduler.kv

    @property
    def proposer(self):
        return self.spec.proposer

    @property
    def spec_policy(self):
        return self.spec.policy

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. `prompt_token_ids`, when the caller already tokenized `prompt`
        (with `validate`), saves tokenizing it twice. `lora_request` (or `params.lora_request`):
        the adapter it runs under."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids = self.validate(prompt_token_ids if prompt_token_ids is not None else prompt, params)
        lora = None
        if lora_request is not None or params.lora_request is not None:
            try:
                lora = self.lora.resolve(lora_request or params.lora_request)
            except LoRAError as e:
                raise RequestError(str(e)) from e
            # Its KV is the adapter's: cached under this load only, never shared with the base
            # model, another adapter or another load of the same name.
            params = copy.copy(params)
            params.cache_salt = f"{params.cache_salt}|{lora.cache_salt}" if params.cache_salt else lora.cache_salt
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
            detok=IncrementalDetokenizer(self.tokenizer, params, token_ids),
            lora=lora,
        )
        prompt_text = prompt if isinstance(prompt, str) else None
        request = Request(request_id, prompt_text, list(token_ids), params, RequestMetrics(arrival_time=now))
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed + index)
        return gen

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and forget it; its blocks return to the pool now.
        False if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.spec.release(seq)
        return True

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV connector (the engine runs no more
        steps). A KV tier first receives every cached block no request holds: what a restart
        finds there. Idempotent."""
        if self.connector.wants_evicted_blocks and not self.scheduler.num_unfinished:
            self.reset_prefix_cache()  # evicts into the tier
            self.runner.connector.start_load_kv(self.scheduler.connector.build_connector_meta())
        self.connector.shutdown()
        if self.tp_executor is not None:
            self._finalizer()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_runnable_requests(self) -> bool:
        """Requests a step can advance now (not only ones waiting for their KV to load)."""
        return self.scheduler.num_unfinished > len(self.scheduler.loading)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[SequenceDelta]:
        """One ragged batch: propose → schedule → execute → sample/verify → update → outputs.
        Returns the text and token deltas of every sequence that got tokens."""
        self.spec.propose(self.scheduler.running)
        start = time.perf_counter()
        done = self.connector.get_finished(self._finished_seq_ids)
        self._finished_seq_ids = []
        arrived = self._arrived(*self.scheduler.finish_kv_transfers(*done, self.connector.get_failed_loads()))
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.loading:  # asynchronous loads wait to start, and no forward will
                self.runner.connector.start_load_kv(self.connector.build_connector_meta())
            self._refresh_stats()
            return arrived
        shape = step_shape(out.scheduled, out.starts)  # before the step moves the sequences on
        self.spec.begin_step(out)
        masks = self._grammar_masks(out)
        if self.lora.enabled:
            self.lora.activate(seq.lora for seq, _ in out.scheduled if seq.lora is not None)
        logits, _, batch = self.runner.execute(out, all_hidden=self.spec.needs_hidden)
        self.spec.end_forward(out)
        sampled = self._sample(logits, batch, masks) + self.spec.verify(logits, batch)
        finished = self.scheduler.update_from_output(out, sampled)
        self._finished_seq_ids += [seq.seq_id for seq in finished]
        self.spec.observe(out, sampled, batch)
        deltas = arrived + self._outputs(sampled, finished)
        # The step as its streams feel it, scheduling to outputs: what the latency budget bounds.
        self.scheduler.budget.record(shape, time.perf_counter() - start)
        self._refresh_stats()
        self.stats_logger.maybe_log(self.stats)
        return deltas

    def _arrived(self, appended: list[SampledTokens], finished: list[Sequence]) -> list[SequenceDelta]:
        """Deltas of the tokens another engine sampled for sequences whose KV arrived (PD's first
        token); a seeded sequence's generator skips the draws they took there."""
        if not appended:
            return []
        for s in appended:
            if s.seq.generator is not None:
                skip_draws(s.seq.generator, s.num_appended)
        self._finished_seq_ids += [seq.seq_id for seq in finished]
        return self._outputs(appended, finished)

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a KV send (PD's prefill side): freed by a later `step`."""
        return bool(self.scheduler.sending) or self.connector.has_pending_sends()

    def _grammar_masks(self, out: SchedulerOutput):
        """Start filling the grammar masks of the sequences that sample one token this step (they
        are filled while the forward runs; sequences with grammars never speculate)."""
        if self._structured is None:
            return None
        will_sample = [s.matcher for s, n in out.scheduled
                       if s.num_computed_tokens + n == s.num_tokens and not s.spec.token_ids]  # fmt: skip
        if not any(m is not None for m in will_sample):
            return None
        return self._structured.fill_async(will_sample)

    def _sample(self, logits: torch.Tensor, batch: StepBatch, masks) -> list[SampledTokens]:  # fmt: skip
        """One token for each sequence that samples plainly (decodes, ends of prefills); a
        request's n > 1 children are forked here and sample their first token off its row."""
        rows: list[int] = []  # logits rows of the sequences sampling one token
        seqs: list[Sequence] = []
        row = 0
        for seq, count in zip(batch.sample_seqs, batch.sample_counts):
            if not seq.spec.token_ids:
                rows.append(row)
                seqs.append(seq)
            row += count
        if not seqs:
            return []
        if len(rows) != logits.shape[0]:  # verification rows are in the batch too
            logits = logits[upload(rows, logits.device)]
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        parents: list[Sequence | None] = []
        for r, seq in enumerate(seqs):
            sample_rows.append(r)
            sample_seqs.append(seq)
            parents.append(None)
            for child in self._fork(seq) if seq.pending_forks else ():
                sample_rows.append(r)
                sample_seqs.append(child)
                parents.append(seq)
        bitmask = masks.result() if masks is not None else None
        if bitmask is not None and len(seqs) != bitmask.shape[0]:  # never expected
            bitmask = self.structured.fill([s.matcher for s in seqs])
        result = self.sampler(logits, sample_rows, sample_seqs, bitmask)
        return [SampledTokens(seq, [tok], [lp], forked_from=parent)
                for seq, tok, lp, parent in zip(sample_seqs, result.token_ids, result.logprobs, parents)]  # fmt: skip

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the parent's children, each with its own generator, text and draft state; the
        scheduler gives them the parent's prompt blocks when it applies the step."""
        request = self.requests[parent.request_id]
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = parent.fork(index, self._generator(parent.params, index))
            child.detok = IncrementalDetokenizer(
                self.tokenizer, parent.params, parent.token_ids[: parent.num_prompt_tokens]
            )
            request.seqs.append(child)
            self.spec.fork(parent, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _outputs(self, sampled: list[SampledTokens], finished: list[Sequence]) -> list[SequenceDelta]:
        """The step's deltas; logprobs and request metrics of the tokens kept."""
        for seq in finished:
            self.spec.release(seq)
        now = self.clock()
        deltas = []
        for s in sampled:
            seq = s.seq
            request = self.requests[seq.request_id]
            n = s.num_appended
            new_logprobs = self._add_logprobs(seq, s.token_ids[:n], s.logprobs[:n])
            done = seq.finish_reason is not None
            metrics = request.metrics
            if done and metrics.finished_time is None and request.finished:
                self.stats.requests_finished_total += 1
                metrics.finished_time = now
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens
            deltas.append(SequenceDelta(
                request_id=seq.request_id,
                index=seq.index,
                new_token_ids=s.token_ids[:n],
                text_delta=seq.detok.delta(done),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                new_logprobs=new_logprobs,
            ))  # fmt: skip
        return deltas

    def _add_logprobs(self, seq: Sequence, tokens: list[int],
                      logprobs: list[TokenLogprob | None]) -> list[dict[int, Logprob]]:  # fmt: skip
        if seq.logprobs is None:
            return []
        entries = []
        for token, logprob in zip(tokens, logprobs):
            if logprob is not None:
                entry = self._logprob_entry(token, *logprob)
                seq.logprobs.append(entry)
                seq.cumulative_logprob += logprob[0]
                entries.append(entry)
        return entries

    def _logprob_entry(self, token: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry = {tid: Logprob(val, r + 1, decode([tid], skip_special_tokens=False))
                 for r, (tid, val) in enumerate(top)}  # fmt: skip
        if token not in entry:
            entry = {token: Logprob(lp, rank, decode([token], skip_special_tokens=False)), **entry}
        return entry

    def _refresh_stats(self) -> None:
        s, sched = self.stats, self.scheduler
        s.num_running = len(sched.running)
        s.num_waiting = len(sched.waiting)
        s.num_preemptions_total = sched.num_preemptions
        s.prompt_tokens_total = sched.num_prompt_tokens_computed
        s.generation_tokens_total = sched.num_generation_tokens
        s.num_free_blocks = self.kv.pool.num_free
        s.kv_cache_usage = self.kv.pool.usage()
        s.prefix_cache_queries_total = sched.prefix_queries_tokens
        s.prefix_cache_hits_total = sched.prefix_hits_tokens
        s.num_cached_blocks = self.kv.prefix_cache.num_nodes
        s.kv_events_dropped_total = getattr(self.kv_events, "dropped", 0)
        s.kv_connector = self.connector.stats()
        s.kv_connector_histograms = self.connector.histograms()
        budget = sched.budget
        s.step_budget_capped_steps_total = budget.num_capped_steps
        s.step_budget_ttft_rescues_total = budget.num_slo_rescues
        cost = budget.cost.coefficients()
        s.step_cost_ms = () if cost is None else tuple(1000 * c for c in cost)

    def get_stats(self) -> EngineStats:
        self._refresh_stats()
        self.stats_logger.update_rates(self.stats, force=False)
        return self.stats

    # ---- results --------------------------------------------------------------------------
    def request_output(self, request_id: str) -> RequestOutput:
        return self.requests[request_id].output()

    def pop_finished(self, request_id: str) -> RequestOutput:
        """The final output of a finished request; forgets the request."""
        return self.requests.pop(request_id).output()

    def reset_prefix_cache(self) -> bool:
        """Flush the prefix cache (blocks in use by running requests stay); True if now empty."""
        return self.scheduler.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """The invariant tests pin: with no request in flight, every block is free or held by the
        prefix cache alone, and flushing the cache leaves the pool entirely free."""
        kv = self.kv
        kv.check_integrity()
        sched = self.scheduler
        assert not sched.running and not sched.waiting and not sched.loading and not sched.sending
        assert not kv.block_tables, f"block tables left: {list(kv.block_tables)}"
        cached = set(kv.prefix_cache.blocks())
        for b, rc in enumerate(kv.pool.ref_counts):
            assert rc == 0 or (rc == 1 and b in cached), f"block {b}: ref {rc}, cached {b in cached}"
        self.spec.check_no_leaks()
        assert self.reset_prefix_cache(), "prefix cache could not be flushed"
        assert kv.pool.num_free == kv.pool.num_blocks, f"{kv.pool.num_blocks - kv.pool.num_free} KV blocks leaked"
