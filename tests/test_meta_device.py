"""A forward on the `meta` device: a smoke test of device placement without a GPU. Every tensor
the runner and the model make must follow the model's device (a CPU tensor meeting a meta one
raises), as on CUDA; the torch attention backend is the one a GPU without kernels runs."""

from __future__ import annotations

import torch

from inferd.engine.memory_plan import run_profiling_step
from inferd.engine.model_runner import ModelRunner
from inferd.kv.kv_cache_manager import KVCacheManager
from inferd.kv.kv_groups import KVLayout
from inferd.loader import load_model
from inferd.models import build_model
from inferd.sampling.params import SamplingParams
from inferd.scheduler.scheduler import SchedulerOutput
from inferd.scheduler.sequence import Sequence

META = torch.device("meta")


def test_prefill_and_decode_forward_on_meta(tiny_models):
    loaded = load_model(str(tiny_models["llama-f32.gguf"].path), verbose=False, quantization="none")
    cfg = loaded.config
    model = build_model(cfg, loaded.weights, max_positions=256, dtype=torch.bfloat16, device=META)
    assert model.attention_backend.name == "torch"
    runner = ModelRunner(model, cfg, 64, 16, torch.bfloat16, META, layout=KVLayout.single(cfg.num_layers))
    assert runner.kv_cache.data.device == META
    # A long prefill and short prompts in one step, then a step of decodes.
    assert run_profiling_step(runner, 100, 4, 256) == 4
    kv = KVCacheManager(runner.num_blocks, runner.block_size, False, runner.layout)
    seqs = []
    for n in (40, 7):
        seq = Sequence("meta", 0, list(range(1, n + 1)), n, SamplingParams(max_tokens=None))
        kv.allocate_slots(seq.seq_id, 0, n)
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    logits, _, _ = runner.execute(SchedulerOutput.of([(s, 1) for s in seqs], kv))
    assert logits.device == META and logits.shape == (2, cfg.vocab_size)
