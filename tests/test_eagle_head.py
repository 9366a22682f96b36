"""The EAGLE-style draft head on tiny random models: shapes and chaining, save/load bit-exact,
targets it was not trained for rejected, training lowering the loss, the acceptance measurement
on constructed cases, and the whole self-distillation recipe end to end."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import TinySpec, with_seed, write_hf_dir

from inferd.loader import load_model
from inferd.models import build_model
from inferd.spec.eagle_data import instructions, target_hidden_states
from inferd.spec.eagle_head import DraftCache, EagleHead
from inferd.spec.eagle_train_core import (
    TrainOptions,
    prepare,
    leading_matches,
    measure_acceptance,
    train_head,
    verification_steps,
)


def _target(path) -> torch.nn.Module:
    loaded = load_model(path, verbose=False)
    return build_model(loaded.config, loaded.weights, max_positions=256, dtype=torch.float32,
                       device=torch.device("cpu"))  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_llama_hf) -> torch.nn.Module:
    return _target(tiny_llama_hf.path)


def _sequences(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _trained_like(target, seed: int = 0, **kwargs) -> EagleHead:
    """A head with weights away from their init (so that every part of it matters)."""
    torch.manual_seed(seed)
    head = EagleHead.for_target(target, **kwargs)
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    return head.requires_grad_(False)


def _cache_upto(head: EagleHead, hidden: torch.Tensor, tokens: torch.Tensor, t: int, lo: int = 0) -> DraftCache:
    """What the engine's proposer holds once positions lo..t are computed (token t + 1 known)."""
    cache = DraftCache(hidden, head.num_kv_heads, head.head_dim)
    cache.write(lo, *head.cache_entries(hidden[lo : t + 1], tokens[lo + 1 : t + 2], torch.arange(lo, t + 1)))
    return cache


@pytest.mark.parametrize("features", [(), (0,)])
def test_engine_chains_equal_the_training_levels(target, features) -> None:
    """Drafting from the engine's cache, step by step, computes the same features as training's
    all-positions-at-once levels (chain step j from t = level j - 1 at position t + j - 1), when
    the chain is fed the same tokens: what the training optimises is what the engine runs. Also
    for a head that reads a lower layer's output beside the final hidden state (EAGLE-3)."""
    head = _trained_like(target, intermediate_size=64, feature_layers=features)
    seq = _sequences(1, 30, target.config.vocab_size)[0]
    states = target_hidden_states(target, [seq], capture_layers=features)
    assert states.hidden[0].shape[1] == head.input_size == target.config.hidden_size * (1 + len(features))
    h, toks = states.hidden[0], states.tokens[0]
    levels = head.forward_levels(h[None], toks[None], torch.tensor([30]), 4)
    assert [f.shape for f in levels] == [(1, 29, target.config.hidden_size)] * 4
    for t in (0, 3, 17, 26):
        k = min(4, 30 - t - 2)
        # Feed the true tokens (as the levels do): `choose` picks them instead of the argmax.
        drafted, logits = head.draft([_cache_upto(head, h, toks, t)], k, return_logits=True,
                                     choose=lambda _, j, t=t: toks[t + 2 + j].view(1))  # fmt: skip
        assert drafted[0].tolist() == toks[t + 2 : t + 2 + k].tolist()
        for j in range(k):
            want = head.compute_logits(levels[j][0, t + j][None])[0]
            torch.testing.assert_close(logits[0, j], want, rtol=1e-4, atol=1e-4)
    # Greedy drafting feeds its own tokens back: the first draft is the level-0 argmax.
    greedy, _ = head.draft([_cache_upto(head, h, toks, 5)], 3)
    assert greedy[0, 0] == head.greedy(levels[0][0, 5])
    assert head.draft([_cache_upto(head, h, toks, 5)], 0)[0].shape == (1, 0)


