"""Every family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3) from an HF directory
written by transformers' own model class and from the same weights as a GGUF: inferd's greedy
tokens equal transformers' for prompts several times longer than the sliding window, batched,
chunked (16-token steps), with prefix-cache hits and with speculative verification; the fused
decode step gives the Python layers' bits; bad checkpoints fail naming what is wrong."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fused_steps import count_fused_rows
from tiny_families import FAMILIES, TinyFamilyModel, hf_greedy, write_family

from inferd import LLM, SamplingParams
from inferd.kernels.quant_gemm import extension as cpu_kernels
from inferd.layers.rotary import rope_parameters
from inferd.loader import ModelLoadError, load_model
from inferd.models import decoder, model_spec
from inferd.models.interface import CausalLM
from inferd.spec import decoder as spec_decoder
from inferd.spec.policy import SpecPolicy

pytest.importorskip("transformers")

NEW_TOKENS = 16
# Positions where transformers' top two logits are closer than this are near-ties that fp32
# rounding order may flip: tokens are compared up to the first one.
CLEAR_MARGIN = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, TinyFamilyModel]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_family(name, root) for name in FAMILIES}


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts of 21-40 tokens (the window is 8-12), two sharing their first 24 tokens, and one
    repeating itself (speculation finds drafts in it)."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 21, 40))
    loop = torch.randint(3, vocab, (6,), generator=g).tolist() * 5
    return [a, b, c, a[:24] + b[:10], loop]


@pytest.fixture(scope="module")
def references(families) -> dict[str, list[tuple[list[int], list[float]]]]:
    return {name: [hf_greedy(m.model, p, NEW_TOKENS) for p in _prompts(m.vocab_size)]
            for name, m in families.items()}  # fmt: skip


def _assert_matches(outs, refs, where: str) -> None:
    for i, (o, (want, margins)) in enumerate(zip(outs, refs)):
        got = o.outputs[0].token_ids
        n = next((k for k, m in enumerate(margins) if m < CLEAR_MARGIN), len(want))
        assert n >= NEW_TOKENS // 2, f"{where}: prompt {i}: the reference's logits tie at {n}"
        assert got[:n] == want[:n], f"{where}: prompt {i}: {got} != transformers' {want}"


def _llm(path: Path, family: str, **kw) -> LLM:
    # Phi-3's LongRoPE takes its short factors up to the original context (as transformers does
    # for these lengths): an engine context no longer than it.
    if family == "phi3":
        kw.setdefault("max_model_len", 128)
    return LLM(str(path), quantization="none", verbose=False, kv_cache_memory=8 << 20, **kw)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(families, references, family, fmt):
    """All prompts together in 16-token steps (prefill chunks beside decodes), then again: every
    prompt now a prefix-cache hit."""
    m = families[family]
    llm = _llm(m.hf_dir if fmt == "hf" else m.gguf_path, family, max_num_batched_tokens=16,
               enable_prefix_caching=True)  # fmt: skip
    assert isinstance(llm.engine.runner.model, CausalLM)  # the interface the engine relies on
    prompts = [{"prompt_token_ids": p} for p in _prompts(m.vocab_size)]
    _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), references[family], "cold")
    hits = llm.engine.stats.prefix_cache_hits_total
    _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), references[family], "cached")
    assert llm.engine.stats.prefix_cache_hits_total > hits
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "phi3"])
def test_torch_attention_backend_matches_transformers(families, references, family):
    """The torch backend (CUDA's, and bf16's on the CPU): short queries in one padded call under
    per-window masks, long chunks one at a time, soft-capping computed eagerly."""
    m = families[family]
    llm = _llm(m.gguf_path, family, max_num_batched_tokens=64, enable_prefix_caching=True)
    runner = llm.engine.runner
    runner.model.select_kernels(runner.device, runner.dtype, attention="torch")
    runner.attention_kernel = None
    prompts = [{"prompt_token_ids": p} for p in _prompts(m.vocab_size)]
    for where in ("cold", "cached"):
        _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), references[family], where)
    llm.engine.check_no_leaks()


def _quiet_spec_policy(monkeypatch) -> None:
    """Fixed speculation costs: the policy reads the clock otherwise, and two runs would batch
    rows differently (see test_decoder_layers.py)."""
    monkeypatch.setattr(
        spec_decoder, "measure_verify_cost", lambda *a, **k: ({1: 0.1, 64: 0.5}, {})
    )
    monkeypatch.setattr(SpecPolicy, "record_speculation_time", lambda self, *args: None)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_speculative_verification_keeps_transformers_tokens(families, references, family,
                                                             monkeypatch):  # fmt: skip
    """Prompt-lookup drafts verified through the windowed layers: the tokens stay transformers'."""
    _quiet_spec_policy(monkeypatch)
    m = families[family]
    llm = _llm(
        m.gguf_path, family, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    )
    prompts = [{"prompt_token_ids": p} for p in _prompts(m.vocab_size)]
    _assert_matches(llm.generate(prompts, GREEDY, use_tqdm=False), references[family], "spec")
    assert llm.engine.stats.spec_draft_tokens > 0
    llm.engine.check_no_leaks()


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_fused_decode_gives_the_python_layers_bits(families, family, monkeypatch):
    """csrc/decoder_layers.h run by the spec (qk-norm, sandwich norms, GELU-tanh, two RoPE
    tables, windows, soft-capping; head sizes 128 and 256): the same tokens and logprobs as the
    Python layer loop."""
    _quiet_spec_policy(monkeypatch)
    fused_rows = count_fused_rows(monkeypatch)
    m = families[family]
    prompts = [{"prompt_token_ids": p} for p in _prompts(m.vocab_size)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(decoder, "FUSED_DECODE", fused)
        fused_rows.clear()
        llm = _llm(
            m.gguf_path, family, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(
            ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], list(fused_rows))
        )
    (want, python_rows), (got, rows) = runs
    assert not python_rows and rows
    assert got == want


