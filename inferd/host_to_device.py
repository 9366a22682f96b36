"""Small host values (indices, per-row sampling parameters) onto the device without a host sync.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host until
the copy is done; staged in pinned memory the copy is queued on the stream and the host goes on
(PyTorch's pinned allocator keeps the staging buffer until the copy has run). On the CPU it is
`torch.tensor` itself.
"""

from __future__ import annotations

import torch


def upload(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device` (int64 for ints unless `dtype`), copied without blocking."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
