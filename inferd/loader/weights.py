"""What a loader produces: config, weights in HF naming (fp32 or GGUF blocks), tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.config import ModelConfig
from inferd.loader.tokenizer import Tokenizer
from inferd.quantization.formats import QuantizedWeight


class ModelLoadError(ValueError):
    """The model path exists but cannot be loaded: corrupt file, unsupported architecture…"""


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    # HF names: model.layers.0.self_attn.q_proj.weight, ...; fp32 tensors, or GGUF blocks kept as
    # they are (`QuantizedWeight`) when the loader was asked to keep the file's quantization.
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Tokenizer | None  # None only where the loader was asked not to build one
    source: str  # the path it came from
    file_type: str  # e.g. "GGUF Q4_1", "safetensors bfloat16"
