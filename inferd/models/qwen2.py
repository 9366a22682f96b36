"""Qwen2 / Qwen2.5: Llama's layers with a bias on the q/k/v projections (`attention_bias`, which
the loaders set for this family); a window on the layers from `max_window_layers` on where the
config turns sliding windows on (the loaders resolve it into `layer_types`)."""

from __future__ import annotations

from inferd.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass
