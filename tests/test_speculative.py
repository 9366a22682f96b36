"""Speculative decoding: lossless (greedy identical, sampling distribution unchanged), KV rolled
back after rejections, policy and configuration, on tiny random models."""

from __future__ import annotations

import collections
import json
import random

import pytest
import torch
from spec_sampling import SEED_PROMPT, assert_speculation_keeps_distribution, model_continued
from tiny_models import TinySpec, with_seed, write_gguf

from inferd import LLM, SamplingParams
from inferd.config import SpeculativeConfig
from inferd.sampling.rejection import verify
from inferd.scheduler.sequence import Sequence
from inferd.spec import decoder as spec_decoder
from inferd.spec.ngram import NgramIndex, lookup
from inferd.spec.policy import SpecPolicy

KV = 1 << 20


@pytest.fixture(autouse=True)
def fixed_speculation_costs(monkeypatch):
    """These tests are about what verification gives, not about when it pays: the engines they
    build price verification and drafting as fixed and cheap. Measured (the engine's start-up
    calibration, drafting's and verifying's time against a tiny model's ~1 ms step), both depend
    on the machine's load, and a policy that rightly finds speculation too dear for a tiny model
    would leave nothing to check. The policy's own tests build `SpecPolicy` directly."""
    fixed = ({1: 0.02, 64: 0.5}, {})
    monkeypatch.setattr(spec_decoder, "measure_verify_cost", lambda *args, **kwargs: fixed)
    monkeypatch.setattr(spec_decoder, "SpecPolicy", _FixedCostPolicy)


class _FixedCostPolicy(SpecPolicy):
    def record_speculation_time(self, *args) -> None:
        pass  # drafting and its bookkeeping stay free

    def record_forward(self, *args) -> None:
        pass  # and verification's forward at the fixed F (no re-measuring, no plain reference steps)


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory):
    """A tiny model with the target's tokenizer and other weights: drafts it proposes are
    sometimes accepted, often not."""
    return write_gguf(tmp_path_factory.mktemp("draft") / "draft.gguf", with_seed(TinySpec(), 7), quant="f32")


@pytest.fixture(scope="module")
def near_draft_gguf(tiny_llama_gguf, tmp_path_factory):
    """The target's weights with a flatter, noisier LM head: the draft's distribution overlaps the
    target's (many drafts accepted) but is wider (many rejected, so the residual distribution is
    exercised). Two independent random models share almost no candidates at top-k / top-p."""
    sd = {name: w.clone() for name, w in tiny_llama_gguf.original.items()}
    g = torch.Generator().manual_seed(11)
    head = sd["lm_head.weight"]
    sd["lm_head.weight"] = 0.6 * head + 0.1 * torch.randn(head.shape, generator=g)
    return write_gguf(tmp_path_factory.mktemp("near") / "near.gguf", tiny_llama_gguf.spec, quant="f32", state_dict=sd)


