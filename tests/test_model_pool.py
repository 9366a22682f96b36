"""ModelPool (model_pool.py) on tiny random models, engines on threads: LRU eviction under
--max-loaded-models and --models-memory, a busy model kept until it drains, --model-ttl, pins,
and the config's checks. The real models behind a real server: test_multi_model.py."""

from __future__ import annotations

import asyncio
import functools

import pytest

from inferd.config import CacheConfig, EngineConfig, SchedulerConfig
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.core import EngineCore
from inferd.server.errors import APIError
from inferd.server.model_pool import ModelPool
from inferd.server.replicas import ReplicaSet
from inferd.server.served_models import ModelPoolConfig, ModelSpec, parse_model_arg


def _engine(path: str) -> EngineCore:
    config = EngineConfig(model=path, cache=CacheConfig(kv_cache_memory=8 << 20),
                          scheduler=SchedulerConfig(max_model_len=256), log_stats_interval=0)  # fmt: skip
    return EngineCore(config, verbose=False)


def _pool(path: str, names: str = "abc", **kw) -> ModelPool:
    config = ModelPoolConfig(tuple(ModelSpec(n, path) for n in names), **kw)
    return ModelPool(config, lambda spec: ReplicaSet(
        [AsyncEngine(functools.partial(_engine, spec.path))], spec.name))  # fmt: skip


def _loaded(pool: ModelPool) -> set[str]:
    return {n for n, e in pool.entries.items() if e.replicas is not None}


async def _until(check, what: str) -> None:
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _run(pool: ModelPool, body) -> None:
    async def main() -> None:
        pool.start()
        try:
            await body()
        finally:
            pool.close()
            await pool.shutdown()

    asyncio.run(main())


def test_least_recently_used_idle_model_goes_first(tiny_llama_gguf) -> None:
    pool = _pool(str(tiny_llama_gguf.path), max_loaded_models=2)

    async def body() -> None:
        for name in "ab":
            async with pool.use(name):
                pass
        async with pool.use("a"):  # a is now the more recent
            pass
        async with pool.use("c"):
            assert _loaded(pool) == {"a", "c"}
        unloads = pool.metrics.unloads
        assert unloads.labels("b", "lru")._value.get() == 1
        assert pool.metrics.loads.labels("a")._value.get() == 1

    _run(pool, body)


def test_a_busy_model_stays_until_it_drains(tiny_llama_gguf) -> None:
    pool = _pool(str(tiny_llama_gguf.path), max_loaded_models=1)

    async def body() -> None:
        held = pool.use("a")
        await held.__aenter__()
        waiter = asyncio.create_task(pool.use("b").__aenter__())
        await _until(lambda: pool._waiting == 1, "b to queue")
        with pytest.raises(APIError) as full:  # unbounded queue by default: admin unload 409
            await pool.unload("a")
        assert full.value.status == 409 and full.value.code == "model_busy"
        assert _loaded(pool) == {"a"} and not waiter.done()
        await held.__aexit__(None, None, None)
        name, _ = await waiter
        assert name == "b" and _loaded(pool) == {"b"}

    _run(pool, body)


def test_a_client_leaving_mid_load_leaves_the_model_loaded(tiny_llama_gguf) -> None:
    pool = _pool(str(tiny_llama_gguf.path), max_loaded_models=1)

    async def body() -> None:
        async def request() -> None:
            async with pool.use("a"):
                pass

        client = asyncio.create_task(request())
        await _until(lambda: "a" in pool._swaps, "the swap to start")
        client.cancel()
        await _until(lambda: _loaded(pool) == {"a"} and not pool._swaps, "the load to end")
        assert pool.entries["a"].leases == 0 and pool._waiting == 0
        async with pool.use("b"):  # the abandoned model is idle: evicted as usual
            assert _loaded(pool) == {"b"}

    _run(pool, body)


def test_the_swap_queue_is_bounded(tiny_llama_gguf) -> None:
    pool = _pool(str(tiny_llama_gguf.path), max_loaded_models=1, max_swap_queue_len=1)

    async def body() -> None:
        held = pool.use("a")
        await held.__aenter__()
        waiter = asyncio.create_task(pool.use("b").__aenter__())
        await _until(lambda: pool._waiting == 1, "b to queue")
        with pytest.raises(APIError) as full:
            async with pool.use("c"):
                pass
        assert full.value.status == 503 and full.value.code == "queue_full"
        assert full.value.headers is not None and int(full.value.headers["Retry-After"]) >= 1
        await held.__aexit__(None, None, None)
        await waiter

    _run(pool, body)


def test_memory_budget_counts_what_the_engine_reports(tiny_llama_gguf) -> None:
    probe = _pool(str(tiny_llama_gguf.path), "a")

    async def measure() -> None:
        await probe.load("a")

    _run(probe, measure)
    one = probe.entries["a"].resident_bytes
    assert one > 8 << 20  # the KV pool at least
    pool = _pool(str(tiny_llama_gguf.path), models_memory=one * 2 + one // 2)

    async def body() -> None:
        for name in "abc":
            await pool.load(name)
        assert _loaded(pool) == {"b", "c"}
        assert pool.metrics.resident.labels("a")._value.get() == 0
        assert pool.metrics.resident.labels("c")._value.get() == one

    _run(pool, body)


def test_idle_models_unload_after_the_ttl_and_pins_stay(tiny_llama_gguf) -> None:
    pool = _pool(str(tiny_llama_gguf.path), "ab", pins=("a",), model_ttl=0.2)

    async def body() -> None:
        await _until(lambda: _loaded(pool) == {"a"}, "the pinned model to load at start")
        await pool.load("b")
        await _until(lambda: pool.metrics.unloads.labels("b", "ttl")._value.get() == 1,
                     "b to expire")  # fmt: skip
        assert _loaded(pool) == {"a"}
        with pytest.raises(APIError) as pinned:
            await pool.unload("a")
        assert pinned.value.status == 409

    _run(pool, body)


def test_config_checks() -> None:
    spec = [ModelSpec("a", "x"), ModelSpec("b", "y")]
    with pytest.raises(ValueError, match="given twice"):
        ModelPoolConfig((spec[0], spec[0]))
    with pytest.raises(ValueError, match="not a served model"):
        ModelPoolConfig(tuple(spec), pins=("z",))
    with pytest.raises(ValueError, match="leaves no room"):
        ModelPoolConfig(tuple(spec), max_loaded_models=1, pins=("a",))
    assert parse_model_arg("a=/m.gguf") == ("a", "/m.gguf")
    assert parse_model_arg("/m.gguf") == (None, "/m.gguf")
    with pytest.raises(ValueError):
        parse_model_arg("=x")
