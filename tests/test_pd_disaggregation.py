"""Prefill/decode disaggregation end to end: real `inferd serve --kv-role prefill` and `--kv-role
decode` workers (a tiny random model, one thread each) behind `inferd router --pd-disaggregation`,
against one colocated server of the same model: the same text (greedy and seeded), streams with
usage, a decode worker that computes no prompt token it did not already hold, a prefill worker
killed before its blocks were pulled (the decode worker recomputes), mismatched layouts refused
at the handshake, and every block back in both pools; and greedy chat parity on the default model.

The colocated reference is the prefill worker answering plain requests (no `kv_transfer_params`:
its connector does nothing for them), which saves a server on a loaded machine. The tests share
the workers and run in file order.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from test_server_utils import RemoteServer, assert_error, assert_no_leaks, free_port, metric

WORKER_ARGS = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--block-size", "8",
               "--log-stats-interval", "0", "--max-num-seqs", "4", "--enable-debug-endpoints"]  # fmt: skip
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ROUTER_ARGS = ["--health-check-interval", "0.5", "--health-failure-threshold", "1"]
STARTUP_S = 900  # a server's start on a machine shared with other jobs (load averages of 30 seen)
# A short pull timeout: the kill test waits for it (the default model's workers keep the default:
# on a loaded machine a live prefill worker may take seconds to answer).
DECODE_CONFIG = json.dumps({"kv_connector_extra_config": {"pull_timeout_s": 10}})

PROMPTS = ["Tell me about the sea and its long tides", "What is a prime number, briefly",
           "List three colours of a sunset sky, then explain why the sky turns red"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models):
    return tiny_models["llama-f32.gguf"].path


@pytest.fixture(scope="module")
def cluster(tiny_gguf) -> Iterator[dict[str, RemoteServer]]:
    """A prefill worker, a decode worker and the PD router, started at once."""
    yield from _start_cluster(str(tiny_gguf), WORKER_ARGS, DECODE_CONFIG)


def _start_cluster(
    model: str, worker_args: list[str], decode_config: str
) -> Iterator[dict[str, RemoteServer]]:
    ports = {name: free_port() for name in ("prefill", "decode")}
    url = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    serve = partial(RemoteServer, model, *worker_args, env=ONE_THREAD, timeout=STARTUP_S)
    starts = {
        "prefill": partial(serve, "--kv-role", "prefill", port=ports["prefill"]),
        "decode": partial(serve, "--kv-role", "decode", "--kv-transfer-config", decode_config,
                          port=ports["decode"]),
        "router": partial(RemoteServer, "--pd-disaggregation", "--prefill", url["prefill"], "--decode",
                          url["decode"], *ROUTER_ARGS, command="router", timeout=STARTUP_S),
    }  # fmt: skip
    with ThreadPoolExecutor(len(starts)) as ex:
        futures = {name: ex.submit(start) for name, start in starts.items()}
        started = {}
        try:
            for name, f in futures.items():
                started[name] = f.result()
        finally:
            if len(started) < len(futures):
                for f in futures.values():
                    if f.exception() is None:
                        f.result().close()
    started["colocated"] = started["prefill"]
    yield started
    for name in ("router", "prefill", "decode"):
        started[name].close()


def _counter(server: RemoteServer, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{server.url}/metrics", timeout=30).text, name, **labels)


def _chat(url: str, content: str, **extra) -> dict:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _reset(*servers: RemoteServer) -> None:
    for s in servers:
        assert httpx.post(f"{s.url}/reset_prefix_cache", timeout=60).json() == {"reset": True}


def test_greedy_and_seeded_text_equal_a_colocated_servers(cluster) -> None:
    router, colocated, decode = cluster["router"], cluster["colocated"], cluster["decode"]
    computed = _counter(decode, "inferd:prompt_tokens_computed_total")
    received = _counter(decode, "inferd:kv_transfer_received_tokens_total")
    prompt_tokens = 0
    for content in PROMPTS:
        want, got = _chat(colocated.url, content), _chat(router.url, content)
        assert got["choices"][0]["message"] == want["choices"][0]["message"], content
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
        assert "kv_transfer_params" not in got  # the handle stays between the router and workers
        prompt_tokens += got["usage"]["prompt_tokens"]
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 16}
    want, got = _chat(colocated.url, PROMPTS[0], **seeded), _chat(router.url, PROMPTS[0], **seeded)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    # The decode worker computed only the tokens it generated: every prompt came over the wire
    # (the seeded one's whole blocks came from its own prefix cache).
    assert _counter(decode, "inferd:prompt_tokens_computed_total") == computed
    assert _counter(decode, "inferd:kv_transfer_received_tokens_total") - received >= prompt_tokens
    assert _counter(decode, "inferd:kv_transfer_failures_total") == 0
    sent = _counter(cluster["prefill"], "inferd:kv_transfer_sent_tokens_total")
    assert sent >= prompt_tokens


def test_decode_pulls_only_what_its_prefix_cache_lacks(cluster) -> None:
    """The second of two prompts sharing a long prefix: the decode worker holds the shared whole
    blocks (from the first) and pulls only the rest."""
    router, decode = cluster["router"], cluster["decode"]
    _reset(decode)
    shared = "Answer in one short sentence. " * 3
    received = _counter(decode, "inferd:kv_transfer_received_tokens_total")
    first = _chat(router.url, shared + "Question one?", max_tokens=4)
    pulled_first = _counter(decode, "inferd:kv_transfer_received_tokens_total") - received
    assert pulled_first == first["usage"]["prompt_tokens"]  # nothing cached here yet
    second = _chat(router.url, shared + "Question two, a little longer?", max_tokens=4)
    pulled = _counter(decode, "inferd:kv_transfer_received_tokens_total") - received - pulled_first
    held = second["usage"]["prompt_tokens"] - pulled  # what the decode worker had itself
    assert held >= 16 and held % 8 == 0, (held, pulled)


def test_streams_pass_through_with_usage(cluster) -> None:
    payload = {"prompt": "One two three four five", "max_tokens": 6, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip

    def events(url: str) -> tuple[list[dict], bytes]:
        with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            raw = r.read()
        return [
            json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
        ], raw

    want, _ = events(cluster["colocated"].url)
    got, raw = events(cluster["router"].url)
    assert raw.endswith(b"data: [DONE]\n\n")
    text = lambda evs: "".join(c["text"] for e in evs for c in e["choices"])
    assert text(got) == text(want)
    assert got[-1]["usage"] == want[-1]["usage"]
    assert [e["choices"][0]["finish_reason"] for e in got if e["choices"]][-1] == "length"


def test_bad_input_gets_the_prefill_workers_error(cluster) -> None:
    r = httpx.post(f"{cluster['router'].url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, timeout=60)  # fmt: skip
    assert_error(r, 400, "temperature")


def test_prefill_killed_before_the_pull_recomputes_on_decode(cluster, tiny_gguf) -> None:
    """A prefill worker answers with a transfer handle and dies (SIGKILL) before the decode
    worker pulls: the pull fails at its timeout and the decode worker computes the prompt itself;
    the client gets the same text, and the failure is counted."""
    decode, colocated = cluster["decode"], cluster["colocated"]
    doomed = RemoteServer(
        str(tiny_gguf), *WORKER_ARGS, "--kv-role", "prefill", env=ONE_THREAD, timeout=STARTUP_S
    )
    body = {
        "messages": [{"role": "user", "content": PROMPTS[2]}],
        "max_tokens": 10,
        "temperature": 0,
    }
    try:
        r = httpx.post(f"{doomed.url}/v1/chat/completions", timeout=60,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
        assert r.status_code == 200, r.text
        handle = r.json()["kv_transfer_params"]
        assert {"transfer_id", "endpoint", "num_tokens"} <= set(handle)
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(30)
    finally:
        doomed.close()
    failures = _counter(decode, "inferd:kv_transfer_failures_total")
    computed = _counter(decode, "inferd:prompt_tokens_computed_total")
    r = httpx.post(f"{decode.url}/v1/chat/completions", timeout=120,
                   json={**body, "kv_transfer_params": {**handle, "do_remote_prefill": True}})  # fmt: skip
    assert r.status_code == 200, r.text
    want = _chat(colocated.url, PROMPTS[2], max_tokens=10)
    assert r.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert _counter(decode, "inferd:kv_transfer_failures_total") == failures + 1
    assert _counter(decode, "inferd:prompt_tokens_computed_total") > computed  # recomputed here


def test_mismatched_layouts_are_refused_at_the_handshake(cluster, tiny_gguf) -> None:
    """A decode worker with another KV cache dtype: the prefill worker refuses its pull naming the
    difference, and the request is computed on the decode side."""
    prefill, colocated = cluster["prefill"], cluster["colocated"]
    odd = RemoteServer(str(tiny_gguf), *WORKER_ARGS, "--kv-role", "decode", "--kv-cache-dtype", "float16",
                       env=ONE_THREAD, timeout=STARTUP_S)  # fmt: skip
    try:
        router = RemoteServer("--pd-disaggregation", "--prefill", prefill.url, "--decode", odd.url, *ROUTER_ARGS,
                              command="router", timeout=STARTUP_S)  # fmt: skip
        try:
            got = _chat(router.url, PROMPTS[1])
        finally:
            router.close()
        want = _chat(colocated.url, PROMPTS[1])
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert _counter(odd, "inferd:kv_transfer_failures_total") == 1
        assert _counter(odd, "inferd:kv_transfer_received_tokens_total") == 0
        assert "KV layouts differ" in odd.log_text() and "kv_dtype" in odd.log_text()
        with httpx.Client(base_url=odd.url, timeout=60) as http:
            assert_no_leaks(http)
    finally:
        odd.close()


def test_no_blocks_leak_on_either_side(cluster) -> None:
    for name in ("prefill", "decode"):
        with httpx.Client(base_url=cluster[name].url, timeout=60) as http:
            assert_no_leaks(http)  # the prefill side once its pinned blocks are released


@pytest.fixture(scope="module")
def default_cluster() -> Iterator[dict[str, RemoteServer]]:
    from real_model import default_gguf

    args = ["--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--log-stats-interval", "0",
            "--enable-debug-endpoints"]  # fmt: skip
    yield from _start_cluster(str(default_gguf()), args, "{}")


def test_default_model_greedy_chat_parity(default_cluster) -> None:
    """The default model (SmolLM2-135M-Instruct): PD's greedy chat answers equal a colocated
    server's, and the decode worker computed none of their prompts."""
    router, colocated, decode = (
        default_cluster["router"],
        default_cluster["colocated"],
        default_cluster["decode"],
    )
    questions = ["What is the capital of France?", "Write a haiku about autumn leaves.",
                 "Explain in two sentences why the sky is blue."]  # fmt: skip
    for q in questions:
        want, got = _chat(colocated.url, q, max_tokens=24), _chat(router.url, q, max_tokens=24)
        assert (
            got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        ), q
    assert _counter(decode, "inferd:prompt_tokens_computed_total") == 0
    assert _counter(decode, "inferd:kv_transfer_failures_total") == 0
    for name in ("prefill", "decode"):
        with httpx.Client(base_url=default_cluster[name].url, timeout=60) as http:
            assert_no_leaks(http)
