"""Model architectures by name (a registry: the loader's `architecture` picks the class)."""

from __future__ import annotations

import torch

from inferd.config import ModelConfig
from inferd.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    quantization_group_size: int = 32,
) -> torch.nn.Module:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}")
    # Build on the meta device and materialise once: no wasted random init of 100M+ parameters.
    with torch.device("meta"):
        model = cls(cfg)
    # Cast before loading: quantized layers swapped in by load_weights keep their packed dtypes.
    model = model.to_empty(device=device).to(dtype=dtype)
    model.load_weights(weights, quantization, quantization_group_size)
    model = model.eval()
    model.set_rotary(max_positions, weights.get("rope_freq_factors"), device)
    model.select_kernels(device, dtype)
    return model
