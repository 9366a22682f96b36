"""Multi-LoRA: adapters written by PEFT, served batched with the base model (inferd/lora).

The reference is HF transformers with the adapter merged into the weights (PEFT's
`merge_and_unload`); inferd adds the delta on the side and must give the same greedy tokens,
alone and with other adapters and the base model in one batch, through the prefix cache, the
slots' LRU and reloads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inferd import LLM, LoRARequest, SamplingParams
from tests.lora_helpers import greedy, merged, write_adapter

pytest.importorskip("peft")

# The second spans two KV blocks (16 tokens each): the prefix cache has whole blocks to keep.
PROMPTS = [
    [1, 5, 9, 33, 70, 100, 7],
    [1, *range(40, 60), 12, 200, 201, 202, 9, 8, 77, 3, *range(100, 110), 5],
    [1, 300, 2],
]
TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_base(tiny_llama_hf, hf_transformers):
    return hf_transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_llama_hf.path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory) -> dict[str, Path]:
    """Four adapters: every target at rank 8; a few targets at rank 4; rslora with an alpha
    pattern; and a second rank-8 one (for reloads)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": write_adapter(hf_base, root / "all8", seed=1, scale=3.0),
        "some4": write_adapter(hf_base, root / "some4", seed=2, rank=4, targets=["q_proj", "v_proj", "down_proj"],
                               scale=3.0),
        "rs": write_adapter(hf_base, root / "rs", seed=3, rank=6, targets=["k_proj", "o_proj", "up_proj", "gate_proj"],
                            use_rslora=True, alpha_pattern={"o_proj": 4}, scale=3.0),
        "other8": write_adapter(hf_base, root / "other8", seed=4, scale=3.0),
    }  # fmt: skip


