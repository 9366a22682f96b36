"""Mixtures of experts (Mixtral, Qwen2-MoE with a shared expert and a dense layer, Qwen3-MoE,
OLMoE) from HF directories written by transformers' own classes and, where llama.cpp has the
architecture, the same weights as GGUF with stacked expert tensors: greedy tokens equal
transformers' batched, in 16-token chunks and on prefix-cache hits; the router picks
transformers' experts; a token's output does not depend on what shares its batch; quantized
experts stay packed; routing variants inferd does not compute are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from fused_steps import count_fused_rows
from tiny_families import MOE_FAMILIES, build_hf, hf_greedy, write_family_gguf

from inferd import LLM, SamplingParams
from inferd.layers.moe import SparseMoE
from inferd.layers.quantized_linear import QuantizedLinear
from inferd.loader import ModelLoadError, load_model
from inferd.models import decoder
from inferd.quantization.formats import dequantize

NEW_TOKENS = 16
CLEAR_MARGIN = 1e-3  # closer top-2 logits are near-ties rounding order may flip
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# (llama.cpp's Qwen2-MoE has no dense layers among its mixtures)
GGUF_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v2")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, family in MOE_FAMILIES.items():
        model, vocab = build_hf(family, root / name)
        gguf_path = None
        if name in GGUF_FAMILIES:
            gguf_path = root / f"{name}.gguf"
            write_family_gguf(family, model, gguf_path)
        if name == "deepseek_v2":  # (and kv_b whole, as llama.cpp's converter wrote it before)
            write_family_gguf(family, model, root / "deepseek_v2-kv_b.gguf", split_kv_b=False)
        g = torch.Generator().manual_seed(1)
        a, b, c = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (30, 21, 40))
        prompts = [a, b, c, a[:24] + b[:10]]
        refs = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
        out[name] = (model, root / name, gguf_path, prompts, refs)
    return out


def _assert_matches(outs, refs, where: str) -> None:
    for i, (o, (want, margins)) in enumerate(zip(outs, refs)):
        got = o.outputs[0].token_ids
        n = next((k for k, m in enumerate(margins) if m < CLEAR_MARGIN), len(want))
        assert n >= NEW_TOKENS // 2, f"{where}: prompt {i}: the reference's logits tie at {n}"
        assert got[:n] == want[:n], f"{where}: prompt {i}: {got} != transformers' {want}"


def _llm(path, **kw) -> LLM:
    return LLM(str(path), quantization="none", verbose=False, kv_cache_memory=8 << 20, **kw)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_greedy_matches_transformers(moe_models, family, fmt):
    _, hf_dir, gguf_path, prompts, refs = moe_models[family]
    if fmt == "gguf" and gguf_path is None:
        pytest.skip(f"no GGUF of this tiny {family}")
    llm = _llm(hf_dir if fmt == "hf" else gguf_path, max_num_batched_tokens=16, enable_prefix_caching=True)
    model = llm.engine.runner.model
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    requests = [{"prompt_token_ids": p} for p in prompts]
    _assert_matches(llm.generate(requests, GREEDY, use_tqdm=False), refs, "cold")
    hits = llm.engine.stats.prefix_cache_hits_total
    _assert_matches(llm.generate(requests, GREEDY, use_tqdm=False), refs, "cached")
    assert llm.engine.stats.prefix_cache_hits_total > hits
    llm.engine.check_no_leaks()


def test_deepseek_v2_gguf_with_kv_b_whole_matches_transformers(moe_models):
    """The older DeepSeek-V2 GGUF layout (kv_b_proj as one attn_kv_b, per-head sizes in
    key_length / value_length) loads the same attention as the split one."""
    _, _, gguf_path, prompts, refs = moe_models["deepseek_v2"]
    llm = _llm(gguf_path.with_name("deepseek_v2-kv_b.gguf"), enable_prefix_caching=False)
    split = llm.engine.runner.model.layers[1].self_attn
    assert split.w_uk.shape == (4, 16, 32) and split.w_uv.shape == (4, 16, 32)  # [H, nope | v, rank]
    requests = [{"prompt_token_ids": p} for p in prompts]
    _assert_matches(llm.generate(requests, GREEDY, use_tqdm=False), refs, "kv_b whole")


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_router_picks_transformers_experts(moe_models, family):
    hf, hf_dir, *_ = moe_models[family]
    ours = _llm(hf_dir).engine.runner.model
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    layer = next(i for i, l in enumerate(ours.layers) if isinstance(l.mlp, SparseMoE))
    _, want_w, want_ids = hf.model.layers[layer].mlp.gate(x)
    ids, w = ours.layers[layer].mlp.route(x)
    # (DeepSeek's router leaves its k choices unsorted: compare each row's choices as a set)
    want_ids, order = want_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w.gather(1, mine), want_w.gather(1, order), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_a_tokens_output_does_not_depend_on_its_batch(moe_models, family):
    """Alone or among others (other tokens routed to its experts), a prompt's greedy tokens and
    logprobs are the same bits (Qwen2-MoE: through its shared expert's sigmoid gate too)."""
    _, hf_dir, _, prompts, _ = moe_models[family]
    llm = _llm(hf_dir, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        o = outs[batch.index(prompts[0])].outputs[0]
        return [(t, lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs)]

    assert run([prompts[0]]) == run([prompts[1], prompts[0], prompts[2], prompts[3]])


def _rewrite_gguf(src, dst, fields=None, add=None) -> None:
    """`src` copied to `dst` with the metadata in `fields` replaced (a None value: dropped) and
    each tensor written by add(writer, name, array) where given."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    fields = fields or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in fields:
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)  # fmt: skip
    for name, value in fields.items():
        if value is not None:
            {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)](name, value)
    for t in reader.tensors:
        arr = np.array(t.data).reshape([int(d) for d in reversed(t.shape)])
        (add or (lambda w, name, arr: w.add_tensor(name, arr)))(w, t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_quantized_experts_stay_packed(moe_models, tmp_path):
    """A GGUF whose expert stacks are Q8_0 loads them packed, each expert its own rows of the
    stack (bit for bit what dequantizing the stack gives), and serves."""
    _, _, gguf_path, prompts, _ = moe_models["qwen3_moe"]
    q8 = tmp_path / "q8.gguf"
    stacks = {}

    def add(w, name, arr):
        if "_exps" not in name:
            return w.add_tensor(name, arr)
        packed = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
        stacks[name] = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    _rewrite_gguf(gguf_path, q8, add=add)
    llm = LLM(str(q8), quantization="auto", verbose=False, kv_cache_memory=8 << 20)
    moe = llm.engine.runner.model.layers[1].mlp
    for e in (0, 5):
        down = moe.experts[e].down_proj
        assert isinstance(down, QuantizedLinear) and down.qweight.source == "GGUF Q8_0"
        want = torch.from_numpy(stacks["blk.1.ffn_down_exps.weight"][e])
        assert torch.equal(dequantize(down.qweight), want)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NEW_TOKENS


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("scoring_func", "sigmoid", "scoring_func='sigmoid'"),
     ("topk_method", "group_limited_greedy", "topk_method='group_limited_greedy'"),
     ("num_experts_per_tok", 9, "num_experts_per_tok must be in [1, num_experts=8]")],
)  # fmt: skip
def test_routing_inferd_does_not_compute_is_refused(moe_models, tmp_path, field, value, message):
    _, hf_dir, *_ = moe_models["qwen3_moe"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(str(bad))


@pytest.mark.parametrize(
    ("fields", "dropped", "message"),
    [({"deepseek2.expert_gating_func": 2}, None, "expert_gating_func 2 (sigmoid routing, DeepSeek-V3's)"),
     ({}, "blk.1.attn_v_b.weight", "'blk.1.attn_v_b.weight' .* missing: a deepseek_v2 model has it")],
)  # fmt: skip
def test_deepseek_v2_gguf_inferd_cannot_load_is_refused(moe_models, tmp_path, fields, dropped, message):
    """A DeepSeek-V3-style sigmoid router, a split kv_b with a half missing: errors naming them."""
    _, _, gguf_path, *_ = moe_models["deepseek_v2"]
    bad = tmp_path / "bad.gguf"
    _rewrite_gguf(gguf_path, bad, fields, add=lambda w, name, arr: name == dropped or w.add_tensor(name, arr))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(str(bad))


def test_deepseek_v2_gguf_yarn_scales_attention_as_transformers(moe_models, tmp_path):
    """YaRN in a deepseek2 GGUF (yarn_log_multiplier = 0.1 x mscale_all_dim) is the rope and
    attention scale of the HF config it was converted from."""
    from inferd.models.deepseek_v2 import DeepseekV2ForCausalLM

    _, hf_dir, gguf_path, *_ = moe_models["deepseek_v2"]
    yarn = tmp_path / "yarn.gguf"
    _rewrite_gguf(gguf_path, yarn, {"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 4.0,
                                    "deepseek2.rope.scaling.original_context_length": 64,
                                    "deepseek2.rope.scaling.yarn_log_multiplier": 0.0707})  # fmt: skip
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in hf_dir.iterdir():
        (hf / f.name).symlink_to(f)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf / "config.json").unlink()
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
    (hf / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {**cfg["rope_parameters"], **scaling}}))
    ours, theirs = load_model(str(yarn)).config, load_model(str(hf)).config
    assert ours.rope_scaling["mscale"] == pytest.approx(0.707) == ours.rope_scaling["mscale_all_dim"]
    for key in ("rope_type", "factor", "original_max_position_embeddings"):
        assert ours.rope_scaling[key] == theirs.rope_scaling[key]
    scale = DeepseekV2ForCausalLM.spec_for(ours).layers[0].attn_scale
    assert scale == pytest.approx(DeepseekV2ForCausalLM.spec_for(theirs).layers[0].attn_scale, rel=1e-6)
    assert scale > (16 + 16) ** -0.5  # (mscale² > 1 at factor 4)


def test_info_names_the_mixture_and_its_active_parameters(moe_models):
    _, hf_dir, *_ = moe_models["qwen2_moe"]
    r = subprocess.run([sys.executable, "-m", "inferd.cli", "info", str(hf_dir)],
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "MoE top-2 of 8 experts of 64 + a shared expert of 96 in 1 of 2 layers" in r.stdout
    assert "M active per token" in r.stdout


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_fused_decode_and_torch_ops_give_the_kernel_layers_bits(moe_models, family, quantization, monkeypatch):
    """Three ways to run a mixture: decode steps in the fused C++ step (decoder_layers.h calling
    moe_layer.h), the Python layer loop calling moe_layer.h, and SparseMoE's PyTorch ops: the same
    tokens and logprobs (OLMoE: qk-norm over all heads in the fused step too)."""
    _, hf_dir, _, prompts, _ = moe_models[family]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    fused_rows = count_fused_rows(monkeypatch)
    runs = []
    for way in ("fused", "python", "torch"):
        monkeypatch.setattr(decoder, "FUSED_DECODE", way == "fused")
        fused_rows.clear()
        llm = LLM(str(hf_dir), quantization=quantization, verbose=False, kv_cache_memory=8 << 20)
        if way == "torch":
            for layer in llm.engine.runner.model.layers:
                if isinstance(layer.mlp, SparseMoE):
                    assert layer.mlp.kernel is not None
                    layer.mlp.kernel = None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert bool(fused_rows) == (way == "fused")
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_bench_counts_the_experts_a_step_reads_and_their_load(moe_models):
    """`inferd bench latency`'s cost model: a step reads the dense weights and k / E of the
    experts at batch 1, more of them as the batch grows; the expert-load histogram counts k
    choices per token of each mixture layer."""
    from inferd.bench.latency import expert_load
    from inferd.bench.roofline import step_cost

    _, hf_dir, _, prompts, _ = moe_models["qwen2_moe"]
    llm = _llm(hf_dir, enable_prefix_caching=False)
    model = llm.engine.runner.model
    moe = model.layers[0].mlp
    one_expert = sum(p.numel() * 4 for p in moe.experts[0].parameters())
    cost = step_cost(model, kv_bytes_per_token=0)
    assert cost.expert_bytes == 8 * one_expert  # one mixture layer of 8 experts
    assert cost.weight_bytes_read(1) == cost.weight_bytes + 2 * one_expert  # top 2 of 8
    assert cost.weight_bytes_read(1) < cost.weight_bytes_read(4) < cost.weight_bytes + cost.expert_bytes
    expert_load(model)  # (zeroed)
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    load = expert_load(model)
    routed = len(prompts[0]) + NEW_TOKENS - 1  # every prompt token and every decode step's token
    assert list(load["per_layer"]) == ["0"] and sum(load["per_layer"]["0"]) == 2 * routed
    assert load["min_share"] <= load["uniform_share"] <= load["max_share"]


def test_mla_cache_holds_latents_and_absorbed_attention_is_the_expanded_one(moe_models, monkeypatch):
    """DeepSeek-V2's KV pool holds one latent + rotary key per token and layer, K and V alike
    ((kv_lora_rank + rope) x layers x 4 bytes, not 2 x heads x head size); the absorbed attention
    every path runs equals the textbook one with keys and values expanded per head."""
    from inferd.models.mla import MLAttention

    hf, hf_dir, _, prompts, _ = moe_models["deepseek_v2"]
    llm = _llm(hf_dir, enable_prefix_caching=False)
    cfg, c = llm.engine.model_config, hf.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    assert cfg.kv_bytes_per_token(torch.float32) == latent * c.num_hidden_layers * 4
    pool = llm.engine.runner.kv_cache.data
    assert pool.shape[1] == 1 and pool.shape[-2:] == (1, latent)
    seen = []
    real = MLAttention.forward

    def record(self, x, ropes, kv_cache, meta):
        out = real(self, x, ropes, kv_cache, meta)
        seen.append((self, x.clone(), [tuple(r.clone() for r in rope) for rope in ropes], out))
        return out

    monkeypatch.setattr(MLAttention, "forward", record)
    llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(seen) == c.num_hidden_layers  # one prefill: every row of the prompt, positions 0..T-1
    for attn, x, ropes, out in seen:
        assert x.shape[0] == len(prompts[2])
        torch.testing.assert_close(out, attn.expanded_reference(x, ropes), rtol=1e-4, atol=1e-5)
