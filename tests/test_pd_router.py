"""The PD router's request shaping and flags, without servers (tests/test_pd_disaggregation.py
runs the real thing)."""

from __future__ import annotations

import argparse

import orjson
import pytest

from inferd.router.cli import _worker_urls, add_router_parser
from inferd.router.pd import carried, prefill_body

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def test_which_requests_pd_carries() -> None:
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    assert carried(CHAT, {**msgs, "temperature": 0.7, "seed": 3, "stream": True})
    assert not carried(CHAT, {**msgs, "n": 2})
    assert not carried(CHAT, {**msgs, "logprobs": True})
    assert not carried(CHAT, {**msgs, "kv_transfer_params": {"x": 1}})
    assert carried(COMPLETIONS, {"prompt": "hi"}) and carried(COMPLETIONS, {"prompt": [1, 2, 3]})
    assert not carried(COMPLETIONS, {"prompt": ["a", "b"]})
    assert not carried(COMPLETIONS, {"prompt": "hi", "echo": True})
    assert not carried(COMPLETIONS, {"prompt": "hi", "logprobs": 0})
    assert not carried(COMPLETIONS, {"prompt": "hi", "best_of": 2})


def test_the_prefill_leg_stops_after_one_token_and_keeps_sampling_fields() -> None:
    body = {"messages": [], "max_completion_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.7, "top_p": 0.9, "seed": 11, "min_tokens": 5, "stop": ["x"]}  # fmt: skip
    leg = orjson.loads(prefill_body(CHAT, body))
    assert leg["max_tokens"] == 1 and "max_completion_tokens" not in leg
    assert leg["stream"] is False and "stream_options" not in leg
    assert leg["min_tokens"] == 1  # EOS held back from the first token as the client asked
    assert leg["kv_transfer_params"] == {"do_remote_decode": True}
    assert {k: leg[k] for k in ("temperature", "top_p", "seed", "stop")} == {
        "temperature": 0.7, "top_p": 0.9, "seed": 11, "stop": ["x"]}  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    return parser.parse_args(["router", *argv])


def test_pd_flags() -> None:
    workers, prefill = _worker_urls(
        _args(
            "--pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://b:2", "http://c:3"
        )
    )
    assert (workers, prefill) == (["http://b:2", "http://c:3"], ["http://a:1"])
    assert _worker_urls(_args("--worker-urls", "http://a:1")) == (["http://a:1"], None)
    for argv, message in [
        (["--pd-disaggregation", "--prefill", "http://a:1"], "needs --prefill URL"),
        (["--pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://b:2", "--worker-urls", "http://c:3"],
         "not --worker-urls"),
        (["--prefill", "http://a:1", "--decode", "http://b:2"], "need --pd-disaggregation"),
        ([], "give --worker-urls"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            _worker_urls(_args(*argv))
