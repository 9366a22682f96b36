"""Gemma 2: sandwich norms (each of attention and MLP between a pre and a post RMSNorm), norms
that scale by (1 + w), GELU-tanh MLP, embeddings times sqrt(hidden), attention scale
`query_pre_attn_scalar` ** -0.5, attention-logit and final-logit soft-capping, and a 4096-key
window on every other layer (the loaders' `layer_types`: even layers local)."""

from __future__ import annotations

from typing import ClassVar

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.spec import ModelSpec, uniform_spec

GEMMA_NORM_NAMES = {
    "input_layernorm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


class Gemma2ForCausalLM(DecoderForCausalLM):
    NORM_NAMES: ClassVar[dict[str, str | None]] = GEMMA_NORM_NAMES

    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        return uniform_spec(cfg, norm="sandwich", embed_scale=True, norm_offset=1.0)
