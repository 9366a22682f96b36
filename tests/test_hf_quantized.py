"""AWQ and GPTQ 4-bit HF checkpoints load into inferd's int4 path. The tests write tiny such
checkpoints themselves, packing as AutoAWQ (`WQLinear_GEMM.from_linear`) and AutoGPTQ
(`QuantLinear.pack`) do, and check the loaded weights against (q - z) * s and generation against
the same dequantized weights stored in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TinySpec, build_tokenizer, make_state_dict, write_hf_dir

from inferd import LLM, SamplingParams
from inferd.loader import ModelLoadError, load_model
from inferd.quantization import formats
from inferd.quantization.formats import QuantizedWeight, dequantize

SPEC = TinySpec()
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group along K: (q [K, N], z [K/g, N], s fp16 [K/g, N])."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(2), g.amax(2)
    s = ((hi - lo) / 15).clamp_min(1e-6).half()
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = (torch.round(g / s.float().unsqueeze(2)) + z.unsqueeze(2)).clamp(0, 15)
    return q.reshape(n, k).t().to(torch.int64), z.t().to(torch.int64), s.t().contiguous()


def _words(acc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32))


def _pack_columns(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, N] → int32 [R, N/8]; nibble i of word c holds column 8c + order[i]."""
    xs = x.numpy().astype(np.uint64)
    acc = np.zeros((x.shape[0], x.shape[1] // 8), dtype=np.uint64)
    for c in range(acc.shape[1]):
        for i in range(8):
            acc[:, c] |= xs[:, 8 * c + order[i]] << np.uint64(4 * i)
    return _words(acc)


def _pack_rows(x: torch.Tensor) -> torch.Tensor:
    """[K, N] → int32 [K/8, N]; nibble i of word r holds row 8r + i."""
    xs = x.numpy().astype(np.uint64)
    acc = np.zeros((x.shape[0] // 8, x.shape[1]), dtype=np.uint64)
    for r in range(acc.shape[0]):
        for i in range(8):
            acc[r] |= xs[8 * r + i] << np.uint64(4 * i)
    return _words(acc)


def write_checkpoint(root: Path, method: str, group: int, act_order: bool = False):
    """A tiny AWQ/GPTQ directory, and the fp32 weights it stands for: {name: [N, K]}."""
    sd = make_state_dict(SPEC, build_tokenizer(SPEC.pre).get_vocab_size(with_added_tokens=True))
    out, ref = {}, {}
    for name, w in sd.items():
        layer = name.rsplit(".", 2)
        if not (len(layer) == 3 and layer[1] in LINEARS and layer[2] == "weight"):
            out[name] = w.half()  # what these checkpoints keep unquantized is fp16
            ref[name] = w.half().float()
            continue
        prefix = name.removesuffix(".weight")
        k = w.shape[1]
        grp = k if group == -1 else group
        perm = (
            torch.randperm(k, generator=torch.Generator().manual_seed(k))
            if act_order
            else torch.arange(k)
        )
        # act-order: groups are formed over the permuted input rows; g_idx names each row's group.
        q, z, s = _quantize(w[:, perm], grp)
        inv = torch.argsort(perm)
        q = q[inv]
        g_idx = (torch.arange(k) // grp)[inv].to(torch.int32)
        ref[name] = ((q - z[g_idx.long()]).float() * s[g_idx.long()].float()).t().contiguous()
        if method == "awq":
            out[prefix + ".qweight"] = _pack_columns(q, AWQ_ORDER)
            out[prefix + ".qzeros"] = _pack_columns(z, AWQ_ORDER)
        else:
            out[prefix + ".qweight"] = _pack_rows(q)
            out[prefix + ".qzeros"] = _pack_columns(z - 1, list(range(8)))  # v1 stores z - 1
            out[prefix + ".g_idx"] = g_idx
        out[prefix + ".scales"] = s
    write_hf_dir(root, SPEC, state_dict=out)
    cfg = json.loads((root / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update(
        {"version": "gemm", "zero_point": True}
        if method == "awq"
        else {"desc_act": act_order, "sym": False}
    )
    cfg["quantization_config"] = qc
    (root / "config.json").write_text(json.dumps(cfg))
    return ref


@pytest.mark.parametrize("method,group", [("awq", 32), ("gptq", 64), ("gptq", -1)])
def test_loads_int4_without_fp32_detour(tmp_path, method, group) -> None:
    ref = write_checkpoint(tmp_path, method, group)
    loaded = load_model(tmp_path, verbose=False, quantization="auto")
    assert method.upper() in loaded.file_type
    for name, want in ref.items():
        got = loaded.weights[name]
        if any(f".{n}." in name for n in LINEARS):
            assert isinstance(got, QuantizedWeight) and got.format == "int4", name
            assert got.group == (want.shape[1] if group == -1 else group)
            got = dequantize(got)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # --quantization none: the same values in fp32.
    plain = load_model(tmp_path, verbose=False, quantization="none")
    for name, want in ref.items():
        torch.testing.assert_close(plain.weights[name], want, rtol=0, atol=1e-6)


def test_act_order_gptq_loads_dequantized(tmp_path) -> None:
    """A g_idx out of group order cannot use inferd's blocks: dequantized exactly instead."""
    ref = write_checkpoint(tmp_path, "gptq", 32, act_order=True)
    loaded = load_model(tmp_path, verbose=False, quantization="auto")
    for name, want in ref.items():
        assert not isinstance(loaded.weights[name], QuantizedWeight)
        torch.testing.assert_close(loaded.weights[name], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,group", [("awq", 32), ("gptq", 64)])
def test_generation_matches_the_dequantized_weights(tmp_path, method, group, monkeypatch) -> None:
    # fp32 activations: the int4 weights themselves must compute what their dequantized copies
    # do. (With the default int8 activations this random model's near-flat logits leave the
    # dense greedy path within a few tokens (awq-32: at token 7 of 16); tests/test_quantization.py bounds their logits.)
    monkeypatch.setattr(formats, "INT8_ACTIVATIONS", False)
    ref = write_checkpoint(tmp_path / "q", method, group)
    write_hf_dir(tmp_path / "ref", SPEC, state_dict=ref)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [
        [1, 5, 9, 13, 17, 21],
        [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    ]
    outs = []
    for path, q in ((tmp_path / "q", "auto"), (tmp_path / "ref", "none")):
        llm = LLM(
            str(path), quantization=q, dtype="float32", kv_cache_memory=1 << 20, verbose=False
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if q == "auto":
            # The linear layers stay int4 (with fp32 scales and mins: <= 0.75 bytes per weight).
            linear = sum(
                t.numel() * 4 for n, t in ref.items() if any(f".{x}." in n for x in LINEARS)
            )
            assert (
                llm.engine.weight_bytes <= sum(t.numel() * 4 for t in ref.values()) - linear * 0.8
            )
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"bits": 8}, "only 4-bit"),
        ({"quant_method": "bitsandbytes"}, "unsupported quantization_config"),
        ({"version": "gemv"}, "gemm"),
    ],
)
def test_unsupported_checkpoints_are_refused(tmp_path, change, message) -> None:
    write_checkpoint(tmp_path, "awq", 32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path, verbose=False, quantization="auto")


def test_missing_zeros_is_refused(tmp_path) -> None:
    write_checkpoint(tmp_path, "awq", 32)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.0.self_attn.q_proj.qzeros"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="qzeros"):
        load_model(tmp_path, verbose=False, quantization="auto")
