"""Draft trees: leaves (alternatives to a chain's draft at some depth) verified in rows of their
own. Lossless — a greedy output is the same with or without them — and an accepted leaf's K/V
moves into the sequence's blocks, which the tokens after it depend on; tiny random models."""

from __future__ import annotations

import pytest
import torch
from test_speculative import _llm, _params, fixed_speculation_costs  # noqa: F401 (autouse)

from inferd import LLM, SamplingParams
from inferd.config import SpeculativeConfig
from inferd.sampling.rejection import verify
from inferd.scheduler.sequence import Sequence
from inferd.spec.draft_tree import SettledChains, rank_nodes
from inferd.spec.policy import SpecPolicy
from inferd.spec.proposer import Proposer


def _prompts() -> list[list[int]]:
    base = [11, 23, 5, 67, 8, 90, 12, 34, 5, 67, 8, 41, 2, 9, 77, 31]
    return [base, base[:7], list(range(5, 40)), [3, 4, 5, 3, 4, 5, 3, 4], base * 3]


def _generate(llm: LLM):
    return llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()], _params(longer=10), use_tqdm=False
    )


class LeafOracle(Proposer):
    """Drafts from the known greedy answers, wrong on purpose: in turn, a chain right to its end,
    or one whose draft at depth d is wrong with the right token among that depth's leaves (next
    to a wrong leaf, and a wrong one deeper). Which drafts are right is all that varies."""

    method = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.answers = answers
        self.vocab_size = vocab_size
        self.calls = 0

    def _wrong(self, token: int, by: int) -> int:
        return (token + by) % self.vocab_size

    def propose(self, seqs: list[Sequence], ks: list[int], widths=None, rows=None) -> None:
        for seq, k in zip(seqs, ks):
            truth = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])][
                seq.num_output_tokens :
            ]
            k = min(k, len(truth))
            if k == 0:
                continue
            self.calls += 1
            depth = self.calls % (k + 1)  # 0: the chain is right
            chain = list(truth[:k])
            leaves = []
            if depth:
                chain[depth - 1] = self._wrong(truth[depth - 1], 1)
                leaves = [(depth, self._wrong(truth[depth - 1], 2)), (depth, truth[depth - 1])]
                if depth < k:
                    leaves.append((depth + 1, self._wrong(truth[depth], 3)))
            seq.spec.set(chain, leaves=leaves)


@pytest.fixture(scope="module")
def reference(tiny_llama_gguf):
    outs = _generate(_llm(tiny_llama_gguf.path))
    return outs


@pytest.mark.parametrize("kv_cache_dtype, kernel", [("auto", True), ("auto", False), ("int8", True),
                                                    ("float16", True)])  # fmt: skip
def test_accepted_leaves_move_into_the_sequence(tiny_llama_gguf, reference, kv_cache_dtype, kernel):
    """Every output, logprob and later token is the same as without speculation: an accepted leaf
    emits its token and the target's next, and its K/V (in a scratch block while verified) is
    where the tokens after it read it — at every offset in a block, through the C++ attention
    kernel or SDPA, on fp32, fp16 and int8 caches."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _llm(
        tiny_llama_gguf.path, spec, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=True
    )
    engine = llm.engine
    if not kernel:
        engine.runner.attention_kernel = None
    answers = {tuple(p): list(out.outputs[0].token_ids) for p, out in zip(_prompts(), reference)}
    engine.spec.proposer = LeafOracle(answers, engine.model_config.vocab_size)
    ref = (
        _generate(_llm(tiny_llama_gguf.path, kv_cache_dtype=kv_cache_dtype))
        if kv_cache_dtype != "auto"
        else reference
    )
    got = _generate(llm)
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in ref
    ]
    for g, r in zip(got, ref):
        if r.outputs[0].logprobs is not None:
            for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
                assert list(a) == list(b)
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    stats = engine.get_stats()
    assert stats.spec_accepted_leaves > 10 and stats.spec_leaf_tokens > stats.spec_accepted_leaves
    assert stats.spec_emitted_tokens == stats.spec_num_drafts + stats.spec_accepted_tokens
    engine.check_no_leaks()
    assert not engine.kv.scratch


def test_leaves_give_way_when_the_pool_is_full(tiny_llama_gguf, reference):
    """A pool too small for the scratch blocks (and forcing preemptions): the chain is verified
    alone, outputs unchanged, nothing leaks."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _llm(tiny_llama_gguf.path, spec, kv_cache_memory=48 << 10)
    answers = {tuple(p): list(out.outputs[0].token_ids) for p, out in zip(_prompts(), reference)}
    llm.engine.spec.proposer = LeafOracle(answers, llm.engine.model_config.vocab_size)
    want = _generate(_llm(tiny_llama_gguf.path, kv_cache_memory=48 << 10))
    assert [[o.token_ids for o in r.outputs] for r in _generate(llm)] == [
        [o.token_ids for o in r.outputs] for r in want
    ]
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_no_leaks()


