"""Medusa heads on tiny random models: lossless (greedy identical to speculation off, batched, with
prefix-cache hits and structured output, for the dynamic tree, the static tree and the chain;
the sampling distribution unchanged), heads refused by a model they were not trained for, the
training recipe's loss falling and the recipe end to end, and no state left per sequence."""

from __future__ import annotations

import json

import pytest
import torch
from spec_sampling import assert_speculation_keeps_distribution, model_continued
from test_spec_suffix import _requests, _texts
from test_speculative import _llm, fixed_speculation_costs  # noqa: F401 (autouse)
from tiny_models import TinySpec, with_seed, write_hf_dir

from inferd import SamplingParams
from inferd.config import SpeculativeConfig
from inferd.spec.medusa_head import MedusaHead
from inferd.train.eagle_data import target_hidden_states
from inferd.train.eagle_train_core import prepare
from inferd.train.train_medusa import MedusaOptions, train_heads, training_rows

K = 3


def _train_on_own_text(target: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int],
                       steps: int, lr: float = 1e-2, num_heads: int = K) -> tuple[MedusaHead, list[float]]:  # fmt: skip
    states = target_hidden_states(target, seqs)
    lm_weight = target.lm_head.weight.detach()
    data = prepare(states, prompt_lens, lm_weight, "float32")
    hidden, labels = training_rows(data, num_heads)
    torch.manual_seed(0)
    head = MedusaHead.for_target(target, num_heads)
    vocab = torch.arange(target.config.vocab_size)
    opts = MedusaOptions(num_heads=num_heads, max_steps=steps, epochs=1e6, batch_rows=128, lr=lr,
                         log_every=0, precision="float32")  # fmt: skip
    losses = train_heads(head, hidden, labels, lm_weight, vocab, opts)
    return head.requires_grad_(False), losses


@pytest.fixture(scope="module")
def medusa_dir(tiny_llama_gguf, tmp_path_factory):
    """Heads trained on the tiny target's own greedy answers to the test prompts (a random model
    soon repeats itself, which the heads learn): many drafts accepted, not all."""
    llm = _llm(tiny_llama_gguf.path)
    prompts, _ = _requests()
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    seeds = [p["prompt_token_ids"] for p in prompts] + [
        list(range(3 + i, 19 + i)) for i in range(12)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in seeds], greedy, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(seeds, outs)]
    head, _ = _train_on_own_text(
        llm.engine.runner.model, seqs, [len(p) for p in seeds], steps=400, lr=3e-2
    )
    return head.save(tmp_path_factory.mktemp("medusa") / "head")


@pytest.mark.parametrize("tree", [{}, {"draft_topk": 2}, {"dynamic_tree": False}],
                         ids=["dynamic", "static", "chain"])  # fmt: skip
