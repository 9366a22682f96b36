"""`--dtype auto` on the CPU is fp32 (the CPU kernels' dtype) whatever the CPU computes natively;
asking for bf16 there still works, with a warning that it decodes on slower ops."""

from __future__ import annotations

import logging

import torch

from inferd import LLM, SamplingParams
from inferd.config import resolve_dtype


def test_auto_is_fp32_on_the_cpu() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_bf16_on_the_cpu_warns_and_still_generates(tiny_llama_hf, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="inferd.engine"):
        llm = LLM(str(tiny_llama_hf.path), dtype="bfloat16", kv_cache_memory=4 << 20, verbose=False)
    assert any("--dtype bfloat16 on the CPU" in r.getMessage() for r in caplog.records)
    (out,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inferd.engine"):
        LLM(str(tiny_llama_hf.path), kv_cache_memory=4 << 20, verbose=False)
    assert not any("on the CPU" in r.getMessage() for r in caplog.records)
