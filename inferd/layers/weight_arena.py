"""A model's CPU weights moved into one block of memory, in the order a decode step reads them,
backed by 2 MiB pages.

Why: a batch-1 decode step streams every weight once. Each tensor allocated on its own sits in
its own mapping; the ones under 2 MiB, and the unaligned ends of the larger ones, get 4 KiB pages
(about half of the default model's weights). A step then walks ~130k pages, each a TLB miss and a
new stream for the hardware prefetcher, and the walks evict the TLB entries of everything else
the step touches: a draft head's weights, read k times right after the target's forward. One
contiguous, huge-page-backed block in the layers' order makes the step one sequential stream over
a few hundred pages, and a pass over the weights measurably faster at 1 and 4 rows.

The block is an anonymous mapping advised MADV_HUGEPAGE before it is touched (so the kernel
backs it with huge pages at the first write whenever `transparent_hugepage` is `madvise` or
`always`), its start aligned to 2 MiB. Parameters keep their identity (`param.data` is swapped),
so tied weights and anything holding the module see the moved tensor.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterable

import torch
from torch import nn

from inferd import envs
from inferd.quantization.formats import QuantizedWeight

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line: the kernels' vector loads stay in one line


def _is_its_whole_storage(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.numel() > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _slots(modules: Iterable[nn.Module]) -> list[tuple[object, str, torch.Tensor]]:
    """(holder, attribute, tensor) for every parameter and quantized weight's tensor, in module
    registration order (a decoder's is its layers' order), each tensor once (tied weights are
    one Parameter, or one QuantizedWeight, shared)."""
    out: list[tuple[object, str, torch.Tensor]] = []
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((p, "data", p.data))
            qw = getattr(module, "qweight", None)
            if isinstance(qw, QuantizedWeight) and id(qw) not in seen:
                seen.add(id(qw))
                for name in ("data", "scales", "mins"):
                    t = getattr(qw, name)
                    if t is not None:
                        out.append((qw, name, t))
    # Only a tensor that is its storage, whole, and the only one here on it: moving it breaks
    # no sharing (a view into another weight, and the weight it views into, stay where they are).
    holders: dict[int, int] = {}
    for _, _, t in out:
        key = t.untyped_storage().data_ptr()
        holders[key] = holders.get(key, 0) + 1
    return [
        s
        for s in out
        if _is_its_whole_storage(s[2]) and holders[s[2].untyped_storage().data_ptr()] == 1
    ]


def _huge_page_block(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` starting on a 2 MiB boundary, advised for huge
    pages before any page of it is touched."""
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without THP: 4 KiB pages, still one sequential block
            logger.debug("weight arena: madvise(MADV_HUGEPAGE) failed: %s", e)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` alive
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes]


def gather_weights(modules: Iterable[nn.Module]) -> int:
    """Move the CPU weights of `modules` (parameters, and `QuantizedWeight`s held as `qweight`)
    into one huge-page block in registration order; returns the bytes moved (0 when off, with
    INFERD_WEIGHT_ARENA=0, with nothing to move, or with too little free memory for the copy:
    peak memory is the model's twice over while it runs). Afterwards rebuild whatever captured
    the old tensors (a fused step's weight list)."""
    if not envs.INFERD_WEIGHT_ARENA:
        return 0
    slots = _slots(list(modules))
    offsets, total = [], 0
    for _, _, t in slots:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    if total < _HUGE_PAGE:  # not worth a mapping of its own
        return 0
    available = _available_memory()
    if available is not None and total > 0.8 * available:
        # The copy holds the model twice for a moment: not where that would run out of memory.
        logger.info(
            "weights: left where they are (%.0f MB to move, %.0f MB free)",
            total / 1e6,
            available / 1e6,
        )
        return 0
    block = _huge_page_block(total)
    for (holder, name, t), off in zip(slots, offsets):
        nbytes = t.numel() * t.element_size()
        moved = block[off : off + nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        setattr(holder, name, moved)  # the old storage goes once nothing else holds it
    slots.clear()
    _return_freed_memory()
    huge = _huge_page_bytes(block.data_ptr())
    logger.info(
        "weights: %.1f MB in one block%s",
        total / 1e6,
        "" if huge is None else f", {min(huge, total) / 1e6:.1f} MB of it on huge pages",
    )
    return total


def _huge_page_bytes(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), None where unknown.
    Logged because the kernel may fall back to 4 KiB pages when memory is fragmented, and a
    step then runs measurably slower."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    inside = int(lo, 16) <= address < int(hi, 16)
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _return_freed_memory() -> None:
    """Hand the old weights' pages back to the OS: glibc keeps freed heap blocks (inferd raises
    its trim threshold, inferd/__init__.py), which would leave a second copy of the model in the
    process's memory."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass
