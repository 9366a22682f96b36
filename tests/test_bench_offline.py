"""`inferd bench offline --scenario NAME` on a tiny model with HF transformers in the same run."""

from __future__ import annotations

import json

import pytest

from inferd.cli import main


def _run(model, capsys, *flags: str) -> dict:
    assert main(["bench", "offline", "--model", str(model.path), "--runs", "1", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_throughput(tiny_llama_hf, hf_transformers, capsys) -> None:
    r = _run(tiny_llama_hf, capsys, "--num-prompts", "3", "--input-len", "10", "--output-len", "5",
             "--peers", "hf")  # fmt: skip
    assert r["scenario"] == "throughput" and (
        r["num_prompts"],
        r["input_len"],
        r["output_len"],
    ) == (3, 10, 5)
    assert set(r["engines"]) == {"inferd", "hf"}
    for e in r["engines"].values():
        assert e["single_decode_tps"] > 0 and e["single_ttft_s"] > 0 and e["batch_tps"] > 0
    assert r["ratio_batch"]["hf"] > 0 and r["ratio_single_decode"]["hf"] > 0


def test_multi_turn_replays_one_conversation(tiny_llama_hf, hf_transformers, capsys) -> None:
    r = _run(tiny_llama_hf, capsys, "--scenario", "multi-turn", "--turns", "3", "--prefix-len", "20",
             "--input-len", "8", "--output-len", "4", "--peers", "hf")  # fmt: skip
    # Turn t's prompt is the whole history: system + t × (user + answer) + the new user turn.
    assert r["prompt_tokens_per_turn"] == [28, 40, 52]
    assert set(r["engines"]) == {"inferd", "inferd-no-cache", "hf"}
    for e in r["engines"].values():
        assert len(e["ttft_per_turn_s"]) == 3 and e["e2e_s"] > 0
    assert set(r["ratio_e2e"]) == {"inferd-no-cache", "hf"}


def test_shared_prefix_computes_the_prefix_once(tiny_llama_hf, hf_transformers, capsys) -> None:
    r = _run(tiny_llama_hf, capsys, "--scenario", "shared-prefix", "--num-prompts", "4",
             "--prefix-len", "64", "--input-len", "8", "--output-len", "3", "--peers", "hf")  # fmt: skip
    e = r["engines"]
    assert e["inferd-no-cache"]["prefill_tokens_computed"] == 4 * (64 + 8)
    assert e["hf"]["prefill_tokens_computed"] == 4 * (64 + 8)
    # With the cache, the 64-token prefix (4 whole blocks of 16) is computed for one request only.
    assert e["inferd"]["prefill_tokens_computed"] == 64 + 4 * 8
    assert all(x["mean_ttft_s"] > 0 and x["output_tps"] > 0 for x in e.values())


def test_long_context_reports_kv_growth(tiny_llama_hf, hf_transformers, capsys) -> None:
    r = _run(tiny_llama_hf, capsys, "--scenario", "long-context", "--context-lens", "32,max",
             "--output-len", "4", "--peers", "hf")  # fmt: skip
    spec = tiny_llama_hf.spec
    assert r["context_lens"] == [32, spec.max_position - 4]
    kv_tok = 2 * spec.layers * spec.kv_heads * spec.head_dim * 4
    first, last = (p["engines"] for p in r["points"])
    # Paged: whole 16-token blocks; HF: a dense cache of exactly the tokens it holds.
    assert first["inferd"]["kv_mib"] == round(48 * kv_tok / 2**20, 1)
    assert last["hf"]["kv_mib"] == round(spec.max_position * kv_tok / 2**20, 1)
    assert set(r["from_shortest_to_longest"]) == {"inferd", "hf"}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--scenario", "long-context", "--context-lens", "100000"], "--context-lens must be in"),
        (["--num-prompts", "0"], "--num-prompts must be ≥ 1"),
        (["--peers", "hf,tgi"], "unknown peer(s) ['tgi']"),
    ],
)
def test_bad_flags_are_clear_errors(tiny_llama_hf, flags, message, capsys) -> None:
    assert (
        main(["bench", "offline", "--model", str(tiny_llama_hf.path), "--peers", "none", *flags])
        == 2
    )
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("scenario", ["multi-turn", "shared-prefix"])
def test_llama_cpp_peer_in_scenarios(tiny_llama_gguf, scenario, capsys) -> None:
    """llama.cpp (when installed) keeps its context between requests; otherwise one clear note."""
    from inferd.bench.peers import LLAMA_CPP_MISSING, llama_cpp_available

    r = _run(tiny_llama_gguf, capsys, "--scenario", scenario, "--turns", "2", "--num-prompts", "3",
             "--prefix-len", "32", "--input-len", "8", "--output-len", "3", "--peers", "llama.cpp")  # fmt: skip
    if llama_cpp_available():
        assert "llama.cpp" in r["engines"]
        assert any(n.startswith("llama.cpp runs") for n in r["notes"])
    else:
        assert "llama.cpp" not in r["engines"] and LLAMA_CPP_MISSING in r["notes"]
