"""Tensor parallelism (`tensor_parallel_size=2`: rank 0 in this process, rank 1 a spawned worker,
one thread each): greedy tokens equal one engine's and transformers' on tiny random checkpoints
whose heads split (4 query / 2 KV heads, 8 / 8, a mixture of experts), in fp32 and with packed
Q8_0 / Q4_0 blocks, in 16-token steps (prefill chunks beside decodes) and again on prefix-cache
hits; Gemma 3 270M (4 query / 1 KV head: the KV head replicated) where it is installed; the
shared-memory all-reduce gives gloo's bits; decode steps run the fused C++ step with the all-reduces
inside it, with the per-layer path's bits; what cannot split fails with a ValueError naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp
from real_model import gemma3_gguf
from tiny_families import hf_greedy, write_family
from tiny_models import KQUANT_SPEC, TinySpec, write_gguf, write_hf_dir

from inferd import LLM, SamplingParams
from inferd.distributed.executor import free_port, usable_cpus
from inferd.distributed.group import TPGroup
from inferd.distributed.shard import check_tensor_parallel
from inferd.distributed.shm_allreduce import ShmAllReduce
from inferd.loader import load_model

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
HEADS_8X8 = TinySpec(hidden=128, heads=8, kv_heads=8, head_dim=16, intermediate=256)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 21, 40)]


def _generate(model, tp: int, **kw) -> list[list[int]]:
    """Greedy tokens of every prompt, all together in 16-token steps; asserts that the same
    prompts again (prefix-cache hits) give the same tokens."""
    source = {"loaded": model} if not isinstance(model, (str, Path)) else {"model": str(model)}
    vocab = kw.pop("vocab", 400)
    with LLM(**source, verbose=False, kv_cache_memory=8 << 20, tensor_parallel_size=tp,
             max_num_batched_tokens=16, enable_prefix_caching=True, **kw) as llm:  # fmt: skip
        prompts = _prompts(vocab)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert again == first, f"tp={tp}: prefix-cache hits changed the tokens"
    return first


def _hf_tokens(hf_dir: Path, vocab: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32
    ).eval()
    return [hf_greedy(model, p, NEW_TOKENS)[0] for p in _prompts(vocab)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread, as each rank of two gets on two cores (restored after the module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp")


# (checkpoint, quantization, compare with transformers too)
CASES = {
    "4q2kv-fp32": ("hf", TinySpec(), "none", True),
    "8q8kv-q8_0": ("q8_0", HEADS_8X8, "auto", False),
    "4q2kv-q4_0": ("q4_0", TinySpec(), "auto", False),
    "4q2kv-int8": ("hf", TinySpec(), "int8", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_one_engine(root, case):
    fmt, spec, quantization, vs_hf = CASES[case]
    if fmt == "hf":
        path = write_hf_dir(root / case, spec).path
    else:
        path = write_gguf(root / f"{case}.gguf", spec, quant=fmt).path
    one = _generate(path, 1, quantization=quantization)
    assert _generate(path, 2, quantization=quantization) == one
    if vs_hf:
        assert one == _hf_tokens(path, 400)


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_tp2_decodes_on_the_fused_step_with_the_python_paths_bits(root, monkeypatch, quant):
    """A rank's decode steps run the fused C++ step, which calls the group's all-reduce after each
    layer's o and down projections: the same tokens as the per-layer Python path on every rank
    (INFERD_FUSED_DECODE=0, which the spawned rank inherits)."""
    from inferd.kernels.quant_gemm import extension
    from inferd.models import decoder

    if extension() is None:
        pytest.skip("the C++ kernels are not built here")
    path = write_gguf(root / f"fused-{quant}.gguf", HEADS_8X8, quant=quant).path
    calls = []
    real = decoder.DecoderForCausalLM._decode_layers

    def counted(self, *args, **kwargs):
        calls.append(args[1].shape[0])  # rows of the step
        return real(self, *args, **kwargs)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "_decode_layers", counted)
    fused = _generate(path, 2, quantization="auto")
    assert calls, "rank 0 never ran the fused step"
    calls.clear()
    monkeypatch.setattr(decoder, "FUSED_DECODE", False)
    monkeypatch.setenv("INFERD_FUSED_DECODE", "0")
    assert _generate(path, 2, quantization="auto") == fused
    assert not calls


def test_tp2_mixture_of_experts(root):
    """Each rank holds every expert's slice of the intermediate rows: the routed sum is a
    row-parallel all-reduce."""
    m = write_family("qwen3_moe", root)
    one = _generate(m.hf_dir, 1, quantization="none", vocab=m.vocab_size)
    assert _generate(m.hf_dir, 2, quantization="none", vocab=m.vocab_size) == one
    assert one == _hf_tokens(m.hf_dir, m.vocab_size)


def test_gemma3_kv_head_replicated():
    """Gemma 3 270M: 4 query heads, 1 KV head (each rank holds it), K-quant blocks split."""
    loaded = load_model(gemma3_gguf(), verbose=False)
    texts = [
        loaded.tokenizer.encode("The capital of France is"),
        loaded.tokenizer.encode("def f(n):"),
    ]
    outs = {}
    for tp in (1, 2):
        with LLM(
            loaded=loaded, verbose=False, kv_cache_memory=32 << 20, tensor_parallel_size=tp
        ) as llm:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    assert outs[2] == outs[1]


def _all_reduce_ranks(rank: int, port: int, name: str, out: str) -> None:
    torch.set_num_threads(1)
    group = TPGroup(rank, 2, "127.0.0.1", port, torch.device("cpu"), name, 1 << 16)
    g = torch.Generator().manual_seed(rank)
    results = []
    for shape in [(576,), (3, 64), (7, 100), (576,), (1,)]:  # the last: the slots alternate
        x = torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 4, shape, generator=g)
        results.append((group.all_reduce_gloo(x.clone()), group.all_reduce(x.clone())))
        results.append((group.all_gather_gloo(x, 0), group.all_gather(x, 0)))
    torch.save(results, f"{out}/{rank}.pt")
    group.close()


def test_shared_memory_collectives_equal_gloo(tmp_path):
    port = free_port()
    tmp.spawn(_all_reduce_ranks, args=(port, ShmAllReduce.create_name(), str(tmp_path)), nprocs=2)
    r0, r1 = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    for (gloo0, shm0), (gloo1, shm1) in zip(r0, r1):
        assert torch.equal(shm0, gloo0) and torch.equal(shm1, gloo1) and torch.equal(shm0, shm1)


def test_what_cannot_split_is_a_value_error(root):
    path = write_hf_dir(root / "split", TinySpec()).path
    with pytest.raises(ValueError, match="4 attention heads do not divide by 3"):
        LLM(str(path), verbose=False, tensor_parallel_size=3)
    cfg = load_model(path, verbose=False).config
    with pytest.raises(ValueError, match="vocabulary of 401 tokens does not divide by 2"):
        check_tensor_parallel(dataclasses.replace(cfg, vocab_size=401), 2)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel(dataclasses.replace(cfg, num_heads=6, num_kv_heads=3), 2)
    # Q4_K blocks of 256 weights: o_proj's 4 heads x 64 cannot split along K in two.
    kq = write_gguf(root / "kq.gguf", KQUANT_SPEC, quant="kquants").path
    with pytest.raises(ValueError, match="multiples of 256"):
        LLM(str(kq), verbose=False, tensor_parallel_size=2)
    if len(usable_cpus()) < 8:
        big = write_hf_dir(root / "split8", HEADS_8X8).path
        tp = 4 if len(usable_cpus()) < 4 else 8
        with pytest.raises(ValueError, match="needs a core per rank"):
            LLM(str(big), verbose=False, tensor_parallel_size=tp)
