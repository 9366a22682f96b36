"""The gated MLP every decoder layer (and every expert of a mixture) runs: down(act(gate) * up),
gate and up in one matmul, and the activation-mul op chosen once at load."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers.linear import Linear

ActMul = Callable[[torch.Tensor], torch.Tensor]


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate/up side by side [T, 2I] → [T, I], in PyTorch ops."""
    gate, up = gu.split_with_sizes([gu.shape[-1] // 2] * 2, -1)
    return F.silu(gate).mul_(up)  # silu's output is fresh: in place


def gelu_tanh_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, as `silu_mul_torch`."""
    gate, up = gu.split_with_sizes([gu.shape[-1] // 2] * 2, -1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def select_act_mul(activation: str, device: torch.device, dtype: torch.dtype) -> ActMul:
    """The activation-mul op of a model of `dtype` on `device`: for fp32 on the CPU with the C++
    kernels one loop (csrc/layer_ops.h), as the fused decode step runs it."""
    ext = cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    if activation == "silu":
        return ext.silu_mul if ext is not None else silu_mul_torch
    return ext.gelu_tanh_mul if ext is not None else gelu_tanh_mul_torch


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.inter = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, hidden_size, bias=False)
        self.act_mul: ActMul | None = None  # set_act_mul, at load
        # LoRA adapters' batched deltas (inferd/lora/slots.py), set with --enable-lora.
        self.gate_up_lora = None
        self.down_lora = None

    def set_act_mul(self, act_mul: ActMul) -> None:
        self.act_mul = act_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_lora is None:
            return self.down_proj.forward(self.act_mul(self.gate_up_proj.forward(x)))
        h = self.act_mul(self.gate_up_lora.add(x, self.gate_up_proj.forward(x)))
        return self.down_lora.add(h, self.down_proj.forward(h))
