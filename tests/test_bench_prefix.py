"""`inferd bench prefix` on a tiny model: both scenarios run end to end and report what they claim."""

from __future__ import annotations

import json

import pytest
import torch

from inferd.cli import main


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_shared_prefix_report(tiny_models, capsys):
    model = str(tiny_models["llama-hf"].path)
    argv = ["bench", "prefix", "--model", model, "--runs", "2", "--prefix-len", "64",
            "--suffix-len", "8", "--num-requests", "4"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    # With the prefix hot only the suffixes are computed: 4 x 8 tokens.
    assert report["prefill_tokens_computed_on"] == 32 and report["distinct_tokens"] == 32
    assert len(report["ratio_per_run"]) == 2
    assert 0 < report["mean_ttft_on_s"] and 0 < report["mean_ttft_off_s"] and report["ratio"] > 0


def test_multi_turn_report(tiny_models, capsys):
    model = str(tiny_models["llama-hf"].path)
    argv = ["bench", "prefix", "--model", model, "--scenario", "multi-turn", "--runs", "1",
            "--turn-tokens", "10", "--answer-tokens", "5"]  # fmt: skip
    assert main(argv) == 0
    report = _report(capsys)
    assert len(report["ttft_per_turn_on"]) == 5 and len(report["ttft_per_turn_off"]) == 5
    assert report["final_prompt_tokens"] == 4 * (10 + 5) + 10


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
