"""The router's policies on the real radix tree and KV index: prefix overlap, the imbalance
override, LRU pruning, worker removal, exact mode from the engine's own KV events."""

from __future__ import annotations

import pytest

from inferd.kv.block_hash import chain_hashes
from inferd.kv.block_pool import BlockPool
from inferd.kv.prefix_cache import PrefixCache
from inferd.router.policy import POLICIES, CacheAwarePolicy, make_policy
from inferd.router.radix import RadixTree, common_prefix_len


def test_common_prefix_len() -> None:
    assert common_prefix_len((1, 2, 3, 4), (1, 2, 9)) == 2
    assert common_prefix_len("hello", "help") == 3
    assert common_prefix_len((), (1,)) == 0
    a = tuple(range(1000))
    assert common_prefix_len(a, a[:637] + (-1,) + a[638:]) == 637


def test_tree_matches_the_longest_prefix_sent() -> None:
    t = RadixTree(max_size=1000)
    t.insert((1, 2, 3, 4, 5))
    t.insert((1, 2, 3, 9))  # splits the edge at 3
    assert t.size == 6  # 1 2 3 | 4 5 | 9
    assert t.match_len((1, 2, 3, 4, 5, 6)) == 5
    assert t.match_len((1, 2, 3, 9, 9)) == 4
    assert t.match_len((1, 2, 7)) == 2
    assert t.match_len((7,)) == 0
    t.check_integrity()
    s = RadixTree(max_size=1000)
    s.insert("system: be brief\nuser: hi")
    assert s.match_len("system: be brief\nuser: bye") == len("system: be brief\nuser: ")
    s.check_integrity()


def test_tree_prunes_least_recently_used_leaves_to_its_size() -> None:
    t = RadixTree(max_size=10)
    t.insert((1, 1, 1, 1))  # oldest
    t.insert((2, 2, 2, 2))
    t.match_len((1, 1, 1, 1))  # touched: now newer than (2, ...)
    t.insert((3, 3, 3, 3))  # 12 > 10: the least recently used leaf goes
    assert t.size == 8
    assert t.match_len((2, 2, 2, 2)) == 0
    assert t.match_len((1, 1, 1, 1)) == 4 and t.match_len((3, 3, 3, 3)) == 4
    t.check_integrity()
    # A shared stem stays while a leaf below it lives; it goes once its children have.
    u = RadixTree(max_size=6)
    u.insert((5, 5, 5, 6))
    u.insert((5, 5, 5, 7))  # stem 5 5 5, leaves 6 and 7: size 5
    u.insert((8, 8))  # size 7: leaf 6 (oldest) goes; the stem still has 7 below it
    assert u.size == 6 and u.match_len((5, 5, 5, 7)) == 4 and u.match_len((5, 5, 5, 6)) == 3
    u.prune(0)
    assert u.size == 0 and not u.root.children
    u.check_integrity()


def _policy(**kw) -> CacheAwarePolicy:
    p = make_policy("cache_aware", **kw)
    assert isinstance(p, CacheAwarePolicy)
    for w in ("a", "b"):
        p.add_worker(w)
    return p


def test_cache_aware_follows_the_prefix_and_spreads_new_ones() -> None:
    p = _policy()
    conv1, conv2 = tuple(range(100)), tuple(range(1000, 1100))
    assert p.select(conv1, {"a": 0, "b": 0}) == "a"
    # New prefix, equal loads: the smaller tree (b's is empty) takes it.
    assert p.select(conv2, {"a": 0, "b": 0}) == "b"
    # Later turns extend the history: each goes where its prefix is, though that worker is busier.
    for turn in range(3):
        c1 = p.choose(conv1 + tuple(range(5000, 5010 + turn)), {"a": 3, "b": 0})
        assert c1.worker_id == "a" and c1.matched == 100 + 10 * (turn > 0) + max(0, turn - 1)
        assert p.select(conv2 + (7,) * turn, {"a": 0, "b": 3}) == "b"


