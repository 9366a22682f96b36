"""DeepSeek-V2 GGUF files (llama.cpp's `deepseek2`): their tensor names, their multi-head latent
attention and routing metadata, and kv_b in either of llama.cpp's layouts, turned into the HF
names and config fields that inferd's MLA model (inferd/models/mla.py) loads.

kv_b_proj ([H · (nope + v), rank] in HF) comes in two layouts:
- files converted before llama.cpp's MLA absorption keep it whole as `attn_kv_b`, and state
  per-head sizes: head_count_kv H, key_length nope + rope, value_length v;
- newer converters split it per head: `attn_k_b`, each head's k rows transposed (ggml shape
  {nope, rank, H}, numpy [H, rank, nope]), and `attn_v_b` (ggml {rank, v, H}, numpy
  [H, v, rank]); their metadata describes the latent as one shared head (head_count_kv 1,
  key_length rank + rope, value_length rank) and puts the per-head sizes in key_length_mla /
  value_length_mla.
Both come back as the HF kv_b_proj. No rows are permuted: the converter writes q_pe's and k_pe's
rows as the checkpoint has them (interleaved pairs, what llama.cpp's deepseek2 rope rotates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from inferd.loader.weights import ModelLoadError

DEEPSEEK2_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # (where there is no q_lora_rank)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",  # (both merged into kv_b_proj at load)
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    # the first leading_dense_block_count layers
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # the others: router, stacked routed experts [E, rows, cols], ungated shared experts
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# The split kv_b's halves: read as fp32 (never kept packed) to be merged back.
SPLIT_KV_B = ("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (DeepSeek-V3's)

Metadata = Callable[..., Any]  # get(key, default=None): a `deepseek2.*` value of the file


def deepseek2_layer_tensors(get: Metadata, layer: int, present: set[str]) -> list[str]:
    """The tensors (llama.cpp's names under blk.{layer}.) that layer must have: q through the
    q_lora bottleneck or not, kv_b in the layout the file uses, a dense MLP or the mixture."""
    names = ["attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
             "attn_output.weight"]  # fmt: skip
    names += ["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"] if get("attention.q_lora_rank") \
        else ["attn_q.weight"]  # fmt: skip
    names += ["attn_kv_b.weight"] if f"blk.{layer}.attn_kv_b.weight" in present \
        else ["attn_k_b.weight", "attn_v_b.weight"]  # fmt: skip
    if layer < int(get("leading_dense_block_count", 0) or 0):
        return names + ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    names += [
        "ffn_gate_inp.weight",
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
    ]
    if int(get("expert_shared_count", 0) or 0):
        names += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
    return names


def deepseek2_config(get: Metadata, num_heads: int, num_layers: int) -> dict[str, Any]:
    """The `ModelConfig` fields of the attention and the mixture that the file's metadata states
    (head_dim: the rotary part of a q / k head, as for an HF DeepSeek-V2); an error naming a
    routing variant inferd does not compute (DeepSeek-V3's sigmoid gating)."""
    rope, rank = get("rope.dimension_count"), get("attention.kv_lora_rank")
    if rope is None or rank is None:
        raise ModelLoadError("a deepseek2 GGUF needs deepseek2.rope.dimension_count and "
                             "deepseek2.attention.kv_lora_rank")  # fmt: skip
    rope, rank = int(rope), int(rank)
    if get("attention.key_length_mla") is not None:  # the split layout's metadata
        qk, v = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:
        qk, v = int(get("attention.key_length")), int(get("attention.value_length"))
    experts = int(get("expert_count", 0) or 0)
    fields: dict[str, Any] = {
        "head_dim": rope,
        "num_kv_heads": num_heads,  # (every head reads the one latent; HF counts them all)
        "kv_lora_rank": rank,
        "q_lora_rank": int(get("attention.q_lora_rank")) if get("attention.q_lora_rank") else None,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v,
    }
    if not experts:
        return fields
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise ModelLoadError(f"MoE expert_gating_func {gating} (sigmoid routing, DeepSeek-V3's) is "
                             "not supported (supported: softmax)")  # fmt: skip
    moe_size = int(get("expert_feed_forward_length"))
    dense = int(get("leading_dense_block_count", 0) or 0)
    groups = int(get("expert_group_count", 1) or 1)
    return {
        **fields,
        "num_experts": experts,
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": moe_size,
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "shared_expert_intermediate_size": moe_size * int(get("expert_shared_count", 0) or 0),
        "shared_expert_gated": False,
        "moe_layers": tuple(i >= dense for i in range(num_layers)) if dense else None,
        # (a group is ranked by its best expert, DeepSeek-V2's group_limited_greedy)
        "moe_topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        "moe_n_group": groups,
        "moe_topk_group": int(get("expert_group_used_count", groups) or groups),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
    }


def deepseek2_rope_scaling(scaling: dict[str, Any] | None, get: Metadata) -> dict[str, Any] | None:
    """YaRN as DeepSeek computes it: the converter stores 0.1 · mscale_all_dim as
    yarn_log_multiplier (HF's mscale equals it in DeepSeek-V2's configs), which scales the
    attention (inferd/models/deepseek_v2.py) and leaves cos / sin unscaled."""
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if scaling is None or scaling.get("rope_type") != "yarn" or not log_mul:
        return scaling
    m = float(log_mul) / 0.1
    return {**scaling, "mscale": m, "mscale_all_dim": m}


def merge_split_kv_b(weights: dict[str, Any], num_layers: int) -> None:
    """Each layer's attn_k_b [H, rank, nope] and attn_v_b [H, v, rank] (fp32) put back together as
    the HF kv_b_proj [H · (nope + v), rank], in place."""
    k_name, v_name = SPLIT_KV_B
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        if prefix + k_name not in weights:
            continue
        k_b, v_b = weights.pop(prefix + k_name), weights.pop(prefix + v_name)
        if (
            k_b.dim() != 3
            or v_b.dim() != 3
            or k_b.shape[0] != v_b.shape[0]
            or k_b.shape[1] != v_b.shape[2]
        ):
            raise ModelLoadError(f"blk.{i}.attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are "
                                 "not [heads, rank, nope] and [heads, v, rank]")  # fmt: skip
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, rank]
        weights[f"{prefix}self_attn.kv_b_proj.weight"] = kv_b.reshape(
            -1, kv_b.shape[-1]
        ).contiguous()
