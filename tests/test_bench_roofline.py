"""`inferd bench roofline` and the per-step cost model that latency figures are computed from."""

from __future__ import annotations

import json

import torch

from inferd import LLM
from inferd.bench.roofline import engine_step_cost, measure_roofline
from inferd.cli import main


def test_measured_ceilings_are_positive_and_ordered() -> None:
    roof = measure_roofline(
        torch.float32, copy_mib=8, matvec_n=512, matmul_n=128, repeats=2, budget_s=0.5
    )
    assert roof.dtype == "float32" and roof.threads == torch.get_num_threads()
    assert roof.copy_gbps > 0 and roof.matvec_gbps > 0 and roof.matmul_gflops > 0


def test_step_cost_counts_every_matmul_weight_once(tiny_llama_hf) -> None:
    spec = tiny_llama_hf.spec
    llm = LLM(str(tiny_llama_hf.path), kv_cache_memory=4 << 20, verbose=False)
    cost = engine_step_cost(llm.engine)
    w = tiny_llama_hf.weights
    matmuls = [v for k, v in w.items() if v.dim() == 2 and "embed_tokens" not in k]
    norms = [v for k, v in w.items() if "norm" in k]
    # An untied embedding only looks rows up: not a per-step read.
    assert cost.weight_bytes == 4 * (
        sum(t.numel() for t in matmuls) + sum(t.numel() for t in norms)
    )
    assert cost.linear_flops_per_token == 2 * sum(t.numel() for t in matmuls)
    assert cost.attn_flops_per_context_token == 4 * spec.layers * spec.heads * spec.head_dim
    assert cost.kv_bytes_per_token == 2 * spec.layers * spec.kv_heads * spec.head_dim * 4
    # A decode step of two sequences at contexts 10 and 20: weights once, KV of 30 tokens.
    b, f = cost.decode_step([10, 20])
    assert b == cost.weight_bytes + 30 * cost.kv_bytes_per_token
    assert f == 2 * cost.linear_flops_per_token + 30 * cost.attn_flops_per_context_token
    # Prefill of 3 tokens: causal attention sees 1 + 2 + 3 keys.
    assert (
        cost.prefill_flops([3])
        == 3 * cost.linear_flops_per_token + 6 * cost.attn_flops_per_context_token
    )


def test_quantized_and_tied_weights_are_read_at_their_packed_size(tiny_models) -> None:
    model = tiny_models["llama-tied-q8_0.gguf"]
    llm = LLM(str(model.path), quantization="auto", kv_cache_memory=4 << 20, verbose=False)
    fp32 = LLM(str(model.path), quantization="none", kv_cache_memory=4 << 20, verbose=False)
    q, f = engine_step_cost(llm.engine), engine_step_cost(fp32.engine)
    # Same matmuls, same FLOPs; Q8_0 blocks are 34 bytes per 32 weights vs 128 in fp32.
    assert q.linear_flops_per_token == f.linear_flops_per_token
    assert q.weight_bytes < 0.4 * f.weight_bytes
    # Tied: the output head is the embedding matrix, read once per step (counted once).
    vocab, hidden = model.weights["model.embed_tokens.weight"].shape
    assert f.linear_flops_per_token > 2 * vocab * hidden
    assert f.weight_bytes >= 4 * vocab * hidden


def test_cli_prints_ceilings_and_model_limits(tiny_llama_hf, capsys) -> None:
    argv = ["bench", "roofline", "--copy-mib", "8", "--matvec-n", "256", "--matmul-n", "128",
            "--budget-s", "0.3", "--model-limits", "--model", str(tiny_llama_hf.path)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["roofline"]) == {
        "dtype",
        "threads",
        "copy_gbps",
        "matvec_gbps",
        "matmul_gflops",
    }
    m = report["model"]
    assert m["bandwidth_limit_tps"] > 0 and m["compute_limit_tps"] > 0 and m["weight_mb"] > 0


def test_best_of_keeps_each_ceilings_higher_measurement() -> None:
    from inferd.bench.roofline import Roofline, best_of

    a = Roofline("float32", 2, copy_gbps=10.0, matvec_gbps=5.0, matmul_gflops=100.0)
    b = Roofline("float32", 2, copy_gbps=8.0, matvec_gbps=9.0, matmul_gflops=120.0)
    assert best_of(a, b) == Roofline("float32", 2, 10.0, 9.0, 120.0)
