"""The model interface: what the model runner, speculative decoding (a learned head's capture
layers), quantization passes and tools may rely on in a causal LM, whatever its family.

Every family implements it through `inferd.models.decoder.DecoderForCausalLM`; nothing outside
`inferd.models` probes a model with `hasattr`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from inferd.config import ModelConfig
from inferd.kv.kv_cache import LayerKV
from inferd.layers.attention import AttentionBackend, AttentionMetadata
from inferd.models.spec import ModelSpec


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig
    spec: ModelSpec  # per-layer attention spec: windows, rope, norms, soft-capping
    embed_tokens: nn.Module  # token id → row (unscaled: `embed` applies the family's scale)
    layers: nn.ModuleList  # the decoder layers, in order; one (K, V) cache pair each
    norm: nn.Module  # the final norm: `forward` returns hidden states after it
    lm_head: nn.Module  # hidden → logits (the embedding's table where tied)
    attention_backend: AttentionBackend | None  # chosen by `select_kernels`
    # Layers whose output (the residual stream) `forward` keeps in `captured`, ascending: the
    # extra features a learned draft head reads (EAGLE-3).
    capture_layers: tuple[int, ...]
    captured: list[torch.Tensor]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, hidden], the first layer's input (embedding scale applied)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[LayerKV, LayerKV]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; K/V of the step written to the caches."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, vocab] for the rows that sample (final soft-capping applied)."""
        ...

    def load_weights(self, weights: dict, quantization: str = "none", group_size: int = 32) -> None:
        """Copy HF-named weights in (`--quantization` decides what stays quantized)."""
        ...

    def set_rotary(self, max_positions: int, rope_freq_factors: torch.Tensor | None,
                   device: torch.device) -> None:  # fmt: skip
        """Build the RoPE tables for positions [0, max_positions)."""
        ...

    def select_kernels(
        self, device: torch.device, dtype: torch.dtype, attention: str | None = None
    ) -> None:
        """Choose, once, the kernels of the ops the layers call by function."""
        ...

    def weights_repacked(self) -> None:
        """Quantized weights were repacked in place (`pack_quantized_weights`)."""
        ...
