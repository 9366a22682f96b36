"""One frozen dataclass per concern, validated once at the edge and passed everywhere.

The field defaults here are the engine's defaults, written once: the CLI flags
(inferd/engine_args.py) and `LLM(...)` take theirs from these fields (`field_default`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# --dtype (EngineConfig also takes torch's aliases "half" and "float").
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --quantization: inferd/quantization/policy.py says what each keeps.
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4", "fp8")
# --quantization-group-size: int4 / fp8 weights per scale (and min).
QUANTIZATION_GROUP_SIZES = (32, 64, 128)


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (a fresh one where the field has a factory);
    TypeError where the field has none or `cls` has no such field."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise TypeError(f"{cls.__name__}.{name} has no default")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names of a layer's attention kind


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder, read from GGUF or config.json. What each layer
    computes follows from these and the family (inferd/models/spec.py)."""

    architecture: str  # e.g. "llama", "qwen2", "mistral", "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    hidden_act: str = "silu"  # HF's name: silu, gelu_pytorch_tanh
    # Keys a sliding-window layer's query sees, itself included; None: no layer has a window.
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention" (HF's `layer_types`); None: every layer
    # slides where `sliding_window` is set (Mistral, Phi-3), else none does.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # sliding layers' RoPE base where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None  # Gemma 2
    # Mixture of experts (0 experts: every layer's MLP is dense). Each MoE layer routes a token to
    # `num_experts_per_tok` of `num_experts` experts of `moe_intermediate_size`, their outputs
    # weighted by the router's softmax (renormalised over the chosen ones where `norm_topk_prob`);
    # Qwen2-MoE adds a shared expert behind a sigmoid gate.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # Per layer whether its MLP is the MoE one; None: every layer's is (where num_experts > 0).
    moe_layers: tuple[bool, ...] | None = None
    # DeepSeek's routing: the top `moe_topk_group` of `moe_n_group` expert groups (by their best
    # expert) first, the top k among their experts then; the chosen weights times
    # `routed_scaling_factor`. Its shared experts have no gate.
    moe_topk_method: str = "greedy"  # or "group_limited_greedy"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # Multi-head latent attention (DeepSeek-V2): each token's keys and values come from one
    # `kv_lora_rank` latent, and a `head_dim` rotary key shared by all heads; both are what the KV
    # cache holds. 0: ordinary attention. (head_dim is then the rotary part of a q / k head;
    # `qk_nope_head_dim` the rest, `v_head_dim` a value head; queries through a `q_lora_rank`
    # bottleneck where set.)
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            odd = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if odd:
                raise ValueError(f"unsupported layer types {odd} (supported: {', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but no sliding_window")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.num_experts_per_tok}")  # fmt: skip
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
            if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
                raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_layout(self) -> tuple[int, int, int]:
        """What the KV cache holds per token and layer: (planes, heads, head size). K and V: 2
        planes of `num_kv_heads` heads; MLA: one plane, one head of latent + rotary key (the
        values are the latent: the same plane serves as K and V)."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        return self.moe_layers is None or self.moe_layers[layer]

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind, resolved (`layer_types` or its default)."""
        if self.layer_types is not None:
            return self.layer_types
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return (kind,) * self.num_layers

    def num_parameters(self) -> int:
        return self._parameters(experts=self.num_experts)

    def num_active_parameters(self) -> int:
        """Parameters one token's forward pass reads: its routed experts only."""
        return self._parameters(experts=self.num_experts_per_tok)

    def _parameters(self, experts: int) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h + (q + 2 * kv if self.attention_bias else 0)
        if self.is_mla:
            qk = self.num_heads * (self.qk_nope_head_dim + self.head_dim)
            qproj = h * qk if not self.q_lora_rank else self.q_lora_rank * (h + qk + 1)
            attn = (qproj + h * (self.kv_lora_rank + self.head_dim) + self.kv_lora_rank
                    + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
                    + self.num_heads * self.v_head_dim * h + 2 * h)  # fmt: skip
        moe = (3 * h * self.moe_intermediate_size * experts + h * self.num_experts
               + (3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gated else 0)
                  if self.shared_expert_intermediate_size else 0))  # fmt: skip
        layers = sum(attn + (moe if self.is_moe_layer(n) else 3 * h * i) for n in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + layers + h + head

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        planes, heads, dim = self.kv_layout()
        return planes * self.num_layers * heads * dim * elem


# --kv-cache-dtype: auto (the model's dtype), a 2-byte float, or one byte per element + a scale.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Bytes of the target's KV pool; None: planned after load (inferd/engine/memory_plan.py).
    kv_cache_memory: int | None = None
    # Share of the GPU's total memory (the CPU's available memory) that weights, activations and
    # the KV pools may take together when kv_cache_memory is None.
    gpu_memory_utilization: float = 0.9
    # Upper bound for the automatic size on CPU, where "free memory" is the whole machine's.
    max_auto_kv_cache_memory: int = 4 << 30
    enable_prefix_caching: bool = True
    # Sliding-window layers give back the KV blocks that left their window (KV cache groups,
    # inferd/kv/kv_groups.py); True keeps every token of every layer, as a model without windows.
    disable_hybrid_kv_cache_manager: bool = False
    # One of KV_CACHE_DTYPES: see inferd/kv/kv_cache.py
    kv_cache_dtype: str = "auto"
    # Bytes of a lazily mapped CPU pool kept faulted in beyond the blocks handed out so far, on
    # idle CPU time (inferd/kv/prefault.py); 0: every page faults on its first write.
    kv_cache_prefault: int = 1 << 30
    # A ZMQ endpoint the engine binds to publish its prefix cache's BlockStored / BlockRemoved
    # events on (inferd/kv/kv_events.py), for a router's exact mode; None: no events.
    kv_events_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.kv_events_endpoint is not None and "://" not in self.kv_events_endpoint:
            raise ValueError(
                f"--kv-events-endpoint must be a ZMQ endpoint such as tcp://*:5557, got "
                f"{self.kv_events_endpoint!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_prefault < 0:
            raise ValueError(f"--kv-cache-prefault must be >= 0, got {self.kv_cache_prefault}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def _check_writable_dir(flag: str, path: str) -> None:
    """Create `path` if need be and check that files can be written there (ValueError if not):
    a tier that cannot write should stop the server at start-up, not warn once per block."""
    try:
        if not path.strip():
            raise OSError("an empty path")
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: not a writable directory ({e.strerror or e})") from None


# --kv-transfer-config's kv_role (vLLM's names): what a connector does with this engine's KV.
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Moving KV blocks out of the engine and back (inferd/kv/connectors, docs/kv-connectors.md):
    which connector, in which role, and the KV tier's places and sizes."""

    # A name in the connector registry (inferd/kv/connectors/registry.py); None: none, unless a
    # tier flag below is given (then the offloading connector).
    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # The KV tier: evicted prefix-cache blocks kept on disk under this directory (shared by
    # restarts and replicas) up to `kv_offload_size` bytes, and in host memory up to
    # `kv_offload_cpu` bytes (0: no host tier).
    kv_offload_dir: str | None = None
    kv_offload_size: int = 20 << 30
    kv_offload_cpu: int = 0

    def __post_init__(self) -> None:
        if self.kv_connector is not None:
            from inferd.kv.connectors.factory import connector_names  # the registry (no cycle)

            if self.kv_connector not in connector_names():
                raise ValueError(f"unknown kv_connector {self.kv_connector!r}; known: "
                                 f"{', '.join(connector_names())}")  # fmt: skip
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}; got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")  # noqa: TRY004
        if self.kv_offload_size <= 0:
            raise ValueError(f"--kv-offload-size must be positive, got {self.kv_offload_size}")
        if self.kv_offload_cpu < 0:
            raise ValueError(f"--kv-offload-cpu must be >= 0, got {self.kv_offload_cpu}")
        if self.kv_offload_dir is not None:
            _check_writable_dir("--kv-offload-dir", self.kv_offload_dir)

    @property
    def connector_name(self) -> str | None:
        """The connector to build: `kv_connector`, or the offloading one when a tier is asked for."""
        if self.kv_connector is not None:
            return self.kv_connector
        if self.kv_offload_dir is not None or self.kv_offload_cpu > 0:
            return "OffloadingConnector"
        return None

    @staticmethod
    def parse_json(text: str | dict | None) -> dict[str, Any]:
        """vLLM's --kv-transfer-config JSON → this dataclass's fields (ValueError naming the problem)."""
        if text is None:
            return {}
        cfg = text
        if isinstance(text, str):
            try:
                cfg = json.loads(text)
            except ValueError as e:
                raise ValueError(f"--kv-transfer-config is not JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")  # noqa: TRY004
        known = {f.name for f in dataclasses.fields(KVTransferConfig)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown keys {unknown}; known: {sorted(known)}")
        return dict(cfg)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # None: the model's context length (clamped to what the KV pool can hold).
    max_model_len: int | None = None
    # Largest prefill chunk one sequence may take in a step; None = the whole token budget.
    long_prefill_token_threshold: int | None = None
    # While decodes run, the prefill tokens a step adds are capped at max(this, number of decodes).
    # On a CPU a step costs about its token count, so a long prompt arriving in one chunk stalls
    # every running stream for many decode steps; chunked, decodes keep flowing. A larger cap lets
    # some steps carry a whole prompt (inter-token latency spikes); a smaller one makes prompts
    # wait far longer for their first token and lowers total throughput. At 128 nearly every step
    # carries one chunk, so inter-token latency stays even while prompts keep arriving.
    # 0: no cap (only max_num_batched_tokens).
    prefill_chunk_with_decodes: int = 128
    # While decodes run, a step takes only the prefill tokens that keep its predicted cost within
    # this many times the cost of the same step without them (inferd/scheduler/step_budget.py;
    # costs from a per-token model fitted to the engine's own step times). Each step still gives
    # a waiting prompt at least one KV block. inf: no such cap.
    max_step_latency_factor: float = 1.5
    # Milliseconds: a prompt whose first token would come later than this at the capped pace takes
    # its chunk uncapped. None: no target.
    ttft_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")
        if self.prefill_chunk_with_decodes < 0:
            raise ValueError(f"--prefill-chunk-with-decodes must be >= 0, got {self.prefill_chunk_with_decodes}")
        if not self.max_step_latency_factor >= 1.0:  # also refuses NaN
            raise ValueError(f"--max-step-latency-factor must be >= 1, got {self.max_step_latency_factor}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError(f"--ttft-slo-ms must be > 0, got {self.ttft_slo_ms}")


SPECULATIVE_METHODS = ("ngram", "suffix", "lookahead", "draft_model", "eagle", "medusa")
# k when `num_speculative_tokens` is not given: suffix decoding drafts as far as its match is sure
# (its own length rule), the others a short chain.
_DEFAULT_DEPTH = {"suffix": 16}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON shape): who proposes draft tokens and how many."""

    method: str  # ngram (prompt lookup) | suffix (shared suffix index) | lookahead | draft_model | eagle | medusa
    # The most draft tokens per sequence per step (k). None: 16 for suffix, lookahead's
    # window + ngram - 1, else 3.
    num_speculative_tokens: int | None = None
    model: str | None = None  # draft_model: GGUF / HF dir; eagle, medusa: the head's directory
    # ngram: the longest and shortest suffix matched against the context. A 1-token match (a
    # "the", a newline) predicts its continuation poorly: its rejected drafts cost verification
    # and drag the running acceptance rate (and so k) down for the good matches; on the bench's
    # transcripts min 2 drafted less and gained more than min 1 on every task.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int | None = None  # None: 2 (or prompt_lookup_max when that is 1)
    # Speculation stops while more than this many sequences decode. None: the engine measures at
    # start-up where verifying k tokens stops being nearly free and decides from the running
    # acceptance length.
    disable_by_batch_size: int | None = None
    # True: each sequence's depth is chosen per step from what verifying costs on this machine
    # (measured at start-up) and what its drafts have been worth (inferd.spec.policy). False:
    # every eligible sequence drafts num_speculative_tokens each step, as vLLM and SGLang do;
    # no start-up measurement.
    adaptive_depth: bool = True
    # draft_model only: its weights' --quantization (default: the target's).
    quantization: str | None = None
    # eagle and medusa: the head's top-`draft_topk` tokens at each depth are verified; the first
    # continues the chain, the others are leaves of a draft tree (greedy requests only). The
    # policy verifies leaves only while they pay for their rows (inferd.spec.policy).
    draft_topk: int = 1
    # eagle and medusa, greedy requests, draft_topk 1: a verification of k drafts spends its k rows on
    # the k nodes of the chain and the head's runner-up at each depth that the head finds likeliest
    # (EAGLE-2's dynamic tree; inferd.spec.draft_tree). False: always the chain.
    dynamic_tree: bool = True
    # suffix only (vLLM's names; inferd.spec.suffix): the longest match of a context's suffix
    # that is looked for, the most drafts per matched token, the least estimated probability of a
    # whole draft, and the shared index's bound (finished requests, and tokens in all).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 1 << 17
    # lookahead only (inferd.spec.lookahead): W, the Jacobi window's guesses verified after a
    # candidate; N, the n-gram size (a candidate is N - 1 drafts); G, the candidates kept per first
    # token. None: W = k - (N - 1) when k is given, else 3; N = 3; G = 4 (rows are dear on a
    # CPU: on chat, N = 3 with k = 5 accepted as much per verification as N = 4 with k = 7).
    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_guesses: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"--speculative-config: {msg}")

        if self.method not in SPECULATIVE_METHODS:
            bad(f"method must be one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        self._check_lookahead(bad)
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", _DEFAULT_DEPTH.get(self.method, 3))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            bad(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method in ("draft_model", "eagle", "medusa") and not self.model:
            bad(f'method "{self.method}" needs "model" (a path)')
        if self.method in ("ngram", "suffix", "lookahead") and self.model is not None:
            bad(f'method "{self.method}" takes no "model"')
        self._check_suffix(bad)
        if self.prompt_lookup_min is None and isinstance(self.prompt_lookup_max, int):
            object.__setattr__(self, "prompt_lookup_min", max(1, min(2, self.prompt_lookup_max)))
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo}, {hi}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            bad(f"disable_by_batch_size must be an integer >= 1, got {b!r}")
        t = self.draft_topk
        if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= 8:
            bad(f"draft_topk must be an integer in [1, 8], got {t!r}")
        if t > 1 and self.method not in ("eagle", "medusa"):
            bad(f'draft_topk > 1 needs method "eagle" or "medusa", got {self.method!r}')
        if not isinstance(self.adaptive_depth, bool):
            bad(f"adaptive_depth must be true or false, got {self.adaptive_depth!r}")
        if not isinstance(self.dynamic_tree, bool):
            bad(f"dynamic_tree must be true or false, got {self.dynamic_tree!r}")
        if self.quantization not in (None, "auto", "none", "int8", "int4", "fp8"):
            bad(f"quantization must be auto, none, int8, int4 or fp8; got {self.quantization!r}")

    def _check_lookahead(self, bad: Callable[[str], None]) -> None:
        """W, N and G validated and defaulted; k defaults to W + N - 1 (a candidate and the
        window in one chain)."""
        names = ("lookahead_window", "lookahead_ngram", "lookahead_guesses")
        given = [name for name in names if getattr(self, name) is not None]
        if self.method != "lookahead":
            if given:
                bad(f'{", ".join(given)}: only for method "lookahead", not {self.method!r}')
            return
        for name, lo, hi in zip(names, (1, 2, 1), (16, 8, 64)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
                bad(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
        n = self.lookahead_ngram or 3
        k = self.num_speculative_tokens
        if self.lookahead_window is None:
            w = 3 if not isinstance(k, int) or isinstance(k, bool) else max(1, k - (n - 1))
        else:
            w = self.lookahead_window
        if k is None:
            k = w + n - 1
            if k > 16:
                bad(f"lookahead_window + lookahead_ngram - 1 must be <= 16 (the drafts of a step), "
                    f"got {w} + {n} - 1")  # fmt: skip
            object.__setattr__(self, "num_speculative_tokens", k)
        elif isinstance(k, int) and not isinstance(k, bool) and 1 <= k < n - 1:
            bad(f"num_speculative_tokens ({k}) must be >= lookahead_ngram - 1 ({n - 1}): a "
                f"candidate n-gram is verified whole")  # fmt: skip
        object.__setattr__(self, "lookahead_window", w)
        object.__setattr__(self, "lookahead_ngram", n)
        object.__setattr__(self, "lookahead_guesses", self.lookahead_guesses or 4)

    def _check_suffix(self, bad: Callable[[str], None]) -> None:
        given = [f.name for f in dataclasses.fields(self) if f.name.startswith("suffix_decoding_")
                 and getattr(self, f.name) != f.default]  # fmt: skip
        if given and self.method != "suffix":
            bad(f'{", ".join(given)}: only for method "suffix", not {self.method!r}')

        def integer(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                bad(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

        integer("suffix_decoding_max_tree_depth", 2, 256)
        integer("suffix_decoding_max_cached_requests", 0, 1 << 30)
        integer("suffix_decoding_max_cached_tokens", 0, 1 << 30)
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 64:
            bad(f"suffix_decoding_max_spec_factor must be a number in (0, 64], got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            bad(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f'--speculative-config needs "method" ({", ".join(SPECULATIVE_METHODS)})')
        return cls(**value)


def _name_eq_path(module: str) -> str:
    """An adapter of --lora-modules as NAME=PATH; vLLM's JSON form '{"name": .., "path": ..}' too."""
    if not module.lstrip().startswith("{"):
        return module
    import json

    try:
        spec = json.loads(module)
        return f"{spec['name']}={spec['path']}"
    except (ValueError, KeyError, TypeError):
        raise ValueError(f'--lora-modules takes NAME=PATH or {{"name": .., "path": ..}}, got {module!r}') from None


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (inferd/lora, docs/lora.md), with vLLM's flags."""

    enable_lora: bool = False
    # NAME=PATH (PEFT adapter directories) registered at start; a request selects one by name.
    lora_modules: tuple[str, ...] = ()
    # Adapters a step may run at once (slots); a request whose adapter finds none free waits.
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept loaded in host memory (least recently used dropped); None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(_name_eq_path(m) for m in self.lora_modules or ()))
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return
        for flag, value in (("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"--max-cpu-loras must be an integer >= --max-loras ({self.max_loras}), got {cpu!r}")
        names = [m.partition("=")[0] for m in self.lora_modules]
        for module, name in zip(self.lora_modules, names):
            if not name or "=" not in module or not module.partition("=")[2]:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {module!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

    @property
    def modules(self) -> dict[str, str]:
        """--lora-modules as name -> path."""
        return dict(m.split("=", 1) for m in self.lora_modules)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# Ray's placement group strategies for a model's tensor-parallel ranks (one bundle per rank).
RAY_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How one model spans processes (inferd/distributed, docs/scale-out.md)."""

    # Ranks that each hold a slice of every layer (heads, MLP rows, vocabulary); rank 0 schedules.
    tensor_parallel_size: int = 1
    # How ranks and replicas start: "mp" = processes on this host (spawned); "ray" = Ray actors
    # (tensor-parallel ranks, and `serve --data-parallel-size` replicas) on a Ray cluster.
    distributed_executor_backend: str = "mp"
    # With "ray": how a model's ranks are placed. STRICT_PACK keeps them on rank 0's node (the
    # shared-memory all-reduce); SPREAD lets them span nodes (gloo over the network).
    ray_placement_strategy: str = "STRICT_PACK"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; got "
                             f"{self.distributed_executor_backend!r}")  # fmt: skip
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(f"--ray-placement-strategy must be one of "
                             f"{', '.join(RAY_PLACEMENT_STRATEGIES)}; got "
                             f"{self.ray_placement_strategy!r}")  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; built once by the CLI or `LLM(...)`."""

    model: str | None = None  # GGUF path, HF directory, or None for the default model
    dtype: str = "auto"  # one of DTYPES
    device: str = "auto"  # auto | cpu | cuda[:N]
    quantization: str = "auto"  # one of QUANTIZATION_METHODS
    quantization_group_size: int = 32  # one of QUANTIZATION_GROUP_SIZES
    seed: int = 0
    # CUDA: decode steps run eagerly, no CUDA graph captured (vLLM's --enforce-eager).
    enforce_eager: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Seconds between periodic stats log lines (0 disables).
    log_stats_interval: float = 10.0
    # Seconds a structured-output grammar may take to compile before its request fails.
    structured_output_timeout: float = 30.0
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "half", "float"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16; got {self.dtype}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization must be auto, none, int8, int4 or fp8; got {self.quantization}"
            )
        if not self.structured_output_timeout > 0:
            raise ValueError(
                f"--structured-output-timeout must be > 0, got {self.structured_output_timeout}"
            )
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(
                f"--quantization-group-size must be 32, 64 or 128; got {self.quantization_group_size}"
            )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return dev


def computes_bf16_natively(device: torch.device) -> bool:
    """Whether bf16 matmuls run at hardware speed on `device`: a CUDA device with bf16, or a CPU
    with AVX512-BF16 or AMX-BF16 (on an AVX2-only CPU ATen emulates them at ~1 GFLOP/s)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    from inferd.kernels.build import cpu_flags

    flags = set(cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 (fp16 where bf16 is missing) on CUDA and fp32 on every CPU.

    Even on CPUs that compute bf16 natively (AVX512-BF16, AMX), inferd's CPU kernels — the fused
    decode step, the int8 tiles, the paged attention — take fp32 activations: a bf16 model there
    runs ATen's per-layer ops instead, and decodes several times slower (tens of times with a
    GGUF's quantized weights). `--dtype bfloat16` still asks for it (its unquantized prefill is
    faster there)."""
    if dtype in ("float32", "float"):
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype in ("float16", "half"):
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
