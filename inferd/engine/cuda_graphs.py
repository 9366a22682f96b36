"""CUDA graphs of decode steps: one per bucket (inferd/engine/decode_buckets.py), captured after
the memory plan, replayed for decode-only steps whose batch fits a bucket.

A graph holds the model's forward and the logits of its bucket's persistent inputs; a step fills
those inputs in place and replays, so its ~1,000 kernel launches cost one. Every graph draws on
one shared memory pool, captured largest bucket first so that the smaller ones reuse its blocks
(as vLLM and SGLang do). Nothing inside the captured region reads the device from the host: the
attention kernels' launches depend on shapes only (the Triton kernel's on `q_max` and the block
tables' width, both fixed per bucket).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from inferd.engine.decode_buckets import DecodeBuckets
from inferd.slow_paths import warn_slow_path


def capture_decode_graphs(
    buckets: DecodeBuckets,
    forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
) -> DecodeGraphs | None:  # fmt: skip
    """Every bucket's graph, or None (decode steps stay eager, with one warning) where capture
    fails: something in the forward read the device from the host."""
    try:
        return DecodeGraphs(buckets, forward, device)
    except RuntimeError as e:  # e.g. "operation not permitted when stream is capturing"
        torch.cuda.synchronize(device)
        warn_slow_path("cuda-graphs-capture", "CUDA graph capture failed (%s): decode steps run "
                       "eagerly", str(e).splitlines()[0][:200])  # fmt: skip
        return None


class DecodeGraphs:
    """A captured decode forward per bucket size; `replay(b)` returns its (logits [b, vocab],
    hidden [b, hidden]) outputs, overwritten by the next replay of any bucket."""

    def __init__(self, buckets: DecodeBuckets, forward: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device) -> None:  # fmt: skip
        """`forward(b)`: bucket b's forward over its persistent inputs → (logits, hidden)."""
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)
        # torch.cuda.graph empties the allocator's cache as each capture begins: empty it first,
        # so the growth of reserved memory below is the graphs' own pool.
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        started = time.perf_counter()
        for b in sorted(buckets.sizes, reverse=True):
            buckets.fill(b, [], [])  # padding rows only: the scratch slot, never a real one
            side = torch.cuda.Stream(device)  # warm-up off the default stream, as capture wants
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces, Triton builds)
                    forward(b)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        self.memory_bytes = torch.cuda.memory_reserved(device) - before
        self.seconds = time.perf_counter() - started

    def describe(self) -> str:
        sizes = sorted(self.graphs)
        return (f"CUDA graphs: {len(sizes)} decode buckets ({sizes[0]}..{sizes[-1]}) captured in "
                f"{self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB")  # fmt: skip

    def __contains__(self, b: int) -> bool:
        return b in self.graphs

    def replay(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.graphs[b].replay()
        return self.outputs[b]
