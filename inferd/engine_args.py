"""Engine arguments, flat and named as vLLM names them → `EngineConfig`, validated once.

One flat namespace over the config dataclasses (inferd/config.py): EngineConfig's own fields,
CacheConfig's and SchedulerConfig's, and `speculative_config` (SpeculativeConfig's JSON or dict).
The CLI flags (`--max-num-seqs`) and `LLM(...)`'s keywords (`max_num_seqs=`) are these names, and
their defaults are the dataclass fields' defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from inferd.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
    RAY_PLACEMENT_STRATEGIES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    field_default,
)

_NESTED: dict[str, type] = {"cache": CacheConfig, "scheduler": SchedulerConfig,
                            "parallel": ParallelConfig, "kv_transfer": KVTransferConfig,
                            "lora": LoRAConfig}  # fmt: skip
_SPECULATIVE = "speculative_config"  # vLLM's name for EngineConfig.speculative
# vLLM's JSON form of KVTransferConfig's fields; a field also given on its own wins.
_KV_TRANSFER = "kv_transfer_config"
# --kv-role's choices → vLLM's kv_role for the PD connector (inferd/kv/connectors/pd).
_PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def _engine_arg_owners() -> dict[str, type]:
    owners: dict[str, type] = {}
    for f in dataclasses.fields(EngineConfig):
        if f.name == "speculative":
            owners[_SPECULATIVE] = EngineConfig
        elif f.name in _NESTED:
            for g in dataclasses.fields(_NESTED[f.name]):
                if g.name in owners:
                    raise TypeError(f"engine argument {g.name!r} is a field of two configs")
                owners[g.name] = _NESTED[f.name]
        else:
            owners[f.name] = EngineConfig
    return owners


# Every engine argument → the dataclass whose field it is.
ENGINE_ARGS: dict[str, type] = _engine_arg_owners()


def engine_arg_default(name: str) -> Any:
    """The default of engine argument `name`: its config field's."""
    if name == _SPECULATIVE:
        return field_default(EngineConfig, "speculative")
    return field_default(ENGINE_ARGS[name], name)


