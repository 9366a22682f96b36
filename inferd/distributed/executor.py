"""Tensor parallelism's rank 0: the engine (scheduler, sampler, its own shard) and the worker
ranks 1..N-1 that hold their shards and KV pools and run each step rank 0 broadcasts
(`ModelRunner.run`), nothing else. The workers are spawned processes on this host
(`--distributed-executor-backend mp`, mp_ranks.py) or Ray actors (`ray`, ray_ranks.py), behind one
`Ranks` interface.

Start-up: rank 0 cuts its own shard first (a weight that cannot split fails before anything
starts), starts the workers, and all ranks join the group (a TCP store at an address rank 0
picks); rank 0 cuts every worker's shard out of the checkpoint it loaded (the file is read once)
and hands it over; every rank builds its model; the workers report ready, or the error that
stopped them, which rank 0 raises as its own. Shut-down: rank 0 broadcasts `None`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from inferd.config import EngineConfig, ModelConfig
from inferd.distributed.group import TPGroup
from inferd.distributed.parallel_layers import parallelize
from inferd.distributed.shard import check_tensor_parallel, shard_config, shard_weights
from inferd.distributed.shm_allreduce import ShmAllReduce
from inferd.kv.kv_groups import KVLayout

logger = logging.getLogger("inferd.distributed")

LOCALHOST = "127.0.0.1"
_SHM_MAX_BYTES = 16 << 20  # the largest all-reduce through shared memory; larger ones go to gloo
START_TIMEOUT_S = 600.0  # for a worker rank to start, join and build


def usable_cpus() -> list[int]:
    """The CPUs this engine's ranks may share. Under `inferd serve`'s OpenMP binding
    (engine_proc._bind_cpus) libgomp has pinned this thread to the first core already, so the
    process's own mask says one CPU: the binding spans the machine's."""
    if "OMP_PROC_BIND" in os.environ or not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def check_placement(tp: int, device: torch.device, backend: str = "mp") -> None:
    """ValueError where `tp` ranks cannot each get a core of this host's (CPU ranks on `mp`;
    on `ray` the cluster's CPUs count, checked when the ranks are placed)."""
    if device.type == "cpu" and backend == "mp" and tp > len(usable_cpus()):
        raise ValueError(f"--tensor-parallel-size {tp} needs a core per rank; this process may "
                         f"use {len(usable_cpus())}")  # fmt: skip
    if device.type == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {tp} needs a GPU per rank; "
                         f"{torch.cuda.device_count()} are visible")  # fmt: skip


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its part of the engine (picklable: it crosses the spawn)."""

    config: EngineConfig
    model_config: ModelConfig  # the whole model's
    num_blocks: int
    block_size: int
    layout: KVLayout
    max_positions: int
    dtype: torch.dtype
    device: str  # rank 0's; a CUDA rank r uses device index r
    threads: int
    host: str  # rank 0's group store
    port: int
    shm_name: str | None
    shm_bytes: int

    @property
    def world(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def device_of(self, rank: int) -> torch.device:
        d = torch.device(self.device)
        return torch.device("cuda", rank) if d.type == "cuda" else d

    def group(self, rank: int) -> TPGroup:
        return TPGroup(rank, self.world, self.host, self.port, self.device_of(rank), self.shm_name,
                       self.shm_bytes)  # fmt: skip


def build_rank_model(spec: RankSpec, weights: dict, group: TPGroup):
    """Rank `group.rank`'s model from its shard of the weights, parallelized over `group`."""
    from inferd.models import build_model

    c = spec.config
    model = build_model(shard_config(spec.model_config, spec.world), weights,
                        max_positions=spec.max_positions, dtype=spec.dtype,
                        device=spec.device_of(group.rank), quantization=c.quantization,
                        quantization_group_size=c.quantization_group_size)  # fmt: skip
    parallelize(model, group)
    return model


def build_runner(spec: RankSpec, model, group: TPGroup):
    from inferd.engine.model_runner import ModelRunner

    c = spec.config
    return ModelRunner(model, spec.model_config, spec.num_blocks, spec.block_size, spec.dtype,
                       spec.device_of(group.rank), kv_cache_dtype=c.cache.kv_cache_dtype,
                       kv_cache_prefault=c.cache.kv_cache_prefault if group.rank == 0 else 0,
                       layout=spec.layout, tp=group if group.rank == 0 else None)  # fmt: skip


def build_worker(spec: RankSpec, rank: int, take_weights: Callable[[], dict]):
    """Worker rank `rank`: join the group (it waits for every rank), then build the model from
    its shard (`take_weights()`, called once joined) and its runner. Returns (group, runner)."""
    group = spec.group(rank)
    model = build_rank_model(spec, take_weights(), group)
    return group, build_runner(spec, model, group)


