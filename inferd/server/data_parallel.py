"""`inferd serve --data-parallel-size N`: the flags, their checks, and the replicas they make.

With the `mp` backend the N engine processes share this host's cores: with C cores, replica i is
pinned to cores [i*C/N, (i+1)*C/N) and runs one torch thread per core it has (or `--threads`).
With `ray` each replica's engine is a Ray actor in a placement group of its own on the cluster
`--ray-address` names (inferd/distributed/ray_backend.py). One replica on `mp` is the plain
single-engine server, unchanged.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from inferd.config import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig
from inferd.distributed.cpus import cpu_list, split_cpus
from inferd.engine.async_engine import AsyncEngine
from inferd.engine.core import EngineCore
from inferd.engine.engine_proc import ProcessBackend
from inferd.router.policy import POLICIES, make_policy
from inferd.server.replicas import ReplicaSet
from inferd.server.supervisor import SupervisionConfig

BACKENDS = DISTRIBUTED_EXECUTOR_BACKENDS


@dataclass(frozen=True, slots=True)
class DataParallelConfig:
    size: int = 1  # engine replicas
    backend: str = "mp"  # mp: processes on this host; ray: actors on a Ray cluster
    threads: int | None = None  # torch threads per replica; None: its share of the cores
    router_policy: str = "cache_aware"
    ray_address: str | None = None  # None: Ray's own default ($RAY_ADDRESS, else a local Ray)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.size}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--distributed-executor-backend must be one of {BACKENDS}, "
                             f"got {self.backend!r}")  # fmt: skip
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.router_policy not in POLICIES:
            raise ValueError(f"--router-policy must be one of {sorted(POLICIES)}, "
                             f"got {self.router_policy!r}")  # fmt: skip


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    d = DataParallelConfig()
    g = parser.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.size,
                   help="engine replicas behind this server, each with its own KV cache and "
                   "its share of the cores; requests are routed by --router-policy")  # fmt: skip
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per replica (default: one per core of its share)")
    g.add_argument("--router-policy", choices=sorted(POLICIES), default=d.router_policy,
                   help="which replica takes a request, by the router's policies (docs/scale-out.md): "
                   "cache_aware (the replica likely to hold the prompt's prefix, unless loads are "
                   "unbalanced), least_load, round_robin or random")  # fmt: skip
    g.add_argument("--ray-address", default=d.ray_address,
                   help="the Ray cluster for --distributed-executor-backend ray (e.g. "
                   "10.0.0.1:6379 or auto; default: $RAY_ADDRESS, else a local Ray)")  # fmt: skip


def data_parallel_config(args: argparse.Namespace) -> DataParallelConfig:
    return DataParallelConfig(
        size=args.data_parallel_size,
        backend=args.distributed_executor_backend,
        threads=args.threads,
        router_policy=args.router_policy,
        ray_address=args.ray_address,
    )


def build_replicas(
    config: DataParallelConfig,
    engine_factory: Callable[[], EngineCore],
    model_name: str,
    supervision: SupervisionConfig,
    *,
    engine_process: bool = True,
    stream_interval: int = 1,
    max_stream_buffer_tokens: int | None = None,
    parallel: ParallelConfig | None = None,
) -> ReplicaSet:
    """The replicas `config` asks for, not started yet (on Ray, each replica's placement group
    has a bundle per tensor-parallel rank of `parallel`). ValueError for what cannot run here
    (more replicas than cores, a thread count over a replica's share, Ray missing)."""
    if config.backend == "ray":
        from inferd.distributed.ray_backend import ray_backends

        parallel = parallel or ParallelConfig()
        makers, placements = ray_backends(
            config.size, engine_factory, config.threads, config.ray_address, stream_interval,
            parallel.tensor_parallel_size, parallel.ray_placement_strategy,
        )  # fmt: skip
    elif config.size == 1 and config.threads is None:
        engine = AsyncEngine(
            engine_factory,
            engine_process=engine_process,
            bind_cpus=engine_process,  # this process only serves HTTP: it may move
            stream_interval=stream_interval,
            max_stream_buffer_tokens=max_stream_buffer_tokens,
        )
        return ReplicaSet([engine], model_name, supervision)
    else:
        if not engine_process:
            raise ValueError("--data-parallel-size and --threads need --engine-process")
        makers, placements = _process_backends(config, engine_factory, stream_interval)
    engines = [
        AsyncEngine(
            engine_factory,
            engine_process=True,
            stream_interval=stream_interval,
            max_stream_buffer_tokens=max_stream_buffer_tokens,
            make_backend=make,
        )
        for make in makers
    ]
    policy = make_policy(config.router_policy)
    return ReplicaSet(engines, model_name, supervision, policy, placements)


def _process_backends(
    config: DataParallelConfig, engine_factory: Callable[[], EngineCore], stream_interval: int
) -> tuple[list[Callable[[], ProcessBackend]], list[str]]:
    shares = split_cpus(os.sched_getaffinity(0), config.size)
    smallest = min(len(s) for s in shares)
    if config.threads is not None and config.threads > smallest:
        raise ValueError(
            f"--threads {config.threads} is more than the {smallest} core(s) each of the "
            f"{config.size} replicas gets; give fewer threads or fewer replicas"
        )
    if config.size == 1:  # --threads alone: the single engine's usual binding, fewer threads
        process = ProcessBackend(engine_factory, True, stream_interval, threads=config.threads)
        return [process.fresh], [""]
    makers, placements = [], []
    for cpus in shares:
        threads = config.threads or len(cpus)
        process = ProcessBackend(engine_factory, False, stream_interval, cpus, threads)
        makers.append(process.fresh)
        placements.append(f"{cpu_list(cpus)}, {threads} thread{'s' if threads > 1 else ''}")
    return makers, placements
