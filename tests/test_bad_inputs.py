"""Each bad input raises one clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from tiny_models import TinySpec, write_gguf, write_hf_dir

from inferd import LLM, SamplingParams
from inferd.engine.core import RequestError
from inferd.loader import ModelLoadError, load_model

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama_gguf):
    """One engine for the whole module: bad requests must not disturb it."""
    llm = LLM(str(tiny_llama_gguf.path), kv_cache_memory=1 << 20, dtype="float32", device="cpu",
              max_model_len=MAX_MODEL_LEN, verbose=False)  # fmt: skip
    yield llm
    llm.engine.check_no_leaks()


@pytest.fixture(scope="module")
def good_prompts(tiny_llama_gguf) -> list[list[int]]:
    return [[5, 17, 42, 99, 123], list(range(10, 40))]


@pytest.fixture(scope="module")
def reference(llm, good_prompts) -> list[list[int]]:
    """Greedy outputs of the good prompts, each run alone."""
    outs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in good_prompts]
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _step(engine, done: dict[str, list[int]]) -> None:
    """One engine step; finished requests' output tokens go into `done`."""
    for delta in engine.step():
        state = engine.requests.get(delta.request_id)
        if delta.finished and state is not None and state.finished:
            done[delta.request_id] = engine.pop_finished(delta.request_id).outputs[0].token_ids


# ---- request-level: RequestError from the engine, the engine keeps serving --------------------
def _bad_requests(vocab: int) -> list[tuple[object, SamplingParams, str]]:
    """(prompt, params, words the error must contain)."""
    too_long = list(range(3, 3 + MAX_MODEL_LEN + 6))  # 70 tokens: 7 over (one must be generated)
    return [
        ("", GREEDY, "prompt is empty"),
        ([], GREEDY, "prompt is empty"),
        (too_long, GREEDY, "7 over"),
        ("x" * 400, GREEDY, "over the limit"),
        ([5, 6, vocab], GREEDY, f"token id {vocab} is out of range"),
        ([5, -1, 6], GREEDY, "token id -1 is out of range"),
        ([5, "a"], GREEDY, "prompt must be"),
        (None, GREEDY, "prompt must be"),
        ([5, 6], SamplingParams(logit_bias={vocab + 3: 1.0}), f"logit_bias token id {vocab + 3}"),
        ([5, 6], SamplingParams(stop_token_ids=[vocab]), f"stop_token_ids entry {vocab}"),
    ]


def test_bad_requests_raise_and_engine_keeps_serving(llm, good_prompts, reference) -> None:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    # A good request is already in flight (prefilled, decoding) when the bad ones arrive.
    done: dict[str, list[int]] = {}
    engine.add_request("good-0", good_prompts[0], GREEDY)
    _step(engine, done)
    for i, (prompt, params, words) in enumerate(_bad_requests(vocab)):
        with pytest.raises(RequestError) as err:
            engine.add_request(f"bad-{i}", prompt, params)
        assert words in str(err.value), (prompt, str(err.value))
        assert f"bad-{i}" not in engine.requests
        if i == 3:
            engine.add_request("good-1", good_prompts[1], GREEDY)
        _step(engine, done)
    while engine.has_unfinished_requests():
        _step(engine, done)
    assert done == {"good-0": reference[0], "good-1": reference[1]}
    engine.check_no_leaks()


def test_too_long_prompt_message_counts_tokens(llm) -> None:
    with pytest.raises(RequestError) as err:
        llm.engine.add_request("long", list(range(3, 73)), GREEDY)
    msg = str(err.value)
    assert "70 tokens" in msg and "7 over" in msg and f"max_model_len is {MAX_MODEL_LEN}" in msg
    # The longest prompt that fits leaves room for exactly one generated token.
    (out,) = llm.generate({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN - 1))},
                          SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # fmt: skip
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason in ("length", "stop")
    with pytest.raises(RequestError, match="1 over"):
        llm.engine.add_request("long", list(range(3, 3 + MAX_MODEL_LEN)), GREEDY)
    llm.engine.check_no_leaks()


def test_generate_refuses_a_bad_batch_before_running_any(llm, good_prompts, reference) -> None:
    prompts = [{"prompt_token_ids": good_prompts[0]}, {"prompt_token_ids": []}]
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in good_prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    llm.engine.check_no_leaks()


