"""The EAGLE-style draft head on tiny random models: shapes and chaining (the engine's chains equal
training's unrolled levels), save/load bit-exact, targets it was not trained for rejected, the
draft vocabulary, and the quantized and C++ inference paths against the plain ones."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_helpers import cache_upto, sequences, target_model, trained_like
from tiny_models import TinySpec, with_seed, write_hf_dir

from inferd.spec import eagle_kernels
from inferd.spec.draft_cache import DraftCache
from inferd.spec.eagle_head import EagleHead
from inferd.train.eagle_data import target_hidden_states
from inferd.train.head_levels import forward_levels


@pytest.fixture(scope="module")
def target(tiny_llama_hf) -> torch.nn.Module:
    return target_model(tiny_llama_hf.path)


@pytest.mark.parametrize("features", [(), (0,)])
def test_engine_chains_equal_the_training_levels(target, features) -> None:
    """Drafting from the engine's cache, step by step, computes the same features as training's
    all-positions-at-once levels (chain step j from t = level j - 1 at position t + j - 1), when
    the chain is fed the same tokens: what the training optimises is what the engine runs. Also
    for a head that reads a lower layer's output beside the final hidden state (EAGLE-3)."""
    head = trained_like(target, intermediate_size=64, feature_layers=features)
    seq = sequences(1, 30, target.config.vocab_size)[0]
    states = target_hidden_states(target, [seq], capture_layers=features)
    assert (
        states.hidden[0].shape[1]
        == head.input_size
        == target.config.hidden_size * (1 + len(features))
    )
    h, toks = states.hidden[0], states.tokens[0]
    levels = forward_levels(head, h[None], toks[None], torch.tensor([30]), 4)
    assert [f.shape for f in levels] == [(1, 29, target.config.hidden_size)] * 4
    for t in (0, 3, 17, 26):
        k = min(4, 30 - t - 2)
        # Feed the true tokens (as the levels do): `choose` picks them instead of the argmax.
        drafted, logits = head.draft(
            [cache_upto(head, h, toks, t)],
            k,
            return_logits=True,
            choose=lambda _, j, t=t: toks[t + 2 + j].view(1),
        )
        assert drafted[0].tolist() == toks[t + 2 : t + 2 + k].tolist()
        for j in range(k):
            want = head.compute_logits(levels[j][0, t + j][None])[0]
            torch.testing.assert_close(logits[0, j], want, rtol=1e-4, atol=1e-4)
    # Greedy drafting feeds its own tokens back: the first draft is the level-0 argmax.
    greedy, _ = head.draft([cache_upto(head, h, toks, 5)], 3)
    assert greedy[0, 0] == head.greedy(levels[0][0, 5])
    assert head.draft([cache_upto(head, h, toks, 5)], 0)[0].shape == (1, 0)


