"""inferd: an LLM inference and serving engine (paged KV cache, continuous batching)."""

from inferd.engine.llm import LLM
from inferd.engine.outputs import CompletionOutput, RequestOutput
from inferd.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