@pytest.mark.parametrize("inference", [False, True])
def test_batched_drafts_equal_one_cache_at_a_time(target, tmp_path, inference) -> None:
    """Caches of different lengths (and one that starts late, as after a prefix-cache hit) drafted
    together give each the chain it gets alone: with plain ops, and with the engine's kernels
    (`load`: the C++ elementwise ops and paged attention over each cache)."""
    head = _trained_like(target, seed=1, intermediate_size=48)
    if inference:
        head = EagleHead.load(head.save(tmp_path / "head"), target)
    seqs = _sequences(3, 24, target.config.vocab_size, seed=2)
    states = target_hidden_states(target, seqs)
    caches = [_cache_upto(head, states.hidden[0], states.tokens[0], 20),
              _cache_upto(head, states.hidden[1], states.tokens[1], 4),
              _cache_upto(head, states.hidden[2], states.tokens[2], 12, lo=8)]  # fmt: skip
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

    head = _trained_like(target, seed=4, intermediate_size=64, feature_layers=features)
    path = head.save(tmp_path / "head")
    plain = EagleHead.load(path, target)
    int4 = EagleHead.load(path, target, quantize=True)
    assert isinstance(int4.gate_up, QuantizedLinear) and not isinstance(plain.gate_up, QuantizedLinear)
    seqs = _sequences(3, 20, target.config.vocab_size, seed=5)
    states = target_hidden_states(target, seqs, capture_layers=features)
    for h, toks in zip(states.hidden, states.tokens):
        want = head.draft([_cache_upto(head, h, toks, 15)], 3, return_logits=True)
        got = plain.draft([_cache_upto(plain, h, toks, 15)], 3, return_logits=True)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        q = int4.draft([_cache_upto(int4, h, toks, 15)], 1, return_logits=True)[1]
        assert torch.nn.functional.cosine_similarity(q[0, 0], want[1][0, 0], dim=0) > 0.99


def test_draft_cache_grows_overwrites_and_restarts_after_a_gap() -> None:
    kv = lambda n, base: (torch.zeros(n, 4), torch.full((n, 1, 2), float(base)), torch.full((n, 1, 2), -float(base)))  # noqa: E731
    c = DraftCache(torch.zeros(1), 1, 2)
    c.write(0, *kv(10, 1))
    c.write(10, *kv(30, 2))  # grows past its first 16 rows
    k, v = c.keys()
    assert (c.lo, c.end) == (0, 40) and k[:10].eq(1).all() and k[10:].eq(2).all() and v[10:].eq(-2).all()
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
    seq = _sequences(1, 12, target.config.vocab_size)[0]
    states = target_hidden_states(target, [seq], capture_layers=features)
    h, toks = states.hidden[0], states.tokens[0]
    a_feats = head.forward_levels(h[None], toks[None], torch.tensor([12]), 2)
    b_feats = loaded.forward_levels(h[None], toks[None], torch.tensor([12]), 2)
    # The loaded head runs the engine's inference modules (inferd's RMSNorm and linears), the
    # trained one nn's: the same math, rounded apart by an ulp on some CPUs (AVX-512 EPYC). A
    # size, eps or rope theta lost on the way would move the features far more than this.
    for x, y in zip(a_feats, b_feats):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    assert loaded.num_heads == target.config.num_heads and loaded.rope_theta == target.config.rope_theta
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
        EagleHead.load(path, _target(other.path))
    with pytest.raises(ValueError, match="architecture"):
        EagleHead.load(path, _target(tiny_models["qwen2-hf"].path))
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
    with pytest.raises(ValueError, match=f"reads target layers \\[{n}\\]; the target model has {n}"):
        EagleHead.load(path, target)
    (path / "config.json").write_text(json.dumps({**deep.config, "feature_layers": [1, 0]}))
    with pytest.raises(ValueError, match="ascending"):
        EagleHead.load(path, target)


def test_batched_hidden_states_equal_one_sequence_at_a_time(target) -> None:
    seqs = _sequences(4, 20, target.config.vocab_size) + [[4, 5, 6]]
    batched = target_hidden_states(target, seqs, max_batch_tokens=64)
    for s, h in zip(seqs, batched.hidden):
        alone = target_hidden_states(target, [s]).hidden[0]
        assert h.shape == (len(s), target.config.hidden_size)
        torch.testing.assert_close(h, alone, rtol=1e-5, atol=1e-5)


