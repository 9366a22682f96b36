"""Learned draft head proposals (EAGLE-style): a small network reads the target's final hidden
state at the last accepted position and the embedding of the token that followed, attends over
the same pairs at every earlier position, predicts the next hidden state, and the target's own LM
head turns it into a draft token; chained k times. The head is trained by
`python -m inferd.spec.train_eagle` (inferd.spec.eagle_head).

Per sequence the proposer keeps the head's keys and values of every position the target computed
(a `DraftCache`, fed by `observe` after each step from the target's hidden states of the step's
rows: prompt chunks, plain decodes, the accepted part of verifications). Positions the target did
not compute for this sequence (a prompt prefix served from the prefix cache) are not in it: the
head then attends over the positions it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from inferd.config import SpeculativeConfig
from inferd.scheduler.sequence import Sequence
from inferd.spec.eagle_head import DraftCache
from inferd.spec.proposer import Proposer

if TYPE_CHECKING:
    from inferd.engine.core import EngineCore


class EagleProposer(Proposer):
    method = "eagle"
    needs_hidden = True

    def __init__(self, engine: EngineCore, spec: SpeculativeConfig) -> None:
        from inferd.spec.eagle_head import EagleHead

        # int8 linears on the CPU (the engine's packed tiles): a draft step streams every weight
        # of the head, k times per target step; drafts are only proposals, verification decides.
        self.head = EagleHead.load(spec.model, engine.runner.model, engine.device, engine.dtype, quantize=True)
        self.caches: dict[int, DraftCache] = {}

    @torch.inference_mode()  # as propose: the caches' buffers are inference tensors
    def observe(self, seqs: list[Sequence], starts: list[int], hidden: list[torch.Tensor]) -> None:
        head = self.head
        rows = torch.cat(hidden)
        positions = torch.cat([torch.arange(s, s + len(h)) for s, h in zip(starts, hidden)])
        # The token after each position: all known once the step's tokens are appended.
        nexts = [t for seq, s, h in zip(seqs, starts, hidden) for t in seq.token_ids[s + 1 : s + 1 + len(h)]]
        x, k, v = head.cache_entries(rows, torch.tensor(nexts, device=rows.device), positions.to(rows.device))
        at = 0
        for seq, start, h in zip(seqs, starts, hidden):
            n = len(h)
            cache = self.caches.get(seq.seq_id)
            if cache is None:
                cache = self.caches[seq.seq_id] = DraftCache(k, head.num_kv_heads, head.head_dim)
            cache.write(start, x[at : at + n], k[at : at + n], v[at : at + n])
            at += n

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None) -> None:
        # A chain starts at the position before the last token: its entry pairs the target's
        # hidden state there with that token.
        widths = widths or [0] * len(seqs)
        ready = [(s, k, w) for s, k, w in zip(seqs, ks, widths)
                 if (c := self.caches.get(s.seq_id)) is not None and c.end == s.num_tokens - 1]  # fmt: skip
        if not ready:
            return
        width = max(w for *_, w in ready)
        caches = [self.caches[s.seq_id] for s, *_ in ready]
        drafted, alts = self.head.draft(caches, max(k for _, k, _ in ready), alternatives=width)
        alts = alts.tolist() if width else None
        for i, ((seq, k, w), row) in enumerate(zip(ready, drafted.tolist())):
            # A draft tree: the head's next w likeliest tokens at each depth, leaves off the chain.
            leaves = [(d + 1, t) for d in range(k) for t in alts[i][d][:w]] if w else None
            seq.set_drafts(row[:k], leaves=leaves)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        cache = self.caches.get(parent.seq_id)
        if cache is not None:
            self.caches[child.seq_id] = cache.copy()

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    def check_no_leaks(self) -> None:
        assert not self.caches, f"draft head caches left for sequences {list(self.caches)}"
