"""OpenVINO GenAI as a peer (optional: `pip install openvino-genai`), timed step by step.

Its `ContinuousBatchingPipeline` loads the same GGUF file inferd runs (converted by OpenVINO at
load, with its CPU plugin's own precisions: on CPUs with native bf16 / int8 it computes in them
and keeps an int8 KV cache). Requests are added together and the pipeline stepped until they
finish; `stamps` are the ends of the steps that produced tokens, as for inferd. Its prefix cache
is off (every prompt is computed), its step token budget is inferd's (`max_num_batched_tokens`),
and it runs on as many threads as torch does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from inferd.bench.peers import Timed

OPENVINO_MISSING = (
    "openvino peer skipped: openvino-genai is not installed (pip install openvino-genai)"
)


def openvino_available() -> bool:
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        return False
    return True


class OpenVinoPeer:
    """OpenVINO GenAI's continuous-batching pipeline on one GGUF: greedy, EOS ignored."""

    def __init__(self, gguf: Path, max_num_seqs: int, max_num_batched_tokens: int = 2048,
                 threads: int | None = None, kv_cache_gb: int = 1) -> None:  # fmt: skip
        import openvino_genai as ov_genai

        self.path = gguf
        self.max_num_seqs = max_num_seqs
        sc = ov_genai.SchedulerConfig()
        sc.enable_prefix_caching = False  # distinct prompts, computed in full: as inferd's are
        sc.max_num_seqs = max_num_seqs
        sc.max_num_batched_tokens = max_num_batched_tokens
        sc.cache_size = kv_cache_gb  # GB of KV cache
        threads = threads or torch.get_num_threads()
        self.pipe = ov_genai.ContinuousBatchingPipeline(
            str(gguf), sc, "CPU", {"INFERENCE_NUM_THREADS": threads}
        )
        self._next_id = 0

    def generate_timed(self, prompts: list[list[int]], output_len: int) -> Timed:
        """All `prompts` added at once, greedy, exactly `output_len` tokens each."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = cfg.min_new_tokens = output_len
        cfg.ignore_eos = True
        cfg.do_sample = False
        timed = Timed(time.perf_counter())
        handles = []
        for p in prompts:
            ids = ov.Tensor(np.array([p], dtype=np.int64))
            handles.append(self.pipe.add_request(self._next_id, ids, cfg))
            self._next_id += 1
        outputs: list[list[int]] = [[] for _ in prompts]
        first: dict[int, float] = {}
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            now = None
            for i, h in enumerate(handles):
                while h.can_read():
                    for out in h.read().values():
                        outputs[i].extend(out.generated_ids)
                        now = now or time.perf_counter()
                        first.setdefault(i, now)
            if now is not None:
                timed.stamps.append(now)
        timed.end = time.perf_counter()
        timed.first = [first[i] for i in range(len(prompts))]
        timed.token_ids = outputs
        return timed

    def close(self) -> None:
        self.pipe = None