def _train_a_few_steps(target, precision: str) -> list[float]:
    torch.manual_seed(0)
    seqs = _sequences(8, 40, target.config.vocab_size)
    states = target_hidden_states(target, seqs)
    lm_weight = target.lm_head.weight.detach()
    opts = TrainOptions(epochs=10, batch_size=4, unroll=2, lr=3e-3, log_every=0, noise=0.05,
                        precision=precision)  # fmt: skip
    data = prepare(states, [5] * 8, lm_weight, precision)
    assert data.num_positions == 320 and data.greedy[0].shape == (40,)
    torch.manual_seed(1)
    head = EagleHead.for_target(target, intermediate_size=128)
    losses = train_head(head, data, target.embed_tokens, lm_weight, opts)
    assert len(losses) == 10 * 2  # 8 sequences, 4 a step
    for p in head.parameters():  # autocast leaves the weights (and their optimizer) in fp32
        assert p.dtype == torch.float32
    return losses


def test_a_few_training_steps_lower_the_loss(target) -> None:
    losses = _train_a_few_steps(target, "float32")
    assert sum(losses[-4:]) / 4 < 0.7 * losses[0], losses


def test_loss_weights_the_regression_and_the_cross_entropy_as_asked(target) -> None:
    """The loss is, over the unrolled levels (weighted step_decay ** level), reg_weight times the
    feature regression plus ce_weight times the cross-entropy: reg_weight 0 leaves the
    cross-entropy alone (EAGLE-3's loss for a last stage)."""
    from inferd.spec.eagle_train_core import head_loss

    seqs = _sequences(4, 24, target.config.vocab_size)
    lm_weight = target.lm_head.weight.detach()
    data = prepare(target_hidden_states(target, seqs), [4] * 4, lm_weight, "float32")
    torch.manual_seed(1)
    head = EagleHead.for_target(target, intermediate_size=64)

    def loss(**weights) -> tuple[float, dict[str, float]]:
        opts = TrainOptions(unroll=2, noise=0.0, ce_rows=1.0, full_vocab_ce=True, **weights)
        total, stats = head_loss(head, data, [0, 1, 2, 3], target.embed_tokens, lm_weight, None, opts)
        return total.item(), stats

    levels = [TrainOptions().step_decay**j for j in range(2)]  # each unrolled level's weight
    ce_only, stats = loss(reg_weight=0.0, ce_weight=1.0)
    ce = sum(w * stats[f"ce{j + 1}"] for j, w in enumerate(levels)) / sum(levels)
    reg = sum(w * stats[f"reg{j + 1}"] for j, w in enumerate(levels)) / sum(levels)
    assert ce_only == pytest.approx(ce, rel=1e-5)
    assert loss(reg_weight=1.0, ce_weight=0.0)[0] == pytest.approx(reg, rel=1e-5)
    assert loss(reg_weight=2.0, ce_weight=0.5)[0] == pytest.approx(2.0 * reg + 0.5 * ce, rel=1e-5)


def test_bf16_training_tracks_fp32(target) -> None:
    """`precision="bfloat16"` runs the forward's matmuls in bf16: the same head and batches give
    losses that differ by bf16 rounding only (so they did run in bf16), and it learns as well."""
    exact, bf16 = _train_a_few_steps(target, "float32"), _train_a_few_steps(target, "bfloat16")
    assert bf16[0] != exact[0]
    assert bf16[0] == pytest.approx(exact[0], rel=0.02)
    assert sum(bf16[-4:]) / 4 < 0.7 * bf16[0], bf16
    assert sum(bf16[-4:]) == pytest.approx(sum(exact[-4:]), rel=0.1)


