"""All-reduce and all-gather between the processes of one host through shared memory: each rank
writes its tensor into its slot, publishes the call's sequence number and waits for every rank's;
an all-reduce then adds the slots in rank order (the same bits on every rank, and gloo's for two
ranks: a + b == b + a), an all-gather concatenates them.

Two sets of slots alternate by call: a rank can only start call n + 2 (overwriting call n's slots)
once every rank has published call n + 1, i.e. has finished reading call n. The sequence numbers
are aligned 8-byte stores and loads, each rank's on a cache line of its own; x86's ordering keeps
a rank's slot writes visible before its published number.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import torch

_LINE = 64  # bytes: one sequence number per cache line
_SPINS_BEFORE_YIELD = 64  # then yield the core: on a shared machine the peer may need it
_SPINS_PER_CHECK = 4096  # yields between checks that the other ranks still run


class ShmAllReduce:
    def __init__(self, name: str, rank: int, world: int, nbytes: int) -> None:
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self.path = f"/dev/shm/{name}"
        header = _LINE * world
        total = header + 2 * world * nbytes
        if rank == 0:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        stride = _LINE // 8
        self._seqs = torch.frombuffer(self._mm, dtype=torch.int64, count=header // 8)[::stride]
        self._slots = torch.frombuffer(self._mm, dtype=torch.float32, offset=header,
                                       count=2 * world * nbytes // 4).view(2, world, -1)  # fmt: skip
        self._seq = 0
        # Whether the other ranks' processes still run (set by whoever started them): a rank
        # that died never publishes, and gloo's closed connection would not tell this loop.
        self.peers_alive: Callable[[], bool] = lambda: True

    @staticmethod
    def create_name() -> str:
        """A fresh name for rank 0 to create and the others to open."""
        return f"inferd-tp-{os.getpid()}-{os.urandom(4).hex()}"

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.is_cpu and x.numel() * 4 <= self.nbytes

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish `x` and wait for every rank's: the slots [world, numel] of this call (valid
        until this rank's next call but one)."""
        self._seq += 1
        seq = self._seq
        slots = self._slots[seq % 2]
        n = x.numel()
        slots[self.rank, :n].copy_(x.reshape(-1))
        self._seqs[self.rank] = seq
        for r in range(self.world):
            spins = 0
            while int(self._seqs[r]) < seq:
                spins += 1
                if spins > _SPINS_BEFORE_YIELD:
                    os.sched_yield()
                    if spins % _SPINS_PER_CHECK == 0 and not self.peers_alive():
                        raise RuntimeError(f"tensor-parallel rank {r} is gone (exchange {seq})")
        return slots[:, :n]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in rank order, in place."""
        slots = self._exchange(x)
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        flat.copy_(slots[0])
        for r in range(1, self.world):
            flat.add_(slots[r])
        if not x.is_contiguous():
            x.copy_(flat.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, rank 0's first (a new tensor)."""
        slots = self._exchange(x)
        return torch.cat([slots[r].view(x.shape) for r in range(self.world)], dim=dim)

    def unlink(self) -> None:
        """Remove the name (every rank has mapped it; the memory lives while they do)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._seqs = self._slots = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last one
            pass