def build_engine_config(**engine_args: Any) -> EngineConfig:
    """EngineConfig from flat engine arguments; each one not given takes its field's default.
    TypeError for a name that is not an engine argument, ValueError for a bad value."""
    if _KV_TRANSFER in engine_args:
        engine_args = dict(engine_args)
        given = KVTransferConfig.parse_json(engine_args.pop(_KV_TRANSFER))
        engine_args = {**given, **{k: v for k, v in engine_args.items() if k not in given or v is not None}}
    unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(ENGINE_ARGS)}")
    own: dict[str, Any] = {}
    nested: dict[type, dict[str, Any]] = {cls: {} for cls in _NESTED.values()}
    for name, value in engine_args.items():
        owner = ENGINE_ARGS[name]
        (own if owner is EngineConfig else nested[owner])[name] = value
    speculative = SpeculativeConfig.parse(own.pop(_SPECULATIVE, None))
    parts = {attr: cls(**nested[cls]) for attr, cls in _NESTED.items()}
    return EngineConfig(**own, **parts, speculative=speculative)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1073741824' → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """Bytes as `parse_bytes` reads them, in the largest whole binary unit: 1073741824 → 1GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """The engine flags, each defaulting to its config field's default."""
    d = engine_arg_default
    model_help = "GGUF file or HF model directory (default: SmolLM2-135M-Instruct)"
    if model_positional:  # `inferd serve`: several, each PATH or NAME=PATH (served_models.py)
        parser.add_argument("models", nargs="*", metavar="model", help=model_help
                            + "; several as NAME=PATH NAME=PATH ...")
        parser.set_defaults(model=d("model"))  # the one model's path, once `serve` has read it
    else:
        parser.add_argument("--model", "-m", default=d("model"), help=model_help)
    g = parser.add_argument_group("engine")

    def add(flag: str, help: str, *aliases: str, **kwargs: Any) -> None:
        name = flag.removeprefix("--").replace("-", "_")
        g.add_argument(flag, *aliases, default=d(name), help=help, **kwargs)

    shown = " (default: %(default)s)"
    add("--dtype", "auto: bfloat16 (float16 without it) on CUDA, float32 on CPUs", choices=DTYPES)
    add("--device", "auto, cpu, cuda or cuda:N")
    add("--quantization", "weights: auto keeps a GGUF's Q8_0/Q4_0/Q4_1 blocks; none = "
        "dequantize; int8 per-channel, int4 group-wise, fp8 E4M3 group-wise", "-q",
        choices=QUANTIZATION_METHODS)
    add("--quantization-group-size", "int4 / fp8 weights per scale (and min)" + shown, type=int,
        choices=QUANTIZATION_GROUP_SIZES)
    add("--seed", "seed of the generator that samples requests without a seed" + shown, type=int)
    add("--enforce-eager", "CUDA: run decode steps eagerly instead of replaying the CUDA graph "
        "captured per batch-size bucket (saves the graphs' memory and start-up capture; the CPU "
        "is always eager)", action="store_true")
    add("--block-size", "tokens per KV block" + shown, type=int)
    add("--kv-cache-memory", "KV cache size in bytes (e.g. 2GiB); default: a share of free "
        "memory", type=parse_bytes)
    add("--kv-cache-dtype", "KV cache storage: auto = the model dtype; float16 / bfloat16 = 2 "
        "bytes per element (2x the tokens of fp32, half the bytes a decode step reads); int8 / "
        "fp8 (e4m3) / fp8_e5m2 = one byte per element + a scale per token and head (~4x the "
        "tokens of fp32)", choices=KV_CACHE_DTYPES)
    add("--kv-cache-prefault", "CPU: bytes of the KV pool kept faulted in ahead of the blocks in "
        "use, on idle CPU time (a page's first write otherwise pays the fault in a step); 0 = off "
        f"(default: {format_bytes(d('kv_cache_prefault'))})", type=parse_bytes)
    add("--gpu-memory-utilization", "share of the GPU's total memory (CPU: available memory) that "
        "weights, activations and the KV pool take; the pool is planned after load unless "
        "--kv-cache-memory" + shown, type=float)
    add("--max-num-seqs", "most sequences in one step" + shown, type=int)
    add("--max-num-batched-tokens", "token budget of one step (prefill chunks + decodes)" + shown,
        type=int)
    add("--max-model-len", "default: the model's context length, clamped to what the KV cache "
        "holds", type=int)
    add("--long-prefill-token-threshold", "largest prefill chunk of one sequence per step "
        "(default: the token budget)", type=int)
    add("--prefill-chunk-with-decodes", "while decodes run, a step adds at most max(N, number of "
        "decodes) prefill tokens, so streams keep flowing while prompts arrive; 0: no cap"
        + shown, type=int)
    add("--max-step-latency-factor", "while decodes run, a step takes only the prompt tokens that "
        "keep its predicted cost within this many pure decode steps (costs learnt from the "
        "engine's own step times; at least one KV block per step while prompts wait); inf: no "
        "cap" + shown, type=float)
    add("--ttft-slo-ms", "time-to-first-token target: a prompt that would miss it at the capped "
        "pace takes its chunk uncapped (default: none)", type=float)
    add("--enable-prefix-caching", "reuse the KV blocks of a shared prompt prefix" + shown,
        action=argparse.BooleanOptionalAction)
    add("--disable-hybrid-kv-cache-manager", "keep every token's KV in sliding-window layers too "
        "(by default their blocks go back to the pool once they leave the window)",
        action="store_true")
    add("--kv-events-endpoint", "publish the prefix cache's stored / evicted blocks over ZMQ PUB "
        "bound here (e.g. tcp://*:5557) for `inferd router --kv-events` (default: off)")
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None,
                   help='vLLM\'s form of --kv-events-endpoint: \'{"enable_kv_cache_events": true, '
                   '"publisher": "zmq", "endpoint": "tcp://*:5557"}\'')  # fmt: skip
    g.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    add("--structured-output-timeout", "seconds a JSON schema / regex / grammar may take to "
        "compile" + shown, type=float)
    add("--speculative-config", 'speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3}\'; methods: ngram (prompt lookup), draft_model ("model": '
        'path), eagle, medusa ("model": a trained head\'s directory)')
    add("--tensor-parallel-size", "ranks that each hold a slice of every layer (heads, MLP rows, "
        "vocabulary), in worker processes on this host (or Ray actors); on a CPU each rank takes "
        "cores / N threads" + shown, "-tp", type=int)
    add("--distributed-executor-backend", "how ranks and replicas start: mp = processes on this "
        "host; ray = tensor-parallel ranks and serve's --data-parallel-size replicas as actors on "
        "a Ray cluster (serve: --ray-address), one placement group per replica "
        "(pip install 'inferd[ray]')" + shown, choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    add("--ray-placement-strategy", "with ray: how a replica's tensor-parallel ranks are placed, "
        "one bundle each: STRICT_PACK = all on one node (shared-memory all-reduce), SPREAD / PACK "
        "/ STRICT_SPREAD = across nodes as Ray allows" + shown, choices=RAY_PLACEMENT_STRATEGIES)
    g.add_argument("--kv-transfer-config", default=None,
                   help='a KV connector as vLLM configures one: \'{"kv_connector": NAME, "kv_role": '
                   '"kv_both", "kv_connector_extra_config": {...}}\' (docs/kv-connectors.md)')  # fmt: skip
    g.add_argument("--kv-role", dest="pd_role", choices=tuple(_PD_ROLES), default=None,
                   help="prefill/decode disaggregation (behind `inferd router --pd-disaggregation`): "
                   "this worker computes prompts (prefill), generates from KV pulled off prefill "
                   "workers (decode), or either (both); short for --kv-transfer-config "
                   '\'{"kv_connector": "PDConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}\'')  # fmt: skip
    add("--kv-offload-dir", "KV tier on disk: prefix-cache blocks evicted from memory are kept "
        "here (content-addressed, reused after a restart and by replicas sharing the directory) "
        "and loaded back instead of recomputed (default: off)")
    add("--kv-offload-size", "most bytes the KV tier keeps under --kv-offload-dir, least recently "
        f"used evicted first (default: {format_bytes(d('kv_offload_size'))})", type=parse_bytes)
    add("--kv-offload-cpu", "bytes of host memory for a KV tier between the pool and the disk "
        "(mostly useful on a GPU); 0 = off" + shown, type=parse_bytes)
    add("--enable-lora", "serve LoRA adapters (PEFT format) batched with the base model: a "
        "request selects one by its `model` name", action="store_true")
    add("--lora-modules", "adapters to register at start, NAME=PATH each", nargs="+",
        metavar="NAME=PATH")
    add("--max-loras", "adapters one step may run at once" + shown, type=int)
    add("--max-lora-rank", "highest adapter rank accepted" + shown, type=int)
    add("--max-cpu-loras", "adapters kept loaded in host memory (default: --max-loras)", type=int)
    add("--log-stats-interval", "seconds between engine stats log lines (0: off)" + shown,
        type=float)


def _kv_events_config(text: str) -> str | None:
    """vLLM's --kv-events-config JSON → the endpoint to publish on (None: events off)."""
    import json

    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    if not cfg.get("enable_kv_cache_events", True):
        return None
    if cfg.get("publisher", "zmq") != "zmq":
        raise argparse.ArgumentTypeError(f"publisher {cfg['publisher']!r}: only zmq is supported")
    return str(cfg.get("endpoint", "tcp://*:5557"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine arguments among `args` (those `add_engine_args` added) → EngineConfig."""
    values = {n: getattr(args, n) for n in ENGINE_ARGS if hasattr(args, n)}
    if getattr(args, "kv_events_config", None):
        values["kv_events_endpoint"] = args.kv_events_config
    if getattr(args, "kv_transfer_config", None):
        # The JSON's fields, unless the same field was given as a flag of its own.
        given = KVTransferConfig.parse_json(args.kv_transfer_config)
        defaults = {n: engine_arg_default(n) for n in given}
        values.update({k: v for k, v in given.items() if values.get(k, defaults[k]) == defaults[k]})
    role = getattr(args, "pd_role", None)
    if role is not None:
        if values.get("kv_connector") not in (None, "PDConnector"):
            raise ValueError(f"--kv-role is the PD connector's short form, but --kv-transfer-config "
                             f"names {values['kv_connector']!r}")  # fmt: skip
        values["kv_connector"], values["kv_role"] = "PDConnector", _PD_ROLES[role]
    return build_engine_config(**values)
