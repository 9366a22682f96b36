"""A tensor-parallel group: the ranks of one model, their torch.distributed process group (gloo on
the CPU, NCCL on CUDA) and the collectives the model and the step broadcast use.

The group is built from its own TCP store rather than `init_process_group`'s global default, so
that a process may hold several engines (tests, a server's models) one after another.

On the CPU the layers' all-reduces and the logits' all-gather go through `ShmAllReduce` (one
shared buffer and a spin barrier between the ranks, all on this host) up to its size: gloo's TCP
round trip costs ~0.25 ms a call here, 61 calls a step for a 30-layer model. Both add the ranks'
partial sums in rank order, so they give the same bits (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from inferd.distributed.shm_allreduce import ShmAllReduce

# Long enough for a worker to load its shard while rank 0 loads its own.
TIMEOUT = datetime.timedelta(minutes=10)


class TPGroup:
    """Rank `rank` of `world` ranks that hold one model's shards."""

    def __init__(self, rank: int, world: int, host: str, port: int, device: torch.device,
                 shm_name: str | None = None, shm_bytes: int = 0) -> None:  # fmt: skip
        self.rank, self.world, self.device = rank, world, device
        self.store = dist.TCPStore(host, port, world, rank == 0, timeout=TIMEOUT)
        # The step broadcast is CPU bytes: gloo always; the model's tensors on NCCL on CUDA.
        self.cpu_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", self.store), rank, world, TIMEOUT
        )
        self.pg = self.cpu_pg
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), rank, world)
        self.shm = None
        if shm_name and device.type == "cpu":
            # Rank 0 creates the buffer, then the others map it; then its name can go.
            shm = ShmAllReduce(shm_name, rank, world, shm_bytes) if rank == 0 else None
            self.barrier()
            self.shm = shm or ShmAllReduce(shm_name, rank, world, shm_bytes)
            self.barrier()
            if rank == 0:
                self.shm.unlink()

    def barrier(self) -> None:
        self.cpu_pg.allreduce([torch.zeros(1)]).wait()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` summed (in rank order on the shared-memory path), in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.pg.allreduce([x]).wait()
        return x

    def all_reduce_gloo(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce` through the process group whatever the size (tests compare the two)."""
        self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, rank 0's first."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        return self.all_gather_gloo(x, dim)

    def all_gather_gloo(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """`all_gather` through the process group whatever the size (tests compare the two)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled: a length, then the bytes)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)  # fmt: skip
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.empty(1, dtype=torch.long)
        self.cpu_pg.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.cpu_pg.broadcast(data, 0).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