def test_greedy_labels_from_bf16_candidates_equal_the_fp32_argmax() -> None:
    """The training labels found among bf16 scores' best candidates, rescored in fp32, are the
    exact argmax, also where the best two rows' logits are closer than bf16 can tell apart (rows
    closer than fp32's own rounding are left out: any two fp32 sums may order them differently)."""
    from inferd.spec.eagle_train_core import greedy_tokens

    g = torch.Generator().manual_seed(0)
    w = torch.randn(600, 64, generator=g)
    h = torch.randn(300, 64, generator=g) * 3
    # Near-ties: rows of h whose best row no earlier one had get a twin of it (kept apart, at
    # 500 + i) whose logit is 1e-3 above or below the best one's.
    twinned, used = [], set()
    for i in range(100):
        best = int((h[i] @ w[:500].T).argmax())
        if best not in used:
            used.add(best)
            twinned.append(i)
            w[500 + i] = w[best] + (1e-3 if i % 2 else -1e-3) * h[i] / h[i].norm() ** 2
    logits = h.double() @ w.double().T
    top2 = logits.topk(2, dim=-1)
    exact, clear = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1] > 2e-4
    assert len(twinned) >= 60 and clear[twinned].all() and clear.sum() >= 200
    for lm_bf16 in (None, w.bfloat16()):
        assert torch.equal(greedy_tokens(h, w, chunk=128, lm_bf16=lm_bf16)[clear], exact[clear])
    # bf16 scores alone pick otherwise on some of the near-ties: the rescoring did the work
    bf16 = (h.bfloat16() @ w.bfloat16().T).argmax(-1)
    assert not torch.equal(bf16[twinned], exact[twinned])


def test_training_precision_option() -> None:
    from inferd.config import computes_bf16_natively
    from inferd.spec.eagle_train_core import autocast_dtype

    cpu = torch.device("cpu")
    assert autocast_dtype("float32", cpu) is None
    assert autocast_dtype("bfloat16", cpu) == torch.bfloat16
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if computes_bf16_natively(cpu) else None)
    with pytest.raises(ValueError, match="precision must be one of"):
        autocast_dtype("fp8", cpu)


def test_leading_matches_counts_until_the_first_mismatch() -> None:
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3], [1, 2, 9]])
    ref = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert leading_matches(drafts, ref).tolist() == [3, 1, 0, 2]


def test_verification_steps_follow_the_accepted_tokens() -> None:
    # A 12-token sequence whose prompt ends at position 3 (token 4 came from the prefill): tokens
    # 5..11 to verify. From 3: 2 accepted + bonus -> 6; 0 + bonus -> 7; k=3 caps 5 at 3, + bonus
    # would be 4 but only 3 tokens are left.
    accepted = [0, 0, 0, 2, 9, 9, 0, 5, 9, 9, 9, 9]
    assert verification_steps(accepted, 3, 12, k=3) == [3, 1, 3]
    # k = 1: every step emits at most 2 tokens.
    assert verification_steps(accepted, 3, 12, k=1) == [2, 2, 2, 1]
    assert verification_steps(accepted, 10, 12, k=3) == []


def test_measure_acceptance_matches_drafting_by_hand(target) -> None:
    head = _trained_like(target, seed=3, intermediate_size=64)
    # A sequence the head's first drafts mostly continue (every third token another one), so that
    # acceptances of 0, 1 and more all occur.
    seq = [5, 9, 14]
    for i in range(14):
        st = target_hidden_states(target, [seq])
        cache = _cache_upto(head, st.hidden[0], torch.tensor(seq + [0]), len(seq) - 2)
        seq.append(int(head.draft([cache], 1)[0]) if i % 3 else (seq[-1] * 7 + 3) % target.config.vocab_size)
    states = target_hidden_states(target, [seq])
    start = 2
    result = measure_acceptance(head, states, [start], ks=(3, 5))
    h, toks = states.hidden[0], states.tokens[0]
    accepted = []
    for p in range(start, len(seq) - 1):  # the engine's way: a cache up to p, then a chain
        d = head.draft([_cache_upto(head, h, toks, p)], 5)[0][0].tolist()
        ref = seq[p + 2 : p + 7]
        n = 0
        while n < len(ref) and d[n] == ref[n]:
            n += 1
        accepted.append(n)
    assert min(accepted) == 0 and max(accepted) >= 1, accepted
    full = [0] * start + accepted
    for k in (3, 5):
        steps = verification_steps(full, start, len(seq), k)
        assert result[f"k{k}_acceptance_length"] == pytest.approx(sum(steps) / len(steps))
        assert result[f"k{k}_steps"] == len(steps)
        per_pos = sum(min(a, k) + 1 for a in accepted) / len(accepted)
        assert result[f"k{k}_per_position"] == pytest.approx(per_pos)


