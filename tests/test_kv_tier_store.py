"""The KV tier's store and connector on tiny models: files round-trip, damaged or foreign files are
never used, the size limit holds (LRU by access), and an engine's output is the same whether a
prefix comes from memory, the tier or recomputation — with no block leaked."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from inferd.config import KVTransferConfig
from inferd.engine_args import build_engine_config
from inferd.kv.connectors.base import NullConnector
from inferd.kv.connectors.factory import make_connector
from inferd.kv.connectors.layout import KVBlockLayout
from inferd.kv.connectors.store import BlockKV, DiskStore, HostStore

LAYOUT = KVBlockLayout("ab" * 16, "float32", 4, 1, 2, 2, 2, 8, False)
QLAYOUT = KVBlockLayout("ab" * 16, "int8", 4, 1, 2, 2, 2, 8, True)


def _block(layout: KVBlockLayout, seed: int) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    if layout.scaled:
        data = torch.randint(0, 256, layout.data_shape, generator=g, dtype=torch.uint8)
        return BlockKV(data, torch.rand(layout.scale_shape, generator=g))
    return BlockKV(torch.randn(layout.data_shape, generator=g), None)


def _equal(a: BlockKV, b: BlockKV) -> bool:
    same = torch.equal(a.data, b.data)
    return (
        same
        and (a.scales is None) == (b.scales is None)
        and (a.scales is None or torch.equal(a.scales, b.scales))
    )


@pytest.mark.parametrize("layout", [LAYOUT, QLAYOUT], ids=["fp32", "int8+scales"])
def test_block_files_round_trip_and_survive_a_new_store(tmp_path, layout) -> None:
    store = DiskStore(str(tmp_path), 1 << 20, layout)
    blocks = {h: _block(layout, h) for h in (11, 22, 33)}
    for h, b in blocks.items():
        assert store.write(h, b)
    assert not store.write(11, blocks[11])  # already stored: touched, not rewritten
    reopened = DiskStore(
        str(tmp_path), 1 << 20, layout
    )  # a restart: the index comes from the files
    assert reopened.nbytes == store.nbytes
    for h, b in blocks.items():
        assert _equal(reopened.read(h), b)
    assert reopened.read(44) is None
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def _only_file(tmp_path, store: DiskStore, h: int) -> str:
    return os.path.join(tmp_path, store.layout.block_key(h) + ".kvb")


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_damaged_file_is_skipped_with_one_warning(tmp_path, caplog, damage) -> None:
    store = DiskStore(str(tmp_path), 1 << 20, LAYOUT)
    store.write(7, _block(LAYOUT, 7))
    path = _only_file(tmp_path, store, 7)
    raw = bytearray(Path(path).read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-100]
    else:
        raw = bytearray(b"not a block")
    Path(path).write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="inferd.kv.tier"):
        assert store.read(7) is None
        assert store.read(7) is None
    assert len([r for r in caplog.records if path in r.getMessage()]) == 1
    assert store.rejected == 2


def test_foreign_layout_file_is_never_used(tmp_path, caplog) -> None:
    """Another model's file under the name this model would look up (a shared directory)."""
    other = KVBlockLayout("cd" * 16, *[getattr(LAYOUT, f) for f in LAYOUT.__slots__[1:]])
    mine, theirs = (
        DiskStore(str(tmp_path), 1 << 20, LAYOUT),
        DiskStore(str(tmp_path), 1 << 20, other),
    )
    assert LAYOUT.block_key(5) != other.block_key(5)  # different models: different names
    theirs.write(5, _block(other, 5))
    os.replace(_only_file(tmp_path, theirs, 5), _only_file(tmp_path, mine, 5))
    with caplog.at_level(logging.WARNING, logger="inferd.kv.tier"):
        assert mine.read(5) is None
    assert "another model or KV layout" in caplog.text


def test_size_limit_evicts_least_recently_used(tmp_path) -> None:
    one = DiskStore(str(tmp_path / "probe"), 1 << 20, LAYOUT)
    one.write(1, _block(LAYOUT, 1))
    size = one.nbytes
    store = DiskStore(str(tmp_path / "tier"), 3 * size, LAYOUT)
    for h in (1, 2, 3):
        store.write(h, _block(LAYOUT, h))
    assert store.read(1) is not None  # 1 is now the most recently used: 2 goes first
    store.write(4, _block(LAYOUT, 4))
    assert store.evictions == 1 and store.nbytes == 3 * size
    assert store.read(2) is None
    assert all(store.read(h) is not None for h in (1, 3, 4))
    assert len(os.listdir(tmp_path / "tier")) == 3
    # A smaller limit at the next start trims the directory to it, oldest first.
    smaller = DiskStore(str(tmp_path / "tier"), 2 * size, LAYOUT)
    assert smaller.nbytes == 2 * size and smaller.read(3) is None


