"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) over a ragged batch.

The router runs on the whole batch at once; the (token, expert) pairs are sorted by expert (a
stable sort, so each expert's rows keep token order) and each expert that got any rows runs its
MLP once over all of them: one matmul pair per *active* expert, whatever the batch, and an
expert no token chose is never read. Outputs are weighted and added back per token in expert
order, so a token's sum has the same order whatever else shares its batch.
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
        # Tokens routed to each expert since the last `take_expert_counts` (the bench's histogram).
        self.expert_counts = torch.zeros(spec.num_experts, dtype=torch.int64)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts)
        self.expert_counts += counts
        rows = order // self.spec.top_k  # the token of each (token, expert) pair, by expert
        pair_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        xs = x.index_select(0, rows)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                end = start + n
                y = self.experts[e].forward(xs[start:end])
                out.index_add_(0, rows[start:end], y * pair_weights[start:end])
                start = end
        if self.shared_expert is not None:
            gate = rowwise_sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x)
        return out

    def take_expert_counts(self) -> torch.Tensor:
        counts, self.expert_counts = self.expert_counts, torch.zeros_like(self.expert_counts)
        return counts
