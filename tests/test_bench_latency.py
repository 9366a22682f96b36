"""`inferd bench latency` on a tiny model, with HF transformers in the same run (short, no
timing asserts)."""

from __future__ import annotations

import json

import pytest
import torch

from inferd.bench.latency import ceiling_line, engine_costs, gguf_step_bytes, summarize
from inferd.bench.peers import (
    LLAMA_CPP_MISSING,
    Timed,
    inferd_generate_timed,
    llama_cpp_available,
)
from inferd.bench.roofline import MatmulPath, Roofline, StepCost, engine_step_cost
from inferd.cli import main


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_fractions_are_of_the_named_ceilings() -> None:
    """Prefill is a fraction of the matmul peak (the fastest path, named), decode of the
    matrix-vector bandwidth, each equal to achieved / ceiling."""
    cost = StepCost(weight_bytes=4_000_000, linear_flops_per_token=2_000_000,
                    attn_flops_per_context_token=1_000, kv_bytes_per_token=500)  # fmt: skip
    roof = Roofline("float32", 2, copy_gbps=40.0, matvec_gbps=20.0, matmul=(
        MatmulPath("fp32", "oneDNN packed", 200.0), MatmulPath("int8-VNNI", "torch._int_mm", 800.0),
        MatmulPath("bf16-AVX512", "at::linear", 400.0)))  # fmt: skip
    # Prefill of 2 × 16 tokens in 1 ms, then 3 decode steps of 1, 2 and 1 ms.
    timed = Timed(start=10.0, stamps=[10.001, 10.002, 10.004, 10.005], first=[10.001] * 2)
    r = summarize([timed], cost, roof, batch=2, input_len=16)
    prefill_gflops = cost.prefill_flops([16, 16]) / 0.001 / 1e9
    assert r["prefill_gflops"] == pytest.approx(prefill_gflops, abs=1e-3)
    assert r["prefill_pct_of_matmul_peak"] == round(100 * prefill_gflops / 800.0, 1)
    read = sum(cost.decode_step([16 + k] * 2)[0] for k in (1, 2, 3))
    assert r["decode_gbps"] == pytest.approx(read / 0.004 / 1e9, abs=1e-3)
    assert r["decode_pct_of_matvec_bw"] == round(100 * read / 0.004 / 1e9 / 20.0, 1)
    assert r["decode_mb_per_step"] == round(cost.decode_step([17, 17])[0] / 1e6, 2)
    line = ceiling_line("inferd", r, roof)
    assert line.startswith(f"inferd prefill: {r['prefill_pct_of_matmul_peak']:.1f} % of "
                           "int8-VNNI matmul peak (800.0 GFLOP/s); decode: ")  # fmt: skip
    assert "% of matrix-vector bandwidth (20.0 GB/s)" in line


@pytest.mark.parametrize("name, quantization", [("llama-f32.gguf", "none"),
                                                ("llama-tied-q8_0.gguf", "auto")])  # fmt: skip
def test_each_engine_is_charged_the_bytes_it_reads(tiny_models, name, quantization) -> None:
    """inferd reads its weights as stored; llama.cpp its GGUF's tensors (an untied embedding
    only looked up, a tied one read as the head), fp16 KV; HF the model in fp32, fp32 KV."""
    from inferd import LLM

    model = tiny_models[name]
    engine = LLM(str(model.path), quantization=quantization, kv_cache_memory=4 << 20,
                 verbose=False).engine  # fmt: skip
    fp32 = LLM(str(model.path), quantization="none", kv_cache_memory=4 << 20, verbose=False).engine
    cost = engine_step_cost(engine)
    costs = engine_costs(engine, cost, model.path, openvino_gguf=model.path)
    assert costs["inferd"] == cost
    assert costs["llama.cpp"].weight_bytes == cost.weight_bytes == gguf_step_bytes(model.path)[0]
    assert costs["openvino"].weight_bytes == cost.weight_bytes  # the same file's tensors, int8 KV
    assert costs["openvino"].kv_bytes_per_token * 4 == costs["hf"].kv_bytes_per_token
    assert costs["hf"].weight_bytes == engine_step_cost(fp32).weight_bytes
    assert costs["hf"].kv_bytes_per_token == cost.kv_bytes_per_token
    assert costs["llama.cpp"].kv_bytes_per_token * 2 == cost.kv_bytes_per_token
    flops = {c.linear_flops_per_token for c in costs.values()}
    assert flops == {cost.linear_flops_per_token}


