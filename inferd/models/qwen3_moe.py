"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (qk-norm per head, no bias) with a
mixture of experts (128 experts, top 8, `norm_topk_prob`) in the layers `moe_layers` names."""

from __future__ import annotations

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.spec import ModelSpec, uniform_spec


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        return uniform_spec(cfg, qk_norm=True)
