"""The modules a rank's model gains on top of its shard (inferd/distributed/shard.py): the
vocabulary-parallel embedding and LM head, and the all-reduce of each layer's attention and MLP
outputs (partial sums of the row-parallel o_proj and down_proj, or of a mixture's experts)."""

from __future__ import annotations

import torch
from torch import nn

from inferd.distributed.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] → rows [T, hidden]: each rank looks up the ids in its vocabulary range
    [start, start + rows) and zeroes the others; the all-reduce adds one row to zeros, so the
    result is exactly the table's row."""

    def __init__(self, local: nn.Module, start: int, rows: int, group: TPGroup) -> None:
        super().__init__()
        self.local, self.start, self.rows, self.group = local, start, rows, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self.local(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)


class VocabParallelHead(nn.Module):
    """Hidden [B, hidden] → logits [B, vocab]: each rank's rows of the vocabulary, gathered in
    rank order (no sum: every logit is one rank's dot product, as a single engine computes it)."""

    def __init__(self, local: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.local, self.group = local, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.local(x), dim=-1)


def parallelize(model: nn.Module, group: TPGroup) -> None:
    """Turn a model built from rank `group.rank`'s shard into that rank's part of the whole:
    the embedding and head over the vocabulary, and each layer's outputs summed across ranks (in
    the Python layers, and in the fused C++ decode step, which calls the same all-reduce)."""
    rows = model.config.vocab_size  # the shard's
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group.rank * rows, rows, group)
    model.lm_head = VocabParallelHead(model.lm_head, group)
    for layer in model.layers:
        layer.reduce = group.all_reduce
