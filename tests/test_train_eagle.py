"""Training the draft head on tiny random models: the distilled data, the loss and its options,
bf16 training against fp32, the offline acceptance measurement on constructed cases, the draft
vocabulary's ranking, and the whole self-distillation recipe end to end."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_helpers import cache_upto, sequences, target_model, trained_like

from inferd.spec.eagle_head import EagleHead
from inferd.train.eagle_data import instructions, target_hidden_states
from inferd.train.eagle_train_core import (
    TrainOptions,
    leading_matches,
    measure_acceptance,
    prepare,
    train_head,
    verification_steps,
)


@pytest.fixture(scope="module")
def target(tiny_llama_hf) -> torch.nn.Module:
    return target_model(tiny_llama_hf.path)


def test_batched_hidden_states_equal_one_sequence_at_a_time(target) -> None:
    seqs = sequences(4, 20, target.config.vocab_size) + [[4, 5, 6]]
    batched = target_hidden_states(target, seqs, max_batch_tokens=64)
    for s, h in zip(seqs, batched.hidden):
        alone = target_hidden_states(target, [s]).hidden[0]
        assert h.shape == (len(s), target.config.hidden_size)
        torch.testing.assert_close(h, alone, rtol=1e-5, atol=1e-5)


def _train_a_few_steps(target, precision: str) -> list[float]:
    torch.manual_seed(0)
    seqs = sequences(8, 40, target.config.vocab_size)
    states = target_hidden_states(target, seqs)
    lm_weight = target.lm_head.weight.detach()
    opts = TrainOptions(
        epochs=10, batch_size=4, unroll=2, lr=3e-3, log_every=0, noise=0.05, precision=precision
    )
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
    from inferd.train.eagle_train_core import head_loss

    seqs = sequences(4, 24, target.config.vocab_size)
    lm_weight = target.lm_head.weight.detach()
    data = prepare(target_hidden_states(target, seqs), [4] * 4, lm_weight, "float32")
    torch.manual_seed(1)
    head = EagleHead.for_target(target, intermediate_size=64)

    def loss(**weights) -> tuple[float, dict[str, float]]:
        opts = TrainOptions(unroll=2, noise=0.0, ce_rows=1.0, full_vocab_ce=True, **weights)
        total, stats = head_loss(
            head, data, [0, 1, 2, 3], target.embed_tokens, lm_weight, None, opts
        )
        return total.item(), stats

    levels = [TrainOptions().step_decay ** j for j in range(2)]  # each unrolled level's weight
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
    from inferd.train.eagle_train_core import greedy_tokens

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
    from inferd.train.eagle_train_core import autocast_dtype

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
    head = trained_like(target, seed=3, intermediate_size=64)
    # A sequence the head's first drafts mostly continue (every third token another one), so that
    # acceptances of 0, 1 and more all occur.
    seq = [5, 9, 14]
    for i in range(14):
        st = target_hidden_states(target, [seq])
        cache = cache_upto(head, st.hidden[0], torch.tensor(seq + [0]), len(seq) - 2)
        seq.append(
            int(head.draft([cache], 1)[0])
            if i % 3
            else (seq[-1] * 7 + 3) % target.config.vocab_size
        )
    states = target_hidden_states(target, [seq])
    start = 2
    result = measure_acceptance(head, states, [start], ks=(3, 5))
    h, toks = states.hidden[0], states.tokens[0]
    accepted = []
    for p in range(start, len(seq) - 1):  # the engine's way: a cache up to p, then a chain
        d = head.draft([cache_upto(head, h, toks, p)], 5)[0][0].tolist()
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
    from inferd.chat_prompts import CHAT_TASKS
    from inferd.train.eagle_data import EVAL_QUESTIONS

    assert instructions("eval", len(EVAL_QUESTIONS)) == list(EVAL_QUESTIONS)
    everything = set(instructions("train", 5000)) | set(instructions("eval", 200))
    assert not everything & set(CHAT_TASKS)


def test_rank_tokens_counts_first_then_ids() -> None:
    from inferd.train.draft_vocab import rank_tokens

    streams = [[9, 9, 9, 7, 7, 50], [7, 9, 12, 400]]  # 400: outside a vocabulary of 60
    assert rank_tokens(streams, 60, 3).tolist() == [
        7,
        9,
        50,
    ]  # 9 and 7 most often; ties: first seen
    assert rank_tokens(streams, 60, 6).tolist() == [0, 1, 7, 9, 12, 50]  # filled from id 0
    assert rank_tokens([], 5, 5).tolist() == [0, 1, 2, 3, 4]
    for bad in (0, 61):
        with pytest.raises(ValueError, match="draft vocabulary size"):
            rank_tokens(streams, 60, bad)


def test_recipe_end_to_end_on_a_tiny_model(tiny_llama_hf, tmp_path) -> None:
    from inferd.train.train_eagle import EagleRecipe, train_eagle

    opts = TrainOptions(epochs=2, batch_size=4, unroll=2, log_every=0)
    recipe = EagleRecipe(
        model=str(tiny_llama_hf.path),
        out=str(tmp_path / "head"),
        num_prompts=6,
        num_questions=8,
        eval_prompts=10,
        max_tokens=12,
        intermediate_size=64,
        kv_cache_memory=8 << 20,
        draft_vocab_size=100,
        data_cache=False,
        train=opts,
    )
    report = train_eagle(recipe)
    acc = report["acceptance"]
    for k in (3, 5):
        assert 1.0 <= acc[f"k{k}_acceptance_length"] <= k + 1
        assert 1.0 <= acc["free_form"][f"k{k}_acceptance_length"] <= k + 1
    assert (
        report["eval_prompts"] == 10 and report["size_bytes"] > 0 and report["train_sequences"] == 6
    )
    head = EagleHead.load(tmp_path / "head", target_model(tiny_llama_hf.path))
    assert head.intermediate_size == 64 and head.draft_vocab_size == 100
    assert json.loads((tmp_path / "head" / "train_report.json").read_text())["out"] == report["out"]


def test_recipe_continues_from_a_saved_head(tiny_llama_hf, tmp_path) -> None:
    """`--init DIR`: training starts from the saved head's weights and keeps its sizes, so a step
    at a negligible learning rate gives the same head back, and its first loss is the saved
    head's, not a fresh one's."""
    from inferd.train.train_eagle import EagleRecipe, train_eagle

    def recipe(out: str, lr: float, init: str | None = None) -> EagleRecipe:
        return EagleRecipe(
            model=str(tiny_llama_hf.path),
            out=str(tmp_path / out),
            num_prompts=6,
            num_questions=0,
            eval_prompts=4,
            max_tokens=8,
            intermediate_size=64,
            kv_cache_memory=8 << 20,
            draft_vocab_size=0,
            data_cache=False,
            init=init,
            train=TrainOptions(epochs=3, batch_size=6, unroll=2, lr=lr, log_every=0),
        )

    first = recipe("first", 2e-2)
    first.feature_layers = ()  # a plain head, continued below as one that reads a lower layer
    first = train_eagle(first)
    again = train_eagle(recipe("again", 1e-12, init=str(tmp_path / "first")))
    assert again["first_loss"] < 0.8 * first["first_loss"]
    target = target_model(tiny_llama_hf.path)
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


def test_recipe_rejects_feature_layers_the_target_lacks_before_generating(
    tiny_llama_hf, tmp_path, capsys
) -> None:
    from inferd.train.train_eagle import EagleRecipe, main, train_eagle

    n = target_model(tiny_llama_hf.path).config.num_layers
    recipe = EagleRecipe(
        model=str(tiny_llama_hf.path),
        out=str(tmp_path / "head"),
        feature_layers=(0, n),
        data_cache=False,
    )
    with pytest.raises(ValueError, match=f"reads target layers \\[0, {n}\\]"):
        train_eagle(recipe)
    assert recipe.feature_layers == (0, n) and not (tmp_path / "head").exists()
    with pytest.raises(SystemExit):
        main(["--feature-layers", "2,x"])
    assert "not comma-separated layer numbers" in capsys.readouterr().err


def test_the_data_cache_key_follows_the_data_seed_not_the_training_seed() -> None:
    """Retraining with another `--seed` reuses the cached data (an hour to make for the default
    model); another `--data-seed` makes new data."""
    from inferd.train.train_eagle import EagleRecipe, _data_key

    base = _data_key(EagleRecipe(), "model.gguf")
    assert _data_key(EagleRecipe(train=TrainOptions(seed=7)), "model.gguf") == base
    assert _data_key(EagleRecipe(data_seed=7), "model.gguf") != base
    assert _data_key(EagleRecipe(num_prompts=7), "model.gguf") != base
