"""Engine defaults are written once, in inferd/config.py's dataclasses: the CLI flags and `LLM(...)`
take theirs from the fields and build the same EngineConfig. INFERD_* environment variables are
declared and read in inferd/envs.py, and reach the code through it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import inferd
from inferd import envs
from inferd.cli import build_parser
from inferd.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    field_default,
)
from inferd.engine.llm import LLM
from inferd.engine_args import (
    ENGINE_ARGS,
    add_engine_args,
    build_engine_config,
    engine_config_from_args,
    format_bytes,
    parse_bytes,
)

# Config fields that are deliberately no CLI flag.
# (The KV connector's name, role and extra config are set through --kv-transfer-config's JSON.)
NOT_FLAGS = {"max_auto_kv_cache_memory", "kv_connector", "kv_role", "kv_connector_extra_config"}


def _value(config: EngineConfig, name: str) -> object:
    """Engine argument `name` as `config` holds it."""
    if name == "speculative_config":
        return config.speculative
    for part in (config, config.cache, config.scheduler, config.parallel, config.kv_transfer, config.lora):
        if hasattr(part, name):
            return getattr(part, name)
    raise KeyError(name)


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_config_field_is_an_engine_argument_once() -> None:
    parts = (CacheConfig, SchedulerConfig, ParallelConfig, KVTransferConfig, LoRAConfig)
    nested = [f for cls in parts for f in cls.__dataclass_fields__]
    own = [f for f in EngineConfig.__dataclass_fields__
           if f not in ("cache", "scheduler", "parallel", "kv_transfer", "lora")]  # fmt: skip
    assert len(ENGINE_ARGS) == len(nested) + len(own)
    assert set(ENGINE_ARGS) == {*nested, *own} - {"speculative"} | {"speculative_config"}


def test_cli_defaults_are_the_dataclass_defaults() -> None:
    parser = _engine_parser()
    defaults = EngineConfig()
    flags = {a.dest for a in parser._actions if a.dest in ENGINE_ARGS}
    assert flags == set(ENGINE_ARGS) - NOT_FLAGS  # a new field needs a flag or a place in NOT_FLAGS
    for name in flags:
        assert parser.get_default(name) == _value(defaults, name), name
    assert engine_config_from_args(parser.parse_args([])) == defaults


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["serve"]])
def test_each_inferd_command_without_flags_builds_the_default_config(command: list[str]) -> None:
    args = build_parser().parse_args(command)
    assert engine_config_from_args(args) == EngineConfig()


def test_llm_builds_the_cli_config_with_stats_lines_off() -> None:
    cli = engine_config_from_args(_engine_parser().parse_args([]))
    assert LLM.engine_config() == cli.replace(log_stats_interval=0.0)
    assert LLM.engine_config(log_stats_interval=cli.log_stats_interval) == cli


def test_flags_and_llm_keywords_name_the_same_settings(tmp_path) -> None:
    argv = ["-m", "x.gguf", "--dtype", "float32", "--device", "cpu", "-q", "int4",
            "--quantization-group-size", "64", "--seed", "5", "--enforce-eager", "--block-size", "32",
            "--kv-cache-memory", "64MiB",
            "--kv-cache-dtype", "int8", "--kv-cache-prefault", "0", "--gpu-memory-utilization",
            "0.5", "--max-num-seqs", "7", "--max-num-batched-tokens", "512", "--max-model-len",
            "300", "--long-prefill-token-threshold", "64", "--prefill-chunk-with-decodes", "0",
            "--max-step-latency-factor", "2", "--ttft-slo-ms", "500",
            "--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager",
            "--structured-output-timeout", "2.5",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
            "--log-stats-interval", "1", "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "ray", "--ray-placement-strategy", "SPREAD",
            "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-offload-dir", str(tmp_path),
            "--kv-offload-size", "1GiB", "--kv-offload-cpu", "64MiB", "--enable-lora", "--lora-modules", "a=/x",
            "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3"]  # fmt: skip
    cli = engine_config_from_args(_engine_parser().parse_args(argv))
    llm = LLM.engine_config(
        "x.gguf", dtype="float32", device="cpu", quantization="int4", quantization_group_size=64,
        seed=5, enforce_eager=True, block_size=32, kv_cache_memory=64 << 20, kv_cache_dtype="int8", kv_cache_prefault=0,
        gpu_memory_utilization=0.5, max_num_seqs=7, max_num_batched_tokens=512, max_model_len=300,
        long_prefill_token_threshold=64, prefill_chunk_with_decodes=0, enable_prefix_caching=False,
        max_step_latency_factor=2.0, ttft_slo_ms=500.0,
        disable_hybrid_kv_cache_manager=True, structured_output_timeout=2.5,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2}, log_stats_interval=1,
        tensor_parallel_size=2, distributed_executor_backend="ray", ray_placement_strategy="SPREAD",
        kv_events_endpoint="tcp://127.0.0.1:5557", kv_offload_dir=str(tmp_path),
        kv_offload_size=1 << 30, kv_offload_cpu=64 << 20, enable_lora=True,
        lora_modules=["a=/x"], max_loras=2, max_lora_rank=8, max_cpu_loras=3,
    )  # fmt: skip
    assert cli == llm
    defaults = EngineConfig()
    # The argv above moves every flag off its default.
    for name in set(ENGINE_ARGS) - NOT_FLAGS:
        assert _value(cli, name) != _value(defaults, name), name


def test_unknown_and_bad_engine_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match=r"LLM\(\): unknown engine arguments \['max_num_seq'\]"):
        LLM.engine_config(max_num_seq=3)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        build_engine_config(speculative={"method": "ngram"})  # the field's name is not vLLM's
    with pytest.raises(ValueError, match="--block-size must be a power of two"):
        LLM.engine_config(block_size=12)
    with pytest.raises(ValueError, match="--speculative-config"):
        LLM.engine_config(speculative_config='{"method": "nope"}')


def test_field_default() -> None:
    assert field_default(SchedulerConfig, "max_num_seqs") == SchedulerConfig().max_num_seqs
    cache = field_default(EngineConfig, "cache")
    assert cache == CacheConfig()
    with pytest.raises(TypeError, match="has no field 'nope'"):
        field_default(EngineConfig, "nope")


def test_byte_sizes_round_trip() -> None:
    for n in (0, 1000, 1 << 10, 3 << 20, 1 << 30, (1 << 30) + 1):
        assert parse_bytes(format_bytes(n)) == n
    assert format_bytes(1 << 30) == "1GiB"


# ---- environment variables ----------------------------------------------------------------------


def test_no_inferd_variable_is_read_outside_envs() -> None:
    root = Path(inferd.__file__).parent
    read = re.compile(r"""(environ|getenv)\b[^\n]*["']INFERD_""")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "envs.py" and read.search(p.read_text())]  # fmt: skip
    assert offenders == []


