"""Speculative decoding through the real server on the default model: several tokens per step
reach streaming clients intact (text, logprobs, usage), and /metrics shows the proposer's counters."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from inferd.bench.spec import PASSAGES
from tests.test_server_utils import MODEL, SMALL_ENGINE, RemoteServer, metric

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
REPEAT = [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGES[0]}"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    # 16 sequences at most (the tests send 9 at once): start-up prices verification for batches
    # of 1, 4 and 16 only, not the default's 64.
    srv = RemoteServer(*SMALL_ENGINE, "--max-num-seqs", "16",
                       "--speculative-config", json.dumps(SPEC))  # fmt: skip
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_stream_equals_whole_response_and_metrics_count_drafts(server, client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=80, temperature=0,
                                           logprobs=True, top_logprobs=2)  # fmt: skip
    text = whole.choices[0].message.content
    assert PASSAGES[0][:40] in text  # the model copies the passage: prompt lookup's best case
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=REPEAT, max_tokens=80, temperature=0, stream=True, logprobs=True,
        top_logprobs=2, stream_options={"include_usage": True}))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [lp.token for lp in logprobs] == [lp.token for lp in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    body = httpx.get(f"{server.url}/metrics").text
    drafts = metric(body, "inferd:spec_decode_num_drafts_total", model_name=MODEL, method="ngram")
    accepted = metric(body, "inferd:spec_decode_num_accepted_tokens_total", model_name=MODEL, method="ngram")
    emitted = metric(body, "inferd:spec_decode_num_emitted_tokens_total", model_name=MODEL, method="ngram")
    # A verification emits its accepted drafts and one token more, unless the sequence stops inside.
    assert drafts > 0 and accepted > 0 and drafts <= emitted <= drafts + accepted
    assert metric(body, "inferd:spec_decode_mean_acceptance_length", model_name=MODEL, method="ngram") > 1.5
    # By chain position (as deep as the policy ever drafted, k = 4 at most): a draft is accepted
    # only after every one before it, so the counts fall with the position and add up to the totals.
    def per_pos(name: str) -> list[float]:
        counts = []
        for i in range(SPEC["num_speculative_tokens"] + 1):
            try:
                counts.append(metric(body, f"inferd:spec_decode_num_{name}_per_pos_total",
                                     model_name=MODEL, method="ngram", position=str(i)))  # fmt: skip
            except KeyError:  # never drafted this deep
                break
        return counts

    proposed, taken = per_pos("draft_tokens"), per_pos("accepted_tokens")
    total = metric(body, "inferd:spec_decode_num_draft_tokens_total", model_name=MODEL,
                   method="ngram")  # fmt: skip
    assert sum(taken) == accepted and taken == sorted(taken, reverse=True)
    assert sum(proposed) == total and proposed == sorted(proposed, reverse=True)
    assert 1 <= len(taken) <= len(proposed) <= SPEC["num_speculative_tokens"]
    assert all(t <= p for t, p in zip(taken, proposed))
    assert proposed[0] == drafts and taken[0] > 0


def test_concurrent_sampled_and_greedy_requests_all_finish(client) -> None:
    import concurrent.futures as cf

    def one(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=REPEAT, max_tokens=40, temperature=0 if i % 2 else 0.8, seed=i,
            n=2 if i == 3 else 1, stop=["town"] if i == 5 else None)  # fmt: skip

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for i, r in enumerate(results):
        assert all(c.finish_reason in ("stop", "length") for c in r.choices), i
        if i == 5:
            assert "town" not in r.choices[0].message.content
    again = one(2)  # seeded sampling is reproducible with speculation too
    assert again.choices[0].message.content == results[2].choices[0].message.content
