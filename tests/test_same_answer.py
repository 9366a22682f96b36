"""Same request, same answer: at temperature 0 (and with a seed above it) a request's tokens do not
depend on the prefix cache (hit, partial hit, miss), on what else shares its batch, on how its
prompt is chunked, on streaming or on concurrent requests, in every weight quantization and KV
cache dtype, on the default model."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from inferd import LLM, SamplingParams
from inferd.loader import load_model
from tests.real_model import default_gguf
from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer

QUESTION = [{"role": "user", "content": "Name three colors."}]
OTHERS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea, please."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
]


@functools.cache
def _loaded(quantization: str):
    return load_model(default_gguf(), verbose=False, quantization=quantization)


def make_llm(quantization: str = "auto", **kw) -> LLM:
    return LLM(loaded=_loaded(quantization), quantization=quantization, verbose=False,
               kv_cache_memory=64 << 20, **kw)  # fmt: skip


def _ids(llm: LLM, messages: list[dict]) -> list[int]:
    tok = llm.engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list, int]]:
    """Each prompt's tokens with their logprobs (bit for bit), and how many of its prompt tokens
    came from the prefix cache."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [([(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
             o.metrics.num_cached_tokens) for o in outs]  # fmt: skip


def _scenarios(llm: LLM, chunked: LLM, params: SamplingParams) -> dict[str, list[int]]:
    target = _ids(llm, QUESTION)
    others = [_ids(llm, m) for m in OTHERS]
    block = llm.engine.kv.block_size
    assert len(target) > 2 * block  # a full-block hit leaves a suffix to compute
    llm.reset_prefix_cache()
    (cold, cold_cached), = _run(llm, [target], params)
    (warm, warm_cached), = _run(llm, [target], params)
    llm.reset_prefix_cache()
    _run(llm, [target[:block] + others[0]], params)  # caches the first block only
    (partial, partial_cached), = _run(llm, [target], params)
    llm.reset_prefix_cache()
    batched = _run(llm, [others[0], target, others[1], others[2]], params)[1][0]
    (chunks, _), = _run(chunked, [target], params)
    # The scenarios are what they say: a miss, a hit of every full block, a hit of one.
    assert cold_cached == 0 and warm_cached == (len(target) - 1) // block * block
    assert partial_cached == block
    return {"cold": cold, "warm": warm, "partial": partial, "batched": batched, "chunked": chunks}


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"),
    [("auto", "auto"), ("int8", "auto"), ("int4", "auto"), ("fp8", "auto"), ("none", "auto"),
     ("auto", "int8"), ("auto", "fp8"), ("auto", "float16")],
)  # fmt: skip
def test_greedy_answer_does_not_depend_on_cache_batch_or_chunking(quantization, kv_cache_dtype):
    kw = {"quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    llm = make_llm(**kw)
    chunked = make_llm(long_prefill_token_threshold=8, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    got = _scenarios(llm, chunked, params)
    assert all(tokens == got["cold"] for tokens in got.values()), got


def test_seeded_sample_does_not_depend_on_cache_batch_or_chunking():
    llm, chunked = make_llm(), make_llm(long_prefill_token_threshold=8)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True, logprobs=0)
    got = _scenarios(llm, chunked, params)
    assert all(tokens == got["cold"] for tokens in got.values()), got


def test_greedy_answer_is_the_same_with_speculation():
    """Prompt lookup verifies 1 + k rows a step where plain decoding computes one: the same tokens
    and logprobs, bit for bit, on the default quantization."""
    llm = make_llm()
    spec = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=0)
    prompts = [_ids(llm, QUESTION), _ids(llm, OTHERS[1])]
    assert _run(spec, prompts, params) == _run(llm, prompts, params)
    assert spec.engine.get_stats().spec_accepted_tokens > 0


# (the default packed weights and dense fp32 ones; that the answer does not depend on the cache,
# the batch or chunking in every quantization is the offline test's, without a server per mode)
@pytest.fixture(scope="module", params=["auto", "none"])
def served(request):
    srv = RemoteServer(*SMALL_ENGINE, "--quantization", request.param)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)
    srv.close()


def test_served_answer_does_not_depend_on_streaming_cache_or_concurrency(served):
    """Through the server: the same chat request cold, again (a prefix-cache hit) streamed and
    not, and among concurrent requests, gives the same text."""
    ask = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    cold = served.chat.completions.create(messages=QUESTION, **ask)
    warm = served.chat.completions.create(messages=QUESTION, **ask)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    chunks = served.chat.completions.create(messages=QUESTION, stream=True, **ask)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with ThreadPoolExecutor(len(OTHERS) * 2 + 1) as pool:
        futures = [pool.submit(served.chat.completions.create, messages=m, **ask)
                   for m in [*OTHERS, QUESTION, *OTHERS]]  # fmt: skip
        concurrent = futures[len(OTHERS)].result()
    text = cold.choices[0].message.content
    assert text and warm.choices[0].message.content == text
    assert streamed == text and concurrent.choices[0].message.content == text
