"""The KV tier against the real server on the default model: a 5-turn chat conversation, a
restart on the same --kv-offload-dir, and turn 5 replayed from disk — the same text, with nearly
all of its prompt served from the tier; a corrupt block file is recomputed, never used; bad tier
flags stop the server at start-up with a clear message."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inferd.kv.block_hash import chain_hashes
from tests.test_server_utils import SMALL_ENGINE, RemoteServer, assert_no_leaks, metric

TURNS = [
    "Name three colours of the rainbow.",
    "Which of them is the warmest?",
    "Write one sentence about that colour.",
    "Now say it again, more briefly.",
    "Thank you. What did I ask you first?",
]
MAX_TOKENS = 16


def _chat(http: httpx.Client, messages: list[dict]) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", "messages": messages,
                                                 "temperature": 0, "max_tokens": MAX_TOKENS})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _serve(tier: Path) -> RemoteServer:
    # A generous start-up wait: the default model loads slowly on a machine shared with other jobs.
    return RemoteServer(*SMALL_ENGINE, "--enable-debug-endpoints", "--kv-offload-dir", str(tier),
                        "--kv-offload-size", "1GiB", timeout=900)  # fmt: skip


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<I", raw, 8)
    return json.loads(raw[12 : 12 + n])


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    """The conversation on a first server: turn 5's messages and its answer; the tier's dir."""
    tier = tmp_path_factory.mktemp("kv-tier")
    server = _serve(tier)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            messages: list[dict] = []
            for text in TURNS:
                messages.append({"role": "user", "content": text})
                answer = _chat(http, messages)
                if len(messages) < 2 * len(TURNS) - 1:
                    messages.append(
                        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
                    )
            turn5 = messages
            tokens = http.post("/tokenize", json={"messages": turn5}).json()["tokens"]
            # Within one server turn 5's prompt comes from memory (what every turn before it cached).
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert_no_leaks(http)  # flushes the prefix cache: into the tier
    finally:
        server.close()
    assert list(tier.glob("*.kvb")), server.log_text()
    return turn5, tokens, answer, tier


def test_restart_replays_turn_five_from_disk(conversation) -> None:
    turn5, tokens, answer, tier = conversation
    server = _serve(tier)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            again = _chat(http, turn5)
            usage = again["usage"]
            assert (
                again["choices"][0]["message"]["content"]
                == answer["choices"][0]["message"]["content"]
            )
            assert usage["prompt_tokens"] == len(tokens)
            assert (
                usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
            ), usage
            text = http.get("/metrics").text
            assert (
                metric(text, "inferd:kv_offload_hits_total")
                == usage["prompt_tokens_details"]["cached_tokens"]
            )
            assert metric(text, "inferd:kv_offload_bytes_read_total") > 0
            for name in ("bytes_written", "evictions", "dropped_writes"):
                metric(text, f"inferd:kv_offload_{name}_total")  # exported
            assert_no_leaks(http)
    finally:
        server.close()


def test_corrupt_block_file_is_recomputed(conversation) -> None:
    turn5, tokens, answer, tier = conversation
    sixth = chain_hashes(tokens, 16)[5]  # the default block size
    (path,) = [p for p in tier.glob("*.kvb") if _header(p)["block_hash"] == sixth]
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x5A
    path.write_bytes(raw)
    server = _serve(tier)
    try:
        with httpx.Client(base_url=server.url, timeout=600) as http:
            again = _chat(http, turn5)
            assert (
                again["choices"][0]["message"]["content"]
                == answer["choices"][0]["message"]["content"]
            )
            # Blocks 0-4 from the tier; the damaged sixth and everything after it recomputed.
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * 16
            assert_no_leaks(http)
    finally:
        server.close()
    log = server.log_text()
    assert log.count(f"{path.name} fails its checksum") == 1, log


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-offload-dir", "/proc/inferd-kv", "--kv-offload-size", "1GiB"], "not a writable directory"),
    (["--kv-offload-dir", "/tmp/inferd-kv-bad", "--kv-offload-size=-5GiB"], "not a byte size"),
    (["--kv-offload-dir", "/tmp/inferd-kv-bad", "--kv-offload-size", "0"], "--kv-offload-size must be positive"),
    (["--kv-transfer-config", '{"kv_connector": "Nope"}'], "unknown kv_connector 'Nope'"),
])  # fmt: skip
def test_bad_tier_flags_stop_the_server_with_a_clear_error(flags, message) -> None:
    proc = subprocess.run([sys.executable, "-m", "inferd.cli", "serve", *SMALL_ENGINE, "--port", "0", *flags],
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
