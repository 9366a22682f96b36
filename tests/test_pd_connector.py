"""PDConnector between two real engines in one process (a tiny model): the decode engine pulls
exactly the blocks beyond its own prefix hit, continues from the prefill engine's first token
(greedy and seeded outputs equal one engine's), recomputes when the pull fails, frees blocks
pulled for a request aborted mid-pull, and both pools end where they began."""

from __future__ import annotations

import time

import pytest

from inferd.config import CacheConfig, EngineConfig, KVTransferConfig
from inferd.engine.core import EngineCore
from inferd.sampling.params import SamplingParams

BS = 8
PROMPT = list(range(5, 5 + 37))  # 4 whole blocks and 5 tokens


def _engine(path: str, role: str | None, **extra) -> EngineCore:
    kv = (
        KVTransferConfig("PDConnector", role, {"pull_timeout_s": 2, **extra})
        if role
        else KVTransferConfig()
    )
    config = EngineConfig(model=path, dtype="float32", quantization="none", log_stats_interval=0,
                          cache=CacheConfig(kv_cache_memory=4 << 20, block_size=BS), kv_transfer=kv)  # fmt: skip
    return EngineCore(config, verbose=False)


@pytest.fixture(scope="module")
def engines(tiny_llama_hf):
    path = str(tiny_llama_hf.path)
    made = {
        "prefill": _engine(path, "kv_producer"),
        "decode": _engine(path, "kv_consumer"),
        "alone": _engine(path, None),
    }
    yield made
    for core in made.values():
        core.close()


def _run(
    core: EngineCore, rid: str, prompt: list[int], params: SamplingParams, timeout: float = 60
) -> dict:
    core.add_request(rid, prompt, params)
    tokens: list[int] = []
    deadline = time.monotonic() + timeout
    while rid in core.requests and not core.requests[rid].finished:
        assert time.monotonic() < deadline, "the request never finished"
        for d in core.step():
            if d.request_id == rid:
                tokens += d.new_token_ids
    out = core.pop_finished(rid)
    assert out.outputs[0].token_ids == tokens
    return {
        "tokens": tokens,
        "handle": out.kv_transfer_params,
        "finish": out.outputs[0].finish_reason,
    }


def _settle(*cores: EngineCore) -> None:
    """Step until no blocks wait for a KV transfer, then check the pools (the leak invariant)."""
    deadline = time.monotonic() + 30
    for core in cores:
        while core.has_pending_kv_transfers():
            assert time.monotonic() < deadline, "blocks still held for a KV send"
            core.step()
        core.check_no_leaks()


def _pd(engines, rid: str, prompt: list[int], params: SamplingParams) -> dict:
    first = _run(engines["prefill"], rid, prompt, SamplingParams(**{**_fields(params), "max_tokens": 1},
                 kv_transfer_params={"do_remote_decode": True}))  # fmt: skip
    handle = first["handle"]
    assert handle["num_tokens"] == len(prompt)
    got = _run(engines["decode"], rid, prompt, SamplingParams(**_fields(params),
               kv_transfer_params={**handle, "do_remote_prefill": True}))  # fmt: skip
    assert got["tokens"][:1] == first["tokens"]
    return got


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "seed", "max_tokens", "ignore_eos")}


def _stats(core: EngineCore) -> dict[str, int]:
    return core.get_stats().kv_connector


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)],
                         ids=["greedy", "seeded"])  # fmt: skip
def test_decode_continues_the_prefill_and_matches_one_engine(engines, params) -> None:
    decode = engines["decode"]
    decode.reset_prefix_cache()
    want = _run(engines["alone"], "r", PROMPT, params)["tokens"]
    computed = decode.scheduler.num_prompt_tokens_computed
    received = _stats(decode)["kv_transfer_received_tokens"]
    assert _pd(engines, "r", PROMPT, params)["tokens"] == want
    assert decode.scheduler.num_prompt_tokens_computed == computed  # no prompt token computed here
    assert _stats(decode)["kv_transfer_received_tokens"] - received == len(PROMPT)
    _settle(engines["prefill"], decode)


