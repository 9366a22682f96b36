"""Several models behind one server (`inferd serve NAME=PATH ...`, served_models.py and
model_pool.py), on the two real models: SmolLM2-135M twice (`smol`, pinned, and `smolb`) and
Gemma 3 270M (`gemma`), with `--max-loaded-models 2`, so `gemma` and `smolb` take turns in the one
slot the pinned model leaves.

Each answer equals the offline `LLM`'s greedy text for its model; loads and unloads are counted
on /metrics; the pinned model is never unloaded; an unloaded model's engine process is gone and the
server's process tree holds less memory; a request in flight is never lost to a swap, and the
queue of requests waiting for a load is bounded (--max-queue-len: 503 with Retry-After).
"""

from __future__ import annotations

import functools
import json
import threading

import httpx
import psutil
import pytest

from inferd import LLM, SamplingParams
from tests.real_model import default_gguf, gemma3_gguf
from tests.test_server_utils import RemoteServer, assert_error, metric, wait_until

KEY, ADMIN = "user-key", "admin-key"
AUTH, ADMIN_AUTH = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "The capital of France is"
NEW_TOKENS = 12
LONG_TOKENS = 64  # the request kept in flight across a swap
KV = 64 << 20


@pytest.fixture(scope="module")
def server():
    smol, gemma = default_gguf(), gemma3_gguf()
    srv = RemoteServer(
        f"smol={smol}", f"gemma={gemma}", f"smolb={smol}",
        "--max-loaded-models", "2", "--pin", "smol", "--max-queue-len", "1",
        "--api-key", KEY, "--admin-api-key", ADMIN, "--enable-debug-endpoints",
        "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--log-stats-interval", "0",
        timeout=900,
    )  # fmt: skip
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer):
    # A load is seconds on a quiet machine, minutes on a loaded one.
    with httpx.Client(base_url=server.url, timeout=1800, headers=AUTH) as c:
        yield c


def reference(model: str, max_tokens: int) -> str:
    """The offline LLM's greedy text for PROMPT on the model the server names `model`."""
    return _offline("gemma" if model == "gemma" else "smol", max_tokens)


