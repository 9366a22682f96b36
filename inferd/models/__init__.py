"""Model architectures by name (a registry: the loader's `architecture` picks the class). Each
family is one file; the interface they all implement is inferd/models/interface.py."""

from __future__ import annotations

import torch

from inferd.config import ModelConfig
from inferd.models.decoder import DecoderForCausalLM
from inferd.models.deepseek_v2 import DeepseekV2ForCausalLM
from inferd.models.gemma2 import Gemma2ForCausalLM
from inferd.models.gemma3 import Gemma3ForCausalLM
from inferd.models.llama import LlamaForCausalLM
from inferd.models.mixtral import MixtralForCausalLM
from inferd.models.olmoe import OlmoeForCausalLM
from inferd.models.phi3 import Phi3ForCausalLM
from inferd.models.qwen2 import Qwen2ForCausalLM
from inferd.models.qwen2_moe import Qwen2MoeForCausalLM
from inferd.models.qwen3 import Qwen3ForCausalLM
from inferd.models.qwen3_moe import Qwen3MoeForCausalLM
from inferd.models.spec import ModelSpec

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported architecture {architecture!r} (supported: {', '.join(MODEL_REGISTRY)})"
        )
    return cls


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The per-layer spec a model of `cfg` runs (nothing is built)."""
    return model_class(cfg.architecture).spec_for(cfg)


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialised storage on `device` for every meta parameter and buffer, floating ones in
    `dtype`: what `to_empty(device).to(dtype)` gives, without its path through torch's meta
    decompositions (which imports sympy, about a second of every engine's start)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                empty = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                table[name] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty


def build_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    quantization_group_size: int = 32,
) -> DecoderForCausalLM:
    cls = model_class(cfg.architecture)
    # Build on the meta device and materialise once: no wasted random init of 100M+ parameters.
    with torch.device("meta"):
        model = cls(cfg)
    # Cast before loading: quantized layers swapped in by load_weights keep their packed dtypes.
    _materialize(model, device, dtype)
    model.load_weights(weights, quantization, quantization_group_size)
    model = model.eval()
    model.set_rotary(max_positions, weights.get("rope_freq_factors"), device)
    model.select_kernels(device, dtype)
    return model