# ---- sampling parameters: refused when built, naming the field --------------------------------
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": -5}, "max_tokens must be an integer >= 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": -0.1}, "top_p must be in (0, 1]"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias must map integer token ids to numbers"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be > 0"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": [1, 2]}, "stop must be a string or a list of strings"),
        ({"stop": ["ok", 3]}, "stop must be a string or a list of strings"),
        ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
        ({"stop": ""}, "stop strings must not be empty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be >= 0"),
    ],
)
def test_bad_sampling_params(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)
    assert str(err.value).count("\n") == 0  # one line


def test_good_edge_sampling_params(llm, good_prompts, reference) -> None:
    """Values at the edges of their ranges are accepted and run as they say."""
    prompts = [{"prompt_token_ids": p} for p in good_prompts]
    vocab = llm.engine.model_config.vocab_size
    # top_p = 1 at temperature 0 is greedy; max_tokens = 1 stops after the reference's first token.
    one = SamplingParams(top_p=1.0, temperature=0.0, max_tokens=1, stop=["a", "b"])
    assert one.stop_strings == ("a", "b")
    for out, want in zip(llm.generate(prompts, one, use_tqdm=False), reference):
        (c,) = out.outputs
        assert c.token_ids == want[:1] and c.finish_reason == "length", (c, want)
        assert not {"a", "b"} & set(c.text)
    # max_tokens = None: no limit but the context (and the stop string, which never shows).
    unbounded = SamplingParams(stop=("a",), max_tokens=None, n=4, seed=0)
    assert unbounded.stop_strings == ("a",)
    eos = set(llm.engine.eos_token_ids)
    stopped_at_a = 0
    for out in llm.generate(prompts, unbounded, use_tqdm=False):
        assert len(out.outputs) == 4
        for c in out.outputs:
            assert c.token_ids and all(0 <= t < vocab for t in c.token_ids)
            assert "a" not in c.text
            if c.finish_reason == "length":
                assert len(out.prompt_token_ids) + len(c.token_ids) == MAX_MODEL_LEN, c
            else:
                assert c.finish_reason == "stop", c
                assert c.stop_reason == "a" or (c.stop_reason is None and c.token_ids[-1] in eos), c
                stopped_at_a += c.stop_reason == "a"
    assert stopped_at_a  # this tiny vocabulary's random text reaches an "a" in most samples
    to_context = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for out, want in zip(llm.generate(prompts, to_context, use_tqdm=False), reference):
        (c,) = out.outputs
        assert c.finish_reason == "length" and c.token_ids[: len(want)] == want
        assert len(out.prompt_token_ids) + len(c.token_ids) == MAX_MODEL_LEN
    llm.engine.check_no_leaks()


# ---- model paths: missing, truncated, corrupt, unsupported ------------------------------------
def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="/nope"):
        LLM("/nope", verbose=False)


