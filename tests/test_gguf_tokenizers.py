"""Tokenizers rebuilt from GGUF vocabularies give HF transformers' ids for the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), family by family: SentencePiece (Llama 2,
Mistral, Phi-3, Gemma: a real Gemma 3 file and a tiny one laid out like it) and byte-level BPE
(Llama 3's and Qwen2's splits). Decoding gives the text back; the engine's streamed text reads as
the continuation of the prompt."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
from real_model import gemma3_gguf, gemma3_hf_tokenizer
from tiny_models import TinySpec, write_gguf
from tiny_tokenizers import (
    TEXT,
    TEXTS,
    gemma_vocab,
    llama2_vocab,
    mistral_vocab,
    phi3_vocab,
    train_sentencepiece,
    vocab_from_sentencepiece,
    write_tokenizer_gguf,
)

from inferd import LLM, SamplingParams
from inferd.loader import ChatTemplateError, ModelLoadError
from inferd.loader.gguf_loader import load_gguf_tokenizer
from inferd.loader.gguf_file import read_gguf_metadata

# The tiny SentencePiece vocabularies are trained with the `sentencepiece` package (a test extra).
needs_sentencepiece = pytest.mark.skipif(
    importlib.util.find_spec("sentencepiece") is None, reason="sentencepiece is not installed"
)

# Chat-shaped strings with each family's control tokens, matched whole.
CHAT_TEXTS = (
    "[INST] What is 2 + 2? [/INST] 4</s>[INST] Thanks! [/INST]",
    "<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>",
    "<start_of_turn>user\nHi  there\n\n<end_of_turn>\n<start_of_turn>model\n",
)


def _byte_tokens(tok, ids: list[int]) -> list[str]:
    return [t for t in (tok.token_to_str(i) for i in ids) if t and t.startswith("<0x")]


def _assert_same_as_transformers(path: Path, texts: tuple[str, ...]) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = load_gguf_tokenizer(path)
    # Every token of the file, and no more (transformers' Gemma class adds a "<mask>" of its own).
    assert tok.vocab_size == len(read_gguf_metadata(path)["tokenizer.ggml.tokens"])
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


@needs_sentencepiece
@pytest.mark.parametrize(
    ("architecture", "vocab"),
    [
        ("llama", llama2_vocab),
        ("mistral", mistral_vocab),
        ("phi3", phi3_vocab),
        ("gemma3", gemma_vocab),
    ],
)
def test_sentencepiece_ids_match_transformers(tmp_path: Path, hf_transformers, architecture,
                                              vocab) -> None:  # fmt: skip
    path = write_tokenizer_gguf(tmp_path / f"{architecture}.gguf", architecture, vocab())
    _assert_same_as_transformers(path, TEXTS + CHAT_TEXTS)
    tok = load_gguf_tokenizer(path)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id  # add_bos_token (said, or SentencePiece's default)
    assert len(_byte_tokens(tok, ids)) >= 8  # the emoji and rare characters fell back to bytes
    for text in _round_trips(architecture):
        assert tok.decode(tok.encode(text)) == text  # byte fallback and "▁" decode back


def _round_trips(architecture: str) -> list[str]:
    """The texts whose ids decode back to them. Llama-style vocabularies prefix "▁" only to a text
    that does not start with a space (transformers' Metaspace, which inferd follows): one of a
    leading run of spaces is lost. Gemma's (no prefix) and Phi-3's (always a prefix) keep it."""
    if architecture in ("gemma3", "phi3"):
        return list(TEXTS)
    return [t for t in TEXTS if not t[:1].isspace()]


@needs_sentencepiece
def test_sentencepiece_ids_match_sentencepiece(tmp_path: Path) -> None:
    """The model the vocabulary came from gives the same pieces: with the space prefix (Llama's),
    and without it where the file says add_space_prefix = false."""
    import sentencepiece as spm

    for prefix in (True, False):
        proto = train_sentencepiece(add_dummy_prefix=prefix)
        sp = spm.SentencePieceProcessor(model_proto=proto)
        path = tmp_path / f"prefix-{prefix}.gguf"
        vocab = vocab_from_sentencepiece(proto, add_space_prefix=prefix, add_bos=False)
        tok = load_gguf_tokenizer(write_tokenizer_gguf(path, "llama", vocab))
        for text in _round_trips("llama") if prefix else TEXTS:
            assert tok.encode(text) == sp.encode(text), (prefix, text)
            assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text)) == text


def test_gemma3_270m_tokenizer_matches_transformers(hf_transformers) -> None:
    """The real file (262,144 pieces). The reference is transformers' GGUF conversion itself (what
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` wraps, less the wrapper's ~20 s)."""
    ref, fields, config = gemma3_hf_tokenizer()
    tok = load_gguf_tokenizer(gemma3_gguf())
    assert tok.vocab_size == len(fields["tokens"]) == 262144
    assert tok.add_bos_token == config["add_bos_token"] is True
    for text in (TEXT, CHAT_TEXTS[2], "  leading and trailing  ", "<table>\n\n\n\t\tx"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, False) == text
    assert tok.token_to_str(tok.bos_token_id) == "<bos>"
    end_of_turn = tok.hf.token_to_id("<end_of_turn>")
    assert end_of_turn in tok.eos_token_ids  # a chat turn's end stops generation
    # The file ships no chat template: Gemma's turn format is the default, system folded in.
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [tok.bos_token_id, tok.hf.token_to_id("<start_of_turn>")]
    assert ids.count(end_of_turn) == 1
    with pytest.raises(ChatTemplateError, match="alternate user and assistant"):
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )


@pytest.mark.parametrize("name", ["qwen2-f32.gguf", "llama-f32.gguf"])
def test_byte_level_ids_match_transformers(tiny_models, hf_transformers, name: str) -> None:
    """Byte-level BPE with Qwen2's split (pre = qwen2: each digit alone) and Llama 3's."""
    _assert_same_as_transformers(tiny_models[name].path, TEXTS)


@needs_sentencepiece
def test_unknown_tokenizer_model_or_pre_is_named(tmp_path: Path) -> None:
    bert = write_tokenizer_gguf(tmp_path / "bert.gguf", "llama", llama2_vocab(model="bert"))
    with pytest.raises(ModelLoadError, match=r"'bert' is not supported.*'gpt2', 'llama'"):
        load_gguf_tokenizer(bert)
    lunar = llama2_vocab(model="gpt2", pre="lunar-bpe")
    path = write_gguf(tmp_path / "lunar.gguf", TinySpec(), vocab=lunar).path
    with pytest.raises(ModelLoadError, match=r"'lunar-bpe'.*not supported.*llama-bpe.*qwen2"):
        load_gguf_tokenizer(path)
    with pytest.raises(ModelLoadError, match="lunar-bpe"):
        LLM(str(path), kv_cache_memory=1 << 20, verbose=False)


@needs_sentencepiece
def test_engine_text_continues_the_prompt(tmp_path: Path) -> None:
    """A tiny Llama with a SentencePiece vocabulary: the output text is what the output tokens add
    to the prompt's text (its first token keeps its "▁" as a space). Byte tokens are banned here:
    random weights would emit bytes that form no character, whose text the next test covers."""
    vocab = llama2_vocab()
    model = write_gguf(tmp_path / "spm.gguf", TinySpec(seed=3), vocab=vocab)
    llm = LLM(str(model.path), kv_cache_memory=1 << 22, dtype="float32", device="cpu",
              verbose=False)  # fmt: skip
    tok = llm.get_tokenizer()
    no_bytes = {i: -100.0 for i, t in enumerate(vocab.types) if t == gguf.TokenType.BYTE}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=no_bytes)
    prompts = ["The quick brown fox", "Grüße aus", "def add(a, b):\n   "]
    spaced = 0
    for out in llm.generate(prompts, params, use_tqdm=False):
        prompt_ids, ids = out.prompt_token_ids, out.outputs[0].token_ids
        whole, prompt = tok.decode(prompt_ids + ids), tok.decode(prompt_ids)
        assert whole.startswith(prompt)
        assert out.outputs[0].text == whole[len(prompt) :]
        spaced += out.outputs[0].text.startswith(" ")
    assert spaced >= 1  # the case the prompt context is for


@needs_sentencepiece
def test_detokenizer_takes_any_byte_sequence() -> None:
    """Byte-fallback tokens that form no character, or form one only with the next token, never
    stop a request: a character split across byte tokens comes out whole, stray bytes as U+FFFD,
    and text already given is never taken back."""
    from inferd.engine.detokenizer import IncrementalDetokenizer
    from inferd.loader.gguf_tokenizer import GGUFVocab, build_gguf_tokenizer
    from inferd.loader.tokenizer import Tokenizer

    vocab = llama2_vocab()
    hf = build_gguf_tokenizer(
        GGUFVocab("llama", "default", vocab.tokens, vocab.types, vocab.scores), "llama"
    )
    tok = Tokenizer(hf, bos_token_id=1, eos_token_ids=(2,), add_bos_token=True, chat_template=None)
    byte = {t: i for i, t in enumerate(vocab.tokens) if t.startswith("<0x")}
    word = tok.encode("fox", add_special_tokens=False)

    def run(ids: list[int]) -> str:
        detok = IncrementalDetokenizer(tok, SamplingParams(), tok.encode("The quick brown"))
        for i in ids:
            detok.add_token(i)
        assert detok.delta(True) == detok.text
        return detok.text

    kanji = [byte[f"<0x{b:02X}>"] for b in "日".encode()]
    assert run(word + kanji + word) == " fox日 fox"
    # "`" (0x60) goes out alone; with the bytes after it, none of the three is valid any more:
    # the "`" given stays, the rest reads as the whole output decodes.
    broken = [byte["<0x60>"], byte["<0xE6>"], byte["<0x41>"]]
    assert tok.decode(word + broken + word) == "fox\ufffd\ufffd\ufffd fox"
    assert run(word + broken + word + kanji + word) == " fox`\ufffd\ufffd fox日 fox"
    assert run(word + kanji[:2] + word) == " fox\ufffd\ufffd fox"


def test_eos_text_is_not_output(tiny_llama_gguf) -> None:
    """The EOS that ends a sequence is not part of its text, even with special tokens kept (as
    for Mistral's tool calls, whose marker is one)."""
    llm = LLM(str(tiny_llama_gguf.path), kv_cache_memory=1 << 20, dtype="float32", device="cpu",
              verbose=False)  # fmt: skip
    eos = tiny_llama_gguf.eos_id
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, logit_bias={eos: 100.0},
                            skip_special_tokens=False)  # fmt: skip
    [out] = llm.generate("The quick brown fox", params, use_tqdm=False)
    done = out.outputs[0]
    assert done.finish_reason == "stop" and done.token_ids[-1] == eos and len(done.token_ids) == 3
    assert "<|im_end|>" not in done.text
    kept = SamplingParams(temperature=0, max_tokens=3, min_tokens=3, ignore_eos=True,
                          logit_bias={eos: 100.0}, skip_special_tokens=False)  # fmt: skip
    [out] = llm.generate("The quick brown fox", kept, use_tqdm=False)
    assert out.outputs[0].text.count("<|im_end|>") == 3  # not ending the text, it stays in it