def test_host_store_is_an_lru_within_its_budget() -> None:
    b = _block(LAYOUT, 0)
    host = HostStore(2 * b.nbytes)
    host.put("a", b)
    host.put("b", b)
    assert host.get("a") is b
    host.put("c", b)
    assert host.get("b") is None and host.get("a") is b and host.get("c") is b
    assert host.evictions == 1


def test_bad_flags_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="--kv-offload-size must be positive"):
        build_engine_config(kv_offload_dir=str(tmp_path), kv_offload_size=-1)
    with pytest.raises(ValueError, match="--kv-offload-cpu must be >= 0"):
        build_engine_config(kv_offload_cpu=-5)
    with pytest.raises(ValueError, match="unknown keys"):
        build_engine_config(kv_transfer_config='{"kv_conector": "x"}')
    with pytest.raises(ValueError, match="kv_role must be one of"):
        build_engine_config(kv_transfer_config='{"kv_role": "both"}')
    with pytest.raises(ValueError, match="unknown kv_connector 'Nope'"):
        KVTransferConfig(kv_connector="Nope")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not a writable directory"):
        make_connector(KVTransferConfig(kv_offload_dir=str(afile)), LAYOUT)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(ValueError, match="not a writable directory"):
            make_connector(KVTransferConfig(kv_offload_dir=str(locked / "kv")), LAYOUT)
    finally:
        locked.chmod(stat.S_IRWXU)


def test_transfer_config_json_and_flags(tmp_path) -> None:
    cfg = build_engine_config(kv_transfer_config='{"kv_connector": "NullConnector", "kv_role": "kv_producer", '
                                                 '"kv_connector_extra_config": {"x": 1}}')  # fmt: skip
    assert cfg.kv_transfer == KVTransferConfig("NullConnector", "kv_producer", {"x": 1})
    assert (
        build_engine_config(kv_offload_dir=str(tmp_path)).kv_transfer.connector_name
        == "OffloadingConnector"
    )
    assert build_engine_config().kv_transfer.connector_name is None
    assert isinstance(make_connector(KVTransferConfig(), LAYOUT), NullConnector)


# ---- an engine with a tier -------------------------------------------------------------------------
PROMPTS = [[1 + (i * 7 + j * 3) % 300 for j in range(45)] for i in range(6)]


def _llm(path, tmp_path, **kw):
    from inferd import LLM

    # A pool of 24 blocks of 4 tokens: each 45-token prompt's 11 full blocks evict older ones.
    # Per token: 2 layers x K, V x 2 heads x (16 fp32 values, or 16 int8 codes + a scale).
    per_token = 2 * 2 * 2 * (16 * 4 if kw.get("kv_cache_dtype", "auto") == "auto" else 16 + 4)
    args = {"dtype": "float32", "quantization": "none", "block_size": 4, "max_num_seqs": 2,
            "kv_cache_memory": 24 * 4 * per_token, "kv_offload_dir": str(tmp_path / "tier"),
            "verbose": False}  # fmt: skip
    return LLM(str(path), **{**args, **kw})


def _run(llm, prompt, params):
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.metrics.num_cached_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_output_is_the_same_from_memory_tier_or_recompute(
    tiny_llama_hf, tmp_path, kv_cache_dtype
) -> None:
    from inferd import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    cold = _llm(tiny_llama_hf.path, tmp_path, kv_cache_dtype=kv_cache_dtype, kv_offload_dir=None)
    want = {
        name: _run(cold, PROMPTS[0], p)[0] for name, p in (("greedy", greedy), ("seeded", seeded))
    }
    cold.engine.check_no_leaks()

    llm = _llm(tiny_llama_hf.path, tmp_path, kv_cache_dtype=kv_cache_dtype)
    tier = llm.engine.connector
    assert _run(llm, PROMPTS[0], greedy) == (want["greedy"], 0)
    assert _run(llm, PROMPTS[0], seeded) == (want["seeded"], 44)  # from memory
    for p in PROMPTS[1:]:  # push prompt 0's blocks out of memory
        _run(llm, p, greedy)
    tier.flush()
    assert tier.stats()["kv_offload_bytes_written"] > 0
    for name, params in (("greedy", greedy), ("seeded", seeded)):
        tokens, cached = _run(llm, PROMPTS[0], params)
        assert tokens == want[name]
        assert cached == 44  # 11 full blocks: from the tier (host or disk) or memory
        for p in PROMPTS[1:3]:
            _run(llm, p, greedy)
    assert tier.stats()["kv_offload_hits"] >= 2 * 40
    llm.engine.check_no_leaks()
    llm.close()

    # A restart on the same directory: what was cached is on disk (written at close).
    again = _llm(tiny_llama_hf.path, tmp_path, kv_cache_dtype=kv_cache_dtype)
    assert _run(again, PROMPTS[0], greedy) == (want["greedy"], 44)
    assert again.engine.connector.stats()["kv_offload_bytes_read"] > 0
    again.engine.check_no_leaks()
    again.close()


