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
from inferd.layers.rotary import rope_kind
from inferd.loader import hf_quantized
from inferd.loader.tokenizer import Tokenizer
from inferd.loader.weights import LoadedModel, ModelLoadError
from inferd.models.spec import activation_of

SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}
_QWEN = ("qwen2", "qwen3", "qwen2_moe")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(base, scaling of the global layers, base of the sliding ones where it differs) from either
    config shape: transformers 5's `rope_parameters` (flat, or per layer type) or the older
    `rope_theta` / `rope_scaling` / `rope_local_base_freq`. A scaling inferd does not compute is an
    error, never ignored."""
    params = cfg.get("rope_parameters")
    local: dict[str, Any] | None = None
    if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    elif isinstance(params, dict):
        full = dict(params)
    else:
        full = dict(cfg.get("rope_scaling") or {})
        if "rope_local_base_freq" in cfg:
            local = {"rope_theta": cfg["rope_local_base_freq"]}
    default_theta = {"gemma3": 1_000_000.0}.get(arch, 10000.0)
    theta = float(full.pop("rope_theta", cfg.get("rope_theta", default_theta)))
    for where in (full, local or {}, cfg):
        if float(where.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 (partial rotary embeddings) is not supported")
    full.pop("partial_rotary_factor", None)
    kind = rope_kind(full)
    full.pop("type", None)  # (the older name of rope_type)
    scaling = {**full, "rope_type": kind} if kind != "default" else None
    if kind == "longrope":
        original = full.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if original is None:
            raise ValueError("longrope scaling needs original_max_position_embeddings")
        scaling = {**full, "rope_type": "longrope", "original_max_position_embeddings": int(original)}
        scaling.setdefault("factor", cfg.get("max_position_embeddings", original) / int(original))
    local_theta = None
    if local is not None and arch == "gemma3":
        if rope_kind(local) != "default":
            raise ValueError(f"rope scaling on sliding layers ({rope_kind(local)!r}) is not supported")
        local_theta = float(local.get("rope_theta", 10000.0))
    return theta, scaling, local_theta


def _sliding(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, layer types): the config's `layer_types` where it has them, else the family's
    rule (Gemma 2 every other layer from the first, Gemma 3 all but every `sliding_window_pattern`th,
    Qwen from `max_window_layers` on when `use_sliding_window`, every layer elsewhere)."""
    window = cfg.get("sliding_window")
    if arch in _QWEN and not cfg.get("use_sliding_window", False):
        window = None
    if arch in ("llama", "olmoe"):
        window = None  # Llama's attention has no window (a stray key in a config is ignored by HF too)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (inferd's attention is causal)")
    types = cfg.get("layer_types")
    if types is not None:
        return (int(window) if window else None), tuple(types)
    if not window:
        return None, None
    window = int(window)
    if arch == "gemma2":
        return window, tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers))
    if arch == "gemma3":
        period = int(cfg.get("sliding_window_pattern", 6))
        return window, tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers))
    if arch in _QWEN:
        first = int(cfg.get("max_window_layers", n_layers))
        return window, tuple("sliding_attention" if i >= first else "full_attention" for i in range(n_layers))
    return window, None


# Routing variants of other mixtures (DeepSeek's grouped or sigmoid routing, ...) by the config
# field that selects them and the values inferd computes.
_ROUTING_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (1,),
                   "topk_group": (1,), "routed_scaling_factor": (1.0,)}  # fmt: skip
# DeepSeek-V2 computes these (None: any value).
_DEEPSEEK_ROUTING = {"topk_method": ("greedy", "group_limited_greedy"), "n_group": None,
                     "topk_group": None, "routed_scaling_factor": None}  # fmt: skip


def _mla(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Multi-head latent attention's sizes (DeepSeek-V2); none for other models."""
    if arch != "deepseek_v2":
        return {}
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias on multi-head latent attention is not supported")
    return {
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "q_lora_rank": int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
    }


def _moe(cfg: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """The mixture fields of `ModelConfig` (none for a dense model); a routing variant inferd
    does not compute is an error naming it."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    deepseek = arch == "deepseek_v2"
    for name, known in _ROUTING_FIELDS.items():
        if deepseek and name in _DEEPSEEK_ROUTING:
            known = _DEEPSEEK_ROUTING[name]
        if cfg.get(name) is not None and known is not None and cfg[name] not in known:
            raise ValueError(f"MoE routing {name}={cfg[name]!r} is not supported (supported: "
                             f"{', '.join(map(repr, known))})")  # fmt: skip
    if cfg.get("clip_qkv") is not None:
        raise ValueError("clip_qkv (clamped q/k/v projections) is not supported")
    sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    if deepseek:  # the first k layers dense
        dense |= set(range(int(cfg.get("first_k_dense_replace") or 0)))
    moe_layers = tuple(i not in dense and (i + 1) % sparse_step == 0 for i in range(n_layers))
    if deepseek:
        moe_size = int(cfg["moe_intermediate_size"])
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": moe_size,
            "norm_topk_prob": False,  # (DeepSeek-V2's router never renormalises, as in transformers)
            "shared_expert_intermediate_size": moe_size * int(cfg.get("n_shared_experts") or 0),
            "shared_expert_gated": False,
            "moe_layers": None if all(moe_layers) else moe_layers,
            "moe_topk_method": cfg.get("topk_method") or "greedy",
            "moe_n_group": int(cfg.get("n_group") or 1),
            "moe_topk_group": int(cfg.get("topk_group") or 1),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        }
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        # Mixtral always renormalises the chosen experts' weights; the others say so.
        "norm_topk_prob": arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe" else 0,
        "moe_layers": None if all(moe_layers) else moe_layers,
    }


def hf_model_config(cfg: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; inferd supports "
            f"{', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias (biases on the MLP projections) is not supported")
    n_heads = cfg["num_attention_heads"]
    n_layers = cfg["num_hidden_layers"]
    eos = _as_tuple(generation.get("eos_token_id")) or _as_tuple(cfg.get("eos_token_id"))
    theta, scaling, local_theta = _rope(cfg, arch)
    window, layer_types = _sliding(cfg, arch, n_layers)
    gemma = arch in ("gemma2", "gemma3")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    activation_of(act)  # an activation inferd does not compute is an error here, at load
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        # (MLA: the rotary part of a query / key head)
        head_dim=(int(cfg["qk_rope_head_dim"]) if arch == "deepseek_v2"
                  else cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),
        attention_bias=(arch == "qwen2" or (arch == "qwen2_moe" and cfg.get("qkv_bias", True))
                        or bool(cfg.get("attention_bias", False))),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=cfg.get("_name_or_path", ""),
        hidden_act=act,
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        **{**_moe(cfg, arch, n_layers), **_mla(cfg, arch)},
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


def load_hf_config(directory: Path) -> ModelConfig:
    """The model config of an HF directory (config.json and generation_config.json)."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{directory}: not a model directory (no config.json)")
    cfg = _read_json(cfg_path)
    gen_path = directory / "generation_config.json"
    try:
        return hf_model_config(cfg, _read_json(gen_path) if gen_path.is_file() else {})
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: required field {e.args[0]!r} is missing") from e
    except ValueError as e:  # an architecture or field inferd does not implement, one out of range
        raise ModelLoadError(f"{cfg_path}: {e}") from e


def load_hf_dir(directory: Path, show_progress: bool = True, keep_quantized: bool = False) -> LoadedModel:
    """`keep_quantized`: an AWQ / GPTQ checkpoint's layers stay int4 (`QuantizedWeight`), else fp32."""
    config = load_hf_config(directory)
    cfg = _read_json(directory / "config.json")
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
