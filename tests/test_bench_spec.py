"""`inferd bench spec` end to end on a tiny model: every config's greedy output equals speculation
off (the bench checks it), drafts are proposed and accepted, counts and ratios are reported (no
timing asserts)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tiny_models import TinySpec, write_gguf

from inferd.cli import main
from inferd.kernels import build, quant_gemm


@pytest.fixture(scope="module")
def long_context_tiny(tmp_path_factory):
    """The bench's prompts (passages, code) run to ~600 tokens with the tiny byte-level tokenizer."""
    spec = dataclasses.replace(TinySpec(), max_position=2048)
    return write_gguf(tmp_path_factory.mktemp("spec-bench") / "tiny.gguf", spec)


def test_bench_spec_reports_every_config(long_context_tiny, capsys) -> None:
    model = str(long_context_tiny.path)
    # 16 tokens: the tiny model's greedy text falls into repeats that prompt lookup then drafts.
    argv = ["bench", "spec", "--model", model, "--k", "2", "--max-tokens", "16",
            "--runs", "2", "--batch", "3", "--tasks", "code", "chat", "--draft-model", model, "--batch-draft",
            "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical_greedy_outputs"]
    # The kernels build wherever AVX2/FMA is there; the report says which path the figures are.
    assert report["cpu_kernels"] is build.cpu_supports_avx2_fma()
    assert report["stream_prefetch"] in quant_gemm.STREAM_PREFETCH_HINTS
    rows = {(r["task"], r["config"]): r for r in report["rows"]}
    assert set(rows) == {(t, c) for t in ("code", "chat") for c in ("off", "ngram k=2", "draft k=2")}
    for (task, config), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        if config == "off":
            assert r["speedup"] == 1.0 and r["acceptance_rate"] is None
    # Speculation ran: prompt lookup proposed drafts on both tasks and the target accepted some
    # (a chain of k = 2 emits 1 to 3 tokens per verification).
    for task in ("code", "chat"):
        ngram = rows[(task, "ngram k=2")]
        assert 0 < ngram["acceptance_rate"] <= 1, ngram
        assert 1 < ngram["mean_acceptance_length"] <= 3, ngram
    # The draft is the target itself: every draft it made is accepted (the policy may judge a
    # draft as slow as the target not worth running at all).
    assert rows[("chat", "draft k=2")]["acceptance_rate"] in (None, 1.0)
    assert set(report["batch3_ratio_vs_off"]) == {"off", "ngram k=2", "draft k=2"}
    assert report["batch3_ratio_vs_off"]["off"] == 1.0


def test_bench_spec_no_ngram_leaves_prompt_lookup_out(long_context_tiny, capsys) -> None:
    model = str(long_context_tiny.path)
    argv = ["bench", "spec", "--model", model, "--k", "2", "3", "--max-tokens", "4", "--runs", "1",
            "--tasks", "chat", "--draft-model", model, "--no-ngram", "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["config"] for r in report["rows"]] == ["off", "draft k=2", "draft k=3"]


def test_bench_spec_repeat_task_drafts_earlier_answers(long_context_tiny, capsys) -> None:
    """On the repeat task suffix decoding drafts each answer from its untimed earlier run (left
    out of the counts): every draft right, chains far longer than a first run's."""
    model = str(long_context_tiny.path)
    argv = ["bench", "spec", "--model", model, "--max-tokens", "16", "--runs", "1", "--tasks", "repeat",
            "--no-ngram", "--suffix", "--suffix-k", "8", "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["config"] for r in report["rows"]] == ["off", "suffix k=8"]
    suffix = report["rows"][1]
    assert suffix["acceptance_rate"] == 1.0 and suffix["mean_acceptance_length"] > 3, suffix


def test_bench_spec_lookahead(long_context_tiny, capsys) -> None:
    """Lookahead decoding runs beside speculation off, its greedy outputs identical (the bench
    refuses otherwise) and its drafts verified."""
    model = str(long_context_tiny.path)
    argv = ["bench", "spec", "--model", model, "--max-tokens", "16", "--runs", "1", "--tasks", "chat",
            "--no-ngram", "--lookahead", "--lookahead-k", "4", "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["config"] for r in report["rows"]] == ["off", "lookahead k=4"]
    assert report["identical_greedy_outputs"]


def test_bench_spec_runs_medusa_heads(long_context_tiny, tmp_path, capsys) -> None:
    from inferd import LLM
    from inferd.spec.medusa_head import MedusaHead

    model = str(long_context_tiny.path)
    target = LLM(model, verbose=False, kv_cache_memory=4 << 20).engine.runner.model
    MedusaHead.for_target(target, 2).save(tmp_path / "heads")  # untrained: the target's own guess
    argv = ["bench", "spec", "--model", model, "--k", "2", "--max-tokens", "8", "--runs", "1",
            "--tasks", "chat", "--no-ngram", "--medusa", str(tmp_path / "heads"),
            "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical_greedy_outputs"]
    assert [r["config"] for r in report["rows"]] == ["off", "medusa k=2"]