def _tier_on_disk(tiny_llama_hf, tmp_path, greedy) -> list[int]:
    """A tier directory holding PROMPTS[0]'s blocks (written at close); its greedy answer."""
    llm = _llm(tiny_llama_hf.path, tmp_path)
    want = _run(llm, PROMPTS[0], greedy)[0]
    llm.close()
    return want


def test_disk_loads_run_beside_the_step(tiny_llama_hf, tmp_path) -> None:
    """A prompt whose blocks are on disk waits outside the queue while the loader thread reads
    them; another request is scheduled in that same step, and both answers are unchanged."""
    from inferd import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _tier_on_disk(tiny_llama_hf, tmp_path, greedy)
    other_want = _run(_llm(tiny_llama_hf.path, tmp_path / "other"), PROMPTS[1], greedy)[0]
    core = _llm(tiny_llama_hf.path, tmp_path).engine
    core.add_request("tier", PROMPTS[0], greedy)
    core.add_request("other", PROMPTS[1], greedy)
    tokens: dict[str, list[int]] = {"tier": [], "other": []}
    for d in core.step():
        tokens[d.request_id] += d.new_token_ids
    loading = [seq.request_id for seq in core.scheduler.loading.values()]
    running = [seq.request_id for seq in core.scheduler.running]
    assert loading == ["tier"] and running == ["other"]
    while core.has_unfinished_requests():
        for d in core.step():
            tokens[d.request_id] += d.new_token_ids
    assert tokens == {"tier": want, "other": other_want}
    assert core.pop_finished("tier").metrics.num_cached_tokens == 44
    assert core.connector.stats()["kv_offload_hits"] >= 44  # more if a preemption recomputes from it
    core.check_no_leaks()
    core.close()


def test_an_abort_while_loading_frees_the_blocks_once_the_load_ends(tiny_llama_hf, tmp_path) -> None:
    from inferd import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _tier_on_disk(tiny_llama_hf, tmp_path, greedy)
    core = _llm(tiny_llama_hf.path, tmp_path).engine
    core.add_request("tier", PROMPTS[0], greedy)
    core.step()
    assert core.scheduler.loading and core.connector.has_pending_sends()
    core.abort_request("tier")
    assert core.scheduler.sending  # its blocks are held: the loader may still write them
    deadline = time.monotonic() + 30
    while core.has_pending_kv_transfers():
        assert time.monotonic() < deadline, "blocks still held for a load"
        core.step()
    core.check_no_leaks()
    core.close()


