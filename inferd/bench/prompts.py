"""Synthetic prompts of an exact token length made of real words (not random token ids)."""

from __future__ import annotations

import random

from inferd.loader import Tokenizer

_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which be or had "
    "not are but have were one their all there been has more when will would who about into "
    "time people year city river mountain village forest history science music language story "
    "water light house school garden market winter summer morning evening journey letter window "
    "bridge island harbor teacher student doctor farmer painter engineer question answer reason "
    "simple careful quiet bright ancient modern small large early late green blue golden silver "
    "walked carried built wrote found opened watched learned remembered explained discovered"
).split()


def synthetic_prompt(tokenizer: Tokenizer, num_tokens: int, seed: int | str) -> list[int]:
    """Token ids of a word-salad sentence, cut to exactly `num_tokens` tokens. A str seed (e.g.
    "run seed/index") keeps the prompts of different runs apart: ints n and n + 1 would give two
    runs all but one prompt in common."""
    rng = random.Random(seed)
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(max(8, num_tokens // 2)))
        ids = tokenizer.encode(" ".join(words).capitalize() + ".")
    return ids[:num_tokens]
