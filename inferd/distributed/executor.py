"""Tensor parallelism's processes (`--distributed-executor-backend mp`): rank 0 is the engine
(scheduler, sampler, its own shard); ranks 1..N-1 are spawned workers that hold their shards and
KV pools and run each step rank 0 broadcasts (`ModelRunner.run`), nothing else.

Start-up: rank 0 spawns the workers, which report that they are up; all ranks then join the
group; rank 0 cuts every rank's weights out of the checkpoint it loaded and hands each worker its
shard through shared memory (a torch.multiprocessing queue: no second read of the file); every
rank builds its model; the workers report ready, or the error that stopped them, which rank 0
raises as its own. Shut-down: rank 0 broadcasts `None`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as tmp

from inferd.config import EngineConfig, ModelConfig
from inferd.distributed.group import TPGroup
from inferd.distributed.parallel_layers import parallelize
from inferd.distributed.shard import check_tensor_parallel, shard_config, shard_weights
from inferd.distributed.shm_allreduce import ShmAllReduce
from inferd.kv.kv_groups import KVLayout
from inferd.quantization.formats import QuantizedWeight

logger = logging.getLogger("inferd.distributed")

_HOST = "127.0.0.1"
_SHM_MAX_BYTES = 16 << 20  # the largest all-reduce through shared memory; larger ones go to gloo
_START_TIMEOUT_S = 600.0


def usable_cpus() -> list[int]:
    """The CPUs this engine's ranks may share. Under `inferd serve`'s OpenMP binding
    (engine_proc._bind_cpus) libgomp has pinned this thread to the first core already, so the
    process's own mask says one CPU: the binding spans the machine's."""
    if "OMP_PROC_BIND" in os.environ or not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def check_placement(tp: int, device: torch.device) -> None:
    """ValueError where `tp` ranks cannot each get a core of this host's (CPU ranks)."""
    if device.type == "cpu" and tp > len(usable_cpus()):
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
        return TPGroup(rank, self.world, _HOST, self.port, self.device_of(rank), self.shm_name,
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


def _exit_with_parent() -> None:
    """A worker whose rank 0 died (killed, crashed) must not wait for it: exit with it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="inferd-tp-parent-watch", daemon=True).start()


def _worker_main(rank: int, spec: RankSpec, conn, weights_queue) -> None:
    """A worker rank: join, build from the shard rank 0 sends, then run steps until `None`."""
    _exit_with_parent()
    torch.set_num_threads(spec.threads)
    group = None
    try:
        conn.send(("started", None))
        group = spec.group(rank)
        weights = weights_queue.get()
        model = build_rank_model(spec, weights, group)
        runner = build_runner(spec, model, group)
        del weights
        conn.send(("ready", None))
    except Exception as e:  # noqa: BLE001 (rank 0 raises it: a worker's stderr is easy to miss)
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while (plan := group.broadcast_object()) is not None:
        runner.run(plan)
    group.close()


def _start_worker(p, rank: int, threads: int) -> None:
    """Start worker `rank`. An engine process whose OpenMP threads are bound from the first core
    (`inferd serve`, engine_proc._bind_cpus) passes that binding on through the environment: the
    worker gets its own cores' places instead, not rank 0's. An engine process is daemonic
    (killed with its server), and multiprocessing refuses children of a daemon: the flag is
    lifted for the start (the workers are daemons themselves, and leave when rank 0 does)."""
    me = multiprocessing.current_process()
    daemon, saved = me.daemon, os.environ.get("OMP_PLACES")
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if "OMP_PROC_BIND" in os.environ:
        cpus = usable_cpus()[rank * threads : (rank + 1) * threads]
        os.environ["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cpus)
        os.sched_setaffinity(0, cpus)  # the child starts with this thread's mask: its cores
    try:
        me.daemon = False
        p.start()
    finally:
        me.daemon = daemon
        if mask is not None:
            os.sched_setaffinity(0, mask)
        if saved is None:
            os.environ.pop("OMP_PLACES", None)
        else:
            os.environ["OMP_PLACES"] = saved


def _shared_copy(weights: dict) -> dict:
    """Every tensor of `weights` copied into shared memory, here and now. The queue's feeder
    thread would otherwise move each tensor's storage into shared memory itself, later, while
    this thread reads the same storage (a replicated weight, or a slice that views the loaded
    one) to build rank 0's model."""

    def shared(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone().share_memory_()

    out = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            w = dataclasses.replace(
                w, data=shared(w.data), scales=shared(w.scales), mins=shared(w.mins)
            )
        else:
            w = shared(w)
        out[name] = w
    return out


def free_port() -> int:
    """A TCP port free on the loopback now (for a group's store)."""
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """Rank 0's side: the worker processes, the group, and rank 0's runner."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict,
                 num_blocks: int, block_size: int, layout: KVLayout, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        tp = config.parallel.tensor_parallel_size
        check_tensor_parallel(model_config, tp)
        check_placement(tp, device)
        from inferd.models import model_class

        threads = (
            max(1, len(usable_cpus()) // tp) if device.type == "cpu" else torch.get_num_threads()
        )
        shm_bytes = min(
            _SHM_MAX_BYTES, config.scheduler.max_num_batched_tokens * model_config.hidden_size * 4
        )
        self.spec = spec = RankSpec(
            config, model_config, num_blocks, block_size, layout, max_positions, dtype, str(device),
            threads, free_port(), ShmAllReduce.create_name() if device.type == "cpu" else None,
            shm_bytes,
        )  # fmt: skip
        cls = model_class(model_config.architecture)
        shard = lambda r: shard_weights(
            weights, model_config, cls, r, tp, config.quantization, config.quantization_group_size
        )
        # Rank 0's first, before any process starts: a weight that cannot split fails here (every
        # rank's cut falls on the boundaries rank 0's end does).
        own = shard(0)
        ctx = tmp.get_context("spawn")
        self.workers, self.conns, queues = [], [], []
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            q = ctx.Queue()
            p = ctx.Process(target=_worker_main, args=(rank, spec, child, q), daemon=True,
                            name=f"inferd-tp-rank{rank}")  # fmt: skip
            _start_worker(p, rank, threads)
            self.workers.append(p)
            self.conns.append(parent)
            queues.append(q)
        self.group = None
        self._threads_before = torch.get_num_threads()  # given back at close (a library caller's)
        try:
            self._wait_for("started")
            torch.set_num_threads(threads)
            self.group = spec.group(0)
            if self.group.shm is not None:
                self.group.shm.peers_alive = lambda: all(p.is_alive() for p in self.workers)
            sent = []
            for rank, q in enumerate(queues, start=1):
                sent.append(_shared_copy(shard(rank)))  # alive until the worker has built from it
                q.put(sent[-1])
            model = build_rank_model(spec, own, self.group)
            del own
            self._wait_for("ready")
            del sent
            self.runner = build_runner(spec, model, self.group)
        except BaseException:
            self.close(graceful=False)
            raise
        logger.info("tensor parallel: %d ranks (%d spawned workers), %d threads each, all-reduce %s",
                    tp, tp - 1, threads, "shared memory + gloo" if spec.shm_name else "nccl")  # fmt: skip

    def _wait_for(self, what: str) -> None:
        for rank, (p, conn) in enumerate(zip(self.workers, self.conns), start=1):
            waited = 0.0
            while not conn.poll(1.0):
                waited += 1.0
                if not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) "
                                       f"before it was {what}")  # fmt: skip
                if waited > _START_TIMEOUT_S:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} not {what} after {waited:.0f} s"
                    )
            kind, detail = conn.recv()
            if kind == "error":
                first = detail.splitlines()[0]
                logger.error("tensor-parallel rank %d failed:\n%s", rank, detail)
                raise (ValueError if first.startswith(("ValueError", "KeyError")) else RuntimeError)(
                    f"tensor-parallel rank {rank}: {first}")  # fmt: skip

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent): `graceful`, through the step loop they are in;
        otherwise (start-up failed: they may be anywhere) by terminating them."""
        if self.group is not None:
            if graceful:
                try:
                    self.group.broadcast_object(None)
                except RuntimeError:  # a worker already gone
                    pass
            self.group.close()
            self.group = None
        torch.set_num_threads(self._threads_before)
        for p in self.workers:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.workers = []
