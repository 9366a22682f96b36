"""Sampling behaviour on the real default model: n > 1 block sharing, seeds, stop strings and stop
tokens, logprobs, logit_bias, min_tokens, filters that reduce to greedy, priorities."""

from __future__ import annotations

import pytest

from inferd import SamplingParams
from inferd.engine.detokenizer import IncrementalDetokenizer
from tests.real_model import loaded_default, make_llm

PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"


@pytest.fixture(scope="module")
def llm():
    llm = make_llm()
    yield llm
    llm.engine.check_no_leaks()


def _greedy(llm, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24), **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    tok = engine.tokenizer
    ids = tok.encode(PROMPT + " a young girl who loved to read books about faraway lands")
    bs = engine.kv.block_size
    assert len(ids) % bs, "the prompt must end in a partial block for copy-on-write to matter"
    prompt_blocks = -(-len(ids) // bs)
    full = prompt_blocks - 1
    assert llm.reset_prefix_cache()
    free0 = engine.kv.pool.num_free
    engine.add_request("n4", ids, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=4))
    engine.step()  # prefill once, then fork into 4 sequences
    state = engine.requests["n4"]
    assert len(state.seqs) == 4
    tables = [engine.kv.block_tables[s.seq_id] for s in state.seqs]
    assert all(t == tables[0] for t in tables)
    # 4 sequences share every prompt block; the full ones are also held by the prefix cache.
    assert [engine.kv.pool.ref_counts[b] for b in tables[0]] == [5] * full + [4]
    assert free0 - engine.kv.pool.num_free == prompt_blocks  # not 4 × prompt_blocks
    engine.step()  # each child writes into the shared partial block: copy-on-write
    assert free0 - engine.kv.pool.num_free == full + 4
    assert [engine.kv.pool.ref_counts[b] for b in tables[0][:full]] == [5] * full
    engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_finished("n4")
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 4 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # independent samples
    engine.check_no_leaks()


def test_greedy_n_gives_identical_copies(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)
    texts = [o.text for o in out[0].outputs]
    assert texts[0] == texts[1] == texts[2] == _greedy(llm, max_tokens=12).text


def test_same_seed_same_output_regardless_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n) for n in (5, 30, 17)]
    batch = llm.generate(["Hello there", PROMPT, "The weather today", "1, 2, 3,"],
                         [others[0], params, others[1], others[2]], use_tqdm=False)  # fmt: skip
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24)
    assert llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_filters_that_keep_one_token_equal_greedy(llm):
    greedy = _greedy(llm).token_ids
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        params = SamplingParams(temperature=1.0, max_tokens=24, seed=3, **kw)
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == greedy, kw


def test_stop_string_split_across_tokens(llm):
    base = _greedy(llm, max_tokens=32)
    tok = llm.get_tokenizer()
    # Build a stop string that starts inside one token and ends inside the next.
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    k = next(i for i in range(4, len(pieces) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2)  # fmt: skip
    stop = pieces[i_end := k][-2:] + pieces[k + 1][len(pieces[i_end]) :][:2]
    cut = base.text.find(stop)
    assert cut != -1
    out = _greedy(llm, max_tokens=32, stop=[stop, "zzzz-never"])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut]
    kept = _greedy(llm, max_tokens=32, stop=stop, include_stop_str_in_output=True)
    assert kept.text == base.text[: cut + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    base = _greedy(llm, max_tokens=16)
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = _greedy(llm, max_tokens=16, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: first + 1]


def test_eos_min_tokens_and_ignore_eos(llm):
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Say just the word: yes"}])
    ids = tok.encode(chat, add_special_tokens=False)
    short = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.stop_reason is None
    assert short.token_ids[-1] in llm.engine.eos_token_ids and len(short.token_ids) < 20
    n = len(short.token_ids) + 10
    longer = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, min_tokens=n),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(longer.token_ids) >= n
    assert not set(longer.token_ids[: n - 1]) & set(llm.engine.eos_token_ids)
    full = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(full.token_ids) == 30 and full.finish_reason == "length"


def test_logprobs(llm):
    out = _greedy(llm, max_tokens=8, logprobs=3)
    assert len(out.logprobs) == 8
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_logit_bias_and_penalties(llm):
    tok = llm.get_tokenizer()
    forced = tok.encode(" banana")[0]
    out = _greedy(llm, max_tokens=6, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 6
    # A strong repetition penalty forbids repeating any seen token under greedy decoding.
    rep = _greedy(llm, max_tokens=20, repetition_penalty=100.0).token_ids
    assert len(set(rep)) == len(rep)
    pres = _greedy(llm, max_tokens=20, presence_penalty=2.0, frequency_penalty=2.0).token_ids
    assert pres != _greedy(llm, max_tokens=20).token_ids


def test_priority_runs_lower_first(llm):
    one = make_llm(max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = one.generate(["a b c", "d e f", "g h i"], params, use_tqdm=False, priority=[5, 0, 3])
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts[1] < firsts[2] < firsts[0]
    one.engine.check_no_leaks()


def test_incremental_detokenizer_multibyte():
    tok = loaded_default().tokenizer
    text = "café 你好 🎉 naïve — ü"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, SamplingParams())
    deltas = []
    for t in ids:
        detok.add_token(t)
        deltas.append(detok.delta(False))
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some token ended mid-character and was held back


def test_engine_stats(llm):
    llm.generate([PROMPT], SamplingParams(max_tokens=5), use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.generation_tokens_total >= 5 and stats.prompt_tokens_total > 0
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
