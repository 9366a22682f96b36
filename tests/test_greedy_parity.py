"""Greedy output equals HF transformers' on the same weights: batch 1, batched (4 and 16 rows),
chunked prefill, and under preemption (a KV pool too small for the batch)."""

from __future__ import annotations

import pytest

from inferd import SamplingParams
from tests.real_model import hf_greedy, loaded_default, make_llm

PROMPTS = [
    "The history of the Roman Empire began when a small settlement on the Tiber river grew into "
    "a city that would eventually rule the Mediterranean world. Its first kings",
    "def quicksort(items):\n    \"\"\"Sort a list of numbers in ascending order using the "
    "quicksort algorithm.\"\"\"\n",
    "Here is a recipe for a simple tomato soup. Ingredients: four ripe tomatoes, one onion, two "
    "cloves of garlic, olive oil, salt and pepper. Steps:",
    "Question: Why is the sky blue during the day and red at sunset? Explain it simply.\nAnswer:",
]
NEW_TOKENS = 32  # (a divergence shows within it; the preemption test's pool still overflows)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    tok = loaded_default().tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    assert all(len(i) > 16 for i in ids), "prompts must be longer than a 16-token chunk"
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> list[list[int]]:
    return [hf_greedy(ids, NEW_TOKENS) for ids in prompt_ids]


def _generate(llm, prompt_ids):
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_one_matches_hf(prompt_ids, reference):
    llm = make_llm()
    got = [_generate(llm, [ids])[0] for ids in prompt_ids]
    assert got == reference
    llm.engine.check_no_leaks()


def test_all_together_matches_hf(prompt_ids, reference):
    llm = make_llm()
    assert _generate(llm, prompt_ids) == reference
    llm.engine.check_no_leaks()


def test_batch_of_sixteen_matches_hf(prompt_ids, reference):
    # Decode steps of 16 rows run the register-blocked fp32 tiles (csrc/dense_gemv.h), not the streaming few-row kernel.
    llm = make_llm()
    assert _generate(llm, prompt_ids * 4) == reference * 4
    llm.engine.check_no_leaks()


def test_chunked_prefill_matches_hf(prompt_ids, reference):
    # A 16-token step budget: every prompt is split into chunks that share steps with decodes.
    llm = make_llm(max_num_batched_tokens=16)
    assert _generate(llm, prompt_ids) == reference
    llm.engine.check_no_leaks()


def test_preemption_matches_hf(prompt_ids, reference):
    # 10 blocks of 16 tokens cannot hold four ~60-token sequences: someone must be preempted
    # and recomputed, and the output must not change.
    per_token = loaded_default().config.kv_bytes_per_token(__import__("torch").float32)
    llm = make_llm(kv_cache_memory=10 * 16 * per_token, max_model_len=160)
    assert _generate(llm, prompt_ids) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_no_leaks()
