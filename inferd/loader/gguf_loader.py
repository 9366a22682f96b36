"""GGUF → `LoadedModel` through the `gguf` package: metadata, dequantized tensors, tokenizer."""

from __future__ import annotations

import functools
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from inferd.config import ModelConfig
from inferd.loader.chat_templates import default_chat_template
from inferd.loader.gguf_deepseek2 import (
    DEEPSEEK2_LAYER,
    SPLIT_KV_B,
    deepseek2_config,
    deepseek2_layer_tensors,
    deepseek2_rope_scaling,
    merge_split_kv_b,
)
from inferd.loader.gguf_file import GGUFFile, GGUFMetadataError, read_gguf, read_gguf_metadata
from inferd.loader.gguf_tokenizer import (
    GGUFVocab,
    UnsupportedTokenizerError,
    build_gguf_tokenizer,
)
from inferd.loader.tokenizer import Tokenizer
from inferd.loader.weights import LoadedModel, ModelLoadError
from inferd.quantization.formats import GGUF_PACKED, QuantizedWeight, from_gguf_blocks

logger = logging.getLogger("inferd.loader")
# Types that hold floats as they are; every other type is a quantization.
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

# llama.cpp's tensor names per architecture (under blk.{i}.) → HF names (under
# model.layers.{i}.). Every name a table lists must be in every layer unless optional.
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GEMMA_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up stacked, gate first
    "ffn_down.weight": "mlp.down_proj.weight",
}
# A mixture's tensors: the router, and each projection of every expert stacked [E, rows, cols]
# (named as the decoder's loader takes them); Qwen2-MoE's shared expert and its gate.
_MOE = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{k: v for k, v in _LLAMA_LAYER.items() if k.startswith("attn_")},
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# llama.cpp's architecture names that differ from inferd's (a Mixtral GGUF says "llama" and has
# experts).
_GGUF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2"}
# Whether the chosen experts' weights are renormalised, where the file does not say
# (`expert_weights_norm`): as llama.cpp computes each architecture.
_MOE_RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid

# (layer names, the optional ones among them)
_ARCH_TENSORS: dict[str, tuple[dict[str, str], frozenset[str]]] = {
    "llama": ({**_LLAMA_LAYER, **_QKV_BIAS}, frozenset(_QKV_BIAS)),
    "mistral": ({**_LLAMA_LAYER, **_QKV_BIAS}, frozenset(_QKV_BIAS)),
    "qwen2": ({**_LLAMA_LAYER, **_QKV_BIAS}, frozenset()),
    "qwen3": ({**_LLAMA_LAYER, **_QK_NORM}, frozenset()),
    "gemma2": (_GEMMA_LAYER, frozenset()),
    "gemma3": ({**_GEMMA_LAYER, **_QK_NORM}, frozenset()),
    "phi3": (_PHI3_LAYER, frozenset()),
    "mixtral": ({**_MOE, **_QKV_BIAS}, frozenset(_QKV_BIAS)),
    "qwen2_moe": ({**_MOE, **_QKV_BIAS, **_SHARED_EXPERT}, frozenset()),
    "qwen3_moe": ({**_MOE, **_QK_NORM}, frozenset()),
    "olmoe": ({**_MOE, **_QK_NORM}, frozenset()),
    # (which of its tensors a layer has depends on the layer and the file: deepseek2_layer_tensors)
    "deepseek_v2": (DEEPSEEK2_LAYER, frozenset(DEEPSEEK2_LAYER)),
}
SUPPORTED_ARCHITECTURES = tuple(a for a in _ARCH_TENSORS if a != "mixtral")  # (Mixtral: "llama")
# Architectures whose Q/K rows convert_hf_to_gguf.py permutes for llama.cpp's (interleaved) rope.
_PERMUTED_ROPE = ("llama", "mistral", "mixtral")
# Architectures whose norms scale by (1 + w): convert_hf_to_gguf.py stores w + 1.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
_OPTIONAL_GLOBALS = frozenset({"output.weight", "rope_freqs.weight"})
# Phi-3's LongRoPE factors: read into the config's rope scaling, not weights.
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of an `arch` model; None for one such a model has not."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    names = _ARCH_TENSORS[arch][0]
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def _check_tensors(names: list[str], arch: str, num_layers: int, get: Metadata) -> None:
    """ModelLoadError naming the first tensor an `arch` model cannot have, or the first it lacks."""
    layer_names, optional = _ARCH_TENSORS[arch]
    present = set(names)
    for name in names:
        m = _BLOCK_RE.fullmatch(name)
        known = name in _GLOBAL_NAMES or (arch == "phi3" and name in _ROPE_FACTORS)
        if m:
            known = m.group(2) in layer_names and int(m.group(1)) < num_layers
        if not known:
            raise ModelLoadError(f"tensor {name!r} is not one a {arch} model has "
                                 f"(block_count {num_layers}); the file does not match its architecture")  # fmt: skip
    wanted = [g for g in _GLOBAL_NAMES if g not in _OPTIONAL_GLOBALS]
    wanted += [f"blk.{i}.{n}" for i in range(num_layers) for n in layer_names if n not in optional]
    if arch == "deepseek_v2":
        wanted += [f"blk.{i}.{n}" for i in range(num_layers) for n in deepseek2_layer_tensors(get, i, present)]
    missing = [n for n in wanted if n not in present]
    if missing:
        more = f"; {len(missing)} tensors missing in all" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]!r} ({hf_tensor_name(missing[0], arch)}) missing: "
                             f"a {arch} model has it{more}")  # fmt: skip


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved) back to HF's half-split layout."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF layout → llama.cpp's layout (what `convert_hf_to_gguf.py` writes); inverse of the above."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _tensor_values(reader: GGUFFile, name: str) -> list[float] | None:
    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else [float(v) for v in _dequantize(t).reshape(-1)]