def test_aborts_between_tree_steps_leave_no_block(tiny_llama_gguf, reference):
    """Requests aborted while others verify trees: every scratch block and every block of the
    aborted ones goes back; the rest still finish with their reference outputs."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = _llm(tiny_llama_gguf.path, spec, enable_prefix_caching=True)
    engine = llm.engine
    answers = {tuple(p): list(out.outputs[0].token_ids) for p, out in zip(_prompts(), reference)}
    engine.spec.proposer = LeafOracle(answers, engine.model_config.vocab_size)
    params = _params(longer=10)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, params[i])
    outputs: dict[str, list[int]] = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 4:
            assert engine.abort_request("r0") and engine.abort_request("r2")
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        assert not engine.kv.scratch  # scratch blocks live within a step only
    assert engine.get_stats().spec_accepted_leaves > 0
    for i in (1, 4):  # greedy, n = 1, no stop string: the stream is the reference's tokens
        assert outputs[f"r{i}"] == list(reference[i].outputs[0].token_ids)
    engine.requests.clear()
    engine.check_no_leaks()


def test_verify_accepts_the_leaf_at_the_rejected_depth():
    vocab = 8
    seq = Sequence("r", 0, [1, 2, 3], 3, SamplingParams(temperature=0, max_tokens=None, logprobs=1))
    # Chain [4, 5, 6]; leaves: 7 at depth 2 (the target's token there), 3 at depth 2, 2 at depth 3.
    seq.spec.set([4, 5, 6], leaves=[(2, 3), (2, 7), (3, 2)])
    argmax = [4, 7, 1, 0, 9 % vocab, 6, 5]  # rows: 3 chain + bonus, then one per leaf
    logits = torch.full((7, vocab), -5.0)
    for row, t in enumerate(argmax):
        logits[row, t] = 5.0
    (res,) = verify(logits, [seq], (), vocab)
    assert res.token_ids == [4, 7, 6]  # draft 1, the leaf, then its own row's argmax
    assert res.num_accepted == 2 and res.leaf == 1
    # Each token's logprob comes from the row it was chosen in: there it is the top token.
    assert [top[0][0] for _, rank, top in res.logprobs] == [4, 7, 6]
    assert all(rank == 1 for _, rank, _ in res.logprobs)
    # No leaf at the rejected depth, or none with the target's token: the chain's result.
    seq.spec.set([4, 5, 6], leaves=[(3, 1)])
    (res,) = verify(logits[[0, 1, 2, 3, 6]], [seq], (), vocab)
    assert res.token_ids == [4, 7] and res.leaf is None


def test_eagle_draft_tree_greedy_identical(tiny_llama_gguf, reference, tmp_path):
    """A learned head (untrained here) with draft_topk 3: its leaves are verified, now and then
    at least, and change no output."""
    from inferd.spec.eagle_head import EagleHead

    target = _llm(tiny_llama_gguf.path).engine.runner.model
    torch.manual_seed(0)
    EagleHead.for_target(target).save(tmp_path / "head")
    llm = _llm(tiny_llama_gguf.path, {"method": "eagle", "model": str(tmp_path / "head"),
                                      "num_speculative_tokens": 3, "draft_topk": 3})  # fmt: skip
    got = _generate(llm)
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in reference
    ]
    assert llm.engine.get_stats().spec_leaf_tokens > 0
    llm.engine.check_no_leaks()


def test_eagle_dynamic_tree_greedy_identical(tiny_llama_gguf, reference, tmp_path):
    """The default (dynamic_tree): greedy verifications spend their rows on the likeliest nodes
    of chain and runner-ups, so an untrained head's near-uniform drafts put a runner-up leaf in
    most steps; outputs unchanged, no block left behind. Off: chains alone."""
    from inferd.spec.eagle_head import EagleHead

    target = _llm(tiny_llama_gguf.path).engine.runner.model
    torch.manual_seed(0)
    EagleHead.for_target(target).save(tmp_path / "head")
    spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    expected = [[o.token_ids for o in r.outputs] for r in reference]
    for dynamic in (True, False):
        llm = _llm(tiny_llama_gguf.path, {**spec, "dynamic_tree": dynamic})
        got = _generate(llm)
        assert [[o.token_ids for o in r.outputs] for r in got] == expected
        stats = llm.engine.get_stats()
        assert stats.spec_num_drafts > 0
        assert (stats.spec_leaf_tokens > 0) == dynamic
        # The ranked nodes' predicted value is checked against what verification accepted.
        assert (llm.engine.spec_policy.calibration != 1.0) == dynamic
        llm.engine.check_no_leaks()


def test_dynamic_tree_beside_sampled_requests(tiny_llama_gguf, tmp_path):
    """Greedy and sampled requests in one batch under the dynamic tree: only the greedy ones get
    runner-up leaves (rejection sampling takes none: verify asserts it), the greedy outputs are
    speculation-off's, the sampled ones run to their length; no block left behind."""
    from inferd.spec.eagle_head import EagleHead

    plain = _llm(tiny_llama_gguf.path)
    torch.manual_seed(0)
    head = EagleHead.for_target(plain.engine.runner.model)
    with torch.no_grad():  # near-uniform drafts: runner-ups outrank the deeper drafts
        head.out_norm.weight.mul_(1e-3)
    head.save(tmp_path / "head")
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) if i % 2 == 0
              else SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama_gguf.path, {"method": "eagle", "model": str(tmp_path / "head"),
                                      "num_speculative_tokens": 3, "adaptive_depth": False})  # fmt: skip
    # Every decode verifies 3 rows (an untrained head's drafts would soon stop paying, and its
    # near-uniform confidence would have the adaptive policy verify one).
    got = llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(got, expected)):
        if i % 2 == 0:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        else:
            assert len(a.outputs[0].token_ids) == 20
    assert llm.engine.get_stats().spec_leaf_tokens > 0
    llm.engine.check_no_leaks()


