"""OLMoE: Llama-shaped layers whose RMSNorm of queries and keys spans the whole q and k
projections (not each head), and a mixture of 64 experts, top 8, in every layer."""

from __future__ import annotations

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.spec import ModelSpec, uniform_spec


class OlmoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        return uniform_spec(cfg, qk_norm=True, qk_norm_span="all")