def serve_steps(runner, group: TPGroup) -> None:
    """A worker rank's loop: run each step rank 0 broadcasts, until it broadcasts `None`."""
    while (plan := group.broadcast_object()) is not None:
        runner.run(plan)
    group.close()


def worker_error(rank: int, detail: str) -> Exception:
    """The exception rank 0 raises for a worker's failure (`detail`: its type, message and
    traceback): a ValueError where the worker's was one (a shard that does not fit)."""
    first = detail.splitlines()[0] if detail else "failed"
    logger.error("tensor-parallel rank %d failed:\n%s", rank, detail)
    kind = ValueError if first.startswith(("ValueError", "KeyError")) else RuntimeError
    return kind(f"tensor-parallel rank {rank}: {first}")


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free on `host` now (for a group's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Ranks(Protocol):
    """How ranks 1..N-1 start and stop: spawned processes (mp_ranks) or Ray actors (ray_ranks).
    The executor calls `start`, joins the group, `joined`, builds rank 0, `wait_ready`; `close`
    once the workers have left their step loop (or to end a start that failed)."""

    host: str  # where rank 0's group store listens (an address every rank reaches)
    same_host: bool  # every rank on rank 0's host: the shared-memory all-reduce applies
    threads: int  # torch threads of each rank

    def describe(self) -> str: ...
    def start(self, spec: RankSpec, shard: Callable[[int], dict]) -> None: ...
    def joined(self) -> None: ...
    def wait_ready(self) -> None: ...
    def alive(self) -> bool: ...
    def close(self, graceful: bool) -> None: ...


def make_ranks(config: EngineConfig, device: torch.device) -> Ranks:
    parallel = config.parallel
    if parallel.distributed_executor_backend == "ray":
        from inferd.distributed.ray_ranks import RayRanks

        return RayRanks(parallel.tensor_parallel_size, device, parallel.ray_placement_strategy)
    from inferd.distributed.mp_ranks import ProcessRanks

    return ProcessRanks(parallel.tensor_parallel_size, device)


class TensorParallelExecutor:
    """Rank 0's side: the worker ranks, the group, and rank 0's runner."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict,
                 num_blocks: int, block_size: int, layout: KVLayout, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        tp = config.parallel.tensor_parallel_size
        check_tensor_parallel(model_config, tp)
        check_placement(tp, device, config.parallel.distributed_executor_backend)
        from inferd.models import model_class

        shm_bytes = min(
            _SHM_MAX_BYTES, config.scheduler.max_num_batched_tokens * model_config.hidden_size * 4
        )
        cls = model_class(model_config.architecture)
        shard = lambda r: shard_weights(
            weights, model_config, cls, r, tp, config.quantization, config.quantization_group_size
        )
        # Rank 0's first, before any rank starts: a weight that cannot split fails here (every
        # rank's cut falls on the boundaries rank 0's end does).
        own = shard(0)
        self.group: TPGroup | None = None
        self._threads_before = torch.get_num_threads()  # given back at close (a library caller's)
        self.ranks = ranks = make_ranks(config, device)
        try:
            shm = ShmAllReduce.create_name() if device.type == "cpu" and ranks.same_host else None
            self.spec = spec = RankSpec(
                config, model_config, num_blocks, block_size, layout, max_positions, dtype,
                str(device), ranks.threads, ranks.host, free_port(ranks.host), shm, shm_bytes,
            )  # fmt: skip
            ranks.start(spec, shard)
            torch.set_num_threads(ranks.threads)
            self.group = spec.group(0)
            if self.group.shm is not None:
                self.group.shm.peers_alive = ranks.alive
            ranks.joined()
            model = build_rank_model(spec, own, self.group)
            del own
            ranks.wait_ready()
            self.runner = build_runner(spec, model, self.group)
        except BaseException:
            self.close(graceful=False)
            raise
        logger.info("tensor parallel: %d ranks (%s), %d threads each, all-reduce %s", tp,
                    ranks.describe(), ranks.threads,
                    "shared memory + gloo" if shm else "gloo" if device.type == "cpu" else "nccl")  # fmt: skip

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent): `graceful`, through the step loop they are in;
        otherwise (start-up failed: they may be anywhere) at once."""
        if self.group is not None:
            if graceful:
                try:
                    self.group.broadcast_object(None)
                except RuntimeError:  # a worker already gone
                    pass
            self.group.close()
            self.group = None
        else:
            graceful = False  # no group: the workers never reached their step loop
        torch.set_num_threads(self._threads_before)
        if self.ranks is not None:
            self.ranks.close(graceful)
            self.ranks = None
