"""Ranking a learned head's draft vocabulary (inferd.spec.draft_vocab) from the target's answers.

Tokens are counted in the target's own responses (what the head is trained on), then the rest
follow in id order: byte-level BPE vocabularies list earlier (more frequent) merges first.

    python -m inferd.train.draft_vocab --head DIR [--size N] [--num-prompts P]

writes DIR/draft_vocab.safetensors for an already trained head (`python -m
inferd.train.train_eagle` writes it itself).
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable, Sequence

import torch

from inferd.spec.draft_vocab import DEFAULT_SIZE, save


def rank_tokens(streams: Iterable[Sequence[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` token ids to draft over (sorted): most counted in `streams` first, then by id."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = collections.Counter(t for s in streams for t in s if 0 <= t < vocab_size)
    chosen = [t for t, _ in counts.most_common(size)]
    seen = set(chosen)
    for t in range(vocab_size):
        if len(chosen) == size:
            break
        if t not in seen:
            chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def main(argv: list[str] | None = None) -> None:
    from inferd import LLM
    from inferd.train.eagle_data import generate_sequences, instructions

    p = argparse.ArgumentParser(
        description="Write the frequency-ranked draft vocabulary of a trained head"
    )
    p.add_argument("--head", required=True, help="the draft head directory (train_eagle's --out)")
    p.add_argument("--model", default=None, help="the target (default model)")
    p.add_argument("--size", type=int, default=DEFAULT_SIZE)
    p.add_argument("--num-prompts", type=int, default=128, help="train-split instructions answered")
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args(argv)
    llm = LLM(a.model, verbose=False, max_num_seqs=128, kv_cache_memory=1 << 30)
    prompts = instructions("train", a.num_prompts)
    seqs, prompt_lens = generate_sequences(llm, prompts, a.max_tokens, [0.0] * len(prompts))
    ids = rank_tokens(
        [s[n:] for s, n in zip(seqs, prompt_lens)], llm.engine.model_config.vocab_size, a.size
    )
    print(f"wrote {save(a.head, ids)} ({len(ids)} tokens)")


if __name__ == "__main__":
    main()
