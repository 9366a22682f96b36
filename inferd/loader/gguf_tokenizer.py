"""Rebuilds an HF `tokenizers` tokenizer from a GGUF file's vocabulary.

Two kinds of vocabulary live in GGUF files (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE with merges (Llama 3, Qwen2, SmolLM, Mistral Nemo); `tokenizer.ggml.pre`
  names how text is split before the merges.
- "llama": SentencePiece (Llama 2, Mistral 7B, Phi-3, Gemma): pieces with scores and `<0xXX>` byte
  tokens, spaces written as "▁". It becomes a BPE with byte fallback whose merges are recovered
  from the vocabulary, ranked by score (Gemma: by position in the file, which is its merge order).

The result gives the ids HF transformers gives for the same GGUF (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), except where the file says more than transformers reads: `add_space_prefix` is
honoured (transformers always prefixes Llama-style vocabularies), and SmolLM's "smollm" split puts
every digit on its own, as its own tokenizer.json and llama.cpp do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4
SPACE_MARK = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces

# Split regexes of the tokenizer.json files each `tokenizer.ggml.pre` value comes from.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# StarCoder-style: every digit on its own, then GPT-2's byte-level split.
_DIGIT_SPLIT = ("smollm", "starcoder", "refact")
_GPT2_SPLIT = ("default", "gpt2")  # GPT-2's own regex (the byte-level pre-tokenizer's)
SUPPORTED_PRE = tuple(sorted((*_SPLITS, *_DIGIT_SPLIT, *_GPT2_SPLIT)))

# Architectures whose SentencePiece vocabulary is not Llama's (see `_sentencepiece`).
_GEMMA = ("gemma", "gemma2", "gemma3")
_PHI3 = ("phi3",)


class UnsupportedTokenizerError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer fields of a GGUF file (`tokenizer.ggml.*`)."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None = None  # SentencePiece: higher merges first
    merges: Sequence[str] | None = None  # "left right", best first
    unk_id: int | None = None
    add_space_prefix: bool = True  # SentencePiece: "▁" before the text (llama.cpp's default)


def build_gguf_tokenizer(vocab: GGUFVocab, architecture: str = "llama") -> HFTokenizer:
    """The tokenizer `vocab` describes; UnsupportedTokenizerError names an unknown model or pre."""
    builders: dict[str, Callable[[GGUFVocab, str], HFTokenizer]] = {
        "gpt2": _byte_level,
        "llama": _sentencepiece,
    }
    if vocab.model not in builders:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {vocab.model!r} is not supported; inferd reads "
            f"{', '.join(map(repr, builders))} (byte-level BPE and SentencePiece)"
        )
    if len(vocab.token_types) != len(vocab.tokens):
        raise UnsupportedTokenizerError(
            f"tokenizer.ggml.token_type has {len(vocab.token_types)} entries for "
            f"{len(vocab.tokens)} tokens"
        )
    return builders[vocab.model](vocab, architecture)


# ---- byte-level BPE ("gpt2") -------------------------------------------------------------------
@functools.cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp associates with `tokenizer.ggml.pre`."""
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(False, use_regex=False)])
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
        )
    if pre in _GPT2_SPLIT:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    raise UnsupportedTokenizerError(
        f"GGUF tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; inferd "
        f"knows {', '.join(SUPPORTED_PRE)}"
    )


