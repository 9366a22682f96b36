"""Llama 2/3, SmolLM and Mistral: pre-norm layers, SiLU MLP, one RoPE table (linear / llama3 /
YaRN scaling from the config), a sliding window on every layer where the config sets one
(Mistral 7B v0.1: 4096)."""

from __future__ import annotations

from inferd.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """The base decoder as it is: checkpoint names and traits are Llama's."""
