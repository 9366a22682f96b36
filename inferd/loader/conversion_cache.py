"""A cache of converted GGUF models (safetensors + metadata) so later starts skip dequantizing.

An entry holds either fp32 weights, or — when the file's quantization is kept — the packed blocks
of each `QuantizedWeight` ("<name>::data", "::scales", "::mins") next to the fp32 rest, so a
quantized start reads about the file's size, not four times it.

The `gguf` package parses metadata and dequantizes in numpy, ~5–8 s for the default model; reading
back the converted tensors takes a fraction of a second, which is what keeps startup under 5 s.
The key covers the file's path, size and mtime, so an edited or replaced file is converted anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from inferd.config import ModelConfig
from inferd.loader.default_model import cache_dir
from inferd.loader.tokenizer import Tokenizer
from inferd.loader.weights import LoadedModel
from inferd.private_dir import private_dir
from inferd.quantization.formats import QuantizedWeight

_FORMAT_VERSION = 3  # bumped whenever what a conversion stores changes (weights, tokenizer)


def _entry(path: Path, keep_quantized: bool = False) -> Path:
    st = path.stat()
    key = f"{_FORMAT_VERSION}|{keep_quantized}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return private_dir(cache_dir() / "converted") / hashlib.sha256(key.encode()).hexdigest()[:24]


def _flatten(weights: dict) -> tuple[dict, dict]:
    tensors, quantized = {}, {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            quantized[name] = {"format": w.format, "shape": list(w.shape), "group": w.group,
                               "source": w.source}  # fmt: skip
            for part, t in w.tensors().items():
                tensors[f"{name}::{part}"] = t.contiguous()
        else:
            tensors[name] = w.contiguous()
    return tensors, quantized


def _unflatten(tensors: dict, quantized: dict) -> dict:
    weights = {k: v for k, v in tensors.items() if "::" not in k}
    for name, q in quantized.items():
        weights[name] = QuantizedWeight(q["format"], tensors[f"{name}::data"],
                                        tensors[f"{name}::scales"], tensors.get(f"{name}::mins"),
                                        tuple(q["shape"]), q["group"], q["source"])  # fmt: skip
    return weights


def load_cached(path: Path, keep_quantized: bool = False) -> LoadedModel | None:
    entry = _entry(path, keep_quantized)
    meta_path = entry / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        cfg = meta["config"]
        cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
        if cfg.get("layer_types") is not None:
            cfg["layer_types"] = tuple(cfg["layer_types"])
        config = ModelConfig(**cfg)
        tok = meta["tokenizer"]
        tokenizer = Tokenizer(
            HFTokenizer.from_str(tok["json"]),
            bos_token_id=tok["bos_token_id"],
            eos_token_ids=tok["eos_token_ids"],
            add_bos_token=tok["add_bos_token"],
            chat_template=tok["chat_template"],
        )
        weights = _unflatten(load_file(str(entry / "weights.safetensors")),
                             meta.get("quantized", {}))  # fmt: skip
    except Exception:
        shutil.rmtree(entry, ignore_errors=True)  # a damaged entry is rebuilt, never trusted
        return None
    return LoadedModel(config, weights, tokenizer, str(path), meta["file_type"])


def store(path: Path, model: LoadedModel, keep_quantized: bool = False) -> None:
    """Write the entry under a unique temporary name, then rename it into place: readers see a
    whole entry or none, and an entry another process finished first is kept, not replaced."""
    entry = _entry(path, keep_quantized)
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.tmp-", dir=entry.parent))  # mode 0700
        tensors, quantized = _flatten(model.weights)
        save_file(tensors, str(tmp / "weights.safetensors"))
        tk = model.tokenizer
        meta = {
            "config": dataclasses.asdict(model.config),
            "file_type": model.file_type,
            "quantized": quantized,
            "tokenizer": {
                "json": tk.hf.to_str(),
                "bos_token_id": tk.bos_token_id,
                "eos_token_ids": list(tk.eos_token_ids),
                "add_bos_token": tk.add_bos_token,
                "chat_template": tk.chat_template,
            },
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, entry)  # atomic; fails (ENOTEMPTY/EEXIST) when the entry exists
        except OSError:
            if not (entry / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process stored it first: keep theirs
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # a read-only or full cache only costs speed
