"""HF model directory (config.json, *.safetensors, tokenizer.json) → `LoadedModel`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from inferd.config import ModelConfig
from inferd.loader import hf_quantized
from inferd.loader.tokenizer import Tokenizer
from inferd.loader.weights import LoadedModel, ModelLoadError

SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def hf_model_config(cfg: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; inferd supports "
            f"{', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    n_heads = cfg["num_attention_heads"]
    eos = _as_tuple(generation.get("eos_token_id")) or _as_tuple(cfg.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=cfg.get("_name_or_path", ""),
    )


def _special_id(tok: HFTokenizer, value: Any) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def _chat_template(directory: Path, tcfg: dict[str, Any]) -> str | None:
    """The template as the directory ships it: tokenizer_config.json's `chat_template` (a named
    list: its "default"), else chat_template.jinja or chat_template.json (newer transformers)."""
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template:
        return template
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = directory / "chat_template.json"
    return _read_json(js).get("chat_template") if js.is_file() else None


def hf_tokenizer(directory: Path, config: ModelConfig) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises bare Exception on a malformed file
        raise ModelLoadError(f"{path}: cannot read tokenizer: {e}") from e
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.is_file() else {}
    bos = _special_id(hf, tcfg.get("bos_token"))
    bos = bos if bos is not None else config.bos_token_id
    eos = _special_id(hf, tcfg.get("eos_token"))
    eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *([eos] if eos is not None else [])]))
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:  # Llama 3 and others say it in tokenizer.json's post-processor instead
        add_bos = bos is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return Tokenizer(
        hf,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos_token=bool(add_bos),
        chat_template=_chat_template(directory, tcfg),
    )


def load_hf_dir(directory: Path, show_progress: bool = True, keep_quantized: bool = False) -> LoadedModel:
    """`keep_quantized`: an AWQ / GPTQ checkpoint's layers stay int4 (`QuantizedWeight`), else fp32."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{directory}: not a model directory (no config.json)")
    cfg = _read_json(cfg_path)
    gen_path = directory / "generation_config.json"
    try:
        config = hf_model_config(cfg, _read_json(gen_path) if gen_path.is_file() else {})
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: required field {e.args[0]!r} is missing") from e
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    dtypes: set[str] = set()
    method = hf_quantized.quant_method(cfg)
    for f in tqdm(files, desc="Loading safetensors", unit="file", disable=not show_progress,
                  leave=False):  # fmt: skip
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    t = sf.get_tensor(name)
                    dtypes.add(str(t.dtype).removeprefix("torch."))
                    # Packed int32 words of a quantized checkpoint must not pass through fp32.
                    weights[name] = t if method and not t.is_floating_point() else t.float()
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read safetensors: {e}") from e
    if method:
        weights = hf_quantized.convert(weights, cfg, keep_quantized)
        dtypes.add(method.upper())
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        raise ModelLoadError(f"{directory}: lm_head.weight missing and embeddings are not tied")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=hf_tokenizer(directory, config),
        source=str(directory),
        file_type=f"safetensors ({', '.join(sorted(dtypes))})",
    )