def test_truncated_gguf(tmp_path: Path, tiny_llama_gguf) -> None:
    data = tiny_llama_gguf.path.read_bytes()
    for name, cut in [("half.gguf", len(data) // 2), ("header.gguf", 64), ("magic.gguf", 4)]:
        path = tmp_path / name
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as err:
            LLM(str(path), kv_cache_memory=1 << 20, verbose=False)
        assert str(path) in str(err.value), str(err.value)


def test_corrupt_gguf(tmp_path: Path, tiny_llama_gguf) -> None:
    rng = random.Random(0)
    path = tmp_path / "random.gguf"
    path.write_bytes(bytes(rng.getrandbits(8) for _ in range(4096)))
    with pytest.raises(ModelLoadError, match=str(path)):
        LLM(str(path), kv_cache_memory=1 << 20, verbose=False)
    # The right magic and version, garbage after: still one ModelLoadError naming the file.
    data = bytearray(tiny_llama_gguf.path.read_bytes())
    data[24:4096] = bytes(rng.getrandbits(8) for _ in range(4096 - 24))
    path = tmp_path / "garbled.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=str(path)):
        load_model(path, verbose=False)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=str(empty)):
        load_model(empty, verbose=False)


def test_corrupt_gguf_metadata(tmp_path: Path, tiny_llama_gguf) -> None:
    """Damage inside the metadata: an undecodable merge, a merge without its space, and seeded
    random byte flips anywhere before the tensor data. Each file loads or raises ModelLoadError."""
    data = tiny_llama_gguf.path.read_bytes()
    merges_at = data.index(b"tokenizer.ggml.merges")
    first_merge = _merges_of(tiny_llama_gguf)[0].encode()
    at = data.index(first_merge, merges_at)
    for name, patch in [("utf8.gguf", b"\xff"), ("nospace.gguf", first_merge.replace(b" ", b"_"))]:
        path = tmp_path / name
        path.write_bytes(data[:at] + patch + data[at + len(patch) :])
        with pytest.raises(ModelLoadError, match=str(path)):
            load_model(path, verbose=False, use_cache=False)

    header_end = gguf.GGUFReader(str(tiny_llama_gguf.path)).data_offset
    rng = random.Random(1234)
    path = tmp_path / "flipped.gguf"
    for _ in range(150):
        damaged = bytearray(data)
        for _ in range(3):
            damaged[rng.randrange(8, header_end)] = rng.randrange(256)
        path.write_bytes(bytes(damaged))
        try:
            load_model(path, verbose=False, use_cache=False)
        except ModelLoadError as e:
            assert str(path) in str(e)


def _merges_of(model) -> list[str]:
    merges = json.loads(model.tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def test_gguf_missing_a_tensor(tmp_path: Path, tiny_llama_gguf) -> None:
    weights = dict(tiny_llama_gguf.original)
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "missing.gguf"
    write_gguf(path, TinySpec(), state_dict=weights)
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), kv_cache_memory=1 << 20, verbose=False)
    assert str(path) in str(err.value) and "model.layers.1.mlp.up_proj.weight" in str(err.value)


def test_damaged_hf_directory(tmp_path: Path, tiny_llama_hf) -> None:
    """A malformed tokenizer.json, a config without hidden_size, a missing or misshapen tensor."""
    weights = dict(tiny_llama_hf.weights)
    del weights["lm_head.weight"]
    write_hf_dir(tmp_path / "no-head", TinySpec(), state_dict=weights)
    weights = dict(tiny_llama_hf.weights)
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:9]
    write_hf_dir(tmp_path / "shape", TinySpec(), state_dict=weights)
    write_hf_dir(tmp_path / "tok", TinySpec())
    (tmp_path / "tok" / "tokenizer.json").write_text("{garbage")
    write_hf_dir(tmp_path / "cfg", TinySpec())
    cfg = json.loads((tmp_path / "cfg" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    cases = [("no-head", "lm_head.weight"), ("shape", "checkpoint shape"),
             ("tok", "tokenizer.json"), ("cfg", "'hidden_size' is missing")]  # fmt: skip
    for name, words in cases:
        with pytest.raises(ModelLoadError) as err:
            LLM(str(tmp_path / name), kv_cache_memory=1 << 20, verbose=False)
        assert str(tmp_path / name) in str(err.value) and words in str(err.value), str(err.value)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, TinySpec(), architecture="gpt2")
    with pytest.raises(ModelLoadError) as err:
        LLM(str(path), kv_cache_memory=1 << 20, verbose=False)
    assert "'gpt2'" in str(err.value) and "unsupported architecture" in str(err.value)
    assert str(path) in str(err.value)


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    write_hf_dir(tmp_path / "gpt2", TinySpec(), architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "gpt2"), kv_cache_memory=1 << 20, verbose=False)
    assert "GPT2LMHeadModel" in str(err.value) and "unsupported architecture" in str(err.value)


def test_hf_dir_without_weights_or_config(tmp_path: Path) -> None:
    directory = tmp_path / "broken"
    write_hf_dir(directory, TinySpec())
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(directory, verbose=False)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(directory, verbose=False)
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty, verbose=False)


# ---- the CLI: exit code 2 and one line ------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.run([sys.executable, "-m", "inferd.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)  # fmt: skip


def test_cli_missing_model() -> None:
    proc = _cli("generate", "--model", "/nope", "x")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("inferd: error: ") and "/nope" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_bad_request_on_a_real_model(tiny_llama_gguf) -> None:
    proc = _cli("generate", "--model", str(tiny_llama_gguf.path), "--kv-cache-memory", "1MiB",
                "--top-p", "1.5", "hello")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("inferd: error: ")]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert "top_p" in errors[0]
    assert "Traceback" not in proc.stderr

