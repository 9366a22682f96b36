"""The KV pool's pages are faulted in ahead of the allocator (inferd/kv/prefault.py): resident
where asked, absent beyond, contents untouched, and the engine moves the target as it allocates."""

from __future__ import annotations

import ctypes
import mmap
import time

import pytest
import torch

from inferd.config import ModelConfig
from inferd.engine.model_runner import allocate_kv_cache, is_lazily_zeroed
from inferd.kv.block_pool import BlockPool
from inferd.kv.prefault import KVPrefaulter

_CFG = ModelConfig(architecture="llama", vocab_size=32, hidden_size=512, intermediate_size=1024, num_layers=4,
                   num_heads=8, num_kv_heads=8, head_dim=64)  # fmt: skip
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident_fraction(t: torch.Tensor) -> float:
    """Share of the pages strictly inside `t` that are in memory (mincore)."""
    page = mmap.PAGESIZE
    start = (t.data_ptr() + page - 1) & ~(page - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~(page - 1)
    pages = (end - start) // page
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def _pool() -> torch.Tensor:
    """[layers, 2, blocks, block_size, heads, dim] fp32, 4 x 2 x 512 x 16 x 8 x 64 = 128 MiB: a
    lazily zeroed mapping, as an engine's pool."""
    data = allocate_kv_cache(_CFG, 512, 16, torch.float32, torch.device("cpu"))
    assert is_lazily_zeroed(data) and data.shape == (4, 2, 512, 16, 8, 64)
    return data


def _prefaulter(data: torch.Tensor, ahead_blocks: int) -> KVPrefaulter:
    per_block = data[0, 0, 0].numel() * data.element_size() * data.shape[0] * data.shape[1]
    p = KVPrefaulter(data, ahead_blocks * per_block)
    if not p.enabled:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available (Linux < 5.14)")
    return p


def test_pages_ahead_of_the_high_water_mark_are_faulted_in_and_nothing_beyond():
    data = _pool()
    p = _prefaulter(data, ahead_blocks=64)
    assert p.wait(30)
    assert p.done == 64
    # (The kernel may map a little more around a populated range: 6.18 here mapped the 2 MiB
    # before each one too. Far from it, nothing.)
    for layer in range(data.shape[0]):
        for kv in range(2):
            assert _resident_fraction(data[layer, kv, 1:63]) == 1.0
            assert _resident_fraction(data[layer, kv, 192:320]) == 0.0
    # The allocator handed out blocks up to 100: the target moves to 164.
    p.advance(100)
    assert p.wait(30)
    assert p.done == 164
    assert _resident_fraction(data[3, 1, 101:163]) == 1.0
    assert _resident_fraction(data[3, 1, 256:384]) == 0.0
    # Small moves wait until they add up to a quarter of `ahead` (16 blocks): no wake-up per block.
    p.advance(110)
    assert p.target == 164
    p.advance(120)
    assert p.target == 184
    p.advance(500)  # capped at the pool's end
    assert p.wait(30) and p.done == 512


def test_contents_are_left_as_they_are():
    data = _pool()
    # Blocks the engine already wrote, inside the range about to be faulted in.
    data[0, 0, 3].fill_(1.5)
    data[2, 1, 40].fill_(-2.0)
    p = _prefaulter(data, ahead_blocks=128)
    assert p.wait(30)
    assert torch.all(data[0, 0, 3] == 1.5) and torch.all(data[2, 1, 40] == -2.0)
    untouched = data[:, :, 100:128]
    assert torch.count_nonzero(untouched) == 0  # still the kernel's zero pages


def test_the_thread_ends_when_the_pool_is_dropped():
    data = _pool()
    p = _prefaulter(data, ahead_blocks=8)
    assert p.wait(30)
    mine = p.threads
    assert mine and all(t.is_alive() for t in mine)
    del data
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(t.is_alive() for t in mine)


def test_stop_ends_the_workers_mid_populate_and_exit_stops_every_prefaulter():
    """`stop` (run for every live prefaulter at exit, before the interpreter finalizes) ends
    the workers after their madvise round, even while they populate a pool they alone still
    hold: none is left to drop a pool's last reference during finalization."""
    from inferd.kv import prefault

    data = _pool()
    p = _prefaulter(data, ahead_blocks=512)  # the whole pool: still populating below
    workers = p.threads
    assert p in prefault._live
    del data
    start = time.monotonic()
    prefault._stop_all()
    assert not any(t.is_alive() for t in workers)
    assert time.monotonic() - start < 10 and not p.enabled


def test_block_pool_tracks_the_highest_block_handed_out():
    pool = BlockPool(10)
    assert pool.high_water == 0
    a = pool.allocate(3)
    assert pool.high_water == 3
    pool.decref(a)
    pool.allocate(2)  # freed blocks are reused first: nothing fresh
    assert pool.high_water == 3
    pool.allocate(4)  # one freed block, then three fresh ones
    assert pool.high_water == 6


def test_engine_prefaults_its_pool_and_follows_allocation(tiny_llama_gguf):
    from inferd import LLM, SamplingParams

    llm = LLM(tiny_llama_gguf.path, kv_cache_memory=96 << 20, kv_cache_prefault=8 << 20, verbose=False)
    runner = llm.engine.runner
    p = runner.kv_prefaulter
    assert p is not None
    if not p.enabled:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available (Linux < 5.14)")
    first_target = p.target
    assert 0 < first_target < p.num_blocks
    prompts = [{"prompt_token_ids": list(range(3, 3 + 200 + 7 * i))} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    high = llm.engine.kv.pool.high_water
    assert high > 0
    # The target follows the high-water mark, in steps of at most a quarter of `ahead`.
    assert high + first_target - first_target // 4 <= p.target <= min(p.num_blocks, high + first_target)
    runner.wait_kv_prefault(30)
    assert p.done == p.target
    data = runner.kv_cache.data
    assert _resident_fraction(data[0, 0, high + 1 : p.done - 1]) == 1.0


def test_prefault_off_and_small_pools_have_no_thread(tiny_llama_gguf):
    from inferd import LLM

    assert LLM(tiny_llama_gguf.path, kv_cache_memory=96 << 20, kv_cache_prefault=0,
               verbose=False).engine.runner.kv_prefaulter is None  # fmt: skip
    # A small pool is zeroed when allocated (allocate_kv_cache): nothing left to fault in.
    assert LLM(tiny_llama_gguf.path, kv_cache_memory=8 << 20, verbose=False).engine.runner.kv_prefaulter is None
    with pytest.raises(ValueError, match="kv-cache-prefault"):
        LLM(tiny_llama_gguf.path, kv_cache_prefault=-1, verbose=False)


def test_allocate_kv_cache_small_pools_come_zeroed():
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)  # fmt: skip
    data = allocate_kv_cache(cfg, 8, 16, torch.float32, torch.device("cpu"))
    assert not is_lazily_zeroed(data) and torch.count_nonzero(data) == 0


def test_a_large_pool_is_fresh_zero_pages_even_after_the_heap_held_garbage():
    """Freed heap memory, NaN-filled, big enough for the pool: malloc would hand it back (its
    mmap threshold is 32 MiB, but a free chunk that fits comes first), resident and not zero."""
    junk = [torch.full((4 << 20,), float("nan")) for _ in range(40)]  # 40 x 16 MiB on the heap
    del junk
    data = _pool()
    assert _resident_fraction(data) == 0.0
    assert torch.count_nonzero(data) == 0


def test_kv_cache_prefault_flag():
    import argparse

    from inferd.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).cache.kv_cache_prefault == 1 << 30
    assert engine_config_from_args(parser.parse_args(["--kv-cache-prefault", "256MiB"])).cache.kv_cache_prefault == 256 << 20
    assert engine_config_from_args(parser.parse_args(["--kv-cache-prefault", "0"])).cache.kv_cache_prefault == 0
    with pytest.raises(SystemExit):  # not a size: argparse's one-line error
        parser.parse_args(["--kv-cache-prefault", "-1"])
