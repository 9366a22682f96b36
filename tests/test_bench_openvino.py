"""`--peers openvino` in `bench latency` and `bench offline` on the default model's GGUF, tiny
lengths; skipped where openvino-genai is not installed."""

from __future__ import annotations

import json

import pytest

from inferd.cli import main

pytest.importorskip("openvino_genai", reason="openvino-genai is not installed")


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_latency_and_throughput_with_the_openvino_peer(capsys) -> None:
    tiny = ["--input-len", "8", "--output-len", "3", "--runs", "1", "--peers", "openvino",
            "--threads", "1"]  # fmt: skip
    assert main(["bench", "latency", *tiny]) == 0
    r = _last_json(capsys)
    assert set(r["engines"]) == {"inferd", "openvino"}
    ov = r["engines"]["openvino"]
    assert ov["decode_tps"] > 0 and ov["prefill_s"] > 0
    assert r["ratio_inferd_vs"]["openvino"] > 0
    assert any(n.startswith("openvino runs") for n in r["notes"])
    assert main(["bench", "offline", "--num-prompts", "2", *tiny]) == 0
    r = _last_json(capsys)
    assert set(r["engines"]) == {"inferd", "openvino"}
    assert r["engines"]["openvino"]["batch_tps"] > 0 and r["ratio_batch"]["openvino"] > 0
