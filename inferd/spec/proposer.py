"""The proposer interface and its registry (one implementation per `--speculative-config` method)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inferd.config import ModelConfig, SpeculativeConfig
from inferd.loader.tokenizer import Tokenizer
from inferd.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from inferd.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer may know of the engine it drafts for; nothing else of it is reachable."""

    spec: SpeculativeConfig
    target: torch.nn.Module  # the target model (an eagle head reads its embedding and LM head)
    model_config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    quantization: str  # the target's --quantization (a draft model's default)
    quantization_group_size: int
    num_kv_blocks: int  # the target's KV pool (a draft model's own pool has as many tokens)
    block_size: int
    enable_prefix_caching: bool
    # A draft model's weights, loaded by the engine before it planned memory (None: load here).
    draft_loaded: LoadedModel | None = None


class Proposer(ABC):
    """Proposes draft tokens for decoding sequences. Contract:
    - `propose` sets each sequence's drafts with `seq.spec.set(tokens, probs)`, at most its `k`
      (fewer or none is fine: a sequence with no drafts decodes one token as usual). `probs` are
      the distributions the drafts were *sampled* from ([n, vocab]); None when they were chosen
      deterministically (argmax, lookup) — the sampler's acceptance rule depends on it.
      `widths[i]` > 0 lets a proposer that ranks alternatives (eagle) add up to that many leaves
      per depth (`seq.spec.set(..., leaves=[(depth, token), ...])`, in depth order); others ignore it.
    - A proposer that `ranks_drafts` (eagle's dynamic tree) knows, for a greedy sequence, the
      probability that each node it could verify is the target's: it drafts the `k` asked, ranks
      the nodes and asks `rows(values)` (the values of its k likeliest nodes, descending) how many
      of them to verify, recording their sum with `seq.spec.set(..., expected=...)`. Without `rows`
      it verifies k.
    - `observe` receives, after every step and only if `needs_hidden`, the target's final hidden
      states of the positions the step computed for each running sequence: its first position
      and the rows [n, hidden] (prompt chunks, plain decodes, a verification's last real token
      and accepted drafts). The token after every one of them is in `seq.token_ids` by then.
    - `verified` receives, only if `wants_row_argmax`, right after a sequence's drafts were
      verified (before the accepted tokens are appended), the target's argmax after each of the
      chain's 1 + k rows: accepted or not (a rejected draft's row still predicts the token after
      it, given the drafts before it).
    - `release` forgets a sequence that finished or was aborted; its resources go back.
    """

    method: str = ""
    needs_hidden: bool = False
    ranks_drafts: bool = False
    shares_across_requests: bool = False  # drafts from what earlier requests wrote (`forget`)
    wants_row_argmax: bool = False  # `verified` is called

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int], widths: list[int] | None = None,
                rows: Callable[[list[float]], int] | None = None) -> None: ...  # fmt: skip

    def observe(self, seqs: list[Sequence], starts: list[int], hidden: list[torch.Tensor]) -> None:
        """hidden[i]: [n_i, hidden_size], positions starts[i] .. starts[i] + n_i - 1 of seqs[i]."""

    def verified(self, seq: Sequence, row_argmax: list[int]) -> None:
        """row_argmax[i]: the target's token after the last real token and drafts 1..i."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (n > 1) starts as a copy of `parent`, whose prompt it shares."""

    def release(self, seq: Sequence) -> None:
        """Called once when `seq` leaves the engine."""

    def check_no_leaks(self) -> None:
        """With no request in flight, nothing per-sequence is held."""

    def forget(self) -> None:
        """Drop what was learned from requests that finished (a benchmark's runs start afresh)."""


def build_proposer(ctx: ProposerContext) -> Proposer:
    """The proposer `ctx.spec.method` names."""
    spec = ctx.spec
    if spec.method == "ngram":
        from inferd.spec.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        from inferd.spec.suffix import SuffixProposer

        return SuffixProposer(spec)
    if spec.method == "lookahead":
        from inferd.spec.lookahead import LookaheadProposer

        return LookaheadProposer(spec)
    if spec.method == "draft_model":
        from inferd.spec.draft_model import DraftModelProposer

        return DraftModelProposer(ctx)
    if spec.method == "medusa":
        from inferd.spec.medusa import MedusaProposer

        return MedusaProposer(ctx)
    from inferd.spec.eagle import EagleProposer

    return EagleProposer(ctx)
