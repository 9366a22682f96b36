"""Tensor-parallel worker ranks as spawned processes on this host (`--distributed-executor-backend
mp`): ranks 1..N-1 start with `spawn`, report that they are up, join the group, take their shard
from a torch.multiprocessing queue (shared memory: rank 0 read the checkpoint once), build, report
ready — or the error that stopped them, which rank 0 raises as its own — and run the steps rank 0
broadcasts until it broadcasts `None`. A worker whose rank 0 dies exits with it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as tmp

from inferd.distributed.executor import LOCALHOST, START_TIMEOUT_S, RankSpec, build_worker
from inferd.distributed.executor import serve_steps, usable_cpus, worker_error
from inferd.quantization.formats import QuantizedWeight


def exit_with_parent() -> None:
    """A worker whose rank 0 died (killed, crashed) must not wait for it: exit with it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="inferd-tp-parent-watch", daemon=True).start()


def _worker_main(rank: int, spec: RankSpec, conn, weights_queue) -> None:
    """A worker rank: join, build from the shard rank 0 sends, then run steps until `None`."""
    exit_with_parent()
    torch.set_num_threads(spec.threads)
    try:
        conn.send(("started", None))
        group, runner = build_worker(spec, rank, weights_queue.get)
        conn.send(("ready", None))
    except Exception as e:  # noqa: BLE001 (rank 0 raises it: a worker's stderr is easy to miss)
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    serve_steps(runner, group)


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


class ProcessRanks:
    """Ranks 1..N-1 as spawned worker processes on this host (the executor's `Ranks`)."""

    host = LOCALHOST
    same_host = True

    def __init__(self, tp: int, device: torch.device) -> None:
        self.tp = tp
        self.threads = (
            max(1, len(usable_cpus()) // tp) if device.type == "cpu" else torch.get_num_threads()
        )
        self.workers: list = []
        self.conns: list = []
        self._queues: list = []
        self._sent: list[dict] = []
        self._shard: Callable[[int], dict] | None = None

    def describe(self) -> str:
        return f"{self.tp - 1} spawned worker process{'es' if self.tp > 2 else ''}"

    def start(self, spec: RankSpec, shard: Callable[[int], dict]) -> None:
        """Spawn the workers and wait until each runs (they then wait to join the group)."""
        self._shard = shard
        ctx = tmp.get_context("spawn")
        for rank in range(1, self.tp):
            parent, child = ctx.Pipe()
            q = ctx.Queue()
            p = ctx.Process(target=_worker_main, args=(rank, spec, child, q), daemon=True,
                            name=f"inferd-tp-rank{rank}")  # fmt: skip
            _start_worker(p, rank, spec.threads)
            self.workers.append(p)
            self.conns.append(parent)
            self._queues.append(q)
        self._wait_for("started")

    def joined(self) -> None:
        """The group is up: hand each worker its shard (alive until it has built from it)."""
        assert self._shard is not None
        for rank, q in enumerate(self._queues, start=1):
            self._sent.append(_shared_copy(self._shard(rank)))
            q.put(self._sent[-1])

    def wait_ready(self) -> None:
        self._wait_for("ready")
        self._sent = []

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.workers)

    def _wait_for(self, what: str) -> None:
        for rank, (p, conn) in enumerate(zip(self.workers, self.conns), start=1):
            waited = 0.0
            while not conn.poll(1.0):
                waited += 1.0
                if not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) "
                                       f"before it was {what}")  # fmt: skip
                if waited > START_TIMEOUT_S:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} not {what} after {waited:.0f} s"
                    )
            kind, detail = conn.recv()
            if kind == "error":
                raise worker_error(rank, detail)

    def close(self, graceful: bool) -> None:
        """Wait for the workers to leave their step loop (`graceful`), else terminate them."""
        for p in self.workers:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.workers = []