@functools.cache
def _offline(model: str, max_tokens: int) -> str:
    path = gemma3_gguf() if model == "gemma" else default_gguf()
    llm = LLM(model=str(path), kv_cache_memory=KV, max_model_len=512, verbose=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    text = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    llm.close()
    return text


def complete(http: httpx.Client, model: str, max_tokens: int = NEW_TOKENS) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return http.post("/v1/completions", json=body)


def loaded(http: httpx.Client) -> dict[str, bool]:
    return {c["id"]: c["loaded"] for c in http.get("/v1/models").json()["data"]}


def test_models_lists_every_model_with_whether_it_is_loaded(http: httpx.Client) -> None:
    assert loaded(http) == {"smol": True, "gemma": False, "smolb": False}  # smol: pinned
    cards = http.get("/v1/models").json()["data"]
    assert [c["root"] for c in cards] == [str(default_gguf()), str(gemma3_gguf()),
                                          str(default_gguf())]  # fmt: skip


def test_alternating_models_answer_as_each_alone(http: httpx.Client) -> None:
    for model in ["gemma", "smolb", "gemma", "smol"]:
        r = complete(http, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == reference(model, NEW_TOKENS), model
        state = loaded(http)
        assert state["smol"], "the pinned model was unloaded"
        assert sum(state.values()) <= 2, state
    text = http.get("/metrics").text
    assert metric(text, "inferd:model_loads_total", model_name="gemma") == 2
    assert metric(text, "inferd:model_loads_total", model_name="smolb") == 1
    assert metric(text, "inferd:model_loads_total", model_name="smol") == 1
    assert metric(text, "inferd:model_unloads_total", model_name="gemma", reason="lru") == 1
    assert metric(text, "inferd:model_unloads_total", model_name="smolb", reason="lru") == 1
    with pytest.raises(KeyError):  # never unloaded
        metric(text, "inferd:model_unloads_total", model_name="smol", reason="lru")
    assert metric(text, "inferd:model_swap_queued_requests_total", model_name="gemma") == 2
    assert metric(text, "inferd:model_swap_queued_requests_total", model_name="smolb") == 1
    assert metric(text, "inferd:model_load_time_seconds_count", model_name="gemma") == 2
    assert metric(text, "inferd:model_resident_bytes", model_name="smol") > 64 << 20
    assert metric(text, "inferd:model_loaded", model_name="smol") == 1
    # The engines' own series keep working, one per loaded model.
    assert metric(text, "inferd:request_success_total", model_name="smol",
                  finished_reason="length") == 1  # fmt: skip


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    err = assert_error(complete(http, "nope"), 404, param="model")
    assert err["code"] == "model_not_found" and "smolb" in err["message"]
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404, param="model")


def test_admin_endpoints_need_the_admin_key(server: RemoteServer, http: httpx.Client) -> None:
    url = f"{server.url}/v1/models/unload"
    assert_error(httpx.post(url, json={"model": "smolb"}), 401)
    assert_error(httpx.post(url, json={"model": "smolb"}, headers=AUTH), 403)
    err = assert_error(http.post("/v1/models/unload", json={"model": "smol"}, headers=ADMIN_AUTH), 409)
    assert "pinned" in err["message"]
    assert_error(http.post("/v1/models/load", json={"model": "nope"}, headers=ADMIN_AUTH), 404)
    assert_error(http.post("/v1/models/unload", json={"model": "nope"}, headers=ADMIN_AUTH), 404)


def _tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def test_unloading_returns_the_memory(server: RemoteServer, http: httpx.Client) -> None:
    """gemma is loaded (the last swap loaded it): unloading it ends its engine process."""
    admin = {"headers": ADMIN_AUTH}
    assert loaded(http) == {"smol": True, "gemma": True, "smolb": False}
    r = http.post("/v1/models/unload", json={"model": "smolb"}, **admin)  # not loaded
    assert r.status_code == 200 and r.json()["changed"] is False, r.text
    children = psutil.Process(server.proc.pid).children(recursive=True)
    rss = {p.pid: p.memory_info().rss for p in children}
    loaded_rss = _tree_rss(server.proc.pid)
    r = http.post("/v1/models/unload", json={"model": "gemma"}, **admin)
    assert r.status_code == 200 and r.json()["changed"] is True, r.text
    gone = [p for p in children if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
    assert gone, "no engine process ended"
    assert loaded(http)["gemma"] is False
    # What the engine process held is gone from the server's tree (the rest may move a little).
    engine_rss = sum(rss[p.pid] for p in gone)
    assert _tree_rss(server.proc.pid) < loaded_rss - engine_rss // 2
    text = http.get("/metrics").text
    assert metric(text, "inferd:model_unloads_total", model_name="gemma", reason="admin") == 1
    assert metric(text, "inferd:model_resident_bytes", model_name="gemma") == 0


def test_a_request_in_flight_outlives_a_swap_and_the_swap_queue_is_bounded(
    http: httpx.Client,
) -> None:
    """smolb streams a long answer; a gemma request must wait for it (the one slot is busy),
    a second one finds the swap queue full (--max-queue-len 1)."""
    r = complete(http, "smolb", 1)  # smolb in the slot
    assert r.status_code == 200, r.text
    first_chunk = threading.Event()
    streamed: list[str] = []

    def stream_smolb() -> None:
        body = {"model": "smolb", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
                    first_chunk.set()

    waiting: dict[str, httpx.Response] = {}

    def gemma() -> None:
        waiting["gemma"] = complete(http, "gemma")

    streamer = threading.Thread(target=stream_smolb)
    streamer.start()
    assert first_chunk.wait(120), "the stream never started"
    queued = threading.Thread(target=gemma)
    queued.start()
    wait_until(lambda: metric(http.get("/metrics").text, "inferd:model_swap_queue_len") == 1,
               what="the gemma request to wait for its load")  # fmt: skip
    full = complete(http, "gemma")
    err = assert_error(full, 503)
    assert err["code"] == "queue_full" and int(full.headers["Retry-After"]) >= 1
    assert loaded(http)["smolb"] is True  # busy: not evicted under the waiting request
    streamer.join(300)
    queued.join(300)
    assert "".join(streamed) == reference("smol", LONG_TOKENS)
    assert waiting["gemma"].status_code == 200, waiting["gemma"].text
    assert waiting["gemma"].json()["choices"][0]["text"] == reference("gemma", NEW_TOKENS)
    assert loaded(http) == {"smol": True, "gemma": True, "smolb": False}
    r = http.post("/debug/check_no_leaks")
    assert r.status_code == 200 and r.json()["ok"], r.text


def test_the_router_serves_every_model_of_a_multi_model_server(server: RemoteServer) -> None:
    """Through `inferd router`, the loaded models (gemma, and smol, pinned) answer as alone."""
    router = RemoteServer("--worker-urls", server.url, "--health-check-interval", "0.5",
                          command="router", timeout=900)  # fmt: skip
    try:
        with httpx.Client(base_url=router.url, timeout=1800, headers=AUTH) as c:
            for model in ["gemma", "smol"]:
                r = complete(c, model)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference(model, NEW_TOKENS)
            assert_error(complete(c, "nope"), 404, param="model")
    finally:
        router.close()
