"""Qwen3: Llama's layers with RMSNorm over each query and key head before RoPE (qk-norm), no
q/k/v bias."""

from __future__ import annotations

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.spec import ModelSpec, uniform_spec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        return uniform_spec(cfg, qk_norm=True)
