"""Loader round trips on tiny models written by the tests (GGUF and HF directories), the conversion
cache, and greedy parity of the engine against HF transformers on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tiny_models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TinyModel,
    TinySpec,
    llama_cpp_permute,
    llama_cpp_unpermute,
    write_gguf,
    write_hf_dir,
)

from inferd import LLM, SamplingParams
from inferd.loader import conversion_cache, load_model
from inferd.loader.gguf_loader import permute_rope, unpermute_rope
from inferd.quantization import formats

ROUND_TRIP_MODELS = [
    "llama-hf",
    "llama-tied-hf",
    "llama-hf-sharded",
    "qwen2-hf",
    "llama-f32.gguf",
    "llama-tied-f32.gguf",
    "qwen2-f32.gguf",
    "qwen2-tied-q8_0.gguf",
    "llama-q8_0.gguf",
    "llama-q4_0.gguf",
    "llama-q4_1.gguf",
    "llama-f16.gguf",
    "llama-mixed.gguf",
]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Digits: 0 7 42 123456789 3.14159, 2024-05-01",
    "Unicode: café naïve Grüße 日本語のテキスト 中文 Ελληνικά 🙂🚀 — “quotes”",
    "  leading spaces, tabs\tand\nnew\n\nlines  ",
    "don't stop, we're sure they'll say it's fine",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    # Where the split regexes differ from GPT-2's: "(x" and ".proj" stay one piece, ":\n" too.
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n",
    "DON'T STOP. We'RE here!\nOk.\n\n",
]

KV_BYTES = 8 << 20  # 8 MiB of KV cache: plenty for the tiny models, cheap to allocate


def _load(model: TinyModel, **kw):
    return load_model(model.path, verbose=False, **kw)


# ---- weights and config ----------------------------------------------------------------------
def test_permute_rope_is_llama_cpp_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        np.testing.assert_array_equal(permute_rope(w, n_head), llama_cpp_permute(w, n_head))
        np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(llama_cpp_permute(w, 8), w)  # the permutation is not the identity
    np.testing.assert_array_equal(llama_cpp_unpermute(llama_cpp_permute(w, 4), 4), w)


@pytest.mark.parametrize("name", ROUND_TRIP_MODELS)
def test_round_trip_config(tiny_models, name: str) -> None:
    model = tiny_models[name]
    spec: TinySpec = model.spec
    cfg = _load(model).config
    assert cfg.architecture == spec.arch
    assert cfg.vocab_size == model.vocab_size
    assert cfg.hidden_size == spec.hidden
    assert cfg.intermediate_size == spec.intermediate
    assert cfg.num_layers == spec.layers
    assert cfg.num_heads == spec.heads
    assert cfg.num_kv_heads == spec.kv_heads
    assert cfg.head_dim == spec.head_dim
    assert cfg.rms_norm_eps == pytest.approx(spec.rms_eps, rel=1e-6)
    assert cfg.rope_theta == spec.rope_theta
    assert cfg.rope_scaling is None
    assert cfg.max_position_embeddings == spec.max_position
    assert cfg.tie_word_embeddings == spec.tied
    assert cfg.attention_bias == (spec.arch == "qwen2")
    assert cfg.bos_token_id == model.bos_id
    assert model.eos_id in cfg.eos_token_ids


@pytest.mark.parametrize("name", ROUND_TRIP_MODELS)
def test_round_trip_weights(tiny_models, name: str) -> None:
    model = tiny_models[name]
    weights = _load(model).weights
    assert set(weights) == set(model.weights)
    exact = all(t in (QType.F32,) for t in model.tensor_types.values())
    for key, want in model.weights.items():
        got = weights[key]
        assert got.dtype == torch.float32 and got.shape == want.shape, key
        if exact:
            assert torch.equal(got, want), f"{key} differs"
        else:
            # `want` is gguf.quants.dequantize of the bytes written, unpermuted: the loader must
            # reproduce it, and it must be near (not equal to) the fp32 original.
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=key)
    if not exact:
        original = model.original
        quantized = [k for k in model.weights if not torch.equal(model.weights[k], original[k])]
        assert quantized, "no tensor was actually quantized"
        for key in quantized:
            orig = model.original[key]
            err = (weights[key] - orig).abs().max().item()
            assert err <= 0.2 * orig.abs().max().item(), f"{key}: quantization error {err}"


def test_quantized_file_has_the_types_written(tiny_models) -> None:
    model = tiny_models["llama-mixed.gguf"]
    file_type = _load(model).file_type
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.F16, QType.F32):
        assert qtype in model.tensor_types.values()
        assert qtype.name in file_type


def test_transformers_reads_our_gguf_as_the_hf_weights(tiny_models, hf_transformers) -> None:
    """Guards the test writer itself: HF's own GGUF reader must undo our Q/K permutation."""
    gguf_model, hf_dir = tiny_models["llama-f32.gguf"], tiny_models["llama-hf"]
    ref = hf_transformers.AutoModelForCausalLM.from_pretrained(
        gguf_model.path.parent, gguf_file=gguf_model.path.name, dtype=torch.float32
    )
    sd = ref.state_dict()
    for key, want in hf_dir.weights.items():
        assert torch.equal(sd[key], want), key