def test_corrupt_file_recomputes_that_block(tiny_llama_hf, tmp_path, caplog) -> None:
    from inferd import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _llm(tiny_llama_hf.path, tmp_path)
    want = _run(llm, PROMPTS[0], greedy)[0]
    llm.close()
    files = sorted((tmp_path / "tier").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) >= 11
    # The prompt's 6th block: which file it is, from its hash.
    from inferd.kv.block_hash import chain_hashes

    layout = llm.engine.kv_block_layout
    sixth = tmp_path / "tier" / (layout.block_key(chain_hashes(PROMPTS[0], 4)[5]) + ".kvb")
    raw = bytearray(sixth.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    sixth.write_bytes(raw)
    again = _llm(tiny_llama_hf.path, tmp_path)
    with caplog.at_level(logging.WARNING, logger="inferd.kv.tier"):
        tokens, cached = _run(again, PROMPTS[0], greedy)
    assert tokens == want
    assert cached == 5 * 4  # the blocks before the damaged one; the rest recomputed
    assert "fails its checksum" in caplog.text
    again.engine.check_no_leaks()
    again.close()


def test_host_tier_alone(tiny_llama_hf, tmp_path) -> None:
    from inferd import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _llm(tiny_llama_hf.path, tmp_path, kv_offload_dir=None, kv_offload_cpu=1 << 20)
    want = _run(llm, PROMPTS[0], greedy)[0]
    for p in PROMPTS[1:]:
        _run(llm, p, greedy)
    assert _run(llm, PROMPTS[0], greedy) == (want, 44)
    assert llm.engine.connector.stats()["kv_offload_hits"] >= 40
    llm.engine.check_no_leaks()
    llm.close()


def test_hybrid_layout_output_unchanged_with_a_tier(tmp_path) -> None:
    """Gemma 2's alternating windowed and global layers: two KV groups per block position. Blocks
    go to the tier (and come back) only where every group holds one; the output never changes."""
    pytest.importorskip("transformers")
    from tiny_families import write_family

    from inferd import LLM, SamplingParams

    m = write_family("gemma2", tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, m.vocab_size, (30,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(llm, prompt):
        return (
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    common = {"quantization": "none", "verbose": False, "block_size": 4, "max_num_seqs": 1,
              "kv_cache_memory": 64 << 10}  # fmt: skip
    want = run(LLM(str(m.hf_dir), enable_prefix_caching=False, **common), prompts[0])
    llm = LLM(str(m.hf_dir), kv_offload_dir=str(tmp_path / "tier"), **common)
    assert llm.engine.kv_block_layout.num_groups == 2
    assert run(llm, prompts[0]) == want
    for p in prompts[1:]:
        run(llm, p)
    assert run(llm, prompts[0]) == want
    llm.engine.check_no_leaks()
    llm.close()
    again = LLM(str(m.hf_dir), kv_offload_dir=str(tmp_path / "tier"), **common)
    assert run(again, prompts[0]) == want
    again.engine.check_no_leaks()
    again.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_connector_moves_every_group_layer_and_scale(kv_cache_dtype) -> None:
    """Two KV groups per block position (a hybrid model's pool): evicted blocks saved from their
    pages in each group, loaded into other pages, bit for bit, scales included."""
    from types import SimpleNamespace

    from inferd.kv.block_hash import chain_hashes
    from inferd.kv.kv_cache import KVCache, storage_dtype

    layout = KVBlockLayout("ef" * 16, "float32" if kv_cache_dtype == "auto" else "int8", 4, 2, 3, 2,
                           2, 8, kv_cache_dtype != "auto")  # fmt: skip
    dtype = storage_dtype(kv_cache_dtype, torch.float32)
    data = torch.randint(0, 100, (3, 2, 12, 4, 2, 8)).to(
        dtype
    )  # [layers, planes, blocks, bs, heads, dim]
    pool = KVCache(data, kv_cache_dtype)
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape))
    before = (pool.data.clone(), None if pool.scales is None else pool.scales.clone())
    tier = make_connector(KVTransferConfig(kv_offload_cpu=1 << 20), layout)
    tier.register_kv_cache(pool)
    tokens = list(range(10, 21))  # 11 tokens: blocks 0 and 1 are full, and may be loaded
    h = chain_hashes(tokens, 4)
    tier.blocks_evicted([(h[0], [1, 5]), (h[1], [2, 7])])  # (hash, block in group 0, in group 1)
    tier.start_load_kv(tier.build_connector_meta())
    request = SimpleNamespace(seq_id=1, token_ids=tokens, num_computed_tokens=0,
                              params=SimpleNamespace(cache_salt=None))  # fmt: skip
    assert tier.get_num_new_matched_tokens(request, 0) == (8, False)
    tier.update_state_after_alloc(request, [[9, 10, 0], [3, 11, 0]], 8)
    tier.start_load_kv(tier.build_connector_meta())
    for dst, src in ((9, 1), (3, 5), (10, 2), (11, 7)):
        assert torch.equal(pool.data[:, :, dst], before[0][:, :, src])
        if pool.scales is not None:
            assert torch.equal(pool.scales[:, :, dst], before[1][:, :, src])
    assert tier.stats()["kv_offload_hits"] == 8
    salted = SimpleNamespace(**{**vars(request), "params": SimpleNamespace(cache_salt="tenant")})
    assert tier.get_num_new_matched_tokens(salted, 0) == (0, False)  # another tenant's: never
