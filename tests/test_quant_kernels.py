"""Fused quantized CPU kernels against the dequantised reference, on awkward shapes; GGUF blocks
map onto the kernel layouts bit-exactly; quantizers stay within their formats' error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from inferd.kernels.quant_gemm import extension
from inferd.quantization.formats import (
    dequantize_rows,
    from_gguf_blocks,
    pack_int4,
    quantize,
    quantize_fp8,
    quantize_int8_blocks,
    unpack_int4,
)

SHAPES = [(1, 32), (7, 96), (37, 608), (131, 1184)]  # (N, K): N odd, K not a multiple of 256
ROWS = [1, 2, 3, 4, 17, 64]


@pytest.fixture(scope="module")
def ext():
    e = extension()
    if e is None:
        pytest.skip("quantized CPU kernels unavailable here (no compiler or no AVX2)")
    return e


def _weights():
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        w[0, :5] = 0.7  # an outlier: groups with very different scales
        yield w


def _quantized():
    for w in _weights():
        k = w.shape[1]
        yield quantize(w, "int8")
        yield quantize_int8_blocks(w)
        yield quantize_fp8(w)  # per-channel
        for group in (32, 64, 128):
            if k % group == 0:
                yield quantize(w, "int4", group)
                yield quantize(w, "fp8", group)


def _call(ext, x, qw):
    if qw.format == "int8":
        return ext.q8_linear(x, qw.data, qw.scales, qw.group)
    if qw.format == "int4":
        return ext.q4_linear(x, qw.data, qw.scales, qw.mins, qw.group)
    return ext.fp8_linear(x, qw.data, qw.scales, qw.group)


@pytest.mark.parametrize("m", ROWS)
def test_kernels_match_dequantized_reference(ext, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    for qw in _quantized():
        ref_w = dequantize_rows(qw)
        x = torch.randn(m, qw.shape[1], generator=g)
        want = F.linear(x, ref_w)
        got = _call(ext, x, qw)  # M <= 4: register GEMV path; M > 4: strips + dense tiles
        tol = 1e-5 * (x.abs() @ ref_w.abs().T).max().item() + 1e-6
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= tol, (qw.source, qw.shape, m)
        # An empty x returns the dequantised weight itself (the prefill path's first half).
        assert torch.equal(_call(ext, x[:0], qw), ref_w), qw.source


def test_fp32_activation_rows_are_batch_invariant(ext) -> None:
    """With fp32 activations (fp8 weights; int8 / int4 where int8 activations are off) a row's
    result is the same bits alone and among any number of rows — the few-row kernel, the strips
    of a decode batch and of a prefill chunk sum in one order — and the same bits as the dense
    fp32 kernel on the dequantised weight (csrc/dense_gemv.h). 150 rows cross a 128-row block."""
    g = torch.Generator().manual_seed(11)
    for qw in _quantized():
        x = torch.randn(150, qw.shape[1], generator=g)
        together = _call(ext, x, qw)
        assert torch.equal(together, ext.dense_linear(x, dequantize_rows(qw))), qw.source
        for m in (1, 2, 3, 4, 5, 9, 64):
            parts = torch.cat([_call(ext, x[i : i + m].contiguous(), qw) for i in range(0, 150, m)])
            assert torch.equal(parts, together), (qw.source, qw.shape, m)


def test_quantized_matmul_dispatch_keeps_batch_dims(ext) -> None:
    """Every dispatch path (one row, a few rows, many rows: dequantised strips; kernels off)
    against an fp64 matmul on the weight itself, with leading batch dimensions kept. The
    weight sits exactly on an int4 grid (each 32-group spans min .. min + 15 * scale, both exact
    in fp16), so quantizing loses nothing and the reference owes nothing to `formats`."""
    from inferd.quantization.formats import quantized_matmul

    g = torch.Generator().manual_seed(0)
    n, k, group = 37, 96, 32
    q = torch.randint(0, 16, (n, k // group, group), generator=g)
    q[:, :, 0], q[:, :, 1] = 0, 15  # each group's extremes are on the grid
    scale = torch.randint(1, 64, (n, k // group, 1), generator=g) / 1024
    lo = torch.randint(-64, 0, (n, k // group, 1), generator=g) / 128
    w = (lo + q * scale).reshape(n, k)
    qw = quantize(w, "int4", group)
    assert torch.equal(dequantize_rows(qw), w)
    for shape in [(96,), (5, 96), (2, 40, 96)]:
        x = torch.randn(*shape, generator=g)
        want = (x.double() @ w.double().T).float()
        got = quantized_matmul(x, qw, int8_activations=False)  # int8 ones: the tests below
        assert got.shape == (*shape[:-1], n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(quantized_matmul(x, qw, use_kernels=False), want,
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_int4_pack_round_trip() -> None:
    q = torch.randint(0, 16, (5, 128), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_load_bit_exact(qtype: str) -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((13, 160)) * 0.1).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    want = gguf.quants.dequantize(raw, t).reshape(w.shape)
    qw = from_gguf_blocks(raw, qtype, w.shape)
    assert qw.format == ("int8" if qtype == "Q8_0" else "int4") and qw.group == 32
    assert qw.scales.dtype == torch.float16  # the file's fp16 scales, kept as shipped
    np.testing.assert_array_equal(dequantize_rows(qw).numpy(), want)
    # Rows permute like the fp32 rows do (what the loader needs for llama.cpp's Q/K order).
    perm = torch.tensor([3, 0, 12, 5])
    np.testing.assert_array_equal(dequantize_rows(qw.rows(perm)).numpy(), want[perm.numpy()])


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.01), ("fp8", 0.04), ("int4", 0.12)])
def test_quantizers_error_is_bounded(fmt: str, bound: float) -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    back = dequantize_rows(quantize(w, fmt))
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < bound, rel


# ---- int8 activations (the decode path, as llama.cpp) --------------------------------------------
@pytest.fixture(scope="module")
def int_ext(kernel_build):
    """The build this CPU runs (AVX512-VNNI `vpdpbusd` where present) and, on an AVX-512 CPU, the
    AVX2-only build (`vpmaddubsw` + `vpmaddwd`, what CPUs without VNNI run): both integer paths
    are tested where both exist."""
    return kernel_build


def _int_weights():
    for w in _weights():
        k = w.shape[1]
        yield quantize(w, "int8")  # per-channel fp32 scales (group = K)
        yield quantize_int8_blocks(w)  # Q8_0: fp16 scale per block
        for group in (32, 64, 128):
            if k % group == 0:
                yield quantize(w, "int4", group)
        for qtype in ("Q4_1", "Q4_0"):  # GGUF's own blocks: fp16 scales and mins
            raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
            yield from_gguf_blocks(raw, qtype, tuple(w.shape))


def _int_call(ext, x, qw):
    if qw.format == "int8":
        return ext.q8_linear(x, qw.data, qw.scales, qw.group, True)
    return ext.q4_linear(x, qw.data, qw.scales, qw.mins, qw.group, True)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 70])
def test_int8_activation_kernels_match_their_reference(int_ext, m: int) -> None:
    from inferd.quantization.formats import int8_activation_matmul_reference, quantize_activations

    g = torch.Generator().manual_seed(100 + m)
    for qw in _int_weights():
        k = qw.shape[1]
        x = torch.randn(m, k, generator=g)
        x[0, 1] = 9.0  # an outlier coarsens its block's int8 grid
        if m > 1 or k > 32:  # (not the whole x: the relative error needs a nonzero output)
            x[-1, :32] = 0.0  # an all-zero block: scale 0, no division by zero
        got = _int_call(int_ext, x, qw)
        # The same x rounding as the kernels, so only fp32 summation order differs.
        want = int8_activation_matmul_reference(x, qw)
        ref_w = dequantize_rows(qw)
        mag = (x.abs() @ ref_w.abs().T).max().item()
        assert (got - want).abs().max().item() <= 2e-6 * mag + 1e-6, (qw.source, qw.shape, m)
        # Against fp32 activations: rounding moves each x by at most half its block's step d, so
        # |error| <= Σ_blocks d/2 · Σ_block |w| elementwise (plus fp32 summation), and on these
        # random inputs it stays within 2% of the output's norm (0.5-1.5% measured).
        _, d, _ = quantize_activations(x)
        bound = 0.5 * d @ ref_w.abs().reshape(qw.shape[0], -1, 32).sum(dim=2).T
        exact = F.linear(x, ref_w)
        assert ((got - exact).abs() <= bound + 2e-6 * mag + 1e-6).all(), (qw.source, qw.shape, m)
        rel = ((got - exact).norm() / exact.norm()).item()
        assert rel < 0.02, (qw.source, qw.shape, m, rel)


def test_int8_activation_rows_are_batch_invariant(int_ext) -> None:
    """A row's result is the same bits alone and among any number of rows (the one-row kernel and
    the many-row AVX512 tiles share every float operation): a request's numerics never depend on
    what else shares its step. 70 rows cross the tiles' 64-row chunks and a 4-row remainder."""
    g = torch.Generator().manual_seed(7)
    for qw in _int_weights():
        x = torch.randn(70, qw.shape[1], generator=g)
        together = _int_call(int_ext, x, qw)
        for m in (1, 3, 5, 70):
            parts = torch.cat([_int_call(int_ext, x[i : i + m].contiguous(), qw) for i in range(0, 70, m)])
            assert torch.equal(parts, together), (qw.source, qw.shape, m)


