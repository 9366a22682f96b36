"""Command-line engine flags (named as vLLM names them) → `EngineConfig`, validated once."""

from __future__ import annotations

import argparse
import re

from inferd.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1073741824' → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)")  # fmt: skip
    else:
        parser.add_argument("--model", "-m", default=None,
                            help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)")  # fmt: skip
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--quantization", "-q", default="auto",
                   choices=["auto", "none", "int8", "int4", "fp8"],
                   help="weights: auto keeps a GGUF's Q8_0/Q4_0/Q4_1 blocks; none = dequantize; "
                        "int8 per-channel, int4 group-wise, fp8 E4M3 group-wise")  # fmt: skip
    g.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="int4 / fp8 weights per scale (and min)")  # fmt: skip
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size in bytes (e.g. 2GiB); default: a share of free memory")  # fmt: skip
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto = the model dtype; float16 / bfloat16 = 2 bytes per "
                        "element (2x the tokens of fp32, half the bytes a decode step reads); int8 / "
                        "fp8 (e4m3) / fp8_e5m2 = one byte per element + a scale per token and head "
                        "(~4x the tokens of fp32)")  # fmt: skip
    g.add_argument("--kv-cache-prefault", type=parse_bytes, default=1 << 30,
                   help="CPU: bytes of the KV pool kept faulted in ahead of the blocks in use, on "
                        "idle CPU time (a page's first write otherwise pays the fault in a step); "
                        "0 = off (default 1GiB)")  # fmt: skip
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (prefill chunks + decodes)")  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="largest prefill chunk of one sequence per step")  # fmt: skip
    g.add_argument("--prefill-chunk-with-decodes", type=int, default=128,
                   help="while decodes run, a step adds at most max(N, number of decodes) prefill "
                        "tokens, so streams keep flowing while prompts arrive; 0: no cap")  # fmt: skip
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    g.add_argument("--structured-output-timeout", type=float, default=30.0,
                   help="seconds a JSON schema / regex / grammar may take to compile")  # fmt: skip
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 3}\'; methods: ngram (prompt lookup), '
                        'draft_model ("model": path), eagle ("model": a trained head\'s directory)')  # fmt: skip
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine stats log lines (0: off)")  # fmt: skip


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_prefault=args.kv_cache_prefault,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            prefill_chunk_with_decodes=args.prefill_chunk_with_decodes,
        ),
        log_stats_interval=args.log_stats_interval,
        structured_output_timeout=args.structured_output_timeout,
        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
    )
