"""The KV pool planned after load (inferd/engine/memory_plan.py): the plan's arithmetic, the
engine's pool equal to its plan, a draft model's pool counted in it, the start-up log line."""

from __future__ import annotations

import logging

import pytest
import torch

from inferd import LLM
from inferd.config import CacheConfig
from inferd.engine.memory_plan import estimate_activation_bytes, plan_kv_memory

CPU = torch.device("cpu")
BLOCK = 4096


def plan(cache: CacheConfig, **kw):
    args = dict(weight_bytes=1 << 20, activation_bytes=0, activation_source="estimated", bytes_per_block=BLOCK)
    return plan_kv_memory(cache, CPU, **(args | kw))


def test_explicit_kv_memory_is_the_target_pool_alone():
    p = plan(CacheConfig(kv_cache_memory=10 * BLOCK + 5), draft_bytes_per_block=BLOCK, activation_bytes=1 << 40)
    assert (p.num_blocks, p.kv_bytes, p.draft_kv_bytes, p.activation_source) == (10, 10 * BLOCK, 0, "explicit")


def test_cpu_plan_is_capped_and_splits_the_budget_with_a_draft():
    cache = CacheConfig(max_auto_kv_cache_memory=100 * BLOCK)
    alone = plan(cache)
    assert alone.num_blocks == 100 and alone.kv_bytes == 100 * BLOCK
    # A draft whose pool takes a quarter of a target block's bytes per block: 100 / 1.25.
    with_draft = plan(cache, draft_bytes_per_block=BLOCK // 4)
    assert with_draft.num_blocks == 80 and with_draft.draft_kv_bytes == 80 * BLOCK // 4
    assert "draft KV" in with_draft.describe() and "80 blocks" in with_draft.describe()


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for the KV cache.*--gpu-memory-utilization"):
        plan(CacheConfig(), activation_bytes=1 << 50)


def test_activation_estimate_grows_with_the_step():
    from inferd.config import ModelConfig

    cfg = ModelConfig("llama", 32000, 4096, 14336, 32, 32, 8, 128)
    small = estimate_activation_bytes(cfg, torch.bfloat16, 256, 8)
    assert estimate_activation_bytes(cfg, torch.bfloat16, 2048, 8) > small
    assert estimate_activation_bytes(cfg, torch.bfloat16, 256, 256) - small == 2 * 248 * 32000 * 4


def test_engine_pool_is_its_plan_and_counts_the_draft(tiny_llama_gguf, caplog):
    spec = {"method": "draft_model", "model": str(tiny_llama_gguf.path)}
    with caplog.at_level(logging.INFO, logger="inferd.engine"):
        llm = LLM(str(tiny_llama_gguf.path), dtype="float32", device="cpu", verbose=True,
                  speculative_config=spec, gpu_memory_utilization=0.5)  # fmt: skip
    engine = llm.engine
    p = engine.memory_plan
    assert p.activation_source == "estimated" and p.draft_weight_bytes > 0
    assert engine.kv.pool.num_blocks == p.num_blocks
    assert engine.runner.kv_cache.nbytes == p.kv_bytes
    # The draft (the same model: as many bytes per token) has a pool of as many tokens.
    draft = engine.proposer
    assert draft.runner.kv_cache.nbytes == p.draft_kv_bytes == p.kv_bytes
    assert p.kv_bytes + p.draft_kv_bytes <= CacheConfig().max_auto_kv_cache_memory
    assert "memory plan: 0.5 × " in caplog.text and f"{p.num_blocks} blocks" in caplog.text
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    engine.check_no_leaks()


def test_profiling_step_fits_its_pool(tiny_models):
    """The step CUDA's plan profiles (its peak memory is measured there) runs on the pool
    `profile_blocks` sizes: every sequence samples a row, and the pool is left free."""
    from inferd.engine.memory_plan import profile_blocks, run_profiling_step
    from inferd.engine.model_runner import ModelRunner
    from inferd.kv.kv_groups import KVLayout
    from inferd.loader import load_model
    from inferd.models import build_model, model_spec

    loaded = load_model(str(tiny_models["llama-f32.gguf"].path), verbose=False, quantization="none")
    cfg = loaded.config
    model = build_model(cfg, loaded.weights, max_positions=256, dtype=torch.float32, device=CPU)
    layout = KVLayout.of(model_spec(cfg), hybrid=True)
    runner = ModelRunner(model, cfg, profile_blocks(600, 8, 16, layout.num_groups, 256), 16, torch.float32, CPU,
                         layout=layout, use_attention_kernel=False)  # fmt: skip
    assert run_profiling_step(runner, 200, 8, 256) == 8
    assert run_profiling_step(runner, 5, 8, 256) == 5  # never more sequences than tokens
    # More tokens than the model has positions: the long prompt is cut at 256 (positions past the
    # RoPE tables are an out-of-range index: an IndexError here, a device-side assert on CUDA).
    assert run_profiling_step(runner, 600, 8, 256) == 3 + 7
