"""The fused decode step (csrc/decoder_layers.h: every layer in one C++ call for steps whose rows
all go to the paged attention kernel) gives the Python layer loop's bits: same tokens, same
logprobs, whatever the weights' format, biases, activation precision, KV cache dtype, batch
size or LoRA adapters."""

from __future__ import annotations

import pytest
import torch
from fused_steps import count_fused_rows

from inferd import LLM, LoRARequest, SamplingParams
from inferd.kernels.quant_gemm import extension
from inferd.models import decoder
from inferd.quantization.formats import int8_activations
from inferd.spec import decoder as spec_decoder
from inferd.spec.policy import SpecPolicy

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ kernels cannot be built here")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "A paged KV cache stores keys and values in fixed-size blocks",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\ndef forward(self, x):",
]


def _generate(path, quantization: str, fused: bool, monkeypatch, prompts, spec: bool,
              kv_cache_dtype: str = "auto") -> tuple[list, int]:  # fmt: skip
    """Greedy outputs (tokens and top-2 logprobs) and the rows of each step that took the fused
    path."""
    monkeypatch.setattr(decoder, "FUSED_DECODE", fused)
    fused_rows = count_fused_rows(monkeypatch)
    # The speculation policy reads the clock (start-up calibration, the proposer's time), so under
    # load two runs draft differently, batch rows differently, and fp32 matmuls (MKL, not
    # batch-invariant) round differently: both runs get the same fixed costs, so that the layer
    # path is the only thing that differs between them.
    monkeypatch.setattr(spec_decoder, "measure_verify_cost", lambda *args, **kwargs: ({1: 0.1, 64: 0.5}, {}))
    monkeypatch.setattr(SpecPolicy, "record_speculation_time", lambda self, *args: None)
    config = {"method": "ngram", "num_speculative_tokens": 3} if spec else None
    llm = LLM(str(path), quantization=quantization, verbose=False, kv_cache_memory=4 << 20,
              speculative_config=config, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], fused_rows[:]


@pytest.mark.parametrize(
    "name,quantization,kv_cache_dtype",
    [
        ("llama-f32.gguf", "none", "auto"),  # fp32 weights: F.linear
        ("qwen2-f32.gguf", "none", "auto"),  # q/k/v biases
        ("qwen2-f32.gguf", "int4", "auto"),  # biases after a quantized matmul
        ("llama-f32.gguf", "int8", "auto"),
        ("llama-f32.gguf", "fp8", "auto"),
        ("llama-mixed.gguf", "auto", "auto"),  # GGUF's own Q4_1/Q8_0 blocks, fp16 scales
        # A 2-byte cache: the fused step rounds K/V as it writes them as ATen's .to() does.
        ("llama-f32.gguf", "none", "float16"),
        ("llama-mixed.gguf", "auto", "bfloat16"),
        # A quantized cache: the fused step quantizes with kv_cache.py's ATen ops.
        ("llama-f32.gguf", "none", "int8"),
        ("llama-mixed.gguf", "auto", "fp8"),
    ],
)
def test_fused_decode_gives_the_python_layers_bits(tiny_models, monkeypatch, name, quantization,
                                                    kv_cache_dtype):  # fmt: skip
    path = tiny_models[name].path
    want, python_rows = _generate(path, quantization, False, monkeypatch, PROMPTS, True,
                                  kv_cache_dtype)  # fmt: skip
    got, fused_rows = _generate(path, quantization, True, monkeypatch, PROMPTS, True, kv_cache_dtype)
    assert not python_rows and fused_rows
    assert got == want


@pytest.mark.parametrize("int8", [False, True])
def test_fused_decode_at_every_batch_size_and_activation_precision(tiny_models, monkeypatch, int8):
    """34 sequences decoding together cross quantized_matmul's 32-row switch to dequantise-once
    sgemm (fp32 activations); int8 activations take the integer tiles from 4 rows."""
    path = tiny_models["llama-f32.gguf"].path
    prompts = [f"{i} {PROMPTS[i % 3]}" for i in range(34)]
    with int8_activations(int8):
        want, _ = _generate(path, "int4", False, monkeypatch, prompts, spec=False)
        got, fused_rows = _generate(path, "int4", True, monkeypatch, prompts, spec=False)
    assert fused_rows
    assert got == want


def test_fp32_decode_of_many_sequences_stays_fused(tiny_models, monkeypatch):
    """70 fp32 sequences decoding together: the fused step's dense matmuls take any row count
    (csrc/dense_gemv.h), so those steps stay fused, with the layer loop's very outputs."""
    path = tiny_models["llama-f32.gguf"].path
    prompts = [f"{i} {PROMPTS[i % 3]}" for i in range(70)]
    want, _ = _generate(path, "none", False, monkeypatch, prompts, spec=False)
    got, fused_rows = _generate(path, "none", True, monkeypatch, prompts, spec=False)
    assert got == want
    assert fused_rows and max(fused_rows) > 64


def _generate_adapted(path, adapters: dict, quantization: str, fused: bool,
                      monkeypatch) -> tuple[list, list]:  # fmt: skip
    """Greedy outputs (tokens and top-2 logprobs) of every prompt under the base model and each
    adapter in one call (3 slots, the adapters in the first two), and for each fused step
    whether it had adapted rows."""
    monkeypatch.setattr(decoder, "FUSED_DECODE", fused)
    adapted_steps: list[bool] = []
    real = decoder.DecoderForCausalLM._decode_layers

    def counted(self, ext, x, *args):
        adapted_steps.append(bool(self.lora_masks()))
        return real(self, ext, x, *args)

    monkeypatch.setattr(decoder.DecoderForCausalLM, "_decode_layers", counted)
    llm = LLM(str(path), quantization=quantization, verbose=False, kv_cache_memory=4 << 20,
              enable_lora=True, max_loras=3, max_lora_rank=8)  # fmt: skip
    prompts, loras = [], []
    for prompt in PROMPTS:
        for i, name in enumerate([None, *adapters]):
            prompts.append(prompt)
            loras.append(None if name is None else LoRARequest(name, i, str(adapters[name])))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], adapted_steps[:]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_adapted_decode_steps_stay_fused_with_the_python_layers_bits(tiny_llama_hf, hf_transformers, tmp_path,
                                                                     monkeypatch, quantization):  # fmt: skip
    """Decode steps mixing two adapters' rows with the base model's run fused, each linear adding
    its LoRA delta (adapted_linear) over the slots the step uses, with the Python layers' bits."""
    pytest.importorskip("peft")
    from lora_helpers import write_adapter

    path = tiny_llama_hf.path
    base = hf_transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    adapters = {
        "all": write_adapter(base, tmp_path / "all", seed=1, scale=3.0),
        "some": write_adapter(base, tmp_path / "some", seed=2, rank=4, targets=["v_proj", "o_proj", "up_proj"],
                              scale=3.0),
    }  # fmt: skip
    want, python_steps = _generate_adapted(path, adapters, quantization, False, monkeypatch)
    got, fused_steps = _generate_adapted(path, adapters, quantization, True, monkeypatch)
    assert not python_steps and any(fused_steps)
    assert got == want
    # The adapters move the model: the base rows' outputs differ from theirs.
    assert want[0][0] != want[1][0] and want[0][0] != want[2][0]
