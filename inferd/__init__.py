"""inferd: an LLM inference and serving engine (paged KV cache, continuous batching)."""

import os

from inferd import envs

# Transparent huge pages for PyTorch's large CPU allocations (weights, the KV pool): a decode
# step streams every weight once, and with 4 KiB pages the TLB misses cost ~6 % of a batch-32 fp32
# step's matmuls here. PyTorch reads the variable at its first allocation, so it is set before
# torch is imported; a value the user set wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _keep_freed_memory() -> None:
    """glibc returns every freed block of more than ~32 MiB (its adaptive mmap threshold; 128 KiB
    at first) to the OS, so a step's large temporaries (a batch's logits: 6 MiB at 32 rows) are
    page-faulted and zeroed afresh every step, huge pages included: 1.9 ms to allocate and fill
    6 MiB, against 0.17 ms from memory kept in the heap; the sampler's distribution for 32 rows
    took 14.9 ms instead of 2.7; a batch-32 `-q auto` decode step 41-47 ms instead of 53-60 (two
    alternations). Blocks under 32 MiB now come from the heap and freed memory stays there (what
    an inference server keeps at its peak anyway). INFERD_MALLOPT=0 leaves glibc as is."""
    if not envs.INFERD_MALLOPT:
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    # Blocks of 32 MiB and more still get their own fresh mmap, zero-filled by the kernel: the KV
    # pool (engine/model_runner.py, _LAZY_ZERO_BYTES) relies on that instead of touching every page.
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


_keep_freed_memory()

# The public names load on first use (PEP 562), so that processes which need no engine (the
# router, the CLI's argument parsing) do not pay for importing torch.
_PUBLIC = {
    "LLM": "inferd.engine.llm",
    "SamplingParams": "inferd.sampling.params",
    "RequestOutput": "inferd.engine.outputs",
    "CompletionOutput": "inferd.engine.outputs",
    "LoRARequest": "inferd.lora.request",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'inferd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
__version__ = "0.1.0"