def test_greedy_identical_batched_with_prefix_hits_and_structured_output(
    tiny_llama_gguf, medusa_dir, tree
):
    off = _llm(tiny_llama_gguf.path, max_num_batched_tokens=64)
    spec = {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": K, **tree}
    on = _llm(tiny_llama_gguf.path, spec, max_num_batched_tokens=64)
    want = _texts(off)
    assert _texts(on) == want
    stats = on.engine.get_stats()
    hits = stats.prefix_cache_hits_total
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    if tree.get("draft_topk"):  # the static tree's leaves were verified
        assert stats.spec_leaf_tokens > 0, stats
    assert _texts(on) == want  # every prompt now a prefix-cache hit
    assert stats.prefix_cache_hits_total > hits
    assert stats.spec_emitted_tokens == stats.spec_num_drafts + stats.spec_accepted_tokens
    on.engine.check_no_leaks()


def test_sampling_keeps_the_distribution(tiny_llama_gguf, medusa_dir):
    """At temperature 0.8 with min_p, the heads' (deterministic) drafts accepted by the sampler's
    lossless rule: token frequencies at every verified position match speculation off (a
    chi-square test). The prompt ends inside text the heads were trained on, so that some drafts
    are accepted and some are not."""
    params = SamplingParams(temperature=0.8, min_p=0.05, max_tokens=4, ignore_eos=True)
    spec = {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": K}
    stats = assert_speculation_keeps_distribution(tiny_llama_gguf.path, spec, params,
                                                  model_continued(tiny_llama_gguf.path, 24))  # fmt: skip
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats


def test_heads_for_another_target_are_refused(tiny_llama_gguf, medusa_dir, tmp_path):
    other = write_hf_dir(tmp_path / "other", with_seed(TinySpec(), 7))  # same shapes, other weights
    spec = {"method": "medusa", "model": str(medusa_dir)}
    with pytest.raises(ValueError, match="not this target model"):
        _llm(other.path, spec)
    with pytest.raises(ValueError, match="not a Medusa head directory"):
        _llm(tiny_llama_gguf.path, {"method": "medusa", "model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="exceeds the 3 heads"):
        _llm(tiny_llama_gguf.path, {**spec, "num_speculative_tokens": 4})
    config = json.loads((medusa_dir / "config.json").read_text())
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "model.safetensors").write_bytes((medusa_dir / "model.safetensors").read_bytes())
    (eagle / "config.json").write_text(json.dumps({**config, "format": "inferd-eagle-head"}))
    with pytest.raises(ValueError, match="not an inferd Medusa head"):
        _llm(tiny_llama_gguf.path, {"method": "medusa", "model": str(eagle)})


def test_saved_heads_load_bit_exact_and_fewer_heads_draft_the_same(tiny_llama_gguf, medusa_dir):
    target = _llm(tiny_llama_gguf.path).engine.runner.model
    a = MedusaHead.load(medusa_dir, target)
    b = MedusaHead.load(medusa_dir, target, num_heads=2)
    assert a.num_heads == K and b.num_heads == 2
    h = torch.randn(5, target.config.hidden_size)
    ids_a, probs_a = a.top(h, 3)
    ids_b, _ = b.top(h, 3)
    assert ids_a.shape == (5, K, 3) and bool((probs_a[..., :-1] >= probs_a[..., 1:]).all())
    assert torch.equal(ids_a[:, :2], ids_b)
    # Untrained heads (W = 0) read the target's own next-token guess.
    fresh = MedusaHead.for_target(target, 2)
    ids, _ = fresh.top(h, 1)
    want = target.compute_logits(h).argmax(-1)
    assert torch.equal(ids[:, 0, 0], want) and torch.equal(ids[:, 1, 0], want)


def test_a_few_training_steps_lower_the_loss(tiny_llama_gguf):
    target = _llm(tiny_llama_gguf.path).engine.runner.model
    g = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(3, target.config.vocab_size, (40,), generator=g).tolist() for _ in range(8)
    ]
    _, losses = _train_on_own_text(target, seqs, [5] * 8, steps=30)
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses


def test_recipe_end_to_end_on_a_tiny_model(tiny_llama_hf, tmp_path):
    from inferd.train.train_medusa import MedusaRecipe, train_medusa

    recipe = MedusaRecipe(model=str(tiny_llama_hf.path), out=str(tmp_path / "heads"), num_prompts=6,
                          num_questions=0, eval_prompts=4, max_tokens=12, draft_vocab_size=100,
                          data_cache=False,
                          train=MedusaOptions(num_heads=3, epochs=4, batch_rows=16, log_every=0))  # fmt: skip
    report = train_medusa(recipe)
    assert report["train_sequences"] == 6 and report["train_steps"] > 1
    assert report["last_loss"] < report["first_loss"]
    assert 1.0 <= report["acceptance"]["k3_acceptance_length"] <= 4
    head = MedusaHead.load(tmp_path / "heads", _llm(tiny_llama_hf.path).engine.runner.model)
    assert head.num_heads == 3 and len(head._vocab[0]) == 100


@pytest.mark.parametrize("value, message", [
    ('{"method": "medusa"}', 'needs "model"'),
    ('{"method": "medusa", "model": "d", "draft_topk": 9}', "draft_topk"),
])  # fmt: skip
def test_bad_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    assert (
        SpeculativeConfig.parse('{"method": "medusa", "model": "d", "draft_topk": 3}').draft_topk
        == 3
    )
