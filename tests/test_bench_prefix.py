"""`inferd bench prefix` on a tiny model: both scenarios run end to end and report what they claim."""

from __future__ import annotations

import json

import pytest
import torch

from inferd.cli import main


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _bench(tiny_models, capsys, *flags: str) -> dict:
    """`inferd bench prefix` on the tiny model with `flags`: its JSON report."""
    assert main(["bench", "prefix", "--model", str(tiny_models["llama-hf"].path), *flags]) == 0
    return _report(capsys)


def test_shared_prefix_report(tiny_models, capsys):
    report = _bench(tiny_models, capsys, "--runs", "2", "--prefix-len", "64", "--suffix-len", "8",
                    "--num-requests", "4")  # fmt: skip
    # With the prefix hot only the suffixes are computed: 4 x 8 tokens (4 x 72 without the cache).
    assert report["prefill_tokens_computed_on"] == 32 and report["distinct_tokens"] == 32
    assert report["computed_over_ideal"] == round(32 / (64 + 32), 3)
    assert len(report["ratio_per_run"]) == 2
    assert 0 < report["mean_ttft_on_s"] and 0 < report["mean_ttft_off_s"] and report["ratio"] > 0


def test_multi_turn_report(tiny_models, capsys):
    report = _bench(tiny_models, capsys, "--scenario", "multi-turn", "--runs", "1", "--turn-tokens", "10",
                    "--answer-tokens", "5")  # fmt: skip
    assert len(report["ttft_per_turn_on"]) == 5 and len(report["ttft_per_turn_off"]) == 5
    assert report["final_prompt_tokens"] == 4 * (10 + 5) + 10


def test_kv_tier_report(tiny_models, capsys):
    """After the restart, turn 5's history comes from the disk tier: all its full blocks."""
    report = _bench(tiny_models, capsys, "--scenario", "kv-tier", "--runs", "1", "--turn-tokens", "10",
                    "--answer-tokens", "5")  # fmt: skip
    assert report["prompt_tokens"] == 4 * (10 + 5) + 10
    assert report["disk_cached_tokens"] == (report["prompt_tokens"] - 1) // 16 * 16
    assert report["bytes_read_per_run"] > 0
    assert all(report[f"turn5_ttft_{k}_s"] > 0 for k in ("warm", "disk", "cold"))
    assert report["disk_over_cold"] > 0


def test_multi_turn_history_comes_from_the_cache(tiny_models):
    """The scenario's premise: each turn's history (earlier turns and answers) is served by the
    prefix cache when it is on, and computed again when it is off."""
    from inferd import LLM
    from inferd.bench.prefix import multi_turn
    from inferd.loader import load_model

    loaded = load_model(tiny_models["llama-hf"].path, verbose=False)
    prompt_tokens = sum(10 + t * (10 + 5) for t in range(5))  # turn t: t turns of history + 10
    computed, hits = {}, {}
    for cache in (True, False):
        llm = LLM(loaded=loaded, verbose=False, enable_prefix_caching=cache,
                  kv_cache_memory=4 << 20)  # fmt: skip
        run = multi_turn(llm, loaded.tokenizer, turns=5, turn_tokens=10, answer_tokens=5)
        assert run["final_prompt_tokens"] == 4 * (10 + 5) + 10
        stats = llm.get_stats()
        assert stats.prefix_cache_queries_total == prompt_tokens
        computed[cache], hits[cache] = stats.prompt_tokens_total, stats.prefix_cache_hits_total
        llm.engine.check_no_leaks()
    assert (computed[False], hits[False]) == (prompt_tokens, 0)
    assert hits[True] > 0 and computed[True] == prompt_tokens - hits[True]


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_cpu_clock_with_one_thread(tiny_models, capsys, restore_threads):
    model = str(tiny_models["llama-hf"].path)
    argv = ["bench", "prefix", "--model", model, "--runs", "1", "--prefix-len", "64",
            "--suffix-len", "8", "--num-requests", "4", "--threads", "1", "--clock", "cpu"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert report["threads"] == 1 and report["clock"] == "cpu"
    assert report["prefill_tokens_computed_on"] == 32
    assert 0 < report["mean_ttft_on_s"] and 0 < report["mean_ttft_off_s"]


def test_cpu_clock_refused_with_several_threads(tiny_models, capsys, restore_threads):
    model = str(tiny_models["llama-hf"].path)
    assert main(["bench", "prefix", "--model", model, "--threads", "2", "--clock", "cpu"]) == 2
    assert "--clock cpu needs --threads 1" in capsys.readouterr().err
