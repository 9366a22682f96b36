"""Rebuilds an HF `tokenizers` byte-level BPE tokenizer from a GGUF file's vocabulary and merges."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's llama_token_type): 1 normal, 2 unknown, 3 control,
# 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UnsupportedTokenizerError(ValueError):
    pass


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp associates with `tokenizer.ggml.pre`."""
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(False, use_regex=False)])
    if pre in ("qwen2", "deepseek-llm"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(False, use_regex=False)])
    if pre in ("smollm", "starcoder", "refact"):
        # StarCoder-style: every digit on its own, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False)  # "gpt2", "default", unknown


def build_gguf_tokenizer(
    model: str, pre: str, tokens: list[str], merges: list[str], token_types: list[int]
) -> HFTokenizer:
    if model != "gpt2":
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {model!r} is not supported yet (byte-level BPE 'gpt2' is)"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
        for i, t in enumerate(token_types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(specials)
    return tok
