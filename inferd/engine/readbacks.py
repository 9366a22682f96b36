"""The step loop's device→host readbacks, counted: each one is a host sync on a GPU.

A decode step needs exactly one: the sampled (or verified) token ids, which the scheduler appends
on the host. Everything else the step decides (which rows sample randomly, top-k / top-p / min-p
on or off, a seeded row's uniform) is known on the host or stays on the device. The count is what
the tests pin on a CPU, where `torch.cuda.set_sync_debug_mode` has nothing to see.
"""

from __future__ import annotations

import torch


class HostReadbacks:
    """`to_host` is the one way the step loop reads a device tensor's values; `count` counts them."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def to_host(self, t: torch.Tensor) -> list:
        self.count += 1
        return t.tolist()