def _rope_scaling(reader: GGUFFile, arch: str, get: Any, max_positions: int) -> dict[str, Any] | None:
    """The HF rope_scaling the file's metadata (and Phi-3's factor tensors) state; an error for a
    type inferd does not compute."""
    kind = get("rope.scaling.type")
    original = get("rope.scaling.original_context_length")
    long, short = _tensor_values(reader, _ROPE_FACTORS[0]), _tensor_values(reader, _ROPE_FACTORS[1])
    if long is not None or short is not None:  # Phi-3's LongRoPE
        if long is None or short is None or original is None:
            raise ModelLoadError("LongRoPE needs rope_factors_long, rope_factors_short and "
                                 f"{arch}.rope.scaling.original_context_length")  # fmt: skip
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                   "original_max_position_embeddings": int(original),
                   "factor": max_positions / int(original)}  # fmt: skip
        if get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
        return scaling
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    if kind == "yarn":
        if original is None:
            raise ModelLoadError(f"yarn rope scaling needs {arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": int(original)}  # fmt: skip
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                scaling[hf] = float(get(f"rope.scaling.{key}"))
        return scaling
    raise ModelLoadError(f"unsupported rope scaling type {kind!r} in {arch}.rope.scaling.type "
                         "(supported: linear, yarn, Phi-3's longrope)")  # fmt: skip


def _layer_types(arch: str, num_layers: int, window: int | None) -> tuple[str, ...] | None:
    """Which layers slide: llama.cpp's patterns (not in the file) for Gemma, every layer for
    others that state a window."""
    if window is None:
        return None
    period = {"gemma2": 2, "gemma3": 6}.get(arch)
    if period is None:
        return None
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers))


def model_architecture(reader: GGUFFile) -> tuple[str, str]:
    """(llama.cpp's architecture name, inferd's) of a GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch == "llama" and _field(reader, "llama.expert_count"):
        return arch, "mixtral"
    return arch, _GGUF_ARCH.get(arch, arch)


def _moe_config(get: Metadata, arch: str) -> dict[str, Any]:
    """The mixture fields of `ModelConfig` from a GGUF's metadata (none for a dense model)."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise ModelLoadError(f"MoE expert_gating_func {gating} (sigmoid routing) is not supported (supported: softmax)")
    scale = get("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise ModelLoadError(f"MoE expert_weights_scale {scale} is not supported (supported: 1.0)")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length") or get("feed_forward_length")),
        "norm_topk_prob": bool(get("expert_weights_norm", _MOE_RENORMALIZE[arch])),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length") or 0),
    }


