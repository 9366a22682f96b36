"""Gemma 3 (text): Gemma 2's layers (sandwich norms, (1 + w) norms, GELU-tanh, scaled
embeddings) with qk-norm instead of soft-capping, five local layers (window 512-1024) to one
global, and two RoPE tables: base 10k on local layers (`rope_local_theta`), 1M with the config's
scaling on global ones."""

from __future__ import annotations

from typing import ClassVar

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.gemma2 import GEMMA_NORM_NAMES
from inferd.models.spec import ModelSpec, uniform_spec


class Gemma3ForCausalLM(DecoderForCausalLM):
    NORM_NAMES: ClassVar[dict[str, str | None]] = GEMMA_NORM_NAMES

    @classmethod
    def spec_for(cls, cfg: ModelConfig) -> ModelSpec:
        return uniform_spec(cfg, norm="sandwich", qk_norm=True, embed_scale=True, norm_offset=1.0)
