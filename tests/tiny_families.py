"""Tiny random models of every supported family, written by transformers' own model classes
(`save_pretrained`, fp32) and the same weights as GGUF files the way llama.cpp's
convert_hf_to_gguf.py writes them (its tensor names and metadata per architecture, Q/K rows
permuted for Llama-style rope, Gemma norms stored as w + 1, Phi-3's fused tensors as they come).

Nothing here imports the engine: the names and conventions come from llama.cpp and HF, so a
loader bug cannot cancel itself out. The HF model written is also the parity reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tiny_models import (
    BOS_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    add_gguf_tokenizer,
    build_tokenizer,
    llama_cpp_permute,
    write_tokenizer_files,
)

WINDOW = 8  # the windowed families' sliding window: prompts are several times longer


@dataclass(frozen=True)
class Family:
    """A tiny model of one family: transformers' config class and kwargs, and its GGUF side."""

    arch: str  # inferd's and llama.cpp's architecture name (Mistral: "llama" in GGUF)
    hf_class: str  # transformers' CausalLM class
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    gguf_arch: str | None = None  # where it differs from `arch`

    @property
    def head_dim(self) -> int:
        c = self.config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", "LlamaConfig", {**_BASE, "head_dim": 16}),
    "mistral": Family(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        {**_BASE, "head_dim": 16, "sliding_window": WINDOW},
        gguf_arch="llama",
    ),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {**_BASE}),
    # head size 128 (the kernels' fast path); every layer local (llama.cpp states one window).
    "qwen3": Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {
            **_BASE,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 0,
        },
    ),
    # Soft-capping tight enough to bite on these logits; layer 0 local, layer 1 global.
    "gemma2": Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {
            **_BASE,
            "head_dim": 64,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Head size 256 with one kv head (Gemma 3 270M's shape); layers 0-4 local, 5 global.
    "gemma3": Family(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {
            **_BASE,
            "num_hidden_layers": 6,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 256,
        },
    ),
    # LongRoPE whose short factors apply (contexts up to the original 128 positions).
    "phi3": Family(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            **_BASE,
            "sliding_window": WINDOW + 4,
            "original_max_position_embeddings": 128,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(8)],
                "long_factor": [3.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
}


_MOE = {**_BASE, "num_experts_per_tok": 2}
# Mixtures of experts: 8 experts of 64 (Qwen's `moe_intermediate_size`), top 2.
MOE_FAMILIES = {
    "mixtral": Family("mixtral", "MixtralForCausalLM", "MixtralConfig",
                      {**_MOE, "head_dim": 16, "num_local_experts": 8, "intermediate_size": 64},
                      gguf_arch="llama"),
    # A shared expert; layer 1 dense (mlp_only_layers).
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                        {**_MOE, "num_experts": 8, "moe_intermediate_size": 64,
                         "shared_expert_intermediate_size": 96, "mlp_only_layers": [1]},
                        gguf_arch="qwen2moe"),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        {**_MOE, "head_dim": 32, "num_experts": 8, "moe_intermediate_size": 64,
                         "norm_topk_prob": True},
                        gguf_arch="qwen3moe"),
    "olmoe": Family("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
                    {**_MOE, "num_experts": 8, "intermediate_size": 64}),
    # Multi-head latent attention (latent 32 + rotary 16, queries through a rank-48 bottleneck),
    # layer 0 dense, then 8 routed experts in 4 groups (top 2 groups, top 2 experts, weights x 1.5)
    # and one shared expert.
    "deepseek_v2": Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
                          {**_MOE, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
                           "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
                           "n_routed_experts": 8, "moe_intermediate_size": 64, "n_shared_experts": 1,
                           "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
                           "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
                          gguf_arch="deepseek2"),
}  # fmt: skip


@dataclass
class TinyFamilyModel:
    family: Family
    hf_dir: Path
    gguf_path: Path
    model: torch.nn.Module  # the transformers model (fp32, eval): the parity reference
    vocab_size: int


def _randomize(model: torch.nn.Module, family: Family, seed: int) -> None:
    """Weights whose logits spread widely (no near-ties for greedy): unit-variance embeddings,
    projections scaled by 1/sqrt(fan_in), norms near their identity (Gemma's (1 + w): w near 0)."""
    g = torch.Generator().manual_seed(seed)
    gemma = family.arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if gemma else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)  # fan-in


def build_hf(family: Family, directory: Path, seed: int = 0) -> tuple[torch.nn.Module, int]:
    import transformers

    tok = build_tokenizer("qwen2" if family.arch.startswith("qwen") else "llama-bpe")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    pad = tok.token_to_id(SPECIAL_TOKENS[0])
    config = getattr(transformers, family.config_class)(
        vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **family.config
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, family.hf_class)(config).float().eval()
    _randomize(model, family, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    write_tokenizer_files(directory, tok, family.config["max_position_embeddings"])
    return model, vocab


# ---- GGUF: llama.cpp's names per architecture --------------------------------------------------
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


_MOE_TENSORS = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",  # (DeepSeek's, ungated)
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
# DeepSeek-V2's multi-head latent attention (convert_hf_to_gguf.py's DeepseekV2Model).
_MLA_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}


