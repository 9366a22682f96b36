"""`inferd bench roofline` and the per-step cost model that latency figures are computed from."""

from __future__ import annotations

import json

import torch

from inferd import LLM
from inferd.bench.roofline import (
    MatmulPath,
    Roofline,
    best_of,
    engine_step_cost,
    laid_out_as_weights,
    matmul_candidates,
    measure_roofline,
    native_paths,
)
from inferd.cli import main
from inferd.kernels.build import cpu_flags
from inferd.kernels.quant_gemm import extension as cpu_kernels


def test_matmul_peak_is_the_fastest_native_path() -> None:
    roof = measure_roofline(
        torch.float32, copy_mib=8, matvec_n=512, matmul_n=128, repeats=2, budget_s=0.5
    )
    assert roof.dtype == "float32" and roof.threads == torch.get_num_threads()
    assert roof.copy_gbps > 0 and roof.matvec_gbps > 0
    # Every precision this CPU multiplies natively is measured, once, and nothing else: fp32
    # always; on a CPU with AVX512-BF16 and VNNI, bf16 and int8 too.
    names = [p.name for p in roof.matmul]
    offered = set(native_paths(set(cpu_flags().split())).values())
    ext = cpu_kernels()
    if ext is not None and ext.has_int8_gemm:
        offered.add("int8-VNNI")  # the engine's own quantized-prefill tiles
    assert sorted(names) == sorted(offered) and "fp32" in names
    assert all(p.gflops > 0 for p in roof.matmul)
    # The peak prefill is judged against is the fastest of them, named as such.
    fastest = max(roof.matmul, key=lambda p: p.gflops)
    assert roof.peak == fastest and roof.matmul_gflops == fastest.gflops
    d = roof.as_dict()
    assert d["matmul_peak_path"] == fastest.name
    assert d["matmul_gflops"] == round(fastest.gflops, 2)
    assert d["matmul_paths"][fastest.name]["op"] == fastest.op
    assert roof.describe_peak() == f"{fastest.name} matmul peak ({fastest.gflops:.1f} GFLOP/s)"


def test_matvec_weight_sits_where_the_engine_keeps_weights() -> None:
    """The bandwidth ceiling streams a matrix moved into the engine's weight block (2 MiB
    pages), values unchanged; where the arena is off, the matrix stays where it is, as the
    engine's weights do."""
    from inferd import envs

    w = torch.randn(1024, 1024)
    moved = laid_out_as_weights(w)
    assert torch.equal(moved, w)
    assert (moved.data_ptr() != w.data_ptr()) == bool(envs.INFERD_WEIGHT_ARENA)


def test_native_paths_follow_the_cpu_flags() -> None:
    """bf16 / fp16 count only with instructions of their own (emulated, they are never the
    fastest path), int8 with VNNI or AMX; AMX names the path where the CPU has it."""
    assert native_paths({"avx2", "fma", "avx512f"}) == {"fp32": "fp32"}
    assert native_paths({"avx512f", "avx512_bf16", "avx512_vnni"}) == {
        "fp32": "fp32", "bf16": "bf16-AVX512", "int8": "int8-VNNI"}  # fmt: skip
    assert native_paths({"avx512_bf16", "amx_bf16", "avx512_fp16", "avx512_vnni", "amx_int8"}) == {
        "fp32": "fp32", "bf16": "bf16-AMX", "fp16": "fp16-AVX512", "int8": "int8-AMX"}  # fmt: skip
    assert native_paths({"avx_vnni"})["int8"] == "int8-VNNI"
    # Without the flags nothing but fp32 is timed, whatever torch could emulate.
    assert {name for name, _, _ in matmul_candidates(64, flags={"avx2", "fma"})} == {"fp32"}


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


def test_kv_is_counted_in_the_cache_dtype(tiny_llama_hf) -> None:
    """A decode step reads the KV as the pool stores it: int8 codes plus a scale per token and
    head, a quarter of fp32 and a little more."""
    costs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(tiny_llama_hf.path), kv_cache_memory=4 << 20, kv_cache_dtype=kv,
                  verbose=False)  # fmt: skip
        costs[kv] = engine_step_cost(llm.engine)
    spec = tiny_llama_hf.spec
    assert costs["auto"].kv_bytes_per_token == 2 * spec.layers * spec.kv_heads * spec.head_dim * 4
    assert costs["int8"].kv_bytes_per_token == 2 * spec.layers * spec.kv_heads * (spec.head_dim + 4)
    assert costs["int8"].weight_bytes == costs["auto"].weight_bytes


def test_cli_prints_ceilings_and_model_limits(tiny_llama_hf, capsys) -> None:
    argv = ["bench", "roofline", "--copy-mib", "8", "--matvec-n", "256", "--matmul-n", "128",
            "--budget-s", "0.3", "--model-limits", "--model", str(tiny_llama_hf.path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    roof = report["roofline"]
    assert set(roof) == {"dtype", "threads", "copy_gbps", "matvec_gbps", "matmul_gflops",
                         "matmul_peak_path", "matmul_paths"}  # fmt: skip
    peak = roof["matmul_peak_path"]
    assert roof["matmul_gflops"] == max(p["gflops"] for p in roof["matmul_paths"].values())
    assert roof["matmul_paths"][peak]["gflops"] == roof["matmul_gflops"]
    assert f"{peak} matmul peak" in out[0]
    m = report["model"]
    assert m["bandwidth_limit_tps"] > 0 and m["compute_limit_tps"] > 0 and m["weight_mb"] > 0
    assert m["compute_limit_path"] == peak


def test_best_of_keeps_each_ceilings_higher_measurement() -> None:
    fp32 = MatmulPath("fp32", "at::mm", 100.0)
    int8 = MatmulPath("int8-VNNI", "torch._int_mm", 300.0)
    a = Roofline("float32", 2, copy_gbps=10.0, matvec_gbps=5.0, matmul=(fp32, int8))
    b = Roofline("float32", 2, copy_gbps=8.0, matvec_gbps=9.0, matmul=(
        MatmulPath("fp32", "oneDNN packed", 120.0), MatmulPath("int8-VNNI", "torch._int_mm", 90.0),
        MatmulPath("bf16-AVX512", "at::linear", 250.0)))  # fmt: skip
    best = best_of(a, b)
    assert (best.copy_gbps, best.matvec_gbps) == (10.0, 9.0)
    assert {(p.name, p.op, p.gflops) for p in best.matmul} == {
        ("fp32", "oneDNN packed", 120.0), ("int8-VNNI", "torch._int_mm", 300.0),
        ("bf16-AVX512", "at::linear", 250.0)}  # fmt: skip
    assert best.peak.name == "int8-VNNI" and best.matmul_gflops == 300.0
