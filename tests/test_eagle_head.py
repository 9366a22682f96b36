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
from inferd.spec.eagle_head import EagleHead
from inferd.spec.eagle_train_core import (
    TrainOptions,
    flatten,
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


def test_shapes_and_chained_draft(target) -> None:
    torch.manual_seed(0)
    head = EagleHead.for_target(target, num_blocks=2, intermediate_size=96)
    h, v = target.config.hidden_size, target.config.vocab_size
    hidden, tokens = torch.randn(5, h), torch.randint(0, v, (5,))
    feature = head(hidden, tokens)
    assert feature.shape == (5, h) and feature.dtype == torch.float32
    drafted, logits = head.draft(hidden, tokens, 4, return_logits=True)
    assert drafted.shape == (5, 4) and logits.shape == (5, 4, v)
    # Chaining by hand: feed each predicted feature back with the token drafted from it.
    f, tok = hidden, tokens
    for j in range(4):
        f = head(f, tok)
        tok = target.compute_logits(f).argmax(-1)
        assert torch.equal(tok, drafted[:, j])
    assert head.draft(hidden, tokens, 0)[0].shape == (5, 0)
    # A custom choice (what sampling at temperature > 0 plugs in) feeds its tokens back.
    chosen, _ = head.draft(hidden, tokens, 3, choose=lambda logits, j: torch.full((5,), 7 + j))
    assert chosen.tolist() == [[7, 8, 9]] * 5


def test_save_load_round_trip_is_bit_exact(target, tmp_path) -> None:
    torch.manual_seed(1)
    head = EagleHead.for_target(target, intermediate_size=80)
    for p in head.parameters():  # not the init values: loading must carry every tensor
        p.data.add_(torch.randn_like(p) * 0.01)
    head.save(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["hidden_size"] == target.config.hidden_size and cfg["intermediate_size"] == 80
    loaded = EagleHead.load(tmp_path / "head", target, device="cpu", dtype=torch.float32)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hidden = torch.randn(3, target.config.hidden_size)
    tokens = torch.tensor([5, 6, 7])
    assert torch.equal(head(hidden, tokens), loaded(hidden, tokens))
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
        EagleHead(8, 10)(torch.zeros(1, 8), torch.zeros(1, dtype=torch.long))


def test_batched_hidden_states_equal_one_sequence_at_a_time(target) -> None:
    seqs = _sequences(4, 20, target.config.vocab_size) + [[4, 5, 6]]
    batched = target_hidden_states(target, seqs, max_batch_tokens=64)
    for s, h in zip(seqs, batched.hidden):
        alone = target_hidden_states(target, [s]).hidden[0]
        assert h.shape == (len(s), target.config.hidden_size)
        torch.testing.assert_close(h, alone, rtol=1e-5, atol=1e-5)


def test_a_few_training_steps_lower_the_loss(target) -> None:
    torch.manual_seed(0)
    states = target_hidden_states(target, _sequences(8, 40, target.config.vocab_size))
    lm_weight = target.lm_head.weight.detach()
    opts = TrainOptions(epochs=8, batch_size=64, unroll=2, lr=3e-3, log_every=0, noise=0.05)
    data = flatten(states, lm_weight, opts.unroll)
    assert len(data.starts) == 8 * (40 - 2)
    head = EagleHead.for_target(target, intermediate_size=128)
    losses = train_head(head, data, target.embed_tokens, lm_weight, opts)
    assert len(losses) == 8 * 5  # ceil(304 / 64) steps per epoch
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


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
    torch.manual_seed(0)
    head = EagleHead.for_target(target, intermediate_size=64).requires_grad_(False)
    # A greedy continuation of the target itself, so acceptance follows what the engine would see.
    seq = [5, 9, 14]
    for _ in range(12):
        h = target_hidden_states(target, [seq]).hidden[0]
        seq.append(int(target.compute_logits(h[-1:]).argmax()))
    states = target_hidden_states(target, [seq])
    start = 2
    result = measure_acceptance(head, states, [start], ks=(3, 5))
    h, toks = states.hidden[0], states.tokens[0]
    accepted = []
    for p in range(start, len(seq) - 1):
        d = head.draft(h[p : p + 1], toks[p + 1 : p + 2], 5)[0][0].tolist()
        ref = seq[p + 2 : p + 7]
        n = 0
        while n < len(ref) and d[n] == ref[n]:
            n += 1
        accepted.append(n)
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
    hidden, tokens = torch.randn(6, h), torch.randint(0, v, (6,))
    full = EagleHead.load(path, target)
    assert full.draft_vocab_size is None
    want, _ = full.draft(hidden, tokens, 4)
    ids = torch.arange(v)[torch.randperm(v, generator=torch.Generator().manual_seed(1))[:150]].sort().values
    draft_vocab.save(path, ids)
    reduced = EagleHead.load(path, target)
    assert reduced.draft_vocab_size == 150
    got, _ = reduced.draft(hidden, tokens, 4)
    f, tok = hidden, tokens
    for j in range(4):  # by hand: the full logits restricted to the subset
        f = full(f, tok)
        tok = ids[target.compute_logits(f)[:, ids].argmax(-1)]
        assert torch.equal(tok, got[:, j])
    assert torch.isin(got, ids).all() and not torch.equal(got, want)
    assert torch.equal(full.set_draft_vocab(torch.arange(v)).draft(hidden, tokens, 4)[0], want)
    (path / draft_vocab.FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable draft vocabulary"):
        EagleHead.load(path, target)
    draft_vocab.save(path, torch.tensor([3, v]))
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        EagleHead.load(path, target)


def test_recipe_end_to_end_on_a_tiny_model(tiny_llama_hf, tmp_path) -> None:
    from inferd.spec.train_eagle import EagleRecipe, train_eagle

    opts = TrainOptions(epochs=1, batch_size=32, unroll=2, log_every=0)
    recipe = EagleRecipe(model=str(tiny_llama_hf.path), out=str(tmp_path / "head"), num_prompts=6,
                         eval_prompts=3, max_tokens=12, intermediate_size=64,
                         kv_cache_memory=8 << 20, draft_vocab_size=100, train=opts)  # fmt: skip
    report = train_eagle(recipe)
    acc = report["acceptance"]
    for k in (3, 5):
        assert 1.0 <= acc[f"k{k}_acceptance_length"] <= k + 1
    assert report["eval_prompts"] == 3 and report["size_bytes"] > 0
    head = EagleHead.load(tmp_path / "head", _target(tiny_llama_hf.path))
    assert head.intermediate_size == 64 and head.draft_vocab_size == 100
    assert json.loads((tmp_path / "head" / "train_report.json").read_text())["out"] == report["out"]