def _llm(path, spec=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", KV)
    return LLM(str(path), dtype="float32", device="cpu", verbose=False, speculative_config=spec, **kw)


def _prompts(tok) -> list[list[int]]:
    text = "the cat sat on the mat and the cat sat on the hat so the cat"
    base = tok.encode(text)
    return [base, base[:7], list(range(5, 40)), tok.encode("a b c a b c a b"), base * 3]


def _params(longer: int = 0) -> list[SamplingParams]:
    """Greedy requests with logprobs, penalties, n = 2 and a stop token (`longer`: more tokens)."""
    return [
        SamplingParams(temperature=0, max_tokens=24 + longer, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17 + longer, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30 + longer, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20 + longer, ignore_eos=True, n=2, min_tokens=3),
        SamplingParams(temperature=0, max_tokens=26 + longer, ignore_eos=True, stop_token_ids=[17]),
    ]


def _run(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(llm.get_tokenizer())], _params(),
                        use_tqdm=False)  # fmt: skip
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_gguf):
    """Outputs and logprobs without speculation, by KV pool size (it bounds max_model_len)."""
    cache = {}

    def get(kv_bytes: int = KV):
        if kv_bytes not in cache:
            llm = _llm(tiny_llama_gguf.path, kv_cache_memory=kv_bytes, max_num_batched_tokens=64)
            prompts = [{"prompt_token_ids": p} for p in _prompts(llm.get_tokenizer())]
            outs = llm.generate(prompts, _params(), use_tqdm=False)
            cache[kv_bytes] = ([[o.token_ids for o in out.outputs] for out in outs],
                               [out.outputs[0].logprobs for out in outs])  # fmt: skip
        return cache[kv_bytes]

    return get


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "int8"])
def test_greedy_outputs_identical_on_a_narrow_kv_cache(tiny_llama_gguf, kv_cache_dtype):
    """Verification rows write and read a 2-byte or quantized cache as plain decodes do (the same
    rounding, the same kernel bits whatever the row's place in the step): still lossless."""
    kw = {"max_num_batched_tokens": 64, "kv_cache_dtype": kv_cache_dtype}
    want = _run(_llm(tiny_llama_gguf.path, **kw))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = _llm(tiny_llama_gguf.path, spec, **kw)
    assert _run(llm) == want
    assert llm.engine.get_stats().spec_accepted_tokens > 0
    llm.engine.check_no_leaks()


def test_fixed_depth_measures_nothing_and_stays_lossless(tiny_llama_gguf, reference, monkeypatch):
    """`adaptive_depth: false` builds no measured policy (no start-up calibration) and its
    verifications, k drafts wherever the proposer has them, change no token."""
    monkeypatch.setattr(spec_decoder, "measure_verify_cost", lambda *a, **kw: pytest.fail("measured"))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive_depth": False}
    llm = _llm(tiny_llama_gguf.path, spec)
    assert _run(llm) == reference(KV)[0]
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens_per_position[3] > 0
    llm.engine.check_no_leaks()