# ---- tokenizer and chat template -------------------------------------------------------------
TOKENIZER_MODELS = ["llama-hf", "llama-f32.gguf", "qwen2-hf", "qwen2-f32.gguf", "llama-mixed.gguf"]


@pytest.mark.parametrize("name", TOKENIZER_MODELS)
def test_tokenizer_round_trip(tiny_models, name: str) -> None:
    model = tiny_models[name]
    tok = _load(model).tokenizer
    ref = model.tokenizer
    assert tok.vocab_size == model.vocab_size
    assert tok.bos_token_id == model.bos_id
    assert tok.eos_token_id == model.eos_id
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == want, text
        want_text = ref.decode(want, skip_special_tokens=False)
        assert tok.decode(want, skip_special_tokens=False) == want_text
        assert tok.decode(want, skip_special_tokens=False) == text
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=True)
    for special in SPECIAL_TOKENS:
        assert tok.encode(f"a{special}b") == [
            *ref.encode("a").ids, ref.token_to_id(special), *ref.encode("b").ids
        ]
    assert set(tok.special_token_ids) == {ref.token_to_id(s) for s in SPECIAL_TOKENS}
    assert tok.decode(tok.encode("x<|im_end|>y")) == "xy"  # specials skipped by default


def test_pre_tokenizer_follows_the_model(tiny_models) -> None:
    """Llama 3 groups digits by three, Qwen2 splits each digit: GGUF 'pre' picks the right one."""
    llama = _load(tiny_models["llama-f32.gguf"]).tokenizer
    qwen = _load(tiny_models["qwen2-f32.gguf"]).tokenizer
    assert len(qwen.encode("1234567890")) == 10
    assert len(llama.encode("1234567890")) < 10


@pytest.mark.parametrize("name", ["llama-hf", "llama-f32.gguf"])
def test_chat_template_renders(tiny_models, name: str) -> None:
    tok = _load(tiny_models[name]).tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.hf.token_to_id("<|im_start|>")) == 3


# ---- conversion cache ------------------------------------------------------------------------
def _entries(cache: Path) -> set[str]:
    converted = cache / "converted"
    return {p.name for p in converted.iterdir()} if converted.is_dir() else set()


def test_conversion_cache(tmp_path: Path, inferd_cache_dir: Path) -> None:
    path = tmp_path / "model.gguf"
    first = write_gguf(path, TinySpec(seed=11), quant="q8_0")
    before = _entries(inferd_cache_dir)

    fresh = load_model(path, verbose=False)
    assert conversion_cache.load_cached(path) is not None
    new = _entries(inferd_cache_dir) - before
    assert len(new) == 1, new

    cached = load_model(path, verbose=False)
    assert cached.config == fresh.config
    assert cached.file_type == fresh.file_type
    assert set(cached.weights) == set(fresh.weights)
    for key, want in first.weights.items():
        assert torch.equal(cached.weights[key], fresh.weights[key]), key
        torch.testing.assert_close(cached.weights[key], want, rtol=0, atol=1e-6)
    assert cached.tokenizer.chat_template == fresh.tokenizer.chat_template == CHAT_TEMPLATE
    assert cached.tokenizer.bos_token_id == fresh.tokenizer.bos_token_id
    assert cached.tokenizer.eos_token_ids == fresh.tokenizer.eos_token_ids
    assert cached.tokenizer.special_token_ids == fresh.tokenizer.special_token_ids
    for text in TEXTS:
        assert cached.tokenizer.encode(text) == fresh.tokenizer.encode(text)

    # Touched: a new key, converted again.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert conversion_cache.load_cached(path) is None
    load_model(path, verbose=False)
    assert conversion_cache.load_cached(path) is not None
    assert len(_entries(inferd_cache_dir) - before) == 2

    # Rewritten with other weights (same size): the new weights, never the stale conversion.
    second = write_gguf(path, TinySpec(seed=12), quant="q8_0")
    assert path.stat().st_size == st.st_size
    reloaded = load_model(path, verbose=False)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(second.weights[key], first.weights[key])
    for key, want in second.weights.items():
        torch.testing.assert_close(reloaded.weights[key], want, rtol=0, atol=1e-6)