def _model_config(reader: GGUFFile, arch: str, n_vocab: int, model_arch: str | None = None) -> ModelConfig:
    """`arch`: llama.cpp's name (the metadata's prefix); `model_arch`: inferd's, where it differs."""
    model_arch = model_arch or arch
    get = _arch_metadata(reader, arch)
    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    if n_embd is None or n_head is None or get("block_count") is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.embedding_length/head_count/block_count")
    n_layers = int(get("block_count"))
    n_head_kv = get("attention.head_count_kv", n_head)
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or n_embd // n_head)
    rope_dims = get("rope.dimension_count")
    mla = model_arch == "deepseek_v2"  # (its heads' sizes: deepseek2_config)
    if rope_dims is not None and int(rope_dims) != head_dim and not mla:
        raise ModelLoadError(f"{arch}.rope.dimension_count {rope_dims} != head size {head_dim}: "
                             "partial rotary embeddings are not supported")  # fmt: skip
    max_positions = int(get("context_length", 2048))
    window = get("attention.sliding_window")
    window = int(window) if window else None
    gemma = arch in ("gemma2", "gemma3")
    scalar = None
    if gemma:  # llama.cpp: 1/sqrt(n_embd / n_head) for the 27B models, 1/sqrt(head_dim) otherwise
        scalar = n_embd / n_head if n_layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(t for t in (eos, eot) if t is not None))
    fields = {
        "architecture": model_arch,
        "vocab_size": int(get("vocab_size") or n_vocab),
        "hidden_size": int(n_embd),
        "intermediate_size": int(get("feed_forward_length")),
        "num_layers": n_layers,
        "num_heads": int(n_head),
        "num_kv_heads": int(n_head_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, get, max_positions),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,  # corrected below if an output.weight tensor exists
        "attention_bias": arch in ("qwen2", "qwen2moe"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_ids": eos_ids,
        "name": str(_field(reader, "general.name", "") or ""),
        "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",
        "sliding_window": window,
        "layer_types": _layer_types(arch, n_layers, window),
        "rope_local_theta": float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }
    if mla:
        fields.update(deepseek2_config(get, int(n_head), n_layers))
        fields["rope_scaling"] = deepseek2_rope_scaling(fields["rope_scaling"], get)
    else:
        fields.update(_moe_config(get, model_arch))
    return ModelConfig(**fields)


def _arch_metadata(reader: GGUFFile, arch: str) -> Metadata:
    """get(key, default=None): the file's `{arch}.{key}` value."""
    return lambda key, default=None: _field(reader, f"{arch}.{key}", default)


# Control tokens that end a chat turn, by the families' spelling (Gemma's "<end_of_turn>", Llama 3's
# "<|eot_id|>", ChatML's "<|im_end|>", Phi-3's "<|end|>"): generation stops at them as at EOS, as in
# llama.cpp, even where the file names only the end of the document as EOS.
_TURN_ENDS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")
_CONTROL_TOKEN = 3


Metadata = Callable[..., Any]  # get(key, default=None): a metadata value of the file


def gguf_vocab(get: Metadata) -> GGUFVocab:
    """The file's `tokenizer.ggml.*` fields; ModelLoadError if it has no vocabulary."""
    tokens = get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens; cannot build a tokenizer")
    return GGUFVocab(
        model=get("tokenizer.ggml.model", "gpt2"),
        pre=get("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=get("tokenizer.ggml.token_type", [1] * len(tokens)),
        scores=get("tokenizer.ggml.scores"),
        merges=get("tokenizer.ggml.merges"),
        unk_id=get("tokenizer.ggml.unknown_token_id"),
        add_space_prefix=bool(get("tokenizer.ggml.add_space_prefix", True)),
    )


def gguf_tokenizer(get: Metadata) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes: vocabulary, BOS / EOS ids, the BOS rule and
    the chat template as the file states them (a SentencePiece file that does not say adds BOS, as
    llama.cpp and transformers do; a file without a template gets its family's, where one is
    known)."""
    vocab = gguf_vocab(get)
    arch = str(get("general.architecture", "") or "")
    try:
        hf = build_gguf_tokenizer(vocab, arch)
    except UnsupportedTokenizerError as e:
        raise ModelLoadError(str(e)) from e
    named = [get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    turn_ends = [hf.token_to_id(t) for t in _TURN_ENDS]
    turn_ends = [i for i in turn_ends if i is not None and vocab.token_types[i] == _CONTROL_TOKEN]
    return Tokenizer(
        hf,
        bos_token_id=get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in (*named, *turn_ends) if i is not None)),
        add_bos_token=bool(get("tokenizer.ggml.add_bos_token", vocab.model == "llama")),
        chat_template=get("tokenizer.chat_template") or default_chat_template(arch),
    )


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file: its metadata is read, its tensors are not."""
    try:
        metadata = read_gguf_metadata(path)
        return gguf_tokenizer(metadata.get)
    except (GGUFMetadataError, ModelLoadError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.array(tensor.data, dtype=np.float32)  # a copy: the mmap is read-only
    else:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    # ggml lists dims fastest-first; numpy wants them slowest-first.
    return data.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _native(tensor: Any) -> QuantizedWeight:
    """Blocks of a GGUF_PACKED type → the kernels' layout, losslessly (no fp32 detour)."""
    *stack, rows, cols = (int(d) for d in reversed(tensor.shape))
    return from_gguf_blocks(np.asarray(tensor.data), tensor.tensor_type.name, (math.prod(stack) * rows, cols))


def load_gguf(path: Path, show_progress: bool = True, keep_quantized: bool = False,
              with_tokenizer: bool = True) -> LoadedModel:  # fmt: skip
    """Any failure on a damaged file (undecodable strings, merges or vocab the tokenizer refuses)
    surfaces as one ModelLoadError naming the file. `keep_quantized`: matrices of the GGUF_PACKED
    types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) come back as `QuantizedWeight`s instead
    of dequantized fp32; other quantized types are dequantized, and one warning names them. Without
    `with_tokenizer` the result has none (what `inferd info` and tools that pass token ids need)."""
    try:
        return _load_gguf(path, show_progress, keep_quantized, with_tokenizer)
    except ModelLoadError as e:
        if str(path) in str(e):
            raise
        raise ModelLoadError(f"{path}: {e}") from e
    except Exception as e:  # tokenizers raises bare Exception; metadata decoding UnicodeDecodeError
        raise ModelLoadError(f"{path}: corrupt GGUF metadata: {type(e).__name__}: {e}") from e


def _load_gguf(path: Path, show_progress: bool, keep_quantized: bool = False,
               with_tokenizer: bool = True) -> LoadedModel:  # fmt: skip
    try:
        reader = read_gguf(path)
    except GGUFMetadataError as e:
        raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt?): {e}") from e
    gguf_arch, arch = model_architecture(reader)
    if arch not in _ARCH_TENSORS:
        raise ModelLoadError(
            f"{path}: unsupported architecture {gguf_arch!r}; inferd supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (a Mixtral is a llama with experts)"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    config = _model_config(reader, gguf_arch, len(tokens), arch)
    _check_tensors([t.name for t in reader.tensors], arch, config.num_layers, _arch_metadata(reader, gguf_arch))
    tokenizer = gguf_tokenizer(functools.partial(_field, reader)) if with_tokenizer else None
    permuted = arch in _PERMUTED_ROPE
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    types: Counter[str] = Counter()
    dequantized: Counter[str] = Counter()  # quantized matrices without packed kernels
    bar = tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress,
               leave=False)  # fmt: skip
    for t in bar:
        name = hf_tensor_name(t.name, arch)
        if name is None:  # (Phi-3's rope factors, read into the config)
            continue
        types[t.tensor_type.name] += 1
        fp32 = name.endswith(SPLIT_KV_B)  # (dequantized by design: merged back into kv_b)
        if keep_quantized and t.tensor_type.name in GGUF_PACKED and len(t.shape) in (2, 3) and not fp32:
            try:
                qw = _native(t)  # (a 3-D stack of experts: their rows one after another)
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot read tensor {t.name}: {e}") from e
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                qw = qw.rows(unpermute_rope(np.arange(qw.shape[0]), heads))  # rows, as below
            weights[name] = qw
            continue
        if keep_quantized and t.tensor_type.name not in _FLOAT_TYPES and not fp32:
            dequantized[t.tensor_type.name] += 1
        try:
            arr = _dequantize(t)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name}: {e}") from e
        if permuted:
            # convert_hf_to_gguf permutes q/k rows of Llama models for llama.cpp's rope.
            if name.endswith("q_proj.weight"):
                arr = unpermute_rope(arr, config.num_heads)
            elif name.endswith("k_proj.weight"):
                arr = unpermute_rope(arr, config.num_kv_heads)
        if arch in _NORM_PLUS_ONE and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # back to the checkpoint's w (the model adds the 1)
        weights[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if arch == "deepseek_v2":
        merge_split_kv_b(weights, config.num_layers)
    if "lm_head.weight" in weights:
        from dataclasses import replace

        config = replace(config, tie_word_embeddings=False)
    main_type = ", ".join(f"{k}×{v}" for k, v in types.most_common())
    if dequantized:
        note = ", ".join(f"{k}×{v}" for k, v in dequantized.most_common())
        main_type += f"; dequantized to fp32: {note}"
        count = sum(dequantized.values())
        logger.warning("%s: GGUF %s have no packed kernels in inferd: %d tensors dequantized to "
                       "fp32 at load", path, note, count)  # fmt: skip
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(path),
        file_type=f"GGUF ({main_type})",
    )
