"""Model loading: GGUF files and HF directories → config, weights, tokenizer."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from inferd.loader import conversion_cache
from inferd.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from inferd.loader.gguf_loader import load_gguf, load_gguf_tokenizer
from inferd.loader.hf_loader import hf_tokenizer, load_hf_config, load_hf_dir
from inferd.loader.tokenizer import ChatTemplateError, Tokenizer
from inferd.loader.weights import LoadedModel, ModelLoadError

__all__ = [
    "ChatTemplateError",
    "LoadedModel",
    "ModelLoadError",
    "Tokenizer",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "DEFAULT_MODEL_NAME",
]


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    if model is None or str(model) == "":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    return path


def load_model(
    model: str | os.PathLike[str] | None,
    *,
    use_cache: bool = True,
    verbose: bool = True,
    quantization: str = "none",
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a GGUF file or HF directory (None: the default model), printing the load time.

    `quantization` is the engine's `--quantization`: unless "none", a GGUF file's Q8_0/Q4_0/Q4_1
    matrices, and an AWQ / GPTQ checkpoint's int4 layers, stay in their blocks (`QuantizedWeight`)
    instead of being dequantized to fp32. Without `with_tokenizer`, a GGUF file's tokenizer is
    not built (the result's may be None): for tools that need the weights and config only."""
    from inferd.quantization.policy import keeps_file_quantization

    keep = keeps_file_quantization(quantization)
    path = resolve_model_path(model)
    start = time.perf_counter()
    if path.is_dir():
        loaded = load_hf_dir(path, show_progress=verbose, keep_quantized=keep)
    elif path.is_file():
        loaded = conversion_cache.load_cached(path, keep) if use_cache else None
        if loaded is None:
            loaded = load_gguf(
                path, show_progress=verbose, keep_quantized=keep, with_tokenizer=with_tokenizer
            )
            if use_cache and loaded.tokenizer is not None:
                conversion_cache.store(path, loaded, keep)
    else:
        raise ModelLoadError(f"{path}: neither a GGUF file nor a model directory")
    if verbose:
        print(
            f"inferd: loaded {path.name} ({loaded.file_type}) in "
            f"{time.perf_counter() - start:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return loaded


def load_tokenizer(model: str | os.PathLike[str] | None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a GGUF file or HF directory (None: the default
    model): its weights are not read."""
    path = resolve_model_path(model)
    if path.is_dir():
        return hf_tokenizer(path, load_hf_config(path))
    return load_gguf_tokenizer(path)
