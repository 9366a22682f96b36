"""benchmarks/run_all.py: the whole set as subprocesses, one JSON and one markdown result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import run_all


def test_quick_set_on_a_tiny_model_writes_json_and_markdown(
    tiny_llama_hf, hf_transformers, tmp_path
) -> None:
    names = ["roofline", "latency-fp32", "serve"]
    argv = [
        "--quick",
        "--only",
        ",".join(names),
        "--model",
        str(tiny_llama_hf.path),
        "--out",
        str(tmp_path),
    ]
    assert run_all.main(argv) == 0
    (result,) = tmp_path.glob("*.json")
    report = json.loads(result.read_text())
    assert [e["name"] for e in report["benches"]] == names
    for e in report["benches"]:
        assert e["returncode"] == 0 and "result" in e, e
        assert e["command"].startswith(("inferd bench", "inferd serve"))
    by_name = {e["name"]: e["result"] for e in report["benches"]}
    assert set(by_name["latency-fp32"]["engines"]) == {"inferd", "hf"}
    assert [p["concurrency"] for p in by_name["serve"]["points"]] == [1, 8]
    md = result.with_suffix(".md").read_text()
    # header row, roofline ×2, latency, serve ×2
    assert md.count("\n| ") == 1 + 2 + 1 + 2
    assert (
        "`inferd bench latency --runs 1 --output-len 32 --model" in md
    )  # --quick replaced --runs 3
    assert "llama.cpp peer skipped" in md  # an HF directory is no GGUF: said in the notes


def test_unknown_bench_name_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        run_all.main(["--only", "roofline,nope"])
    assert e.value.code == 2 and "unknown bench(es) ['nope']" in capsys.readouterr().err