@pytest.fixture(scope="module")
def references(hf_base, adapters) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of every prompt under the base model (None) and each adapter, merged."""
    refs = {None: [greedy(hf_base, p, TOKENS) for p in PROMPTS]}
    for name, path in adapters.items():
        model = merged(hf_base, path)
        refs[name] = [greedy(model, p, TOKENS) for p in PROMPTS]
    for name in adapters:  # the adapters move the model: a test that passes could not by chance
        assert refs[name] != refs[None], name
    return refs


def lora_llm(model: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 16 << 20)
    return LLM(str(model), enable_lora=True, verbose=False, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_matches_peft_merged(tiny_llama_hf, adapters, references):
    llm = lora_llm(tiny_llama_hf.path, max_loras=1, max_lora_rank=8)
    for i, (name, path) in enumerate(adapters.items()):
        got = tokens(
            llm.generate(
                PROMPTS, GREEDY, lora_request=LoRARequest(name, i + 1, str(path)), use_tqdm=False
            )
        )
        assert got == references[name], name
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == references[None]
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("max_loras", [4, 2, 1])
def test_mixed_batch_matches_alone(tiny_llama_hf, adapters, references, max_loras):
    """Every (prompt, adapter or base) pair in one call: one step mixes them while slots allow;
    with fewer slots than adapters, requests wait for a slot and all finish, each exact."""
    names = [None, "all8", "some4", "rs"]
    llm = lora_llm(tiny_llama_hf.path, max_loras=max_loras, max_lora_rank=8)
    prompts, loras, want = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for name in names:
            prompts.append(prompt)
            loras.append(None if name is None else LoRARequest(name, 1, str(adapters[name])))
            want.append(references[name][p])
    assert tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)) == want
    assert llm.engine.lora.slots.masks is None  # no delta outside a step
    llm.engine.check_no_leaks()


def test_prefix_cache_is_keyed_by_adapter_and_load(tiny_llama_hf, adapters, references, tmp_path):
    llm = lora_llm(tiny_llama_hf.path, max_loras=2, max_lora_rank=8, enable_prefix_caching=True)
    prompt = [PROMPTS[1]]
    a = LoRARequest("a", 1, str(adapters["all8"]))
    assert tokens(llm.generate(prompt, GREEDY, lora_request=a, use_tqdm=False)) == [
        references["all8"][1]
    ]
    # The same prompt under another adapter and the base model: their own outputs, not the
    # first's cached KV.
    b = LoRARequest("b", 2, str(adapters["some4"]))
    assert tokens(llm.generate(prompt, GREEDY, lora_request=b, use_tqdm=False)) == [
        references["some4"][1]
    ]
    assert tokens(llm.generate(prompt, GREEDY, use_tqdm=False)) == [references[None][1]]
    # The same adapter again: its blocks are reused.
    hits = llm.engine.scheduler.prefix_hits_tokens
    assert tokens(llm.generate(prompt, GREEDY, lora_request=a, use_tqdm=False)) == [
        references["all8"][1]
    ]
    assert llm.engine.scheduler.prefix_hits_tokens > hits
    # Reloading name "a" with other weights (another path): new output, no stale KV.
    a2 = LoRARequest("a", 1, str(adapters["other8"]))
    assert tokens(llm.generate(prompt, GREEDY, lora_request=a2, use_tqdm=False)) == [
        references["other8"][1]
    ]
    # ... and with new files at the same path, through the manager's load (the endpoint's).
    moved = tmp_path / "a"
    moved.mkdir()
    for f in adapters["all8"].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    llm.engine.lora.load("c", str(moved))
    c = LoRARequest("c", 3)
    assert tokens(llm.generate(prompt, GREEDY, lora_request=c, use_tqdm=False)) == [
        references["all8"][1]
    ]
    for f in adapters["other8"].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    llm.engine.lora.load("c", str(moved))
    assert tokens(llm.generate(prompt, GREEDY, lora_request=c, use_tqdm=False)) == [
        references["other8"][1]
    ]
    llm.engine.check_no_leaks()


def test_host_cache_drops_and_reads_again(tiny_llama_hf, adapters, references):
    """--max-cpu-loras 1 with --lora-modules of two: the one dropped from host memory is read
    again when asked for, with the same output."""
    mods = (f"x={adapters['all8']}", f"y={adapters['some4']}")
    llm = lora_llm(
        tiny_llama_hf.path, max_loras=1, max_cpu_loras=1, max_lora_rank=8, lora_modules=mods
    )
    for _ in range(2):
        for name, ref in (("x", "all8"), ("y", "some4")):
            out = llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest(name), use_tqdm=False)
            assert tokens(out) == [references[ref][0]]
            assert len(llm.engine.lora._cpu) == 1


def test_speculation_skips_adapted_rows(tiny_llama_hf, adapters, references):
    llm = lora_llm(tiny_llama_hf.path, max_loras=2, max_lora_rank=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    loras = [
        None,
        LoRARequest("a", 1, str(adapters["all8"])),
        LoRARequest("b", 2, str(adapters["rs"])),
    ]
    got = tokens(llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras, use_tqdm=False))
    assert got == [references[None][0], references["all8"][0], references["rs"][0]]


def test_bad_adapters_are_named(tiny_llama_hf, hf_base, hf_transformers, adapters, tmp_path):
    llm = lora_llm(tiny_llama_hf.path, max_loras=1, max_lora_rank=4)

    def refused(path, match: str, name: str = "bad") -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(
                PROMPTS[:1], GREEDY, lora_request=LoRARequest(name, 1, str(path)), use_tqdm=False
            )

    refused(adapters["all8"], r"rank 8 .* exceeds --max-lora-rank 4")
    small = hf_transformers.LlamaForCausalLM(hf_transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))  # fmt: skip
    refused(write_adapter(small, tmp_path / "small", seed=5, rank=4), r"base model mismatch")
    refused(
        write_adapter(hf_base, tmp_path / "head", seed=6, rank=4, targets=["lm_head"]),
        r"unknown target module",
    )
    refused(tmp_path, r"not a LoRA adapter")
    refused(tmp_path / "missing", r"not a LoRA adapter")
    with pytest.raises(ValueError, match=r"'nobody' is not loaded"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("nobody"), use_tqdm=False)
    base_only = LLM(str(tiny_llama_hf.path), kv_cache_memory=16 << 20, verbose=False)
    with pytest.raises(ValueError, match=r"LoRA is not enabled"):
        base_only.generate(
            PROMPTS[:1],
            GREEDY,
            lora_request=LoRARequest("x", 1, str(adapters["all8"])),
            use_tqdm=False,
        )
    # Nothing was left behind by the refusals, and the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_no_leaks()


def test_flags_are_checked():
    from inferd.engine_args import build_engine_config

    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_engine_config(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        build_engine_config(enable_lora=True, lora_modules=["a"])
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        build_engine_config(enable_lora=True, max_loras=4, max_cpu_loras=2)
    cfg = build_engine_config(enable_lora=True, lora_modules=["a=/x", "b=/y=z"], max_loras=2)
    assert cfg.lora.modules == {"a": "/x", "b": "/y=z"} and cfg.lora.cpu_capacity == 2
    cfg = build_engine_config(enable_lora=True, lora_modules=['{"name": "c", "path": "/p", "base_model_name": "m"}'])
    assert cfg.lora.modules == {"c": "/p"}


# ---- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_server(tiny_llama_hf, adapters):
    from tests.test_server_utils import RemoteServer

    srv = RemoteServer(str(tiny_llama_hf.path), "--enable-lora", "--lora-modules", f"all8={adapters['all8']}",
                       "--max-loras", "2", "--max-lora-rank", "8", "--api-key", "sk-test",
                       "--kv-cache-memory", "64MiB", "--log-stats-interval", "0")  # fmt: skip
    yield srv
    srv.close()


def test_server_serves_adapters_by_model_name(lora_server, tiny_llama_hf, adapters, references):
    import httpx

    from tests.test_server_utils import assert_error

    auth = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=lora_server.url, timeout=300, headers=auth) as http:
        base = str(tiny_llama_hf.path)

        def complete(model: str, prompt: list[int]) -> httpx.Response:
            return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": TOKENS,
                                                      "temperature": 0, "ignore_eos": True})  # fmt: skip

        def completion_text(model: str, p: int) -> str:
            r = complete(model, PROMPTS[p])
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"].rstrip("\ufffd")

        def text(name: str | None, p: int) -> str:
            """The reference's text (the stream holds back a last partial UTF-8 character)."""
            return tiny_llama_hf.tokenizer.decode(
                references[name][p], skip_special_tokens=True
            ).rstrip("\ufffd")

        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert cards["all8"]["parent"] == base and cards["all8"]["root"] == str(adapters["all8"])
        assert cards[base]["parent"] is None
        # Base and adapter requests at once (one batch), each its own reference.
        import concurrent.futures as cf

        jobs = [(m, p) for p in range(len(PROMPTS)) for m in (base, "all8")]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(lambda j: completion_text(*j), jobs))
        for (m, p), got in zip(jobs, texts):
            assert got == text(None if m == base else "all8", p), (m, p)

        assert_error(complete("nobody", PROMPTS[0]), 404)
        assert complete("nobody", PROMPTS[0]).json()["error"]["code"] == "model_not_found"
        # Loading at run time: bad adapters are 400s naming the problem.
        for path, words in ((adapters["all8"].parent, "not a LoRA adapter"),):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
            assert_error(r, 400)
            assert words in r.json()["error"]["message"]
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "all8", "lora_path": str(adapters["rs"])}
        )
        assert_error(r, 400)  # the name is taken
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "rs", "lora_path": str(adapters["rs"])}
        )
        assert r.status_code == 200, r.text
        assert "rs" in {c["id"] for c in http.get("/v1/models").json()["data"]}
        assert completion_text("rs", 0) == text("rs", 0)
        # Reloaded in place with other weights: the new output.
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "rs", "lora_path": str(adapters["other8"]),
                                                     "load_inplace": True})  # fmt: skip
        assert r.status_code == 200, r.text
        assert completion_text("rs", 0) == text("other8", 0)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rs"}).status_code == 200
        assert_error(complete("rs", PROMPTS[0]), 404)
        assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "rs"}), 404)
        # Behind the API key.
        r = httpx.post(
            f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "/x"}
        )
        assert r.status_code == 401