def test_acceptance_counted_by_chain_position(tiny_llama_gguf):
    """The engine's per-position counts (vLLM's num_accepted_tokens_per_pos): drafts verified
    and accepted at each depth of the chain, consistent with the totals."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = _llm(tiny_llama_gguf.path, spec)
    _run(llm)
    s = llm.engine.get_stats()
    proposed, taken = s.spec_draft_tokens_per_position, s.spec_accepted_per_position
    assert 0 < len(taken) <= len(proposed) <= 4 and taken[0] > 0
    assert sum(proposed) == s.spec_draft_tokens and proposed[0] == s.spec_num_drafts
    assert sum(taken) == s.spec_accepted_tokens
    assert proposed == sorted(proposed, reverse=True) and taken == sorted(taken, reverse=True)
    assert s.spec_acceptance_rate_per_position == [t / p for t, p in zip(taken, proposed)]


def test_stats_line_shows_acceptance_by_position(caplog):
    import logging
    import time

    from inferd.engine.stats import EngineStats, StatsLogger

    stats = EngineStats(spec_method="eagle", spec_num_drafts=10, spec_draft_tokens=25,
                        spec_accepted_tokens=9, spec_emitted_tokens=19,
                        spec_draft_tokens_per_position=[10, 10, 5],
                        spec_accepted_per_position=[6, 2, 1])  # fmt: skip
    log = StatsLogger(interval=0.01)
    time.sleep(0.02)
    with caplog.at_level(logging.INFO, logger="inferd.engine"):
        log.maybe_log(stats)
    assert "mean acceptance length 1.90" in caplog.text
    assert "acceptance rate 36.0% (by position: 60%, 20%, 20%)" in caplog.text


@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
@pytest.mark.parametrize("kv_bytes", [KV, 48 << 10])  # the small pool forces preemption
def test_greedy_outputs_identical(tiny_llama_gguf, draft_gguf, reference, method, kv_bytes):
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            "draft_same": {"method": "draft_model", "model": str(tiny_llama_gguf.path)},
            "draft_other": {"method": "draft_model", "model": str(draft_gguf.path),
                            "num_speculative_tokens": 5}}[method]  # fmt: skip
    llm = _llm(tiny_llama_gguf.path, spec, kv_cache_memory=kv_bytes, max_num_batched_tokens=64)
    assert _run(llm) == reference(kv_bytes)[0]
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens > 0
    if method == "draft_same":  # a draft identical to the target is always right
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert stats.spec_emitted_tokens == stats.spec_num_drafts + stats.spec_accepted_tokens
    llm.engine.check_no_leaks()


def test_logprobs_identical_with_speculation(tiny_llama_gguf, reference):
    llm = _llm(tiny_llama_gguf.path, {"method": "draft_model", "model": str(tiny_llama_gguf.path)})
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.get_tokenizer())]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    for out, ref in zip(outs, reference()[1]):
        got = out.outputs[0].logprobs
        assert (got is None) == (ref is None)
        if ref is not None:
            assert [list(d) for d in got] == [list(d) for d in ref]
            for a, b in zip(got, ref):
                for t in a:
                    assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_abort_mid_speculation_frees_every_block(tiny_llama_gguf, draft_gguf):
    llm = _llm(tiny_llama_gguf.path, {"method": "draft_model", "model": str(draft_gguf.path)})
    engine = llm.engine
    tok = llm.get_tokenizer()
    for i, p in enumerate(_prompts(tok)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.stats.spec_num_drafts > 0
    for i in range(0, 5, 2):
        assert engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.requests.clear()
    engine.check_no_leaks()


# ---- the sampling distribution is unchanged ------------------------------------------------

def _emitted_distribution(p: torch.Tensor, q: torch.Tensor | None, drafts_from_q: bool, trials: int):
    """Run `verify` on fixed target rows p [2, V] with one draft; count (first, second) emitted."""
    vocab = p.shape[1]
    logits = p.log()
    counts: collections.Counter = collections.Counter()
    gen = torch.Generator().manual_seed(1)
    for _ in range(trials):
        seq = Sequence("r", 0, [1, 2, 3], 3, SamplingParams(temperature=1.0, max_tokens=None), generator=gen)
        if drafts_from_q:
            draft = int(torch.multinomial(q[0], 1, generator=gen))
            seq.spec.set([draft], q[:1])
        else:
            seq.spec.set([2])  # a deterministic proposer: always token 2
        (res,) = verify(logits, [seq], (), vocab)
        counts[res.token_ids[0]] += 1
    return counts


@pytest.mark.parametrize("drafts_from_q", [True, False])
def test_rejection_sampling_first_token_follows_target(drafts_from_q):
    torch.manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(2, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, vocab) * 1.5, dim=-1)
    trials = 6000
    counts = _emitted_distribution(p, q, drafts_from_q, trials)
    empirical = torch.tensor([counts[i] / trials for i in range(vocab)])
    tv = 0.5 * (empirical - p[0]).abs().sum().item()
    assert tv < 0.03, (empirical, p[0])
    # The draft's own distribution is far from the target's: accepting blindly would show.
    assert 0.5 * (q[0] - p[0]).abs().sum().item() > 0.15


def test_sampling_distribution_unchanged_end_to_end(tiny_llama_gguf, near_draft_gguf):
    """Token frequencies at every output position match with and without speculation at
    temperature 1 with top-k 40 / top-p 0.95, with a draft that is accepted often but not always
    and the depth the policy chooses."""
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, max_tokens=4, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(near_draft_gguf.path)}
    stats = assert_speculation_keeps_distribution(tiny_llama_gguf.path, spec, params, SEED_PROMPT,
                                                  fixed_depth=False)  # fmt: skip
    assert 0.1 * stats.spec_draft_tokens < stats.spec_accepted_tokens < 0.9 * stats.spec_draft_tokens, stats


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_sampling_keeps_the_distribution_with_penalties_and_min_p(tiny_llama_gguf, tmp_path, method):
    """Prompt lookup and a learned head (untrained: its drafts are mostly rejected, so the
    residual distribution is what is tested) at temperature 0.8 with repetition, presence and
    frequency penalties and min_p: token frequencies at every verified position match
    speculation off (the processors see each draft row's own prefix)."""
    params = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=0.1, max_tokens=4,
                            ignore_eos=True)  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "eagle":
        from inferd.spec.eagle_head import EagleHead

        torch.manual_seed(0)
        EagleHead.for_target(_llm(tiny_llama_gguf.path).engine.runner.model).save(tmp_path / "head")
        spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    prompt = model_continued(tiny_llama_gguf.path, 160)
    stats = assert_speculation_keeps_distribution(tiny_llama_gguf.path, spec, params, prompt)
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    assert stats.spec_accepted_tokens > 0 or method == "eagle", stats


