"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) over a ragged batch.

The router runs on the whole batch at once; the (token, expert) pairs are sorted by expert (a
stable sort, so each expert's rows keep token order) and each expert that got any rows runs its
MLP once over all of them: one matmul pair per *active* expert, whatever the batch, and an
expert no token chose is never read. Outputs go back to (token, choice) order, are weighted, and
each token's choices are added in rank order: a token's sum has the same order whatever else
shares its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from inferd.layers.linear import Linear
from inferd.layers.mlp import MLP, ActMul

if TYPE_CHECKING:  # (inferd.models imports this module)
    from inferd.models.spec import MoeSpec


# torch's vectorised elementwise loops leave a tail shorter than their unrolled vectors to scalar
# code whose exp rounds differently, so sigmoid over a [T, 1] column gives a row bits that depend
# on T and the row's place. Spread to this width (a multiple of every SIMD width's unrolled step)
# every element is computed in full vectors.
_SIMD_SAFE_WIDTH = 64


def rowwise_sigmoid(column: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [T, 1] column, each row's bits independent of T and of its place."""
    return torch.sigmoid(column.expand(-1, _SIMD_SAFE_WIDTH).contiguous())[:, :1]


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(hidden_size, spec.num_experts, bias=False)  # the router (kept fp32)
        self.experts = nn.ModuleList(MLP(hidden_size, spec.intermediate) for _ in range(spec.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate:
            self.shared_expert = MLP(hidden_size, spec.shared_intermediate)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        # Tokens routed to each expert since the last `take_expert_counts` (the bench's histogram);
        # made at the first forward, on the batch's device (the module is built on "meta").
        self.expert_counts: torch.Tensor | None = None
        # On the CPU in fp32 with the C++ kernels the layer runs moe_layer.h's moe_forward (the
        # fused decode step's own code): the extension and the layer's weights as it takes them,
        # built at the first forward after load.
        self.kernel: tuple | None = None

    def set_act_mul(self, act_mul: ActMul) -> None:
        for expert in self.experts:
            expert.set_act_mul(act_mul)
        if self.shared_expert is not None:
            self.shared_expert.set_act_mul(act_mul)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [T, k] (by descending probability) and their weights [T, k]:
        softmax over the router's logits in fp32, the top k kept, renormalised where the model
        says so."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)
        weights, experts = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def kernel_weights(self, ext, linear_weights, activation: int):
        """This layer as moe_layer.h takes it (`linear_weights(ext, module)`: a linear's)."""
        if self.expert_counts is None:
            self.expert_counts = torch.zeros(self.spec.num_experts, dtype=torch.int64)
        shared = {}
        if self.shared_expert is not None:
            shared = {"shared_gate_up": linear_weights(ext, self.shared_expert.gate_up_proj),
                      "shared_down": linear_weights(ext, self.shared_expert.down_proj),
                      "shared_gate": self.shared_expert_gate.weight}  # fmt: skip
        return ext.MoeWeights(
            self.gate.weight, [linear_weights(ext, e.gate_up_proj) for e in self.experts],
            [linear_weights(ext, e.down_proj) for e in self.experts], self.spec.top_k, self.spec.renormalize,
            activation, expert_counts=self.expert_counts, **shared,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            ext, weights, int8_activations = self.kernel
            return ext.moe_forward(x, weights, int8_activations)[0]
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The layer in PyTorch ops (any device; the bits of moe_forward on the CPU)."""
        experts, weights = self.route(x)
        t, k = experts.shape
        flat = experts.flatten()  # pair p: token p // k, its (p % k)-th choice
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts)
        if self.expert_counts is None:
            self.expert_counts = torch.zeros_like(counts)
        self.expert_counts += counts
        xs = x.index_select(0, order // k)  # the pairs' rows, grouped by expert
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(self.experts[e].forward(xs[start : start + n]))
                start += n
        ys = outs[0] if len(outs) == 1 else torch.cat(outs)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        pairs = ys.index_select(0, back).view(t, k, -1) * weights.unsqueeze(-1)
        out = pairs[:, 0]
        for j in range(1, k):  # a token's choices summed in their rank order, one add at a time
            out = out + pairs[:, j]
        if self.shared_expert is not None:
            gate = rowwise_sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x)
        return out

    def take_expert_counts(self) -> torch.Tensor:
        """The counts so far (then zeroed in place: the kernel's weights hold the same tensor)."""
        if self.expert_counts is None:
            return torch.zeros(self.spec.num_experts, dtype=torch.int64)
        counts = self.expert_counts.cpu().clone()
        self.expert_counts.zero_()
        return counts