def test_gguf_and_hf_load_the_same_weights_and_spec(families):
    """Gemma's GGUF norms (w + 1 on disk) come back as the checkpoint's w; Phi-3's fused tensors
    and LongRoPE factors, Qwen3's qk-norm and every window arrive as the HF directory states them."""
    for name, m in families.items():
        hf, gg = load_model(m.hf_dir, verbose=False), load_model(m.gguf_path, verbose=False)
        spec_hf, spec_gg = model_spec(hf.config), model_spec(gg.config)
        assert [replace(a, rope=None) for a in spec_hf.layers] == [
            replace(b, rope=None) for b in spec_gg.layers], name  # fmt: skip
        assert len(spec_hf.ropes()) == len(spec_gg.ropes())
        for a, b in zip(spec_hf.ropes(), spec_gg.ropes()):  # the same tables (fp32 factors)
            args = (hf.config.head_dim, a.theta, a.scaling_dict(), None, 128)
            want = rope_parameters(*args)
            got = rope_parameters(hf.config.head_dim, b.theta, b.scaling_dict(), None, 128)
            torch.testing.assert_close(got[0], want[0], rtol=1e-7, atol=0, msg=name)
            assert got[1] == pytest.approx(want[1], rel=1e-7), name
        assert set(hf.weights) - {"lm_head.weight"} == set(gg.weights) - {"lm_head.weight"}, name
        for key, w in gg.weights.items():
            torch.testing.assert_close(w, hf.weights[key], rtol=0, atol=1e-6, msg=f"{name} {key}")


def test_spec_summaries(families):
    summary = {name: model_spec(load_model(m.gguf_path, verbose=False).config).summary()
               for name, m in families.items()}  # fmt: skip
    assert summary["llama"] == "2 layers: all global"
    assert summary["mistral"] == "2 layers: 2 local window 8"
    assert summary["gemma2"] == "2 layers: 1 local window 8, 1 global"
    assert summary["gemma3"] == "6 layers: 5 local window 8, 1 global"
    assert summary["phi3"] == "2 layers: 2 local window 12"
    spec = model_spec(load_model(families["gemma3"].gguf_path, verbose=False).config)
    assert [r.theta for r in spec.ropes()] == [10000.0, 1_000_000.0]
    assert spec.layers[0].qk_norm and spec.layers[0].norm == "sandwich"
    assert spec.layers[0].activation == "gelu_tanh" and spec.norm_offset == 1.0
    assert spec.embed_scale == pytest.approx(64**0.5)


