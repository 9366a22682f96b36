"""SentencePiece vocabularies for tiny GGUF files, written as llama.cpp's convert_hf_to_gguf.py
writes them: pieces, scores and token types from a trained `sentencepiece` model (byte fallback,
control and user-defined pieces), `tokenizer.ggml.model = llama`, the BOS / space-prefix flags.

Nothing here imports the engine. `write_tokenizer_gguf` writes a file with no tensors (enough for
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` and inferd's `load_gguf_tokenizer`); a whole
tiny model with such a vocabulary comes from `tiny_models.write_gguf(..., vocab=...)`.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
from gguf import TokenType
from tiny_models import _CORPUS_LINES

# A multilingual text with emoji (most fall back to bytes in a tiny vocabulary), code and runs of
# spaces, tabs and newlines.
TEXT = (
    "Grüße aus München! Ελληνικά, русский, 日本語のテキスト, 中文。 Emoji: 🙂🚀✨👩‍💻 ok.\n"
    "def add(a, b):\n    return a + b  # sum\n\n\n\tTabs\tand   runs   of spaces, "
    "1234567890, 3.14159 and \U0001f9ec.   \n"
)
TEXTS = (
    TEXT,
    "The quick brown fox jumps over the lazy dog.",
    "x",
    "    indented(code)\n\t\treturn {'k': [1, 2]}\n",
    "trailing spaces   ",
    "",
)

# Mistral v0.3's control pieces (in its SentencePiece model, after <unk> <s> </s>).
MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]")  # fmt: skip
PHI3_CONTROL = ("<|assistant|>", "<|end|>", "<|user|>", "<|system|>")


@functools.cache
def train_sentencepiece(
    add_dummy_prefix: bool = True, control: tuple[str, ...] = (), vocab_size: int = 700
) -> bytes:
    """A BPE SentencePiece model (the serialized proto) trained on the tiny corpus, byte fallback
    on, no normalization (as Llama's): deterministic for the same arguments."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS_LINES * 8),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        control_symbols=list(control),
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


@dataclass(frozen=True)
class SpmVocab:
    """The `tokenizer.*` fields of a SentencePiece GGUF."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]
    bos_id: int
    eos_id: int
    unk_id: int
    add_bos: bool | None = True  # None: the field is not written
    add_space_prefix: bool | None = None  # None: not written (llama.cpp's default, true)
    chat_template: str | None = None
    model: str = "llama"
    pre: str = "default"

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(list(self.tokens))
        w.add_token_scores(list(self.scores))
        w.add_token_types(list(self.types))
        w.add_bos_token_id(self.bos_id)
        w.add_eos_token_id(self.eos_id)
        w.add_unk_token_id(self.unk_id)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


def vocab_from_sentencepiece(proto: bytes, **fields) -> SpmVocab:
    """convert_hf_to_gguf's `_create_vocab_sentencepiece`: every piece with its score and type."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    ids = {"bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "unk_id": sp.unk_id()}
    return SpmVocab(tuple(tokens), tuple(scores), tuple(types), **{**ids, **fields})


def llama2_vocab(**fields) -> SpmVocab:
    return vocab_from_sentencepiece(train_sentencepiece(), **fields)


def mistral_vocab(**fields) -> SpmVocab:
    return vocab_from_sentencepiece(train_sentencepiece(control=MISTRAL_CONTROL), **fields)


def phi3_vocab(**fields) -> SpmVocab:
    return vocab_from_sentencepiece(train_sentencepiece(control=PHI3_CONTROL), **fields)


def gemma_vocab(**fields) -> SpmVocab:
    """Laid out as Gemma's GGUF is: <pad> <eos> <bos> <unk> first, control turn markers, then
    user-defined runs of newlines and of spaces (stored as real spaces, not "▁"), an HTML tag, and
    the trained pieces; no space prefix."""
    base = vocab_from_sentencepiece(train_sentencepiece(add_dummy_prefix=False))
    head = [("<pad>", TokenType.CONTROL), ("<eos>", TokenType.CONTROL), ("<bos>", TokenType.CONTROL),
            ("<unk>", TokenType.UNKNOWN), ("<start_of_turn>", TokenType.CONTROL),
            ("<end_of_turn>", TokenType.CONTROL), ("\n", TokenType.USER_DEFINED),
            ("\n\n", TokenType.USER_DEFINED), ("  ", TokenType.USER_DEFINED),
            ("   ", TokenType.USER_DEFINED), ("    ", TokenType.USER_DEFINED),
            ("\t", TokenType.USER_DEFINED), ("<table>", TokenType.USER_DEFINED)]  # fmt: skip
    # Pieces are unique, the runs of spaces included under their "▁" spelling.
    taken = {t for t, _ in head} | {"\u2581" * len(t) for t, _ in head if not t.strip(" ")}
    special = {base.bos_id, base.eos_id, base.unk_id}
    body = [
        (t, s, k)
        for i, (t, s, k) in enumerate(zip(base.tokens, base.scores, base.types))
        if i not in special and t not in taken
    ]
    tokens = tuple(t for t, _ in head) + tuple(t for t, _, _ in body)
    # Gemma's scores do not follow its merge order; its file order does.
    scores = (-1000.0,) * len(head) + tuple(-float(i % 7) for i in range(len(body)))
    types = tuple(k for _, k in head) + tuple(k for _, _, k in body)
    vocab = SpmVocab(tokens, scores, types, bos_id=2, eos_id=1, unk_id=3, add_space_prefix=False)
    return replace(vocab, **fields)


def write_tokenizer_gguf(path: Path, architecture: str, vocab: SpmVocab) -> Path:
    """A GGUF with the vocabulary and a tiny model's hyper-parameters, and no tensors."""
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name(f"tiny-{architecture}-tokenizer")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(len(vocab.tokens))
    vocab.write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
