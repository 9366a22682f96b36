"""The Triton kernels of the CUDA path without a GPU: each against its PyTorch reference on CPU
tensors under the interpreter (tests/triton_interpreted_checks.py, in a subprocess: TRITON_INTERPRET
must be set before triton is imported), and every shipped configuration compiled for sm_90, which
rejects what the interpreter lets through. The backend choice for CUDA is checked here too."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget

from inferd import slow_paths
from inferd.kernels.triton import paged_attention as pa
from inferd.kernels.triton import quant_gemm as qg
from inferd.layers.attention import TorchAttention, TritonAttention, select_attention_backend

ROOT = Path(__file__).resolve().parent.parent


# Interpreter tolerances: fp32 math; a 16-bit output (fp16 / bf16 / f16 in the name) rounds once.
def _tolerance(name: str) -> float:
    return 2e-3 if any(t in name for t in ("fp16", "bf16", "f16")) else 1e-5


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_interpreted_checks.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_match_references_under_the_interpreter(interpreted):
    assert len(interpreted) == 20
    bad = {name: err for name, err in interpreted.items() if not err <= _tolerance(name)}
    assert not bad, bad


def _signature(kernel, types: dict, constexprs: dict) -> dict:
    names = kernel.arg_names
    return {n: ("constexpr" if n in constexprs else types[n]) for n in names}


def _compile(kernel, types: dict, constexprs: dict, num_warps: int = 4):
    """`kernel` for sm_90 as a launch compiles it: pointers and strides 16-aligned (what triton
    specializes on at run time, and what lets its pipeliner use async copies)."""
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n.endswith("_ptr") or n.startswith("stride")}  # fmt: skip
    sig = _signature(kernel, types, constexprs)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _attention_types(act: str, pool: str) -> dict:
    t = {n: "*i64" for n in ("row_start_ptr", "q_len_ptr", "ctx_ptr", "table_ptr")}
    t.update(q_ptr=f"*{act}", out_ptr=f"*{act}", k_ptr=f"*{pool}", v_ptr=f"*{pool}",
             ks_ptr="*fp32", vs_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32",
             sm_scale="fp32", window="i32", softcap="fp32")  # fmt: skip
    t.update(
        {
            n: "i32"
            for n in (
                "stride_qt",
                "stride_qh",
                "stride_ot",
                "stride_oh",
                "stride_tb",
                "num_q_tiles",
            )
        }
    )
    return t


# What the CUDA path launches: (activations, pool, kv format, G, D, q_max, keys, window, softcap,
# prefill tiles).
ATTENTION_CONFIGS = [
    ("bf16", "bf16", pa.FLOAT, 4, 128, 1, 8192, False, False, False),  # Llama-3-8B-shaped decode
    ("bf16", "bf16", pa.FLOAT, 4, 128, 5, 512, False, False, False),  # 1 + 4 verification rows
    ("fp16", "fp16", pa.FLOAT, 1, 64, 1, 2048, False, False, False),  # MHA
    ("bf16", "u8", pa.INT8, 8, 128, 1, 4096, False, False, False),
    ("bf16", "u8", pa.FP8_E4M3, 2, 64, 8, 1024, False, False, False),
    ("fp16", "u8", pa.FP8_E5M2, 4, 128, 1, 256, False, False, False),
    ("bf16", "bf16", pa.FLOAT, 4, 256, 2, 1024, True, True, False),  # Gemma: window, soft-capping
    ("fp32", "fp32", pa.FLOAT, 4, 64, 1, 1024, False, False, False),
    ("bf16", "bf16", pa.FLOAT, 4, 128, 2048, 8192, False, False, True),  # chunk after context
    ("bf16", "u8", pa.FP8_E4M3, 1, 64, 512, 1024, False, False, True),
    ("bf16", "bf16", pa.FLOAT, 2, 256, 1024, 4096, True, True, True),
]


@pytest.mark.parametrize(
    "act,pool,fmt,group,d,q_max,keys,window,softcap,prefill", ATTENTION_CONFIGS
)
def test_attention_compiles_for_sm90(
    act, pool, fmt, group, d, q_max, keys, window, softcap, prefill
):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[act]
    cfg = pa.launch_config(q_max, group, d, keys, prefill)
    warps = cfg.pop("num_warps")
    dot_dtype, precision = pa.dot_dtypes(dtype, torch.device("cuda"))
    consts = dict(HKV=8 // min(group, 8), G=group, D=d, BS=16, SPLIT_KEYS=pa.SPLIT_KEYS, FMT=fmt,
                  DOT_DTYPE=dot_dtype, PRECISION=precision, HAS_WINDOW=window,
                  HAS_SOFTCAP=softcap, **cfg)  # fmt: skip
    compiled = _compile(pa._paged_attention_kernel, _attention_types(act, pool), consts, warps)
    assert compiled.metadata.num_warps == warps
    if pool == act != "fp32":  # K/V tiles go to the dot as loaded: async copies, pipelined
        assert "cp.async" in compiled.asm["ptx"]
    if consts["SPLITS"] > 1:
        merge = dict(HQ=32, D=d, SPLITS=consts["SPLITS"])
        types = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=f"*{act}", rows_ptr="*i64",
                     stride_ot="i32", stride_oh="i32")  # fmt: skip
        assert _compile(pa._merge_splits_kernel, types, merge).asm["ptx"]


# (activations, format, group, M, N, K): decodes and prefill tiles of 8B-shaped projections.
GEMM_CONFIGS = [
    ("bf16", "int4", 32, 1, 14336, 4096),
    ("bf16", "int4", 32, 128, 4096, 14336),
    ("fp16", "int8", 32, 32, 4096, 4096),
    ("bf16", "int8", 4096, 1, 4096, 4096),
    ("bf16", "fp8", 32, 1, 4096, 14336),
    ("bf16", "fp8", 128, 512, 14336, 4096),
    ("fp32", "int4", 32, 8, 4096, 4096),
]


@pytest.mark.parametrize("act,fmt,group,m,n,k", GEMM_CONFIGS)
def test_quant_gemm_compiles_for_sm90(act, fmt, group, m, n, k):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[act]
    dot_dtype, precision = qg.dot_dtypes(dtype, torch.device("cuda"))
    cfg = qg.launch_config(m, n, k, 132)  # an H100 / H200's SMs
    consts = dict(K=k, GROUP=group, FMT=fmt, DOT_DTYPE=dot_dtype, PRECISION=precision, **cfg)
    data = {"int8": "*i8", "int4": "*u8", "fp8": "*u8"}[fmt]
    scales = {"int8": "*fp16", "int4": "*fp16", "fp8": "*fp32"}[fmt]
    out = act if cfg["SPLIT_K"] == 1 else "fp32"
    types = dict(x_ptr=f"*{act}", w_ptr=data, s_ptr=scales, m_ptr=scales, y_ptr=f"*{out}",
                 M="i32", N="i32", stride_xm="i32")  # fmt: skip
    assert _compile(qg._quant_gemm_kernel, types, consts).asm["ptx"]


def test_cuda_selects_the_triton_backend(caplog):
    cuda = torch.device("cuda")  # nothing is allocated: the choice reads device type and dtype
    backend = select_attention_backend(cuda, torch.bfloat16, 128)
    assert isinstance(backend, TritonAttention) and backend.kernel is pa
    assert backend.kernel_max_query == 32
    slow_paths._reported.clear()  # once per process: make this test's the first
    with caplog.at_level(logging.WARNING, logger="inferd.engine"):
        odd = select_attention_backend(cuda, torch.bfloat16, 576)  # MLA's latent width
    assert odd.kernel is None and "head size 576" in caplog.text
    assert isinstance(
        select_attention_backend(torch.device("cpu"), torch.bfloat16, 64), TorchAttention
    )