def _moe_tensors(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A mixture's tensors (transformers' in-memory names, experts stacked) as llama.cpp's
    converter writes them; None for any other tensor."""
    _, _, layer, rest = name.split(".", 3)
    if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] → gate and up stacks [E, I, H]
        gate, up = np.split(arr, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", arr)]
    if rest in _MOE_TENSORS:
        return [(f"blk.{layer}.{_MOE_TENSORS[rest]}", arr.reshape(-1) if "shared_expert_gate" in rest else arr)]
    return None


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in glob:
        return glob[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    table = _GEMMA_LAYER if arch.startswith("gemma") else {**_LAYER, **_MLA_LAYER}
    return f"blk.{layer}.{table[module]}.{kind}"


def _deepseek2_metadata(w: gguf.GGUFWriter, cfg: Any, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters: the newer converter (`split_kv_b`) describes the latent
    as one shared KV head and the per-head sizes as *_mla; the older one states per-head sizes."""
    rope, rank = cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.qk_nope_head_dim + rope)
        w.add_value_length(cfg.v_head_dim)
    w.add_rope_dimension_count(rope)
    w.add_kv_lora_rank(rank)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)


def _split_kv_b(name: str, arr: np.ndarray, cfg: Any) -> list[tuple[str, np.ndarray]]:
    """The newer converter's kv_b: per head, k_b's rows transposed [H, rank, nope] and v_b's
    [H, v, rank] (ggml shapes {nope, rank, H} and {rank, v, H})."""
    _, _, layer, _ = name.split(".", 3)
    kv_b = arr.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
    k_b, v_b = kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]
    return [(f"blk.{layer}.attn_k_b.weight", k_b.transpose(0, 2, 1)), (f"blk.{layer}.attn_v_b.weight", v_b)]


def write_family_gguf(family: Family, model: torch.nn.Module, path: Path, split_kv_b: bool = True) -> None:
    """The HF model's weights and config as convert_hf_to_gguf.py writes them (F32). DeepSeek-V2:
    kv_b split per head as llama.cpp's converter has since its MLA absorption (`split_kv_b`), or
    whole as before."""
    cfg = model.config
    arch = family.gguf_arch or family.arch
    tok = build_tokenizer("qwen2" if family.arch.startswith("qwen") else "llama-bpe")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family.arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    if family.arch != "deepseek_v2":
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full["rope_theta"])
    if family.arch == "deepseek_v2":
        _deepseek2_metadata(w, cfg, split_kv_b)
    elif family.arch.startswith("gemma"):
        w.add_key_length(family.head_dim)
        w.add_value_length(family.head_dim)
    else:
        w.add_rope_dimension_count(family.head_dim)
        if family.head_dim != cfg.hidden_size // cfg.num_attention_heads:
            w.add_key_length(family.head_dim)
            w.add_value_length(family.head_dim)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    experts = (getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
               or getattr(cfg, "n_routed_experts", None))  # fmt: skip
    if experts and family.arch != "deepseek_v2":
        if getattr(cfg, "mlp_only_layers", None):
            raise ValueError("llama.cpp's MoE architectures have a mixture in every layer")
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if family.arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if family.arch == "phi3":
        original = cfg.rope_parameters["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        factor = cfg.max_position_embeddings / original
        w.add_float32(
            f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(factor) / math.log(original))
        )
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor(
            "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)
        )
    add_gguf_tokenizer(w, tok, "qwen2" if family.arch.startswith("qwen") else "llama-bpe")
    for name, arr in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            arr = llama_cpp_permute(arr, heads)
        if family.arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # convert_hf_to_gguf.py's norm_shift
        moe = _moe_tensors(name, arr) if experts and name.startswith("model.layers.") else None
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            moe = _split_kv_b(name, arr, cfg)
        for gguf_name, part in moe or [(gguf_tensor_name(name, family.arch), arr)]:
            w.add_tensor(gguf_name, np.ascontiguousarray(part))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_family(name: str, root: Path, seed: int = 0) -> TinyFamilyModel:
    family = FAMILIES.get(name) or MOE_FAMILIES[name]
    hf_dir = root / f"{name}-hf"
    model, vocab = build_hf(family, hf_dir, seed)
    path = root / f"{name}.gguf"
    write_family_gguf(family, model, path)
    return TinyFamilyModel(family, hf_dir, path, model, vocab)


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], new_tokens: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and, per step, the top-2 logit margin."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = []
    for logits in out.logits:
        top = logits[0].float().topk(2).values
        margins.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt) :].tolist(), margins