def _untrained_head(path):
    """An untrained head on the tiny target and a maker of fresh draft caches holding 6
    positions (each draft writes its chain's keys into the cache it is given)."""
    from inferd.spec.eagle_head import DraftCache, EagleHead

    target = _llm(path).engine.runner.model
    torch.manual_seed(0)
    head = EagleHead.for_target(target).bind(target)
    hidden = torch.randn(6, target.config.hidden_size)
    tokens = torch.tensor([3, 9, 4, 1, 7, 2, 5])

    def cache() -> DraftCache:
        c = DraftCache(hidden, head.num_kv_heads, head.head_dim)
        c.write(0, *head.cache_entries(hidden, tokens[1:], torch.arange(6)))
        return c

    return head, cache


def test_head_confidences_are_its_top_three_probabilities(tiny_llama_gguf):
    head, cache = _untrained_head(tiny_llama_gguf.path)
    chain, logits = head.draft([cache()], 3, return_logits=True)
    chain2, (others, probs) = head.draft([cache()], 3, confidences=True)
    assert torch.equal(chain, chain2) and others.shape == (1, 3, 2) and probs.shape == (1, 3, 3)
    for step in range(3):
        p, top = logits[0, step].softmax(-1).topk(3)
        assert top[0] == chain[0, step] and torch.equal(top[1:], others[0, step])
        assert torch.allclose(probs[0, step], p, rtol=1e-5)


@pytest.mark.parametrize("probs, budget, expected", [
    # A confident head: the chain to its end.
    ([(0.9, 0.05), (0.8, 0.1), (0.9, 0.05)], 3, (3, [])),
    # Unsure at depth 1 (0.4 against 0.35): its runner-up (0.35) beats the third draft
    # (0.4 * 0.9 * 0.8 = 0.29).
    ([(0.4, 0.35), (0.9, 0.05), (0.8, 0.1)], 3, (2, [(1, 0)])),
    # Unsure at depth 2: the runner-up there (0.9 * 0.3) beats the third draft (0.9 * 0.4 * 0.6).
    ([(0.9, 0.05), (0.4, 0.3), (0.6, 0.05)], 3, (2, [(2, 0)])),
    # Unsure from the start: depth 1's runner-up ties the first draft (0.3) and is taken, the
    # second draft ties depth 2's runner-up (0.06) and is taken first.
    ([(0.3, 0.3), (0.2, 0.2), (0.5, 0.1)], 3, (2, [(1, 0)])),
    ([(0.3, 0.3), (0.2, 0.2), (0.5, 0.1)], 4, (2, [(1, 0), (2, 0)])),
    # A budget of one row: the likelier of the first draft and its runner-up, a tie to the chain.
    ([(0.5, 0.5)], 1, (1, [])),
    ([(0.6, 0.1), (0.9, 0.05)], 2, (2, [])),
    ([(0.6, 0.3), (0.4, 0.3)], 2, (1, [(1, 0)])),
    # Thirds: a flat first depth's third (0.25) beats the second draft (0.3 * 0.5); a tie between
    # a runner-up and a third goes to the runner-up.
    ([(0.3, 0.28, 0.25), (0.5, 0.2, 0.1)], 3, (1, [(1, 0), (1, 1)])),
    ([(0.3, 0.2, 0.2), (0.9, 0.05, 0.01)], 3, (2, [(1, 0)])),
    ([(0.3, 0.2, 0.2), (0.9, 0.05, 0.01)], 4, (2, [(1, 0), (1, 1)])),
])  # fmt: skip
def test_rank_nodes_verifies_the_likeliest_paths(probs, budget, expected):
    assert rank_nodes(probs, budget) == expected


