"""Learned draft head proposals (EAGLE-style): a small network reads the target's final hidden
state at the last accepted position and the embedding of the token that followed, predicts the
next hidden state, and the target's own LM head turns it into a draft token; chained k times.
The head is trained by `python -m inferd.spec.train_eagle` (inferd.spec.eagle_head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferd.config import SpeculativeConfig
from inferd.scheduler.sequence import Sequence
from inferd.spec.proposer import Proposer

if TYPE_CHECKING:
    from inferd.engine.core import EngineCore


class EagleProposer(Proposer):
    method = "eagle"
    needs_hidden = True

    def __init__(self, engine: EngineCore, spec: SpeculativeConfig) -> None:
        from inferd.spec.eagle_head import EagleHead

        self.head = EagleHead.load(spec.model, engine.runner.model, engine.device, engine.dtype)
        # Per sequence: the target's hidden state at the position before its last token.
        self.hidden: dict[int, torch.Tensor] = {}

    def observe(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        for seq, h in zip(seqs, hidden):
            self.hidden[seq.seq_id] = h

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> None:
        ready = [(s, k) for s, k in zip(seqs, ks) if s.seq_id in self.hidden]
        if not ready:
            return
        hidden = torch.stack([self.hidden[s.seq_id] for s, _ in ready])
        last = torch.tensor([s.token_ids[-1] for s, _ in ready], device=hidden.device)
        drafted, _ = self.head.draft(hidden, last, max(k for _, k in ready))
        for (seq, k), row in zip(ready, drafted.tolist()):
            seq.set_drafts(row[:k])

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.hidden, f"draft head states left for sequences {list(self.hidden)}"
