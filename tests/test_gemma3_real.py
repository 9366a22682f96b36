"""Gemma 3 270M (Q4_K_M GGUF from PyPI, inferd/loader/gemma3_model.py): inferd's greedy tokens equal
HF transformers' loading the same GGUF (`--quantization none`: both dequantize to fp32), for
short prompts and one longer than the local layers' 512-token window, batched, in 128-token
chunks, and again from the prefix cache.

The prompts go in as text through inferd's own tokenizer of the file (SentencePiece, rebuilt from
the GGUF's vocabulary), whose ids must equal transformers' ids for them (transformers' own GGUF
tokenizer conversion, with the BOS its config adds).
"""

from __future__ import annotations

import functools

import pytest
import torch
from real_model import gemma3_gguf, gemma3_hf_ids

from inferd import LLM, SamplingParams
from inferd.loader import load_model
from inferd.models import model_spec

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24
CLEAR_MARGIN = 1e-3  # top-2 logit gap below which fp32 rounding order may flip a token
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
_PARAGRAPH = (
    "The river rose through the night and by morning the lower streets of the town were under "
    "water. Boats moved between the houses, carrying bread, blankets and the old. "
)

TEXTS = [*PROMPTS, _PARAGRAPH * 20 + "What happened to the town?"]


@functools.cache
def _hf_model():
    path = gemma3_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    ids = [gemma3_hf_ids(p) for p in TEXTS]
    assert len(ids[-1]) > 600, "the long prompt must pass the local layers' 512-token window"
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> list[tuple[list[int], int]]:
    """transformers' greedy tokens, and how many of them lie before a near-tie."""
    model = _hf_model()
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            r = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        margins = [float(v[0] - v[1]) for v in (l[0].topk(2).values for l in r.logits)]
        clear = next((k for k, m in enumerate(margins) if m < CLEAR_MARGIN), NEW_TOKENS)
        out.append((r.sequences[0, len(ids) :].tolist(), clear))
    return out


@pytest.fixture(scope="module")
def loaded():
    return load_model(gemma3_gguf(), quantization="none", verbose=False)


def test_tokenizer_gives_transformers_ids(loaded, prompt_ids):
    for text, ids in zip(TEXTS, prompt_ids):
        assert loaded.tokenizer.encode(text) == ids, text


def test_spec_of_the_real_file(loaded):
    spec = model_spec(loaded.config)
    assert spec.summary() == "18 layers: 15 local window 512, 3 global"
    assert [i for i, layer in enumerate(spec.layers) if not layer.is_local] == [5, 11, 17]
    assert [r.theta for r in spec.ropes()] == [10000.0, 1_000_000.0]
    assert loaded.config.head_dim == 256 and loaded.config.vocab_size == 262144


def test_greedy_matches_transformers(loaded, reference):
    llm = LLM(loaded=loaded, quantization="none", verbose=False, kv_cache_memory=64 << 20,
              max_num_batched_tokens=128, enable_prefix_caching=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)  # inferd's tokenizer: same ids as HF's
    again = llm.generate([TEXTS[-1]], params, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits_total > 0
    for i, (o, (want, clear)) in enumerate(zip([*outs, *again], [*reference, reference[-1]])):
        assert clear >= NEW_TOKENS // 2, f"prompt {i}: the reference's logits tie at {clear}"
        assert o.outputs[0].token_ids[:clear] == want[:clear], f"prompt {i}"
    llm.engine.check_no_leaks()