def test_a_prefix_under_the_cache_threshold_does_not_pull_new_conversations() -> None:
    """New conversations share a short system prompt: under cache_threshold of each prompt, it
    does not count, and they spread by load and tree size; a longer shared part does count."""
    p = _policy(cache_threshold=0.5)
    system = (1, 2, 3)
    assert p.select(system + tuple(range(100, 140)), {}) == "a"
    assert p.select(system + tuple(range(200, 240)), {}) == "b"  # 3 of 43 cached on a: cold
    assert p.select(system + tuple(range(300, 340)), {"a": 0, "b": 1}) == "a"
    assert p.select(system + tuple(range(100, 140)) + (9,), {"a": 2, "b": 0}) == "a"  # 43 of 44
    q = _policy(cache_threshold=0.0)  # the prefix always counts: the shared 3 tokens pull to a
    q.select(system + tuple(range(100, 110)), {})
    assert q.select(system + tuple(range(200, 210)), {}) == "a"


def test_cost_weighs_uncached_tokens_against_load() -> None:
    p = _policy(prefix_weight=0.1)
    prompt = tuple(range(40))
    assert p.select(prompt, {}) == "a"
    # b caches nothing: 40 tokens × 0.1 = 4 requests' worth. a with 3 more in flight still wins,
    # with 5 more it does not.
    assert p.select(prompt, {"a": 3, "b": 0}) == "a"
    assert p.select(prompt, {"a": 5, "b": 0}) == "b"


