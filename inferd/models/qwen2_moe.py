"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with a mixture of
experts in the layers `decoder_sparse_step` and `mlp_only_layers` pick (the loaders resolve
them into `moe_layers`), each mixture with a shared expert behind a sigmoid gate."""

from __future__ import annotations

from inferd.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    pass
