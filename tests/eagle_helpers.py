"""Shared pieces of the draft head's tests (test_eagle_head, test_train_eagle): a tiny fp32 target,
random token sequences, a head with weights away from their init, and an engine-like cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inferd.loader import load_model
from inferd.models import build_model
from inferd.spec.draft_cache import DraftCache
from inferd.spec.eagle_head import EagleHead


def target_model(path: str | Path) -> torch.nn.Module:
    """The model at `path` as an fp32 CPU target the head can be trained on."""
    loaded = load_model(path, verbose=False)
    return build_model(
        loaded.config,
        loaded.weights,
        max_positions=256,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def sequences(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def trained_like(target: torch.nn.Module, seed: int = 0, **kwargs: Any) -> EagleHead:
    """A head with weights away from their init (so that every part of it matters)."""
    torch.manual_seed(seed)
    head = EagleHead.for_target(target, **kwargs)
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    return head.requires_grad_(False)


def cache_upto(
    head: EagleHead, hidden: torch.Tensor, tokens: torch.Tensor, t: int, lo: int = 0
) -> DraftCache:
    """What the engine's proposer holds once positions lo..t are computed (token t + 1 known)."""
    cache = DraftCache(hidden, head.num_kv_heads, head.head_dim)
    cache.write(
        lo, *head.cache_entries(hidden[lo : t + 1], tokens[lo + 1 : t + 2], torch.arange(lo, t + 1))
    )
    return cache
