"""inferd: an LLM inference and serving engine (paged KV cache, continuous batching)."""

import os

# Transparent huge pages for PyTorch's large CPU allocations (weights, the KV pool): a decode
# step streams every weight once, and with 4 KiB pages the TLB misses cost ~6 % of a batch-32 fp32
# step's matmuls here. PyTorch reads the variable at its first allocation, so it is set before
# torch is imported; a value the user set wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from inferd.engine.llm import LLM
from inferd.engine.outputs import CompletionOutput, RequestOutput
from inferd.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
