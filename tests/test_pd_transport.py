"""The PD transport on its own: blocks copied byte for byte over shared memory and TCP, released
or timed out on the sender, mismatched layouts and unknown transfers refused."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from inferd.kv.connectors.layout import KVBlockLayout
from inferd.kv.connectors.pd.handshake import KVLayoutMismatch
from inferd.kv.connectors.pd.transport import (
    BlockIO,
    KVReceiver,
    KVSender,
    KVTransferError,
    Outgoing,
    check_transport,
)
from inferd.kv.kv_cache import KVCache

BS = 4


def _cache(kv_cache_dtype: str = "auto", seed: int = 0) -> KVCache:
    dtype = torch.uint8 if kv_cache_dtype == "int8" else torch.float32
    data = torch.zeros(3, 2, 10, BS, 2, 8, dtype=dtype)
    cache = KVCache(data, kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        data.copy_(torch.randint(0, 255, data.shape, generator=g, dtype=torch.uint8))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=g))
    else:
        data.copy_(torch.randn(data.shape, generator=g))
    return cache


def _layout(cache: KVCache, kv_cache_dtype: str = "auto") -> KVBlockLayout:
    layers, planes, _, bs, heads, head_dim = cache.data.shape
    stored = "int8" if kv_cache_dtype == "int8" else "float32"
    return KVBlockLayout(
        "m1", stored, bs, 1, layers, planes, heads, head_dim, cache.scales is not None
    )


@pytest.fixture
def pair():
    def make(kv_cache_dtype: str = "auto", transport: str = "auto", receiver_layout=None):
        src, dst = _cache(kv_cache_dtype, 1), _cache(kv_cache_dtype, 2)
        dst.data.zero_()
        sender = KVSender(BlockIO(src), _layout(src, kv_cache_dtype))
        layout = receiver_layout(dst) if receiver_layout else _layout(dst, kv_cache_dtype)
        receiver = KVReceiver(BlockIO(dst), layout, timeout_s=5, transport=transport)
        made.append((sender, receiver))
        return src, dst, sender, receiver

    made: list = []
    yield make
    for sender, receiver in made:
        sender.close()
        receiver.close()


def _handle(sender: KVSender, tid: str = "t1") -> dict:
    return {"transfer_id": tid, "endpoint": sender.endpoint, "hostname": sender.hostname}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_pull_copies_blocks_and_release_frees(pair, transport, kv_cache_dtype):
    src, dst, sender, receiver = pair(kv_cache_dtype, transport)
    sender.register(
        "t1",
        Outgoing([5, 6, 7, 8, 9, 10, 11], 7, [7, 2, 4], {"first_token": 3}, time.monotonic() + 60),
    )
    # The receiver has the first block already (a prefix-cache hit): it pulls blocks [1, 3).
    got = receiver.pull(_handle(sender), 1, [0, 9])
    assert (got.token_ids, got.num_tokens, got.extra, got.num_blocks) == (
        [5, 6, 7, 8, 9, 10, 11],
        7,
        {"first_token": 3},
        2,
    )
    assert torch.equal(dst.data[:, :, [0, 9]], src.data[:, :, [2, 4]])
    assert not dst.data[:, :, [1, 2, 3, 5, 6, 7, 8]].any()
    if kv_cache_dtype == "int8":
        assert torch.equal(dst.scales[:, :, [0, 9]], src.scales[:, :, [2, 4]])
    assert sender.num_sent_blocks == 2 and sender.num_sent_tokens == 7 - BS
    assert sender.take_released() == []  # pinned until the receiver says so
    receiver.release(_handle(sender))
    deadline = time.monotonic() + 5
    released = []
    while not released and time.monotonic() < deadline:
        released = sender.take_released()
    assert [tid for tid, _ in released] == ["t1"] and released[0][1].blocks == [7, 2, 4]
    assert sender.num_pending == 0


def test_unpulled_transfer_expires(pair):
    _, _, sender, _ = pair()
    sender.register("old", Outgoing([1], 1, [0], {}, deadline=time.monotonic() - 1))
    sender.register("new", Outgoing([1], 1, [1], {}, deadline=time.monotonic() + 60))
    assert [tid for tid, _ in sender.take_released()] == ["old"]
    assert sender.num_pending == 1


@pytest.mark.parametrize(
    "change, field",
    [({"model_fingerprint": "other-model"}, "model_fingerprint"), ({"block_size": 8}, "block_size"),
     ({"kv_dtype": "float16"}, "kv_dtype"), ({"group_layers": 2}, "group_layers"),
     ({"kv_heads": 1}, "kv_heads"), ({"head_dim": 16}, "head_dim")],
)  # fmt: skip
def test_mismatched_layout_is_refused_at_the_handshake(pair, change, field):
    _src, dst, sender, receiver = pair(
        receiver_layout=lambda c: dataclasses.replace(_layout(c), **change)
    )
    sender.register("t1", Outgoing([1, 2], 2, [3], {}, time.monotonic() + 60))
    with pytest.raises(KVLayoutMismatch, match=field):
        receiver.handshake(sender.endpoint)
    with pytest.raises(KVLayoutMismatch, match=f"{field}: here"):
        receiver.pull(_handle(sender), 0, [0])
    assert not dst.data.any()  # nothing was written


def test_unknown_transfer_and_dead_peer_fail_cleanly(pair):
    _, _, sender, receiver = pair()
    with pytest.raises(KVTransferError, match="no transfer 'nope'"):
        receiver.pull(_handle(sender, "nope"), 0, [0])
    receiver.timeout_s = 0.3
    dead = {"transfer_id": "t", "endpoint": "tcp://127.0.0.1:9", "hostname": "elsewhere"}
    with pytest.raises(KVTransferError, match="did not answer"):
        receiver.pull(dead, 0, [0])


def test_optional_transports_are_a_clear_error_when_absent():
    check_transport("shm")
    with pytest.raises(ValueError, match="'nixl' package, which is not installed"):
        check_transport("nixl")
    with pytest.raises(ValueError, match="must be one of"):
        check_transport("rdma")