def test_only_the_blocks_beyond_the_local_hit_are_pulled(engines) -> None:
    decode, params = (
        engines["decode"],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    decode.reset_prefix_cache()
    _run(decode, "local", PROMPT[:24] + [200, 201, 202], params)  # caches 3 whole blocks here
    before = dict(_stats(decode))
    want = _run(engines["alone"], "r", PROMPT, params)["tokens"]
    assert _pd(engines, "r", PROMPT, params)["tokens"] == want
    assert (
        _stats(decode)["kv_transfer_received_tokens"] - before["kv_transfer_received_tokens"]
        == len(PROMPT) - 24
    )
    assert (
        _stats(decode)["kv_transfer_received_blocks"] - before["kv_transfer_received_blocks"] == 2
    )
    _settle(engines["prefill"], decode)


def test_a_failed_pull_is_recomputed(engines) -> None:
    decode, params = (
        engines["decode"],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    want = _run(engines["alone"], "r", PROMPT, params)["tokens"]
    failures = _stats(decode)["kv_transfer_failures"]
    computed = decode.scheduler.num_prompt_tokens_computed
    gone = {"transfer_id": "gone", "endpoint": "tcp://127.0.0.1:9", "hostname": "x", "num_tokens": len(PROMPT),
            "do_remote_prefill": True}  # fmt: skip
    decode.reset_prefix_cache()
    got = _run(decode, "r", PROMPT, SamplingParams(**_fields(params), kv_transfer_params=gone))
    assert got["tokens"] == want
    assert _stats(decode)["kv_transfer_failures"] == failures + 1
    assert decode.scheduler.num_prompt_tokens_computed - computed == len(PROMPT)
    _settle(decode)


def test_an_abort_mid_pull_frees_the_blocks_once_the_pull_ends(engines) -> None:
    decode = engines["decode"]
    slow = {"transfer_id": "slow", "endpoint": "tcp://127.0.0.1:9", "hostname": "x", "num_tokens": len(PROMPT),
            "do_remote_prefill": True}  # fmt: skip
    decode.add_request("a", PROMPT, SamplingParams(max_tokens=4, kv_transfer_params=slow))
    while not decode.connector._in_flight:  # admitted, its blocks allocated, the pull started
        decode.step()
    decode.abort_request("a")
    assert decode.has_pending_kv_transfers()  # the pull may still write them
    _settle(decode)


def test_unpulled_blocks_are_freed_at_the_send_timeout(tiny_llama_hf) -> None:
    prefill = _engine(str(tiny_llama_hf.path), "kv_producer", send_timeout_s=0.2)
    try:
        out = _run(
            prefill,
            "r",
            PROMPT,
            SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        )
        assert out["handle"] is not None and prefill.has_pending_kv_transfers()
        _settle(prefill)
    finally:
        prefill.close()


def test_bad_options_are_refused(tiny_llama_hf) -> None:
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        _engine(str(tiny_llama_hf.path), "kv_consumer", pull_timeout=1)
    with pytest.raises(ValueError, match="'nixl' package"):
        _engine(str(tiny_llama_hf.path), "kv_consumer", kv_transport="nixl")


def test_a_sliding_window_model_goes_through_pd_in_one_kv_group(tmp_path) -> None:
    """Gemma 3 (windowed and global layers: several KV groups where no connector is set) keeps one
    group on both PD sides, as --disable-hybrid-kv-cache-manager would, and its decode side
    continues the prefill exactly as one engine does."""
    from tiny_families import write_family

    path = str(write_family("gemma3", tmp_path).hf_dir)
    alone = _engine(path, None)
    pd = {"prefill": _engine(path, "kv_producer"), "decode": _engine(path, "kv_consumer")}
    try:
        assert alone.kv_block_layout.num_groups > 1
        assert pd["prefill"].kv_block_layout.num_groups == pd["decode"].kv_block_layout.num_groups == 1
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = _run(alone, "r", PROMPT, params)["tokens"]
        computed = pd["decode"].scheduler.num_prompt_tokens_computed
        assert _pd(pd, "r", PROMPT, params)["tokens"] == want
        assert pd["decode"].scheduler.num_prompt_tokens_computed == computed
        _settle(pd["prefill"], pd["decode"])
    finally:
        for core in (alone, *pd.values()):
            core.close()
