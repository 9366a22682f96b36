"""DeepSeek-V2 / V2-Lite: multi-head latent attention (inferd/models/mla.py; the KV cache holds
the latent and the rotary key) and, from layer `first_k_dense_replace` on, a mixture of routed
experts (DeepSeek's group-limited top-k where the config says so, weights times
`routed_scaling_factor`) plus ungated shared experts. The attention scale is (nope + rope)^-1/2,
times YaRN's mscale² where the RoPE scaling sets `mscale_all_dim`."""

from __future__ import annotations

import math
from typing import ClassVar

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.spec import ModelSpec, uniform_spec


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    SHARED_EXPERT: ClassVar[str] = "shared_experts"

    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale *= m * m
        return uniform_spec(cfg, attn_scale=scale)