# ---- the default model (SmolLM2-135M, Q4_1 weights) --------------------------------------------
def test_default_model_adapters_match_peft_merged(tmp_path):
    """Adapters of the real default model: its HF copy from the GGUF, PEFT-merged, is the
    reference for each alone and for all mixed with the base model in one batch (the base
    linears stay Q4_1: the delta is added on the side)."""
    from tests.real_model import hf_reference, loaded_default, make_llm

    base = hf_reference()
    a = write_adapter(base, tmp_path / "a", seed=11, rank=8, scale=0.5)
    b = write_adapter(base, tmp_path / "b", seed=12, rank=16, targets=["q_proj", "v_proj", "o_proj", "down_proj"],
                      use_rslora=True, scale=0.5)  # fmt: skip
    tok = loaded_default().tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    ")]
    n = 12
    refs = {None: [greedy(base, p, n) for p in prompts]}
    for name, path in (("a", a), ("b", b)):
        m = merged(base, path)
        refs[name] = [greedy(m, p, n) for p in prompts]
        del m
        assert refs[name] != refs[None]
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=16)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    reqs = {None: None, "a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}
    for name in ("a", "b"):
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, lora_request=reqs[name], use_tqdm=False
        )
        assert tokens(outs) == refs[name], name
    jobs = [(name, i) for i in range(len(prompts)) for name in (None, "a", "b")]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in jobs], sp,
                        lora_request=[reqs[name] for name, _ in jobs], use_tqdm=False)  # fmt: skip
    assert tokens(outs) == [refs[name][i] for name, i in jobs]
    llm.engine.check_no_leaks()