def test_ngram_lookup_prefers_longest_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 3, 1, 3) == [7, 5, 2]  # "2 3" latest
    assert lookup([4, 5, 6, 4, 5], 2, 1, 4) == [6, 4]
    assert lookup([1, 2, 3], 3, 1, 4) == []
    assert lookup([1, 2, 3, 1], 3, 2, 4) == []  # only a 1-token match, below the minimum
    assert lookup([1, 1], 5, 1, 4) == [1]  # continuation stops at the end


@pytest.mark.parametrize(("n_min", "n_max"), [(1, 1), (2, 4), (1, 5)])
def test_ngram_index_drafts_what_lookup_drafts(n_min, n_max):
    """The proposer's incremental index against the scanning reference, at every length of
    growing sequences over small vocabularies (many matches, many misses), whether it is asked at
    every step or only now and then (tokens appended in between)."""
    rng = random.Random(n_min * 10 + n_max)
    for vocab, every in ((3, 1), (6, 1), (40, 1), (6, 5)):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))]
        index = NgramIndex(n_min, n_max)
        for _ in range(160):
            tokens.append(rng.randrange(vocab))
            if rng.randrange(every) == 0:
                k = rng.randrange(1, 6)
                assert index.lookup(tokens, k) == lookup(tokens, k, n_min, n_max), (vocab, tokens, k)


def test_calibration_measures_every_depth(tiny_llama_gguf):
    """The start-up measurement gives F(1..k) per batch size, non-decreasing in the depth and in
    the batch size, and frees its dummy sequences."""
    from inferd.spec.calibrate import measure_verify_cost

    engine = _llm(tiny_llama_gguf.path).engine
    costs, leaf_costs = measure_verify_cost(engine.runner, engine.kv, 3, 16,
                                            engine.model_config.vocab_size, context=16, repeats=1)  # fmt: skip
    engine.check_no_leaks()
    assert sorted(costs) == [1, 4, 16] and leaf_costs == {}
    for by_depth in costs.values():
        assert len(by_depth) == 3 and by_depth == sorted(by_depth) and by_depth[0] >= 0.0
    for small, large in zip(costs.values(), list(costs.values())[1:]):
        assert all(x <= y for x, y in zip(small, large))


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('[1]', "JSON object"),
    ('{"num_speculative_tokens": 3}', "needs \"method\""),
    ('{"method": "hydra"}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model"}', "needs \"model\""),
    ('{"method": "ngram", "k": 3}', "unknown keys"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "prompt_lookup_max": 0}', "prompt_lookup_min"),
    ('{"method": "ngram", "prompt_lookup_min": "2"}', "prompt_lookup_min"),
    ('{"method": "ngram", "adaptive_depth": "no"}', "adaptive_depth must be true or false"),
])  # fmt: skip
def test_bad_speculative_config(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_prompt_lookup_min_defaults_to_two():
    assert SpeculativeConfig.parse('{"method": "ngram"}').prompt_lookup_min == 2
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 1}').prompt_lookup_min == 1
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_min": 1}').prompt_lookup_min == 1


def test_draft_model_with_another_tokenizer_is_refused(tiny_llama_gguf, tiny_models):
    other = tiny_models["qwen2-f32.gguf"]
    with pytest.raises(ValueError, match="tokenizer differs"):
        _llm(tiny_llama_gguf.path, {"method": "draft_model", "model": str(other.path)})


