"""The command-line flags every head trainer shares: the target, where the head goes, and the
generated data it learns from (inferd.train.eagle_data)."""

from __future__ import annotations

import argparse

import torch


def add_data_args(p: argparse.ArgumentParser, recipe, head: str) -> None:
    """`recipe`: the trainer's defaults (its num_prompts, num_questions, eval_prompts,
    max_tokens, quantization and data_seed); `head`: the cache folder name ("eagle", "medusa")."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    p.add_argument("--out", default=None, help=f"output directory (default: $INFERD_CACHE_DIR/{head}/<model>)")
    p.add_argument("--quantization", default=recipe.quantization)
    p.add_argument("--num-prompts", type=int, default=recipe.num_prompts, help="template instructions")
    p.add_argument("--num-questions", type=int, default=recipe.num_questions,
                   help="free-form questions the target writes itself (self-instruct)")  # fmt: skip
    p.add_argument("--eval-prompts", type=int, default=recipe.eval_prompts)
    p.add_argument("--max-tokens", type=int, default=recipe.max_tokens)
    p.add_argument("--data-seed", type=int, default=recipe.data_seed,
                   help="the generated data's seed (instructions, sampled answers, questions): new data")  # fmt: skip
    p.add_argument("--no-data-cache", action="store_true", help="generate the data afresh and do not keep it")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def parse_with_threads(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses and applies --threads."""
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    return a
