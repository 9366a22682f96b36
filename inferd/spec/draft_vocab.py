"""A frequency-ranked draft vocabulary (FR-Spec): the learned head scores only the N tokens the
target most often writes instead of the whole vocabulary.

Why: the LM head over a model's whole vocabulary (SmolLM2's 49,152 tokens) is nearly all of a
greedy draft step's work, against a head body of a few million parameters. Scoring the N most
frequent tokens reads a fraction of those bytes. Outputs never change: the target still verifies
against its full vocabulary, and a token outside the set simply cannot be drafted.

The ids live beside the head's weights as DIR/draft_vocab.safetensors; `EagleHead.load` picks the
file up when present. Ranking them from the target's responses is training's job
(inferd.train.draft_vocab).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILE = "draft_vocab.safetensors"
# Tokens a head drafts over unless told otherwise: on the default model's chat answers, 8,192
# drafted as well as twice as many while its LM-head rows, the largest part of a draft step, cost
# half as much.
DEFAULT_SIZE = 8192


def save(directory: str | Path, ids: torch.Tensor) -> Path:
    """Write `ids` (the token ids to draft over) as `directory`'s draft vocabulary."""
    path = Path(directory) / FILE
    save_file({"ids": ids.to(torch.long).contiguous()}, str(path))
    return path


def load(directory: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The saved ids, or None when the directory has none. ValueError for a damaged file."""
    path = Path(directory).expanduser() / FILE
    if not path.is_file():
        return None
    try:
        ids = load_file(str(path))["ids"]
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path}: unreadable draft vocabulary ({e})") from e
    if ids.dim() != 1 or ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"{path}: draft vocabulary ids must be a non-empty 1-D list in [0, {vocab_size})"
        )
    return ids.to(torch.long)