def test_speculative_config_flag(tiny_llama_gguf):
    import argparse

    from inferd.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 5})])
    spec = engine_config_from_args(args).speculative
    assert spec.method == "ngram" and spec.num_speculative_tokens == 5


def test_seeded_sampling_is_the_same_with_speculation_on(tiny_llama_gguf):
    """A seed promises the same output whatever the batch: seeded sampled sequences do not
    speculate (the number of drafts a step verifies depends on the batch)."""
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}] * 4

    def run(spec):
        return [o.outputs[0].token_ids for o in _llm(tiny_llama_gguf.path, spec).generate(prompts, params, use_tqdm=False)]

    assert run({"method": "ngram"}) == run(None)


@pytest.mark.parametrize(("vocab", "features"), [(None, ()), (120, ()), (None, (0,))])
def test_eagle_head_greedy_identical(tiny_llama_gguf, reference, tmp_path, vocab, features):
    """A learned draft head (here untrained: its drafts are mostly wrong) changes no output, with
    the whole vocabulary or a reduced draft vocabulary, or reading a lower layer's output too."""
    from inferd.spec import draft_vocab
    from inferd.spec.eagle_head import EagleHead

    target = _llm(tiny_llama_gguf.path).engine.runner.model
    torch.manual_seed(0)
    head = EagleHead.for_target(target, feature_layers=features)
    if features:  # not the zero init: the feature layer's rows must reach the head
        torch.nn.init.normal_(head.feature_fc.weight, std=0.1)
    head.save(tmp_path / "head")
    if vocab:
        draft_vocab.save(tmp_path / "head", torch.arange(0, 2 * vocab, 2))
    llm = _llm(tiny_llama_gguf.path, {"method": "eagle", "model": str(tmp_path / "head"),
                                      "num_speculative_tokens": 3})  # fmt: skip
    assert llm.engine.proposer.head.draft_vocab_size == vocab
    assert _run(llm) == reference()[0]
    assert llm.engine.get_stats().spec_num_drafts > 0
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("features", [(), (0,)])
def test_eagle_caches_hold_every_position_the_target_computed(tiny_llama_gguf, tmp_path, features):
    """After every step, the proposer's per-sequence cache holds the head's keys and values of
    each position the target computed (prompt chunks, decodes, the accepted part of a
    verification), equal to those computed offline from the whole sequence; a prompt prefix
    served from the prefix cache is left out (the cache starts after it), and nothing is left
    behind once requests end. With a feature layer (EAGLE-3), the rows the engine's steps
    capture from it (the fused decode step split there) are the offline forward's."""
    from inferd.spec.eagle import _MAX_PENDING
    from inferd.spec.eagle_head import EagleHead
    from inferd.train.eagle_data import target_hidden_states
    from inferd.train.eagle_train_core import TrainOptions, prepare, train_head

    plain = _llm(tiny_llama_gguf.path)
    target = plain.engine.runner.model
    prompt = [5, 6, 7, 5, 6, 7, 5, 6] * 5  # 40 tokens: prefilled in 16-token chunks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # A head that learned this very continuation by heart: many drafts accepted, some not.
    (out,) = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    states = target_hidden_states(target, [prompt + list(out.outputs[0].token_ids)], capture_layers=features)
    lm = target.lm_head.weight.detach()
    torch.manual_seed(0)
    head = EagleHead.for_target(target, feature_layers=features)
    train_head(head, prepare(states, [len(prompt)], lm), target.embed_tokens, lm,
               TrainOptions(epochs=60, batch_size=1, lr=3e-3, noise=0.0, log_every=0))  # fmt: skip
    head.save(tmp_path / "head")
    llm = _llm(tiny_llama_gguf.path, {"method": "eagle", "model": str(tmp_path / "head"),
                                      "num_speculative_tokens": 3},
               enable_prefix_caching=True, max_num_batched_tokens=16)  # fmt: skip
    engine = llm.engine
    checked = []
    fused_runs = []  # whether each fused decode step captured rows (the feature layer's)
    model = engine.runner.model
    fused = model._decode_layers

    def recording(ext, x, rope, kv, meta, captured=None):
        fused_runs.append(0 if captured is None else captured.shape[0])
        return fused(ext, x, rope, kv, meta, captured)

    model._decode_layers = recording

    depths = engine.spec_policy.depths
    quiet_steps = {"left": 0}

    def depths_after_quiet(seqs, batch_size):
        # While `left` > 0 no sequence speculates: the head's caches are not fed, and the rows
        # wait until the next draft feeds them all in one pass.
        ks = depths(seqs, batch_size)
        if quiet_steps["left"] > 0:
            quiet_steps["left"] -= 1
            return [0] * len(ks)
        return ks

    engine.spec_policy.depths = depths_after_quiet
    # The target's rows as the engine handed them to the proposer, by sequence and position.
    observed: dict[tuple[int, int], torch.Tensor] = {}
    observe = engine.proposer.observe

    def recording_observe(seqs, starts, hidden):
        for seq, start, rows in zip(seqs, starts, hidden):
            for j, row in enumerate(rows):
                observed[seq.seq_id, start + j] = row.clone()
        return observe(seqs, starts, hidden)

    engine.proposer.observe = recording_observe

    def run(request_id: str, quiet: int = 0) -> None:
        quiet_steps["left"] = quiet
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                cache = engine.proposer.caches.get(seq.seq_id)
                pending = engine.proposer.pending.get(seq.seq_id)
                # Nothing the target computed is missing: in the cache, or waiting for it.
                covered = pending.end if pending is not None else cache.end if cache else 0
                assert covered >= seq.num_computed_tokens - 1
                assert pending is None or pending.end - pending.start < _MAX_PENDING  # bounded
                if cache is None:
                    continue
                n = cache.end
                # The engine's rows are the target's (up to the offline prefill's rounding)...
                states = target_hidden_states(target, [seq.token_ids[:n]], capture_layers=features)
                rows = torch.stack([observed[seq.seq_id, p] for p in range(cache.lo, n)])
                torch.testing.assert_close(rows, states.hidden[0][cache.lo :], rtol=1e-4, atol=1e-4)
                # ...and the cache holds exactly the head's entries of those rows, each with the
                # token that followed it and its own position: nothing stale, missing or shifted.
                # (Bits, not a tolerance: a head that learned a sequence by heart can turn the
                # rounding of two attention kernels into 1e-3 in its keys.)
                _, k, v = engine.proposer.head.cache_entries(
                    rows, torch.tensor(seq.token_ids[cache.lo + 1 : n + 1]), torch.arange(cache.lo, n))
                kc, vc = cache.keys()
                assert torch.equal(kc, k) and torch.equal(vc, v)
                checked.append((request_id, cache.lo, n))

    run("first")
    run("second")  # the same prompt: its first full blocks come from the prefix cache
    # Nothing drafts in the third's first 10 steps (3 prompt chunks, 7 decodes): its cache is
    # first fed on its first draft, with the prompt and those decodes at once.
    engine.reset_prefix_cache()
    run("third", quiet=10)
    firsts = [c for c in checked if c[0] == "first"]
    seconds = [c for c in checked if c[0] == "second"]
    thirds = [c[2] for c in checked if c[0] == "third"]
    assert firsts and all(lo == 0 for _, lo, _ in firsts)
    assert seconds and all(lo > 0 and lo % engine.kv.block_size == 0 for _, lo, _ in seconds)
    assert thirds and thirds[0] >= len(prompt) + 7
    stats = engine.get_stats()
    # Verifications kept several rows, and rejected some (both paths of the bookkeeping ran).
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert len(checked) > 10
    engine.check_no_leaks()
    from inferd.kernels.quant_gemm import extension
    from inferd.models.decoder import FUSED_DECODE

    if FUSED_DECODE and extension() is not None:  # decodes ran fused, capturing the layer's rows
        assert set(fused_runs) == {len(features)}