def _byte_level(vocab: GGUFVocab, architecture: str) -> HFTokenizer:
    pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    if not vocab.merges:
        raise UnsupportedTokenizerError("a byte-level BPE GGUF needs tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
    # A token written in plain UTF-8 rather than the byte alphabet (an added token such as
    # "<think>" usually is both) is looked up in its byte-alphabet spelling, as the merges make it.
    spelled = [t if set(t) <= alphabet else _byte_spelling(t) for t in vocab.tokens]
    ids = {tok: i for i, tok in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tok = HFTokenizer(models.BPE(vocab=ids, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter's mislabel: skipped, as
    # transformers does (adding it would give it a second id).
    _add_listed_tokens(tok, vocab, ids, keep=lambda t: set(t) <= alphabet)
    return tok


def _byte_spelling(text: str) -> str:
    """`text` in the byte-level alphabet (GPT-2's printable stand-in for each UTF-8 byte)."""
    spelled = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in spelled.pre_tokenize_str(text))


# ---- SentencePiece ("llama") -------------------------------------------------------------------
def _sentencepiece(vocab: GGUFVocab, architecture: str) -> HFTokenizer:
    tokens = list(vocab.tokens)
    gemma = architecture in _GEMMA
    if gemma:
        # Gemma files store its runs of spaces as real spaces; as pieces they are "▁▁", "▁▁▁"...
        tokens = [SPACE_MARK * len(t) if t and not t.strip(" ") else t for t in tokens]
    ids = {tok: i for i, tok in enumerate(tokens)}
    if vocab.merges:
        pairs = [tuple(m.split(" ", 1)) for m in vocab.merges]
    elif gemma:
        # Gemma's scores do not follow its merge order; the order of the pieces in the file does.
        pairs = merges_from_vocab(ids, {t: -float(i) for t, i in ids.items()})
    else:
        if vocab.scores is None or len(vocab.scores) != len(tokens):
            raise UnsupportedTokenizerError(
                "a SentencePiece GGUF needs tokenizer.ggml.scores, one per token"
            )
        pairs = merges_from_vocab(ids, dict(zip(tokens, map(float, vocab.scores))))
    unk = (
        tokens[vocab.unk_id]
        if vocab.unk_id is not None and 0 <= vocab.unk_id < len(tokens)
        else None
    )
    bpe = models.BPE(vocab=ids, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    pieces_to_text: list[decoders.Decoder] = [
        decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()
    ]  # fmt: skip
    if gemma:
        # No space prefix: spaces become "▁" and the text is one piece sequence.
        tok.normalizer = normalizers.Replace(" ", SPACE_MARK)
    elif architecture in _PHI3:
        # Phi-3 prefixes every stretch of text between special tokens (its tokenizer.json uses a
        # normalizer, not Metaspace: "  hi" is "▁▁▁hi").
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", SPACE_MARK)]
        )
        pieces_to_text.append(decoders.Strip(" ", 1, 0))
    else:
        # Llama 2 / Mistral: "▁" before the start of the text only (not after special tokens),
        # as transformers' non-legacy Llama tokenizer does; none if the file says so.
        scheme = "first" if vocab.add_space_prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(SPACE_MARK, prepend_scheme=scheme, split=False)
        if vocab.add_space_prefix:
            pieces_to_text.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(pieces_to_text)
    _add_listed_tokens(tok, vocab, ids, keep=lambda t: True)
    return tok


def merges_from_vocab(ids: dict[str, int], score: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces,
    best (highest-scoring) result first; ties by the longer left part, then the longer right part,
    then by position in the vocabulary. This is the order transformers gives them, so that both
    pick the same merge wherever two would apply."""
    found: list[tuple[float, int, int, str, str]] = []
    for piece, piece_score in score.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        local = [(left, right) for left, right in local if left in ids and right in ids]
        local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        found.extend((piece_score, len(left), len(right), left, right) for left, right in local)
    # A stable sort, descending on (score, len(left), len(right)); equal keys keep the order above.
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in found]


def _add_listed_tokens(
    tok: HFTokenizer, vocab: GGUFVocab, ids: dict[str, int], keep: Callable[[str], bool]
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both are
    matched whole in the text before the model splits it. A user-defined token the vocabulary holds
    under another spelling (Gemma's runs of spaces, UTF-8 in a byte-level vocabulary) stays a
    normal piece, as in transformers."""
    added = []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind == _CONTROL and keep(token):
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED and token in ids:
            added.append(AddedToken(token, special=False, normalized=False))
    tok.add_tokens(added)
