"""GGUF → `LoadedModel` through the `gguf` package: metadata, dequantized tensors, tokenizer."""

from __future__ import annotations

import functools
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
from inferd.loader.gguf_metadata import GGUFMetadataError, read_gguf_metadata
from inferd.loader.gguf_tokenizer import (
    GGUFVocab,
    UnsupportedTokenizerError,
    build_gguf_tokenizer,
)
from inferd.loader.tokenizer import Tokenizer
from inferd.loader.weights import LoadedModel, ModelLoadError
from inferd.quantization.formats import GGUF_NATIVE, QuantizedWeight, from_gguf_blocks

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

# GGUF tensor names → HF names; "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


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


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _model_config(reader: Any, arch: str, n_vocab: int) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    if n_embd is None or n_head is None or get("block_count") is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.embedding_length/head_count/block_count")
    n_head_kv = get("attention.head_count_kv", n_head)
    head_dim = get("attention.key_length") or get("rope.dimension_count") or n_embd // n_head
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(t for t in (eos, eot) if t is not None))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size") or n_vocab),
        hidden_size=int(n_embd),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(n_head),
        num_kv_heads=int(n_head_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=True,  # corrected below if an output.weight tensor exists
        attention_bias=arch == "qwen2",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=str(_field(reader, "general.name", "") or ""),
    )


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
    """Q8_0/Q4_0/Q4_1 blocks → the kernels' layout, bytes copied (no fp32 detour)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return from_gguf_blocks(np.asarray(tensor.data), tensor.tensor_type.name, shape)


def load_gguf(path: Path, show_progress: bool = True, keep_quantized: bool = False) -> LoadedModel:
    """Any failure on a damaged file (undecodable strings, merges or vocab the tokenizer refuses)
    surfaces as one ModelLoadError naming the file. `keep_quantized`: Q8_0/Q4_0/Q4_1 matrices come
    back as `QuantizedWeight`s in their blocks instead of dequantized fp32."""
    try:
        return _load_gguf(path, show_progress, keep_quantized)
    except ModelLoadError as e:
        if str(path) in str(e):
            raise
        raise ModelLoadError(f"{path}: {e}") from e
    except Exception as e:  # tokenizers raises bare Exception; metadata decoding UnicodeDecodeError
        raise ModelLoadError(f"{path}: corrupt GGUF metadata: {type(e).__name__}: {e}") from e


def _load_gguf(path: Path, show_progress: bool, keep_quantized: bool = False) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors
        raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt?): {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; inferd supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    config = _model_config(reader, arch, len(tokens))
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    types: Counter[str] = Counter()
    bar = tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress,
               leave=False)  # fmt: skip
    for t in bar:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        types[t.tensor_type.name] += 1
        if keep_quantized and t.tensor_type.name in GGUF_NATIVE and len(t.shape) == 2:
            try:
                qw = _native(t)
            except Exception as e:
                raise ModelLoadError(f"{path}: cannot read tensor {t.name}: {e}") from e
            if arch != "qwen2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in name else config.num_kv_heads
                qw = qw.rows(unpermute_rope(np.arange(qw.shape[0]), heads))  # rows, as below
            weights[name] = qw
            continue
        try:
            arr = _dequantize(t)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name}: {e}") from e
        if arch != "qwen2":
            # convert_hf_to_gguf permutes q/k rows of Llama models for llama.cpp's rope.
            if name.endswith("q_proj.weight"):
                arr = unpermute_rope(arr, config.num_heads)
            elif name.endswith("k_proj.weight"):
                arr = unpermute_rope(arr, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if "lm_head.weight" in weights:
        from dataclasses import replace

        config = replace(config, tie_word_embeddings=False)
    main_type = ", ".join(f"{k}×{v}" for k, v in types.most_common())
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=gguf_tokenizer(functools.partial(_field, reader)),
        source=str(path),
        file_type=f"GGUF ({main_type})",
    )
