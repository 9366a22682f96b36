"""The hybrid KV manager (inferd/kv/kv_groups.py): sliding-window layers in KV cache groups of
their own that give blocks back once they leave the window. On tiny random Gemma 3 (5 local : 1
global), Gemma 2 (alternating) and Mistral (every layer windowed) checkpoints written by
transformers, windows of 8 tokens, 4-token blocks: greedy tokens equal transformers' for prompts
many windows long, batched, chunked, with prefix-cache hits, preempted and with speculation, and
bit for bit the same as with every block kept; a long sequence holds its full-attention blocks and
a window's worth per windowed group only; no block leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_families import WINDOW, TinyFamilyModel, hf_greedy, write_family

from inferd import LLM, SamplingParams
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.kv.kv_groups import NULL_BLOCK, KVGroup, KVLayout, kv_bytes_per_token_at
from inferd.models.spec import LayerSpec, ModelSpec, RopeSpec
from inferd.spec import decoder as spec_decoder
from inferd.spec.policy import SpecPolicy

pytest.importorskip("transformers")

BS = 4  # tokens per block: a window of 8 spans 2-3 blocks
NEW_TOKENS = 12
CLEAR_MARGIN = 1e-3  # transformers' top-2 logits closer than this: a near-tie, compared up to it
FAMILIES = ("gemma3", "gemma2", "mistral")


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, TinyFamilyModel]:
    root = tmp_path_factory.mktemp("hybrid")
    return {name: write_family(name, root) for name in FAMILIES}


def _prompts(vocab: int) -> list[list[int]]:
    """37-64 tokens (4-8 windows); the last two share their first 40 tokens."""
    g = torch.Generator().manual_seed(7)
    a, b, c = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 64, 50))
    return [a, b, c, b[:40] + a[:9]]


@pytest.fixture(scope="module")
def references(families) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy(m.model, p, NEW_TOKENS) for p in _prompts(m.vocab_size)]
            for name, m in families.items()}  # fmt: skip


def _llm(path: Path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    return LLM(str(path), quantization="none", verbose=False, block_size=BS, **kw)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_transformers(got, refs) -> None:
    for i, ((tokens, _), (want, margins)) in enumerate(zip(got, refs)):
        n = next((k for k, m in enumerate(margins) if m < CLEAR_MARGIN), len(want))
        assert n >= NEW_TOKENS // 2, f"prompt {i}: the reference's logits tie at {n}"
        assert tokens[:n] == want[:n], f"prompt {i}: {tokens} != transformers' {want}"


def _quiet_spec_policy(monkeypatch) -> None:
    """Fixed speculation costs (the policy reads the clock otherwise)."""
    monkeypatch.setattr(
        spec_decoder, "measure_verify_cost", lambda *a, **k: ({1: 0.1, 64: 0.5}, {})
    )
    monkeypatch.setattr(SpecPolicy, "record_speculation_time", lambda self, *args: None)


# ---- layouts -------------------------------------------------------------------------------
def _spec(windows: list[int | None]) -> ModelSpec:
    rope = RopeSpec.of(10000.0, None)
    return ModelSpec(tuple(LayerSpec(rope, 1.0, sliding_window=w) for w in windows), tied_head=True)


def test_layouts_group_layers_by_attention_type():
    gemma3_270m = _spec(([512] * 5 + [None]) * 3)
    layout = KVLayout.of(gemma3_270m)
    assert layout.group_size == 3 and layout.num_groups == 6
    assert sorted(layout.windows, key=str) == [512] * 5 + [None]
    (full,) = [g for g in layout.groups if g.window is None]
    assert full.layers == (5, 11, 17) and layout.groups[0].layers == (0, 1, 2)
    assert layout.layer_group[17] == layout.groups.index(full) and layout.layer_slot[17] == 2
    assert layout.describe() == "6 KV groups of 3 layers: 5 window 512, 1 full"
    # Gemma 3 270M: 1 kv head x 256, fp32 = 2,048 bytes per layer and token.
    assert kv_bytes_per_token_at(gemma3_270m, 2048, 8192, hybrid=True) == 8064
    assert kv_bytes_per_token_at(gemma3_270m, 2048, 8192, hybrid=False) == 36864
    alternating = KVLayout.of(_spec([4096, None] * 13))
    assert (alternating.num_groups, alternating.group_size) == (2, 13)
    assert KVLayout.of(_spec([4096] * 4)).windows == (4096,)  # Mistral: one windowed group
    assert not KVLayout.of(_spec([None] * 4)).is_hybrid
    assert KVLayout.of(gemma3_270m, hybrid=False).num_groups == 1
    # A sequence holds every block of the full group and a window (+ a step's queries) of the rest.
    assert layout.blocks_for(8192, 16, 256) == 512 + 5 * layout.window_blocks(512, 16, 256)


def test_windowed_blocks_released_and_cached_per_group():
    """A full group and a window-8 group over 4-token blocks, exact block ids: releases keep the
    table positional, a hit takes the full group's whole path and the window's blocks only, and
    eviction takes windowed blocks from inside the tree."""
    layout = KVLayout((KVGroup((0,), None), KVGroup((1,), 8)), 2)
    kv = KVCacheManager(num_blocks=32, block_size=4, layout=layout)
    tokens = list(range(20))
    assert kv.allocate_slots(1, 0, 20)
    assert kv.tables(1) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    kv.cache_computed_blocks(1, tokens, 20)
    # The next query, at position 20, sees keys 13..20: blocks 0-2 of the window group are done.
    assert kv.allocate_slots(1, 20, 1)
    assert kv.tables(1) == [[0, 1, 2, 3, 4, 10], [NULL_BLOCK] * 3 + [8, 9, 11]]
    assert [kv.pool.ref_counts[b] for b in (5, 6, 7)] == [1, 1, 1]  # the tree's alone
    assert kv.num_blocks_held(1) == 9
    kv.check_integrity()
    # A hit of 5 blocks computes from position 20: the window group needs blocks 3 and 4 only.
    assert kv.attach_cached_prefix(2, tokens + [99]) == 20
    assert kv.tables(2) == [[0, 1, 2, 3, 4], [NULL_BLOCK] * 3 + [8, 9]]
    assert kv.prefix_cache.evict(3) == 3  # the released window blocks, from interior nodes
    assert kv.cached_prefix_len(tokens[:13]) == 0  # a hit at 4, 8 or 12 needs one of them
    assert kv.cached_prefix_len(tokens + [99]) == 20
    kv.check_integrity()
    kv.free(1)
    kv.free(2)
    assert kv.reset_prefix_cache() and kv.pool.num_free == 32
    kv.check_integrity()


def test_info_prints_kv_bytes_at_8k(families):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "inferd.cli", "info", str(families["gemma3"].gguf_path)],
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # 6 tiny layers, 1 kv head x 256 fp32: 2,048 bytes a layer; 5 keep 8 of 8,192 tokens.
    assert "2,058 B/token (hybrid: 5 local layers hold 8 tokens), 12,288 without" in r.stdout, (
        r.stdout
    )


# ---- the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_chunked_batched_cached(families, references, family):
    """All prompts at once in 16-token steps (8-token prefill chunks), then again as prefix-cache
    hits: transformers' tokens, and the same bits as a pool that keeps every block."""
    m = families[family]
    prompts = _prompts(m.vocab_size)
    llm = _llm(m.hf_dir, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert llm.engine.kv.layout.is_hybrid
    cold = _run(llm, prompts)
    _assert_transformers(cold, references[family])
    hits = llm.engine.stats.prefix_cache_hits_total
    assert _run(llm, prompts) == cold
    assert llm.engine.stats.prefix_cache_hits_total > hits
    llm.engine.check_no_leaks()
    kept = _llm(m.hf_dir, disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False)
    assert not kept.engine.kv.layout.is_hybrid
    assert _run(kept, prompts) == cold


def test_long_sequence_holds_global_layers_and_a_window(families):
    """A Gemma 3 sequence of 230 tokens: the pool's use stays within the full-attention group's
    blocks plus a window (and a step's queries) per local group."""
    m = families["gemma3"]
    budget = 32
    llm = _llm(m.hf_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    kv = llm.engine.kv
    layout = kv.layout
    assert layout.num_groups == 6 and layout.group_size == 1  # 5 local + 1 global layer
    peak = [0]
    allocate = kv.allocate_slots

    def recording(seq_id, num_computed, num_new):
        ok = allocate(seq_id, num_computed, num_new)
        peak[0] = max(peak[0], kv.pool.num_blocks - kv.pool.num_free)
        return ok

    kv.allocate_slots = recording
    prompt = torch.randint(
        3, m.vocab_size, (200,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    ((tokens, _),) = _run(llm, [prompt], max_tokens=30)
    total = len(prompt) + 30
    full = -(-total // BS)
    bound = full + 5 * layout.window_blocks(WINDOW, BS, budget)
    assert peak[0] <= bound < 6 * full // 2, (peak[0], bound, 6 * full)
    llm.engine.check_no_leaks()
    kept = _llm(m.hf_dir, disable_hybrid_kv_cache_manager=True, enable_prefix_caching=False,
                max_num_batched_tokens=budget)  # fmt: skip
    assert _run(kept, [prompt], max_tokens=30)[0][0] == tokens


def test_preemption_and_abort_leak_nothing(families, references):
    """A pool too small for every sequence at once: preempted sequences recompute to the same
    tokens; aborted ones give every block back."""
    m = families["gemma2"]
    prompts = _prompts(m.vocab_size)
    roomy = _run(_llm(m.hf_dir), prompts, max_tokens=30)
    # Gemma 2 tiny: 1 layer a group, 2 kv heads x 64 fp32 x 4 tokens = 4 KiB a block: 48 blocks.
    small = _llm(m.hf_dir, kv_cache_memory=48 * 4096, max_num_batched_tokens=16)
    assert small.engine.kv.pool.num_blocks == 48
    assert _run(small, prompts, max_tokens=30) == roomy
    assert small.engine.stats.num_preemptions_total > 0
    small.engine.check_no_leaks()
    engine = small.engine
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(12):
        engine.step()
    for i in (0, 2):
        assert engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.requests.clear()
    engine.check_no_leaks()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculation_with_a_hybrid_target(families, references, method, monkeypatch, tmp_path):
    """Verification rows read the window before their first row: prompt lookup, a draft model
    (whose own pool holds what the target's would without groups) and a learned head keep
    transformers' tokens."""
    _quiet_spec_policy(monkeypatch)
    m = families["gemma3"]
    spec: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(families["mistral"].hf_dir)
    if method == "eagle":
        from inferd.spec.eagle_head import EagleHead

        torch.manual_seed(0)
        EagleHead.for_target(_llm(m.hf_dir).engine.runner.model).save(tmp_path / "head")
        spec["model"] = str(tmp_path / "head")
    llm = _llm(m.hf_dir, speculative_config=spec, max_num_batched_tokens=32)
    prompts = _prompts(m.vocab_size)
    loop = prompts[0][:6] * 8  # prompt lookup finds drafts in it
    got = _run(llm, prompts + [loop])
    _assert_transformers(got, references["gemma3"] + [hf_greedy(m.model, loop, NEW_TOKENS)])
    assert llm.engine.stats.spec_num_drafts > 0
    if method == "draft_model":
        target = llm.engine.kv.pool.num_blocks
        assert llm.engine.proposer.kv.pool.num_blocks == target // llm.engine.kv.layout.num_groups
    llm.engine.check_no_leaks()
    plain = _llm(m.hf_dir, max_num_batched_tokens=32)
    assert [t for t, _ in _run(plain, prompts + [loop])] == [t for t, _ in got]


@pytest.mark.parametrize("kernel", [True, False])
def test_draft_tree_leaves_move_into_every_group(families, monkeypatch, kernel):
    """Draft-tree leaves verified in scratch blocks of every KV group (the C++ kernel or the
    torch backend): an accepted leaf's K/V lands in each group's block, so every later token and
    logprob is the same as without speculation."""
    from test_draft_tree import LeafOracle

    _quiet_spec_policy(monkeypatch)
    m = families["gemma3"]
    prompts = _prompts(m.vocab_size)
    plain = _llm(m.hf_dir)
    if not kernel:
        plain.engine.runner.attention_kernel = None
    want = _run(plain, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _llm(m.hf_dir, speculative_config=spec)
    engine = llm.engine
    if not kernel:
        engine.runner.attention_kernel = None
    answers = {tuple(p): tokens for p, (tokens, _) in zip(prompts, want)}
    engine.spec.proposer = LeafOracle(answers, engine.model_config.vocab_size)
    got = _run(llm, prompts)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):  # the torch backend's sums vary with the batch's shape
        for x, y in zip(a, b):
            assert list(x) == list(y)
            assert [x[t].logprob for t in x] == pytest.approx([y[t].logprob for t in y], abs=1e-4)
    assert engine.get_stats().spec_accepted_leaves > 0
    engine.check_no_leaks()
    assert not engine.kv.scratch
