"""Mixtral: Llama's attention (a window on every layer where the config sets one) with a mixture
of experts in every layer: top-k of the router's softmax, renormalised over the chosen experts.
Its checkpoints name the mixture `block_sparse_moe` and each expert's projections w1 (gate),
w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import ClassVar

from inferd.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    MOE_MODULE: ClassVar[str] = "block_sparse_moe"
    EXPERT_NAMES: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")