def test_quantized_matmul_int8_activations_dispatch(ext) -> None:
    from inferd.quantization.formats import int8_activation_matmul_reference, quantized_matmul

    qw = quantize(torch.randn(37, 96), "int4", 32)
    small = torch.randn(2, 3, 96)  # 6 rows: int8 activations
    want = int8_activation_matmul_reference(small.reshape(-1, 96), qw).reshape(2, 3, 37)
    torch.testing.assert_close(quantized_matmul(small, qw, int8_activations=True), want,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    # Opted out, the same rows meet fp32 activations.
    exact = F.linear(small, dequantize_rows(qw))
    torch.testing.assert_close(quantized_matmul(small, qw, int8_activations=False), exact,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    # Prefill-sized calls take them too, with each row's bits as alone (batch invariance); opted
    # out, they take the BLAS sgemm on the dequantised weight.
    big = torch.randn(45, 96)
    got = quantized_matmul(big, qw, int8_activations=True)
    for r in (0, 17, 44):
        assert torch.equal(got[r : r + 1], quantized_matmul(big[r : r + 1], qw, int8_activations=True))
    torch.testing.assert_close(quantized_matmul(big, qw, int8_activations=False),
                               F.linear(big, dequantize_rows(qw)), rtol=1e-4, atol=1e-4)  # fmt: skip
    # fp8 weights have no integer path: fp32 activations at any row count.
    f8 = quantize_fp8(torch.randn(37, 96))
    torch.testing.assert_close(quantized_matmul(small, f8, int8_activations=True),
                               F.linear(small, dequantize_rows(f8)), rtol=1e-4, atol=1e-4)  # fmt: skip


def test_int8_activations_default_follows_the_integer_tiles(monkeypatch) -> None:
    """By default int8 activations are on where many-row calls have integer tiles (AVX512-VNNI)
    and off on the AVX2-only build, where prefill would run on the one-row kernel."""
    from inferd.kernels.build import cpu_flags
    from inferd.kernels.quant_gemm import extension_avx2
    from inferd.quantization import formats

    native, avx2 = extension(), extension_avx2()
    if native is None or avx2 is None:
        pytest.skip("quantized CPU kernels unavailable here (no compiler or no AVX2)")
    flags = cpu_flags().split()
    assert native.has_int8_gemm == all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni"))
    assert avx2.has_int8_gemm is False
    monkeypatch.setattr(formats, "INT8_ACTIVATIONS", None)
    qw = quantize(torch.randn(37, 96), "int4", 32)
    x = torch.randn(5, 96)
    want = formats.quantized_matmul(x, qw, int8_activations=native.has_int8_gemm)
    assert torch.equal(formats.quantized_matmul(x, qw), want)


def test_kernels_build_where_they_can():
    """On an x86 CPU with AVX2/FMA and a C++ compiler the extension must build: a compile error
    would otherwise turn every kernel test into a skip and the engine into the slow PyTorch path."""
    import shutil

    from inferd.kernels.build import cpu_supports_avx2_fma
    from inferd.kernels.quant_gemm import extension_avx2

    if not cpu_supports_avx2_fma() or shutil.which("c++") is None:
        pytest.skip("no AVX2/FMA CPU or no C++ compiler here")
    assert extension() is not None
    assert extension_avx2() is not None


def test_packed_tiles_give_the_row_layout_bits_and_dequantize_back(packed_tiles_ext) -> None:
    """A weight packed into tiles computes exactly what its row layout computes (the same exact
    block sums, the same fp32 operations) at every row count, and dequantises to the same values."""
    from inferd.quantization import formats
    from inferd.quantization.formats import pack_tiles

    ext = packed_tiles_ext
    g = torch.Generator().manual_seed(11)
    for qw in _int_weights():
        if qw.shape[0] % 16:
            assert pack_tiles(qw) is None  # the row layout stays
            continue
        tiles = pack_tiles(qw)
        assert tiles.layout == "tiles" and tiles.data.numel() == qw.data.numel()
        np.testing.assert_array_equal(dequantize_rows(tiles).numpy(), dequantize_rows(qw).numpy())
        rows = torch.tensor([5, 0, qw.shape[0] - 1, 17 % qw.shape[0], 5])
        assert torch.equal(dequantize_rows(tiles, rows), dequantize_rows(qw, rows))
        # The lookup's C++ loop (an embedding's rows) and the ATen formulation: the same bits.
        assert torch.equal(formats._dequantize_tiles(tiles, rows), formats._dequantize_tiles_torch(tiles, rows))
        with pytest.raises(RuntimeError, match="out of range"):
            formats._dequantize_tiles(tiles, torch.tensor([qw.shape[0]]))
        back = tiles.rows(rows)  # a row-layout subset (the draft head's vocabulary does this)
        assert back.layout == "rows" and torch.equal(dequantize_rows(back), dequantize_rows(qw, rows))
        mins = tiles.mins if tiles.mins is not None else torch.empty(0)
        for m in (1, 3, 9, 70):
            x = torch.randn(m, qw.shape[1], generator=g)
            want = _int_call(ext, x, qw)
            got = ext.tiles_linear(x, tiles.data, tiles.scales, mins)
            assert torch.equal(got, want), (qw.source, qw.shape, m)
            # Streamed past the caches (a model's weight) or kept (a draft head's): only a hint.
            assert torch.equal(ext.tiles_linear(x, tiles.data, tiles.scales, mins, False), want)


def test_engine_packs_its_quantized_weights_in_place(
    tiny_models, monkeypatch, packed_tiles_ext
) -> None:
    """At start-up the engine packs its int8 / int4 matmuls into tiles instead of keeping a second
    copy, and generates what the row layout generates."""
    from inferd import LLM, SamplingParams
    from inferd.engine import model_runner
    from inferd.layers.quantized_linear import QuantizedLinear

    path = str(tiny_models["llama-f32.gguf"].path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = ["The quick brown fox jumps over", "A paged KV cache stores"]

    def run(pack: bool):
        with monkeypatch.context() as m:
            if not pack:  # the row layout, as an engine without the VNNI tiles keeps it
                m.setattr(model_runner, "pack_quantized_weights", lambda model: 0)
            llm = LLM(path, quantization="int4", verbose=False, kv_cache_memory=4 << 20)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return linears, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    packed, got = run(True)
    rows, want = run(False)
    assert {m.qweight.layout for m in packed} == {"tiles"} and {m.qweight.layout for m in rows} == {"rows"}
    assert got == want
    # The packed bytes replace the row layout's: the same weight bytes, fp32 block scales.
    assert sum(m.qweight.data.numel() for m in packed) == sum(m.qweight.data.numel() for m in rows)
