"""Verification prices kept on disk (inferd/spec/verify_prices.py): an engine started again with the
same configuration reads the prices the first one measured instead of measuring; another depth is
measured anew; a damaged file is measured over and rewritten; answers are the same either way."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from inferd import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPT = "one two three one two three one two"


def _llm(path: Path, k: int) -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": k}
    return LLM(str(path), kv_cache_memory=16 << 20, max_num_seqs=4, speculative_config=spec,
               verbose=False)  # fmt: skip


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    """A cache of this test's own: what other tests' engines measured is not in it."""
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))


def _files() -> set[Path]:
    return set((Path(os.environ["INFERD_CACHE_DIR"]) / "verify-prices").glob("*.json"))


def _answer(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_restart_reads_the_prices_it_measured(tiny_llama_gguf, caplog) -> None:
    caplog.set_level(logging.INFO, logger="inferd.spec")
    first = _llm(tiny_llama_gguf.path, k=3)
    (written,) = _files()
    assert "verification cost of 1..3 drafts" in caplog.text
    measured, answer = first.engine.spec_policy.verify_cost, _answer(first)
    assert json.loads(written.read_text())["key"]["k"] == 3
    first.close()

    caplog.clear()
    again = _llm(tiny_llama_gguf.path, k=3)
    assert f"verification prices from {written}" in caplog.text
    assert "verification cost of" not in caplog.text  # not measured
    assert again.engine.spec_policy.verify_cost == measured
    assert _answer(again) == answer
    again.close()
    assert _files() == {written}

    caplog.clear()
    deeper = _llm(tiny_llama_gguf.path, k=4)  # another depth: measured, kept beside
    assert "verification cost of 1..4 drafts" in caplog.text
    assert len(_files()) == 2
    deeper.close()


@pytest.mark.parametrize("damage", ["not json", '{"key": 1}', '{"cost": {}}'])
def test_a_damaged_file_is_measured_over(tiny_llama_gguf, caplog, damage: str) -> None:
    caplog.set_level(logging.INFO, logger="inferd.spec")
    _llm(tiny_llama_gguf.path, k=2).close()
    (path,) = _files()
    path.write_text(damage)
    caplog.clear()
    llm = _llm(tiny_llama_gguf.path, k=2)
    assert "verification cost of 1..2 drafts" in caplog.text
    if damage == "not json":
        assert f"ignoring {path}" in caplog.text
    assert json.loads(path.read_text())["key"]["k"] == 2  # rewritten whole
    llm.close()