def test_chains_settle_once_no_deeper_draft_can_be_verified():
    """The early stop agrees with rank_nodes: a chain settles exactly when every node rank_nodes
    picks from the full chain is already drafted."""
    import random

    rng = random.Random(0)
    for _ in range(500):
        budget = rng.randint(1, 5)
        probs = []
        alternatives = rng.randint(1, 2)
        for _ in range(budget):
            p1 = rng.random()
            p2 = rng.random() * min(p1, 1 - p1)
            p3 = rng.random() * min(p2, 1 - p1 - p2)
            probs.append((p1, p2, p3)[: 1 + alternatives])
        full = rank_nodes(probs, budget)
        settled = SettledChains(1, budget)
        depth = budget
        for d in range(1, budget):
            if settled.step(torch.tensor([probs[d - 1]], dtype=torch.float64)):
                depth = d
                break
        assert rank_nodes(probs[:depth], budget) == full
        assert full[0] <= depth and all(d <= depth for d, _ in full[1])
    # Two chains: settled only when both are.
    both = SettledChains(2, 3)
    assert not both.step(torch.tensor([[0.4, 0.35], [0.9, 0.05]]))
    assert not both.step(torch.tensor([[0.5, 0.2], [0.9, 0.05]]))
    alone = SettledChains(1, 3)
    alone.step(torch.tensor([[0.4, 0.35]]))
    assert alone.step(torch.tensor([[0.5, 0.2]]))  # depth 1's runner-up (0.35) beats c2 (0.2)
    # Four rows: after depth 2 (c2 = 0.15) depth 1's runner-up and third both beat any deeper
    # draft; with runner-ups alone, a third draft could still be among the four.
    thirds, seconds = SettledChains(1, 4), SettledChains(1, 4)
    assert not thirds.step(torch.tensor([[0.3, 0.28, 0.25]]))
    assert thirds.step(torch.tensor([[0.5, 0.1, 0.05]]))
    assert not seconds.step(torch.tensor([[0.3, 0.28]]))
    assert not seconds.step(torch.tensor([[0.5, 0.1]]))


def test_head_alternatives_are_the_next_likeliest_tokens(tiny_llama_gguf):
    head, cache = _untrained_head(tiny_llama_gguf.path)
    chain, logits = head.draft([cache()], 3, return_logits=True)
    chain2, alts = head.draft([cache()], 3, alternatives=2)
    assert torch.equal(chain, chain2) and alts.shape == (1, 3, 2)
    for step in range(3):
        top = logits[0, step].topk(3).indices
        assert top[0] == chain[0, step] and torch.equal(alts[0, step], top[1:])


def test_policy_verifies_leaves_while_they_pay():
    seqs = [
        Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0, max_tokens=None))
        for _ in range(2)
    ]
    cheap = SpecPolicy(3, None, {1: 0.02}, leaf_width=2, leaf_cost={1: 0.02})
    dear = SpecPolicy(3, None, {1: 0.02}, leaf_width=2, leaf_cost={1: 0.6})
    # A chain that keeps failing early (acceptance ~0.3): the case leaves are for. (At the 0.7
    # prior a chain mostly runs to its end, and leaves would rarely have a rejection to fix.)
    for policy in (cheap, dear):
        policy.depths(seqs, 1)
        for _ in range(8):
            for seq in seqs:
                policy.record(seq, 3, 1)
    ks = cheap.depths(seqs, 1)
    assert min(ks) > 0 and cheap.leaf_widths(seqs, ks, 1) == [2, 2]
    ks = dear.depths(seqs, 1)
    widths = [dear.leaf_widths(seqs[:1], ks[:1], 1)[0] for _ in range(32)]
    assert widths.count(2) == 2  # probes only, every 16 verifications
    sampled = Sequence("r", 0, [1, 2], 2, SamplingParams(temperature=0.8, max_tokens=None))
    assert cheap.leaf_widths([sampled], cheap.depths([sampled], 1), 1) == [0]  # greedy only
    # Leaves that never hit stop paying even when cheap.
    for _ in range(200):
        cheap.record(seqs[0], 3, 0, [(1, 5), (1, 6)], leaf_hit=False)
    assert cheap.leaf_widths(seqs[1:], [3], 1) == [0]


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle", "model": "x", "draft_topk": 0}', "draft_topk"),
    ('{"method": "eagle", "model": "x", "draft_topk": 9}', "draft_topk"),
    ('{"method": "eagle", "model": "x", "draft_topk": "2"}', "draft_topk"),
    ('{"method": "ngram", "draft_topk": 2}', "needs method"),
    ('{"method": "eagle", "model": "x", "dynamic_tree": "yes"}', "dynamic_tree"),
])  # fmt: skip
def test_bad_draft_topk(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