# ---- bad input ---------------------------------------------------------------------------------
def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_config_fields_inferd_does_not_implement_are_errors(families, tmp_path):
    src = families["llama"].hf_dir
    cases = {
        "unsupported rope scaling type 'dynamic'": {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        "unsupported activation 'relu'": {"hidden_act": "relu"},
        "partial_rotary_factor": {"partial_rotary_factor": 0.5},
        "mlp_bias": {"mlp_bias": True},
        "unsupported architecture": {"architectures": ["FalconForCausalLM"]},
    }  # fmt: skip
    for i, (message, changes) in enumerate(cases.items()):
        bad = _edit_config(src, tmp_path / f"bad{i}", **changes)
        with pytest.raises(ModelLoadError, match=message) as err:
            load_model(bad, verbose=False)
        assert str(bad) in str(err.value)
    with pytest.raises(ModelLoadError, match="Gemma3ForCausalLM"):  # names the supported list
        load_model(_edit_config(src, tmp_path / "arch", architectures=["Foo"]), verbose=False)


def _rewrite_gguf(src: Path, dst: Path, drop: str | None = None, add: str | None = None,
                  arch: str | None = None) -> Path:  # fmt: skip
    """`src` with tensor `drop` left out, a tensor `add` added, or another architecture."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), new_arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key.replace(old_arch, new_arch, 1), value)
        else:
            w.add_key_value(key.replace(old_arch, new_arch, 1), value, vtype)
    for t in reader.tensors:
        if t.name != drop:
            shape = tuple(int(d) for d in reversed(t.shape))
            w.add_tensor(t.name, np.array(t.data, dtype=np.float32).reshape(shape))
    if add is not None:
        w.add_tensor(add, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_gguf_whose_tensors_do_not_match_its_architecture(families, tmp_path):
    gemma3 = families["gemma3"].gguf_path
    missing = _rewrite_gguf(gemma3, tmp_path / "missing.gguf", drop="blk.2.attn_q_norm.weight")
    with pytest.raises(ModelLoadError, match=r"'blk\.2\.attn_q_norm\.weight'.*missing"):
        load_model(missing, verbose=False)
    odd = _rewrite_gguf(gemma3, tmp_path / "odd.gguf", add="blk.0.ffn_gate_exps.weight")
    with pytest.raises(
        ModelLoadError, match=r"'blk\.0\.ffn_gate_exps\.weight' is not one a gemma3"
    ):
        load_model(odd, verbose=False)
    # Gemma 3's tensors under a Llama header: its sandwich and qk norms are not a Llama's.
    relabelled = _rewrite_gguf(gemma3, tmp_path / "relabelled.gguf", arch="llama")
    with pytest.raises(ModelLoadError, match="is not one a llama model has"):
        load_model(relabelled, verbose=False)
    unknown = _rewrite_gguf(families["llama"].gguf_path, tmp_path / "unknown.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'.*gemma3"):
        load_model(unknown, verbose=False)


def test_info_prints_the_per_layer_spec(families):
    import re
    import subprocess
    import sys

    for path, attention, layer in [
        (families["gemma3"].gguf_path, "6 layers: 5 local window 8, 1 global",
         "sandwich norms, qk-norm, gelu_tanh, embedding x 8, rope 10000 / 1e+06"),
        (families["gemma2"].hf_dir, "2 layers: 1 local window 8, 1 global",
         "sandwich norms, gelu_tanh, attention softcap 4, final softcap 8, embedding x 8"),
    ]:  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "inferd.cli", "info", str(path)],
                           capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert re.search(rf"^attention\s+{attention}$", r.stdout, re.MULTILINE), r.stdout
        assert re.search(rf"^layer\s+{re.escape(layer)}", r.stdout, re.MULTILINE), r.stdout