# ---- the scheduler's slots ---------------------------------------------------------------------
def test_scheduler_admits_adapters_within_slots_in_order():
    """--max-loras 1: one adapter runs at a time; a request whose adapter waits for the slot
    holds back the adapted requests behind it (no starvation) but not base-model ones; once the
    running adapter's requests end, it goes first."""
    from inferd.config import SchedulerConfig
    from inferd.kv.kv_cache_manager import KVCacheManager
    from inferd.scheduler.scheduler import SampledTokens, Scheduler
    from inferd.scheduler.sequence import Sequence
    from inferd.scheduler.stop import StopCriteria

    a, b = object(), object()  # two adapters' loads
    sched = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=64, block_size=4), StopCriteria((), 1000),
                      max_loras=1)  # fmt: skip
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3], 3, params, 0, float(i), lora=lora) for i, lora in enumerate([a, b, a, None])]
    for s in seqs:
        sched.add(s)
    ran = []
    while sched.num_unfinished:
        out = sched.schedule()
        running = {id(s.lora) for s in sched.running if s.lora is not None}
        assert len(running) <= 1
        ran.append(sorted(s.request_id for s, _ in out.scheduled))
        sched.update_from_output(out, [SampledTokens(s, [7], [None]) for s, _ in out.scheduled])
    # r2 (adapter a, which runs) waits behind r1 (adapter b, waiting for the slot); r3 (base)
    # joins at once; each runs a prefill step and a decode step.
    assert ran == [["r0", "r3"], ["r0", "r3"], ["r1"], ["r1"], ["r2"], ["r2"]]
    sched.kv.check_integrity()


def test_bench_lora_scenario(tiny_llama_hf, capsys):
    import json

    from inferd.cli import main

    assert main(["bench", "offline", "--scenario", "lora", "--model", str(tiny_llama_hf.path), "--runs", "1",
                 "--num-prompts", "4", "--input-len", "10", "--output-len", "5", "--lora-adapters", "2",
                 "--lora-rank", "4", "--peers", "none"]) == 0  # fmt: skip
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scenario"] == "lora" and (r["lora_adapters"], r["lora_rank"], r["num_prompts"]) == (2, 4, 4)
    assert r["base_tps"] > 0 and r["lora_tps"] > 0 and r["ratio_lora"] > 0 and r["ratio_lora_cpu_time"] > 0