def test_instruction_splits_are_disjoint() -> None:
    train, ev = instructions("train", 300), instructions("eval", 40)
    assert len(set(train)) == 300 and len(set(ev)) == 40 and not set(train) & set(ev)
    assert instructions("train", 5, seed=3) == instructions("train", 5, seed=3)
    with pytest.raises(ValueError):
        instructions("test", 1)
    with pytest.raises(ValueError):
        instructions("eval", 10_000)
    # The eval split starts with the free-form questions; the bench's chat prompts are in neither.
    from inferd.bench.spec import CHAT_TASKS
    from inferd.spec.eagle_data import EVAL_QUESTIONS

    assert instructions("eval", len(EVAL_QUESTIONS)) == list(EVAL_QUESTIONS)
    everything = set(instructions("train", 5000)) | set(instructions("eval", 200))
    assert not everything & set(CHAT_TASKS)


def test_rank_tokens_counts_first_then_ids() -> None:
    from inferd.spec.draft_vocab import rank_tokens

    streams = [[9, 9, 9, 7, 7, 50], [7, 9, 12, 400]]  # 400: outside a vocabulary of 60
    assert rank_tokens(streams, 60, 3).tolist() == [7, 9, 50]  # 9 and 7 most often; ties: first seen
    assert rank_tokens(streams, 60, 6).tolist() == [0, 1, 7, 9, 12, 50]  # filled from id 0
    assert rank_tokens([], 5, 5).tolist() == [0, 1, 2, 3, 4]
    for bad in (0, 61):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            rank_tokens(streams, 60, bad)


@pytest.mark.parametrize("model", ["llama-f32.gguf", "llama-tied-q8_0.gguf"])
def test_draft_vocab_drafts_the_best_token_of_the_subset(tiny_models, tmp_path, model) -> None:
    """Greedy drafting over a reduced vocabulary picks, at every step, the token of the subset the
    full LM head scores highest (plain and quantized heads); the whole vocabulary as the subset
    drafts exactly what the full head does."""
    from inferd import LLM
    from inferd.spec import draft_vocab

    target = LLM(str(tiny_models[model].path), kv_cache_memory=4 << 20, verbose=False).engine.runner.model
    torch.manual_seed(0)
    path = EagleHead.for_target(target).save(tmp_path / "head")
    v, h = target.config.vocab_size, target.config.hidden_size
    full = EagleHead.load(path, target)
    assert full.draft_vocab_size is None
    caches = [_cache_upto(full, torch.randn(8, h), torch.randint(0, v, (8,)), t) for t in (2, 6, 6, 4)]
    want, _ = full.draft(caches, 4)
    ids = torch.arange(v)[torch.randperm(v, generator=torch.Generator().manual_seed(1))[:150]].sort().values
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


def test_recipe_end_to_end_on_a_tiny_model(tiny_llama_hf, tmp_path) -> None:
    from inferd.spec.train_eagle import EagleRecipe, train_eagle

    opts = TrainOptions(epochs=2, batch_size=4, unroll=2, log_every=0)
    recipe = EagleRecipe(model=str(tiny_llama_hf.path), out=str(tmp_path / "head"), num_prompts=6, num_questions=8,
                         eval_prompts=10, max_tokens=12, intermediate_size=64,
                         kv_cache_memory=8 << 20, draft_vocab_size=100, data_cache=False,
                         train=opts)  # fmt: skip
    report = train_eagle(recipe)
    acc = report["acceptance"]
    for k in (3, 5):
        assert 1.0 <= acc[f"k{k}_acceptance_length"] <= k + 1
        assert 1.0 <= acc["free_form"][f"k{k}_acceptance_length"] <= k + 1
    assert report["eval_prompts"] == 10 and report["size_bytes"] > 0 and report["train_sequences"] == 6
    head = EagleHead.load(tmp_path / "head", _target(tiny_llama_hf.path))
    assert head.intermediate_size == 64 and head.draft_vocab_size == 100
    assert json.loads((tmp_path / "head" / "train_report.json").read_text())["out"] == report["out"]