def test_engine_timing_stamps_every_step(tiny_llama_hf) -> None:
    from inferd import LLM

    engine = LLM(str(tiny_llama_hf.path), kv_cache_memory=4 << 20, verbose=False).engine
    timed = inferd_generate_timed(engine, [[5, 6, 7, 8], [9, 10, 11]], output_len=6)
    # One prefill step then five decode steps, each producing a token for both requests.
    assert len(timed.stamps) == 6 and len(timed.step_s) == 5
    assert timed.start < timed.first[0] == timed.first[1] == timed.stamps[0] <= timed.end
    assert [len(t) for t in timed.token_ids] == [6, 6]
    assert not engine.requests  # everything popped: the engine is ready for the next run
    engine.check_no_leaks()


def test_latency_batch_against_hf(tiny_llama_hf, hf_transformers, capsys) -> None:
    argv = ["bench", "latency", "--model", str(tiny_llama_hf.path), "--batch-size", "2",
            "--input-len", "12", "--output-len", "6", "--runs", "2",
            "--peers", "hf,llama.cpp"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert set(report["engines"]) == {"inferd", "hf"}
    # Each engine's prefill is given as a fraction of the named fastest path.
    peak = report["roofline"]["matmul_peak_path"]
    assert report["limits"]["compute_limit_path"] == peak
    for name, r in report["engines"].items():
        assert any(line.startswith(f"{name} prefill: {r['prefill_pct_of_matmul_peak']:.1f} % of "
                                   f"{peak} matmul peak") for line in out)  # fmt: skip
    # Not a GGUF file: llama.cpp is skipped with a note (or missing altogether).
    assert any("llama.cpp peer skipped" in n for n in report["notes"])
    for r in report["engines"].values():
        s = r["decode_step_ms"]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
        assert r["decode_tps"] > 0 and r["prefill_s"] > 0
        assert r["decode_gbps"] > 0 and r["decode_gflops"] > 0 and r["prefill_gflops"] > 0
    assert report["limits"]["bandwidth_limit_tps"] > 0
    assert report["ratio_inferd_vs"]["hf"] > 0
    assert report["roofline"]["matvec_gbps"] > 0


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_llama_cpp_peer_is_optional(tiny_llama_gguf, restore_threads, capsys) -> None:
    argv = ["bench", "latency", "--model", str(tiny_llama_gguf.path), "--input-len", "8",
            "--output-len", "4", "--runs", "1", "--peers", "llama.cpp",
            "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert report["threads"] == 1
    if llama_cpp_available():
        assert set(report["engines"]) == {"inferd", "llama.cpp"}
        assert report["engines"]["llama.cpp"]["decode_tps"] > 0
        assert any("llama.cpp runs" in n for n in report["notes"])
    else:
        assert set(report["engines"]) == {"inferd"}
        assert LLAMA_CPP_MISSING in report["notes"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--output-len", "1"], "--output-len ≥ 2"),
        (["--peers", "vllm"], "unknown peer(s) ['vllm']"),
    ],
)
def test_bad_flags_are_clear_errors(tiny_llama_hf, flags, message, capsys) -> None:
    assert main(["bench", "latency", "--model", str(tiny_llama_hf.path), *flags]) == 2
    assert message in capsys.readouterr().err


def test_kv_pool_size_reads_like_serves(tiny_llama_hf, capsys) -> None:
    """`--kv-cache-memory` takes sizes as `inferd serve` does, and `--kv-cache-dtype` picks the
    KV storage as it does."""
    base = ["bench", "latency", "--model", str(tiny_llama_hf.path),
            "--runs", "1", "--peers", "none"]  # fmt: skip
    assert main([*base, "--kv-cache-memory", "4MiB", "--kv-cache-dtype", "int8", "--input-len", "8",
                 "--output-len", "3"]) == 0  # fmt: skip
    assert _report(capsys)["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit) as e:
        main([*base, "--kv-cache-memory", "lots"])
    assert e.value.code == 2 and "not a byte size" in capsys.readouterr().err


def test_latency_sampled_is_inferd_only(tiny_llama_hf, capsys) -> None:
    """`--temperature` times inferd's sampling path (filters and draws every step); the greedy
    peers would not be comparable, so asking for them is a clear error."""
    argv = ["bench", "latency", "--model", str(tiny_llama_hf.path), "--batch-size", "3",
            "--input-len", "8", "--output-len", "5", "--runs", "1", "--peers", "none",
            "--temperature", "0.8", "--top-p", "0.9"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert report["temperature"] == 0.8 and report["top_p"] == 0.9
    assert set(report["engines"]) == {"inferd"} and report["engines"]["inferd"]["decode_tps"] > 0
    assert main([*argv[:-6], "--peers", "hf", "--temperature", "0.8"]) != 0
    assert "--peers none" in capsys.readouterr().err
