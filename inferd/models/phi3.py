"""Phi-3 / Phi-3.5: Llama's layers with q/k/v in one checkpoint tensor (`qkv_proj`) and gate/up
in one (`gate_up_proj`, gate first), LongRoPE scaling (inferd/layers/rotary.py), and a sliding
window on every layer where the config sets one (Phi-3 mini 4k: 2047)."""

from __future__ import annotations

from inferd.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    FUSED_QKV = True
    FUSED_GATE_UP = True