def test_recipe_continues_from_a_saved_head(tiny_llama_hf, tmp_path) -> None:
    """`--init DIR`: training starts from the saved head's weights and keeps its sizes, so a step
    at a negligible learning rate gives the same head back, and its first loss is the saved
    head's, not a fresh one's."""
    from inferd.spec.train_eagle import EagleRecipe, train_eagle

    def recipe(out: str, lr: float, init: str | None = None) -> EagleRecipe:
        return EagleRecipe(model=str(tiny_llama_hf.path), out=str(tmp_path / out), num_prompts=6,
                           num_questions=0, eval_prompts=4, max_tokens=8, intermediate_size=64,
                           kv_cache_memory=8 << 20, draft_vocab_size=0, data_cache=False, init=init,
                           train=TrainOptions(epochs=3, batch_size=6, unroll=2, lr=lr, log_every=0))  # fmt: skip

    first = recipe("first", 2e-2)
    first.feature_layers = ()  # a plain head, continued below as one that reads a lower layer
    first = train_eagle(first)
    again = train_eagle(recipe("again", 1e-12, init=str(tmp_path / "first")))
    assert again["first_loss"] < 0.8 * first["first_loss"]
    target = _target(tiny_llama_hf.path)
    a, b = EagleHead.load(tmp_path / "first", target), EagleHead.load(tmp_path / "again", target)
    assert b.intermediate_size == 64
    assert a.feature_layers == () and b.feature_layers == (target.config.num_layers // 2,)
    theirs = b.state_dict()
    assert theirs.pop("feature_fc.weight").abs().max() < 1e-6  # started at zero, barely moved
    for (name, x), (_, y) in zip(a.state_dict().items(), theirs.items(), strict=True):
        assert torch.allclose(x, y, atol=1e-6), name
    # A head that reads other layers than the data has cannot go on with it.
    with pytest.raises(ValueError, match="reads target layers"):
        bad = recipe("bad", 1e-12, init=str(tmp_path / "again"))
        bad.feature_layers = (0,)
        train_eagle(bad)


def test_recipe_rejects_feature_layers_the_target_lacks_before_generating(tiny_llama_hf, tmp_path, capsys) -> None:
    from inferd.spec.train_eagle import EagleRecipe, main, train_eagle

    n = _target(tiny_llama_hf.path).config.num_layers
    recipe = EagleRecipe(model=str(tiny_llama_hf.path), out=str(tmp_path / "head"), feature_layers=(0, n),
                         data_cache=False)  # fmt: skip
    with pytest.raises(ValueError, match=f"reads target layers \\[0, {n}\\]"):
        train_eagle(recipe)
    assert recipe.feature_layers == (0, n) and not (tmp_path / "head").exists()
    with pytest.raises(SystemExit):
        main(["--feature-layers", "2,x"])
    assert "not comma-separated layer numbers" in capsys.readouterr().err


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
    path = _trained_like(target, seed=6, intermediate_size=64).save(tmp_path / "head")
    v = target.config.vocab_size
    ids = torch.randperm(v, generator=torch.Generator().manual_seed(7))[:160]
    draft_vocab.save(path, ids.sort().values)
    head = EagleHead.load(path, target, quantize=True)
    layout = "tiles" if formats.int8_activations_default(head._kernels) else "rows"
    assert head.qkv.qweight.layout == head._draft_vocab[1].qweight.layout == layout
    if not isinstance(target.embed_tokens, Embedding):  # the tied GGUF's quantized table
        assert target.embed_tokens.qweight.layout == layout
    assert head._fused_weights() is not None
    states = target_hidden_states(target, _sequences(3, 24, v, seed=8))
    lengths = (9, 16, 21)

    def caches() -> list[DraftCache]:
        rows = zip(states.hidden, states.tokens, lengths)
        return [_cache_upto(head, h, t, n) for h, t, n in rows]

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


def test_the_data_cache_key_follows_the_data_seed_not_the_training_seed() -> None:
    """Retraining with another `--seed` reuses the cached data (an hour to make for the default
    model); another `--data-seed` makes new data."""
    from inferd.spec.train_eagle import EagleRecipe, _data_key

    base = _data_key(EagleRecipe(), "model.gguf")
    assert _data_key(EagleRecipe(train=TrainOptions(seed=7)), "model.gguf") == base
    assert _data_key(EagleRecipe(data_seed=7), "model.gguf") != base
    assert _data_key(EagleRecipe(num_prompts=7), "model.gguf") != base