def test_imbalance_override_picks_the_shortest_queue() -> None:
    p = _policy(prefix_weight=1.0, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = tuple(range(500))
    assert p.select(prompt, {}) == "a"
    assert p.select(prompt, {"a": 4, "b": 0}) == "a"  # 4 - 0 is not > 4: the cache still wins
    assert p.select(prompt, {"a": 5, "b": 0}) == "b"  # imbalanced: shortest queue
    other = tuple(range(1000, 1500))
    assert p.select(other, {"a": 0, "b": 1}) == "a"
    assert p.select(other, {"a": 13, "b": 9}) == "a"  # 13 > 9 + 4 but not > 9 × 1.5
    assert p.select(other, {"a": 15, "b": 9}) == "b"


def test_removed_worker_gets_nothing_and_its_tree_goes() -> None:
    p = _policy()
    p.select((1, 2, 3), {})
    p.remove_worker("a")
    assert "a" not in p.trees
    assert {p.select((1, 2, 3), {"a": 0}) for _ in range(5)} == {"b"}
    p.add_worker("a")  # back, empty: the prefix is b's now
    assert p.choose((1, 2, 3), {}).worker_id == "b"
    p.remove_worker("a")
    p.remove_worker("b")
    with pytest.raises(LookupError):
        p.select((1,), {})


def test_simple_policies() -> None:
    rr = make_policy("round_robin")
    ll = make_policy("least_load")
    rnd = make_policy("random", seed=0)
    for p in (rr, ll, rnd):
        for w in ("a", "b", "c"):
            p.add_worker(w)
    assert [rr.select("x", {}) for _ in range(4)] == ["a", "b", "c", "a"]
    assert ll.select("x", {"a": 2, "b": 1, "c": 3}) == "b"
    assert {ll.select("x", {"a": 0, "b": 0, "c": 0}) for _ in range(3)} == {"a", "b", "c"}
    assert {rnd.select("x", {}) for _ in range(50)} == {"a", "b", "c"}


def test_bad_policy_names_and_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*cache_aware"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="policy 'round_robin'.*unexpected keyword"):
        make_policy("round_robin", max_tree_size=3)
    with pytest.raises(ValueError, match="prefix_weight"):
        make_policy("cache_aware", prefix_weight=-1)
    assert set(POLICIES) == {"cache_aware", "round_robin", "least_load", "random"}


class _Recorder:
    """The engine side's publisher interface, keeping the batches it would send."""

    enabled = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.payloads: list[dict] = []

    def stored(self, hashes) -> None:
        if hashes:
            self.payloads.append(
                {
                    "block_size": self.block_size,
                    "events": [{"type": "stored", "hashes": list(hashes)}],
                }
            )

    def removed(self, hashes) -> None:
        if hashes:
            self.payloads.append(
                {
                    "block_size": self.block_size,
                    "events": [{"type": "removed", "hashes": list(hashes)}],
                }
            )


def test_exact_mode_follows_the_engines_prefix_cache_events() -> None:
    """A real PrefixCache publishes what it stores and evicts; the policy's KV index then knows
    exactly which worker holds a prompt's blocks, and forgets evicted ones."""
    bs = 4
    pool = BlockPool(8)
    events = _Recorder(bs)
    cache = PrefixCache(pool, bs, events=events)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    blocks = pool.allocate(3)
    cache.insert(prompt, [blocks], [0], end_block=2)
    pool.decref(blocks)  # the sequence ends: its full blocks stay in the tree
    assert events.payloads[-1]["events"][0]["hashes"] == chain_hashes(prompt, bs)

    p = _policy(prefix_weight=1.0)
    for payload in events.payloads:
        p.on_kv_event("b", payload)
    c = p.choose(prompt + [7, 7], {"a": 0, "b": 1})
    assert (c.worker_id, c.matched) == ("b", 8)  # exact: whole blocks, though a's tree is empty
    # The same tokens under a tenant's salt are other blocks.
    salted = PrefixCache(BlockPool(8), bs, events=_Recorder(bs))
    salted.insert(prompt, [salted.pool.allocate(2)], [0], end_block=2, salt="tenant")
    salted_hashes = salted.events.payloads[-1]["events"][0]["hashes"]
    assert salted_hashes == chain_hashes(prompt, bs, "tenant")
    assert not set(salted_hashes) & set(chain_hashes(prompt, bs))

    assert cache.evict(2) == 2
    assert events.payloads[-1]["events"][0]["type"] == "removed"
    for payload in events.payloads[-1:]:
        p.on_kv_event("b", payload)
    assert p.kv_index.num_blocks("b") == 0
    assert p.kv_index.matched_tokens(prompt, ["b"]) == {"b": 0}
    p.on_kv_event(
        "b",
        {"block_size": bs, "events": [{"type": "stored", "hashes": [1, 2]}, {"type": "cleared"}]},
    )
    assert p.kv_index.num_blocks("b") == 0
    p.remove_worker("b")
    p.on_kv_event("b", events.payloads[0])  # from a worker no longer routed to: ignored
    assert p.kv_index.num_blocks("b") == 0
    cache.reset()
    pool.check_integrity({})


def test_kv_events_flags() -> None:
    """`--kv-events-endpoint` and vLLM's `--kv-events-config` set where the engine publishes."""
    from inferd.cli import build_parser
    from inferd.engine_args import engine_config_from_args

    def endpoint(*flags: str) -> str | None:
        return engine_config_from_args(
            build_parser().parse_args(["serve", *flags])
        ).cache.kv_events_endpoint

    assert endpoint() is None
    assert endpoint("--kv-events-endpoint", "tcp://*:5557") == "tcp://*:5557"
    cfg = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000"}'
    assert endpoint("--kv-events-config", cfg) == "tcp://*:6000"
    assert endpoint("--kv-events-config", '{"enable_kv_cache_events": false}') is None
    with pytest.raises(ValueError, match="must be a ZMQ endpoint"):
        endpoint("--kv-events-endpoint", "localhost:5557")
    with pytest.raises(SystemExit):  # argparse: "not JSON", "only zmq is supported"
        endpoint("--kv-events-config", "{nope")
    with pytest.raises(SystemExit):
        endpoint("--kv-events-config", '{"publisher": "nats"}')


def test_the_publisher_never_blocks_the_engine() -> None:
    """With nobody draining its queue, publishing returns at once and counts what it drops; a
    subscriber receives what was sent, in the wire format the router decodes."""
    import zmq

    from inferd.kv.kv_events import ZmqKVEventPublisher, decode_batch

    pub = ZmqKVEventPublisher("tcp://127.0.0.1:*", block_size=16, max_queue=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(pub.endpoint)
    try:
        received = None
        for _ in range(200):  # a SUB socket misses what is sent before it has joined: resend
            pub.stored([1, 2])
            if sub.poll(50):
                received = decode_batch(sub.recv_multipart())[1]
                break
        assert received is not None and received["block_size"] == 16
        assert {"type": "stored", "hashes": [1, 2]} in received["events"]
        pub.close()  # the sender thread is gone: nothing drains the queue of one
        dropped = pub.dropped
        for _ in range(3):
            pub.removed([3])
        assert pub.dropped == dropped + 2
    finally:
        sub.close()
        pub.close()
