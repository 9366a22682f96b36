"""Speculation at temperature > 0 is lossless: token frequencies at every verified position match
speculation off (a chi-square test), with drafts verified on every step."""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from inferd import LLM, SamplingParams
from inferd.engine.stats import EngineStats

SEED_PROMPT = list(range(3, 19))
# Samples per run, speculation off and on: enough that a bias of ~0.07 in total variation onto
# one token is caught, few enough to keep a test within seconds.
SAMPLES = 1500
_plain_histograms: dict[tuple, list[collections.Counter]] = {}


def _llm(path: Path, spec: dict | None = None, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", verbose=False, speculative_config=spec,
               max_num_seqs=256, kv_cache_memory=8 << 20, **kw)  # fmt: skip


def model_continued(path: Path, new_tokens: int) -> list[int]:
    """SEED_PROMPT followed by the model's own greedy continuation (a random model soon repeats
    itself): drafts from the context are then what the model is likely to say next, so some are
    accepted and some are not."""
    if not new_tokens:
        return list(SEED_PROMPT)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return SEED_PROMPT + list(_llm(path).generate([SEED_PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)


def token_histograms(llm: LLM, prompt: list[int], params: SamplingParams, samples: int = SAMPLES):
    """Counts of each token at each output position over `samples` runs of the prompt."""
    outs = llm.generate([{"prompt_token_ids": prompt}] * samples, params, use_tqdm=False)
    hist = [collections.Counter() for _ in range(params.max_tokens)]
    for out in outs:
        for pos, t in enumerate(out.outputs[0].token_ids):
            hist[pos][t] += 1
    return hist


def assert_same_distribution(a: collections.Counter, b: collections.Counter, pos: int) -> None:
    """Chi-square test of homogeneity between two equal-sized samples of tokens: fails when the
    two are this unlikely (p < 1e-4) to come from one distribution. Tokens seen fewer than 10
    times in both samples together are pooled, so every cell the statistic uses is well filled.
    (A fixed bound on the total-variation distance is not a test: its noise grows with the number
    of tokens the model spreads over.)"""
    cells, rare_a, rare_b = [], 0, 0
    for t in set(a) | set(b):
        if a[t] + b[t] >= 10:
            cells.append((a[t], b[t]))
        else:
            rare_a, rare_b = rare_a + a[t], rare_b + b[t]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    dof = len(cells) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item() if dof else 1.0  # fmt: skip
    assert p_value > 1e-4, (pos, stat, dof, p_value, a.most_common(8), b.most_common(8))


def assert_speculation_keeps_distribution(path: Path, spec: dict, params: SamplingParams, prompt: list[int],
                                          fixed_depth: bool = True) -> EngineStats:  # fmt: skip
    """Samples the prompt with speculation off and on (`fixed_depth`: drafting k on every step,
    however little a random model's drafts pay) and compares every verified position; returns
    the speculating engine's stats for the caller's checks on acceptance."""
    key = (str(path), tuple(prompt), repr(params))
    if key not in _plain_histograms:
        _plain_histograms[key] = token_histograms(_llm(path), prompt, params)
    off = _plain_histograms[key]
    on_llm = _llm(path, {**spec, "adaptive_depth": False} if fixed_depth else spec)
    on = token_histograms(on_llm, prompt, params)
    for pos in range(1, params.max_tokens):  # position 0 comes from the prefill, never verified
        assert_same_distribution(off[pos], on[pos], pos)
    on_llm.engine.check_no_leaks()
    return on_llm.engine.get_stats()