def test_damaged_cache_entry_is_rebuilt(tmp_path: Path, inferd_cache_dir: Path) -> None:
    path = tmp_path / "model.gguf"
    model = write_gguf(path, TinySpec(seed=13))
    before = _entries(inferd_cache_dir)
    load_model(path, verbose=False)
    (entry,) = _entries(inferd_cache_dir) - before
    (inferd_cache_dir / "converted" / entry / "weights.safetensors").write_bytes(b"garbage")
    again = load_model(path, verbose=False)
    for key, want in model.weights.items():
        assert torch.equal(again.weights[key], want), key
    assert conversion_cache.load_cached(path) is not None  # stored anew


# ---- greedy parity with HF transformers ------------------------------------------------------
def _llm(model: TinyModel, **kw) -> LLM:
    return LLM(str(model.path), kv_cache_memory=KV_BYTES, dtype="float32", device="cpu",
               verbose=False, **kw)  # fmt: skip


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    # Ids >= 3 skip the special tokens; lengths cross block boundaries (block size 16).
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (1, 7, 23, 50)]


def _hf_greedy(ref, prompt: list[int], max_new: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=max_new, pad_token_id=eos, eos_token_id=eos)  # fmt: skip
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.fixture(scope="module")
def hf_reference(hf_transformers, tiny_models, tmp_path_factory):
    """Tiny model name → HF transformers model on exactly the weights the engine should load."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            model: TinyModel = tiny_models[name]
            if model.path.is_dir():
                directory = model.path
            else:  # a GGUF: its dequantized, unpermuted weights as an HF directory
                directory = tmp_path_factory.mktemp("hf-ref")
                write_hf_dir(directory, model.spec, state_dict=model.weights)
            auto = hf_transformers.AutoModelForCausalLM
            ref = auto.from_pretrained(directory, dtype=torch.float32)
            cache[name] = ref.eval()
        return cache[name]

    return get


PARITY_MODELS = ["llama-hf", "llama-tied-hf", "qwen2-hf", "llama-f32.gguf", "qwen2-tied-q8_0.gguf",
                 "llama-mixed.gguf"]  # fmt: skip


@pytest.mark.parametrize("name", PARITY_MODELS)
def test_greedy_parity_with_transformers(tiny_models, hf_reference, name: str, monkeypatch) -> None:
    # HF runs GGUF blocks dequantized with fp32 activations; so does inferd here (its default int8
    # activations for quantized blocks are bounded in test_quantization / test_perplexity).
    monkeypatch.setattr(formats, "INT8_ACTIVATIONS", False)
    model = tiny_models[name]
    ref = hf_reference(name)
    prompts = _prompts(model.vocab_size)
    max_new = 16
    want = [_hf_greedy(ref, p, max_new, model.eos_id) for p in prompts]
    llm = _llm(model)
    params = SamplingParams(temperature=0, max_tokens=max_new)
    # All prompts in one batch, then one at a time: batch composition must not change the tokens.
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, w, out in zip(prompts, want, together):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == w
        assert out.outputs[0].finish_reason == ("stop" if w[-1] == model.eos_id else "length")
    for p, w in zip(prompts, want):
        (out,) = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        assert out.outputs[0].token_ids == w
    llm.engine.check_no_leaks()


def test_greedy_parity_chunked_prefill(tiny_models, hf_reference) -> None:
    """A 16-token step budget splits the long prompts into chunks that share steps with decodes."""
    model = tiny_models["llama-hf"]
    ref = hf_reference("llama-hf")
    prompts = _prompts(model.vocab_size)
    want = [_hf_greedy(ref, p, 16, model.eos_id) for p in prompts]
    llm = _llm(model, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.engine.check_no_leaks()


def test_greedy_parity_transformers_reading_the_gguf(tiny_models, hf_transformers) -> None:
    """The reference loads the very same GGUF file (transformers' own GGUF reader)."""
    model = tiny_models["llama-f32.gguf"]
    ref = hf_transformers.AutoModelForCausalLM.from_pretrained(
        model.path.parent, gguf_file=model.path.name, dtype=torch.float32
    ).eval()
    prompts = _prompts(model.vocab_size)[1:3]
    want = [_hf_greedy(ref, p, 16, model.eos_id) for p in prompts]
    llm = _llm(model)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == want