def test_every_variable_is_declared_with_a_meaning() -> None:
    table = envs.describe()
    for name, var in envs.ENV_VARS.items():
        assert name.startswith("INFERD_") and var.name == name and var.meaning and var.default
        assert f"`{name}`" in table
    assert set(dir(envs)) >= set(envs.ENV_VARS)
    with pytest.raises(AttributeError):
        envs.INFERD_NO_SUCH_THING  # noqa: B018


def test_cache_dirs_reach_the_code_through_envs(monkeypatch, tmp_path) -> None:
    from inferd.kernels.build import build_dir
    from inferd.loader.default_model import cache_dir

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("INFERD_KERNEL_CACHE_DIR", raising=False)
    assert cache_dir() == tmp_path / "c" and cache_dir().is_dir()
    assert build_dir("probe", "cpu_kernels.cpp").parent == tmp_path / "c" / "kernels"
    monkeypatch.setenv("INFERD_KERNEL_CACHE_DIR", str(tmp_path / "k"))
    assert build_dir("probe", "cpu_kernels.cpp").parent == tmp_path / "k"
    monkeypatch.delenv("INFERD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "inferd"


def test_api_key_is_the_default_of_the_flag(monkeypatch) -> None:
    monkeypatch.setenv("INFERD_API_KEY", "k-123")
    assert build_parser().parse_args(["serve"]).api_key == "k-123"
    assert build_parser().parse_args(["serve", "--api-key", "other"]).api_key == ["other"]
    monkeypatch.delenv("INFERD_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


@pytest.mark.parametrize(
    "raw, switch, tristate",
    [(None, True, None), ("", True, None), ("1", True, True), ("0", False, False),
     ("false", False, False), ("OFF", False, False), ("yes", True, True)],
)  # fmt: skip
def test_switches(monkeypatch, raw: str | None, switch: bool, tristate: bool | None) -> None:
    for name in ("INFERD_WEIGHT_ARENA", "INFERD_INT8_ACTIVATIONS"):
        if raw is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, raw)
    assert envs.INFERD_WEIGHT_ARENA is switch
    assert envs.INFERD_INT8_ACTIVATIONS is tristate


def test_weight_arena_switch_reaches_the_arena(monkeypatch) -> None:
    import torch
    from torch import nn

    from inferd.layers.weight_arena import gather_weights

    big = nn.Linear(1024, 1024, bias=False)  # 4 MiB: worth a block of its own
    monkeypatch.setenv("INFERD_WEIGHT_ARENA", "off")
    ptr = big.weight.data_ptr()
    assert gather_weights([big]) == 0 and big.weight.data_ptr() == ptr
    monkeypatch.setenv("INFERD_WEIGHT_ARENA", "1")
    before = big.weight.detach().clone()
    assert gather_weights([big]) >= before.numel() * 4
    assert big.weight.data_ptr() != ptr and torch.equal(big.weight, before)


def test_stream_prefetch_choices_are_the_kernels_hints(monkeypatch) -> None:
    from inferd.kernels import quant_gemm

    assert set(envs.STREAM_PREFETCH_CHOICES) == set(quant_gemm.STREAM_PREFETCH_HINTS)
    monkeypatch.setenv("INFERD_STREAM_PREFETCH", " NTA ")
    assert quant_gemm.stream_prefetch_hint() == "nta"
    monkeypatch.setenv("INFERD_STREAM_PREFETCH", "always")
    with pytest.raises(ValueError, match="INFERD_STREAM_PREFETCH='always'"):
        envs.INFERD_STREAM_PREFETCH  # noqa: B018
