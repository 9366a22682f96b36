"""`inferd bench latency` on a tiny model, with HF transformers in the same run (short, no timing asserts)."""

from __future__ import annotations

import json

import pytest
import torch

from inferd.bench.peers import LLAMA_CPP_MISSING, inferd_generate_timed, llama_cpp_available
from inferd.cli import main


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


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
            "--input-len", "12", "--output-len", "6", "--runs", "2", "--peers", "hf,llama.cpp"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert set(report["engines"]) == {"inferd", "hf"}
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
            "--output-len", "4", "--runs", "1", "--peers", "llama.cpp", "--threads", "1"]  # fmt: skip
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
    """`--kv-cache-memory` takes sizes as `inferd serve` does (it took bare integers only), and
    `--kv-cache-dtype` picks the KV storage as it does."""
    base = ["bench", "latency", "--model", str(tiny_llama_hf.path), "--runs", "1", "--peers", "none"]
    assert main([*base, "--kv-cache-memory", "4MiB", "--input-len", "8", "--output-len", "3"]) == 0
    capsys.readouterr()
    assert main([*base, "--kv-cache-dtype", "int8", "--input-len", "8", "--output-len", "3"]) == 0
    assert _report(capsys)["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit) as e:
        main([*base, "--kv-cache-memory", "lots"])
    assert e.value.code == 2 and "not a byte size" in capsys.readouterr().err


def test_latency_sampled_is_inferd_only(tiny_llama_hf, capsys) -> None:
    """`--temperature` times inferd's sampling path (filters and draws every step); the greedy
    peers would not be comparable, so asking for them is a clear error."""
    argv = ["bench", "latency", "--model", str(tiny_llama_hf.path), "--batch-size", "3", "--input-len", "8",
            "--output-len", "5", "--runs", "1", "--peers", "none", "--temperature", "0.8", "--top-p", "0.9"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert report["temperature"] == 0.8 and report["top_p"] == 0.9
    assert set(report["engines"]) == {"inferd"} and report["engines"]["inferd"]["decode_tps"] > 0
    assert main([*argv[:-6], "--peers", "hf", "--temperature", "0.8"]) != 0
    assert "--peers none" in capsys.readouterr().err