@pytest.mark.parametrize("inference", [False, True])
def test_batched_drafts_equal_one_cache_at_a_time(target, tmp_path, inference) -> None:
    """Caches of different lengths (and one that starts late, as after a prefix-cache hit) drafted
    together give each the chain it gets alone: with plain ops, and with the engine's kernels
    (`load`: the C++ elementwise ops and paged attention over each cache)."""
    head = trained_like(target, seed=1, intermediate_size=48)
    if inference:
        head = EagleHead.load(head.save(tmp_path / "head"), target)
    seqs = sequences(3, 24, target.config.vocab_size, seed=2)
    states = target_hidden_states(target, seqs)
    caches = [
        cache_upto(head, states.hidden[0], states.tokens[0], 20),
        cache_upto(head, states.hidden[1], states.tokens[1], 4),
        cache_upto(head, states.hidden[2], states.tokens[2], 12, lo=8),
    ]
    together, logits = head.draft(caches, 3, return_logits=True)
    for i, c in enumerate(caches):
        alone, alone_logits = head.draft([c], 3, return_logits=True)
        assert together[i].tolist() == alone[0].tolist()
        torch.testing.assert_close(logits[i], alone_logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("features", [(), (0, 1)])
def test_inference_layers_draft_what_the_trained_head_drafts(target, tmp_path, features) -> None:
    """`load` swaps in the engine's kernels (fp32: the same drafts; int4 linears: features within
    int4 rounding) and drops nothing: every weight still takes part (the feature layers' too, and
    their C++ norm)."""
    from inferd.layers.quantized_linear import QuantizedLinear

    head = trained_like(target, seed=4, intermediate_size=64, feature_layers=features)
    path = head.save(tmp_path / "head")
    plain = EagleHead.load(path, target)
    int4 = EagleHead.load(path, target, quantize=True)
    assert isinstance(int4.gate_up, QuantizedLinear) and not isinstance(
        plain.gate_up, QuantizedLinear
    )
    seqs = sequences(3, 20, target.config.vocab_size, seed=5)
    states = target_hidden_states(target, seqs, capture_layers=features)
    for h, toks in zip(states.hidden, states.tokens):
        want = head.draft([cache_upto(head, h, toks, 15)], 3, return_logits=True)
        got = plain.draft([cache_upto(plain, h, toks, 15)], 3, return_logits=True)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        q = int4.draft([cache_upto(int4, h, toks, 15)], 1, return_logits=True)[1]
        assert torch.nn.functional.cosine_similarity(q[0, 0], want[1][0, 0], dim=0) > 0.99


def test_draft_cache_grows_overwrites_and_restarts_after_a_gap() -> None:
    kv = lambda n, base: (
        torch.zeros(n, 4),
        torch.full((n, 1, 2), float(base)),
        torch.full((n, 1, 2), -float(base)),
    )  # noqa: E731
    c = DraftCache(torch.zeros(1), 1, 2)
    c.write(0, *kv(10, 1))
    c.write(10, *kv(30, 2))  # grows past its first 16 rows
    k, v = c.keys()
    assert (
        (c.lo, c.end) == (0, 40)
        and k[:10].eq(1).all()
        and k[10:].eq(2).all()
        and v[10:].eq(-2).all()
    )
    c.write(35, *kv(2, 3))  # a recomputation from position 35 (preemption): overwrite, shorten
    assert (c.lo, c.end) == (0, 37) and c.keys()[0][35:].eq(3).all() and c.keys()[0][34].eq(2).all()
    copy = c.copy()
    c.write(50, *kv(3, 4))  # positions 37..49 never computed: start afresh at 50
    assert (c.lo, c.end) == (50, 53) and c.keys()[0].eq(4).all()
    assert (copy.lo, copy.end) == (0, 37)  # a fork's copy is its own


@pytest.mark.parametrize("features", [(), (0, 1)])
def test_save_load_round_trip_is_bit_exact(target, tmp_path, features) -> None:
    torch.manual_seed(1)
    head = EagleHead.for_target(target, intermediate_size=80, feature_layers=features)
    for p in head.parameters():  # not the init values: loading must carry every tensor
        p.data.add_(torch.randn_like(p) * 0.01)
    head.save(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["hidden_size"] == target.config.hidden_size and cfg["intermediate_size"] == 80
    loaded = EagleHead.load(tmp_path / "head", target, device="cpu", dtype=torch.float32)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.feature_layers == features and cfg["feature_layers"] == list(features)
    seq = sequences(1, 12, target.config.vocab_size)[0]
    states = target_hidden_states(target, [seq], capture_layers=features)
    h, toks = states.hidden[0], states.tokens[0]
    a_feats = forward_levels(head, h[None], toks[None], torch.tensor([12]), 2)
    b_feats = forward_levels(loaded, h[None], toks[None], torch.tensor([12]), 2)
    # The loaded head runs the engine's inference modules (inferd's RMSNorm and linears), the
    # trained one nn's: the same math, rounded apart by an ulp on some CPUs (AVX-512 EPYC). A
    # size, eps or rope theta lost on the way would move the features far more than this.
    for x, y in zip(a_feats, b_feats):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    assert (
        loaded.num_heads == target.config.num_heads
        and loaded.rope_theta == target.config.rope_theta
    )
    assert not any(p.requires_grad for p in loaded.parameters())
    # The target's embedding and LM head are borrowed, never saved.
    assert not any("embed" in k and "norm" not in k for k in b)


def test_load_rejects_bad_paths_and_other_targets(target, tiny_models, tmp_path) -> None:
    head = EagleHead.for_target(target, intermediate_size=64)
    path = head.save(tmp_path / "head")
    with pytest.raises(ValueError, match="not a draft head directory"):
        EagleHead.load(tmp_path / "missing", target)
    other = write_hf_dir(tmp_path / "other", with_seed(TinySpec(), 7))  # same shapes, other weights
    with pytest.raises(ValueError, match="not this target model"):
        EagleHead.load(path, target_model(other.path))
    with pytest.raises(ValueError, match="architecture"):
        EagleHead.load(path, target_model(tiny_models["qwen2-hf"].path))
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable draft head weights"):
        EagleHead.load(path, target)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable draft head config"):
        EagleHead.load(path, target)
    (path / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an inferd draft head"):
        EagleHead.load(path, target)
    with pytest.raises(RuntimeError, match="not bound"):
        EagleHead(8, 10, 2, 1).inputs(torch.zeros(1, 8), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="bad draft head sizes"):
        EagleHead(10, 10, 4, 2)  # 10 is no multiple of 4 heads
    (path / "config.json").write_text(json.dumps({**head.config, "architecture": "fc-swiglu-v1"}))
    with pytest.raises(ValueError, match="architecture 'fc-swiglu-v1' is not supported"):
        EagleHead.load(path, target)
    # Feature layers the target does not have, or out of order.
    n = target.config.num_layers
    deep = EagleHead.for_target(target, intermediate_size=64, feature_layers=(0,))
    path = deep.save(tmp_path / "deep")
    (path / "config.json").write_text(json.dumps({**deep.config, "feature_layers": [n]}))
    with pytest.raises(
        ValueError, match=f"reads target layers \\[{n}\\]; the target model has {n}"
    ):
        EagleHead.load(path, target)
    (path / "config.json").write_text(json.dumps({**deep.config, "feature_layers": [1, 0]}))
    with pytest.raises(ValueError, match="ascending"):
        EagleHead.load(path, target)


@pytest.mark.parametrize("model", ["llama-f32.gguf", "llama-tied-q8_0.gguf"])
def test_draft_vocab_drafts_the_best_token_of_the_subset(tiny_models, tmp_path, model) -> None:
    """Greedy drafting over a reduced vocabulary picks, at every step, the token of the subset the
    full LM head scores highest (plain and quantized heads); the whole vocabulary as the subset
    drafts exactly what the full head does."""
    from inferd import LLM
    from inferd.spec import draft_vocab

    target = LLM(
        str(tiny_models[model].path), kv_cache_memory=4 << 20, verbose=False
    ).engine.runner.model
    torch.manual_seed(0)
    path = EagleHead.for_target(target).save(tmp_path / "head")
    v, h = target.config.vocab_size, target.config.hidden_size
    full = EagleHead.load(path, target)
    assert full.draft_vocab_size is None
    caches = [
        cache_upto(full, torch.randn(8, h), torch.randint(0, v, (8,)), t) for t in (2, 6, 6, 4)
    ]
    want, _ = full.draft(caches, 4)
    ids = (
        torch.arange(v)[torch.randperm(v, generator=torch.Generator().manual_seed(1))[:150]]
        .sort()
        .values
    )
    draft_vocab.save(path, ids)
    reduced = EagleHead.load(path, target)
    assert reduced.draft_vocab_size == 150
    got, _ = reduced.draft(caches, 4)
    # By hand: the full logits restricted to the subset, the chosen token fed back.
    by_hand, _ = full.draft(caches, 4, choose=lambda logits, j: ids[logits[:, ids].argmax(-1)])
    assert torch.equal(got, by_hand)
    assert torch.isin(got, ids).all() and not torch.equal(got, want)
    assert torch.equal(full.set_draft_vocab(torch.arange(v)).draft(caches, 4)[0], want)
    (path / draft_vocab.FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable draft vocabulary"):
        EagleHead.load(path, target)
    draft_vocab.save(path, torch.tensor([3, v]))
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        EagleHead.load(path, target)


def test_quantized_head_on_an_fp32_target_ranks_its_draft_vocab_in_int4(
    tiny_models, tmp_path, packed_tiles_ext
) -> None:
    """The engine's head (int4 linears in packed tiles) over an fp32 target keeps the draft
    vocabulary's rows of the LM head in int4 too (in fp32 they were most of a draft step), and
    rescores each step's close candidates against the fp32 rows: drafts stay in the subset and
    are the token the fp32 rows rank first, where int4 alone swaps near-ties."""
    from inferd import LLM
    from inferd.layers.quantized_linear import QuantizedLinear
    from inferd.spec import draft_vocab

    llm = LLM(str(tiny_models["llama-f32.gguf"].path), kv_cache_memory=4 << 20, verbose=False)
    target = llm.engine.runner.model
    assert target.lm_head.weight.dtype == torch.float32
    torch.manual_seed(0)
    path = EagleHead.for_target(target).save(tmp_path / "head")
    v, h = target.config.vocab_size, target.config.hidden_size
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(2))[:160].sort().values
    draft_vocab.save(path, ids)
    head = EagleHead.load(path, target, quantize=True)
    for linear in (head._draft_vocab[1], head.fc, head.gate_up):
        assert isinstance(linear, QuantizedLinear)
        assert (linear.qweight.format, linear.qweight.layout) == ("int4", "tiles")
    fp32_head = EagleHead.load(path, target)
    assert not isinstance(fp32_head._draft_vocab[1], QuantizedLinear)  # its rows stay fp32
    features = torch.randn(400, h, generator=torch.Generator().manual_seed(3))
    fp32 = ids[(features @ target.lm_head.weight[ids].T).argmax(-1)]
    got = head.greedy(features)
    assert torch.isin(got, ids).all()
    head.__dict__["_exact_from"] = None  # int4 scores alone
    int4 = head.greedy(features)
    # Random features over a random tiny LM head leave many near-ties for int4's rounding to
    # flip; the rescored ones are the fp32 argmax.
    assert (int4 == fp32).float().mean().item() < 0.95
    assert torch.equal(got, fp32)


def test_rescore_close_replaces_the_close_scores_by_the_fp32_rows(kernel_build) -> None:
    """csrc/eagle_draft.h `rescore_close`: in each row, the scores within `within` of the max (at
    most `max_candidates`, the largest) become the feature's dot with the fp32 table's row of
    their token; every other score, and a row whose max is not finite, stays as it was."""
    g = torch.Generator().manual_seed(4)
    table = torch.randn(300, 40, generator=g)
    ids = torch.randperm(300, generator=g)[:120].sort().values
    feature = torch.randn(5, 40, generator=g)
    scores = torch.randn(5, 120, generator=g) * 2
    scores[1, 7] = scores[1, 9] = scores[1].max() + 1.0  # a tie at the top: both rescored
    scores[3] = float("-inf")
    scores[4, :30] = 50.0  # 30 candidates, only 16 kept: ties go to the lower index
    before = scores.clone()
    kernel_build.eagle_rescore_close(scores, feature, ids, table, 1.5, 16)
    exact = feature @ table[ids].T
    for r in range(5):
        m = before[r].max()
        close = (before[r] >= m - 1.5).nonzero().flatten()
        if r == 3:  # no finite max: nothing is close
            close = close[:0]
        if r == 4:
            close = torch.arange(16)
        changed = (scores[r] != before[r]).nonzero().flatten()
        assert set(changed.tolist()) <= set(close.tolist())
        assert torch.allclose(scores[r, close], exact[r, close], atol=1e-4)
        rest = torch.ones(120, dtype=torch.bool)
        rest[close] = False
        assert torch.equal(scores[r, rest], before[r, rest])
    assert len(close) == 16 and bool((scores[3] == float("-inf")).all())
    with pytest.raises(RuntimeError, match="rescore_close"):
        kernel_build.eagle_rescore_close(scores, feature, ids.int(), table, 1.5, 16)


@pytest.mark.parametrize("activations", ["default", "fp32"])
@pytest.mark.parametrize("model", ["llama-f32.gguf", "llama-tied-q8_0.gguf"])
def test_the_cpp_chain_drafts_what_the_python_chain_does(
    tiny_models, tmp_path, model, activations
) -> None:
    """The engine's cache entries and greedy chains in C++ (csrc/eagle_draft.h) are the Python
    head's: the same keys, values and inputs in every cache, the same drafts, the chains' own
    keys left behind alike; several sequences at different lengths, over an fp32 embedding and a
    quantized one (the tied GGUF's). With int8 activations (by default where the CPU has
    AVX512-VNNI) the head and the tied table are packed tiles; with fp32 ones (by default on an
    AVX2-only CPU; forced off here) they keep the row layout: int8 rows, fp32-activation kernels."""
    from inferd.quantization import formats

    if activations == "fp32":
        with formats.int8_activations(False):
            _check_cpp_chain(tiny_models[model].path, tmp_path)
    else:
        _check_cpp_chain(tiny_models[model].path, tmp_path)


def _check_cpp_chain(model_path, tmp_path) -> None:
    from inferd import LLM
    from inferd.layers.linear import Embedding
    from inferd.quantization import formats
    from inferd.spec import draft_vocab

    llm = LLM(str(model_path), kv_cache_memory=4 << 20, verbose=False)
    target = llm.engine.runner.model
    path = trained_like(target, seed=6, intermediate_size=64).save(tmp_path / "head")
    v = target.config.vocab_size
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(7))[:160]
    draft_vocab.save(path, ids.sort().values)
    head = EagleHead.load(path, target, quantize=True)
    layout = "tiles" if formats.int8_activations_default(head._kernels) else "rows"
    assert head.qkv.qweight.layout == head._draft_vocab[1].qweight.layout == layout
    if not isinstance(target.embed_tokens, Embedding):  # the tied GGUF's quantized table
        assert target.embed_tokens.qweight.layout == layout
    assert eagle_kernels.fused_weights(head) is not None
    states = target_hidden_states(target, sequences(3, 24, v, seed=8))
    lengths = (9, 16, 21)

    def caches() -> list[DraftCache]:
        rows = zip(states.hidden, states.tokens, lengths)
        return [cache_upto(head, h, t, n) for h, t, n in rows]

    flat = False
    for k, confidences in ((1, False), (4, False), (3, True), (4, True), (4, "flat")):
        if confidences == "flat" and not flat:
            # Near-uniform drafts (the output norm scaled down): runner-ups outrank the deeper
            # drafts, and both chains stop once no deeper draft could be verified.
            with torch.no_grad():
                head.out_norm.weight.mul_(1e-3)
            flat = True
        fused_caches = caches()
        fused, extra = head.draft(fused_caches, k, confidences=bool(confidences))
        head.__dict__["_fused"] = False  # the Python head: its cache entries, its chain
        try:
            python_caches = caches()
            python, python_extra = head.draft(python_caches, k, confidences=bool(confidences))
        finally:
            head.__dict__["_fused"] = None
        assert fused.shape[0] == 3 and (fused.shape[1] == k or confidences)
        assert torch.equal(fused, python)
        if confidences:  # the alternatives and all probabilities: the same bits
            (others, probs), (python_others, python_probs) = extra, python_extra
            assert torch.equal(others, python_others) and torch.equal(probs, python_probs)
            steps = fused.shape[1]
            assert others.shape == (3, steps, 2) and probs.shape == (3, steps, 3)
            assert bool((probs[..., :-1] >= probs[..., 1:]).all())  # drafted, runner-up, third
            assert bool((others != fused.unsqueeze(-1)).all())
            assert bool((others[..., 0] != others[..., 1]).all())
            assert (steps < k) == flat  # stopped early only where runner-ups outrank
        for a, b in zip(fused_caches, python_caches):
            rows = a.end - a.lo + fused.shape[1] - 1  # the true rows and the chain's own keys
            assert torch.equal(a.k[:rows], b.k[:rows]) and torch.equal(a.v[:rows], b.v[:rows])
            assert torch.equal(a.x_last, b.x_last)
