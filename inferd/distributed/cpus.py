"""Sharing a host's cores among engine replicas (`serve --data-parallel-size`, `LLM(...,
data_parallel_size=N)`): replica i of N gets the cores [i*C/N, (i+1)*C/N)."""

from __future__ import annotations

from collections.abc import Sequence


def split_cpus(cpus: Sequence[int], n: int) -> list[list[int]]:
    """Replica i's cores: [i*C/N, (i+1)*C/N) of the C cores in `cpus` (sorted)."""
    cpus = sorted(cpus)
    if n > len(cpus):
        raise ValueError(
            f"--data-parallel-size {n} needs a core per replica; this process may use "
            f"{len(cpus)} ({cpu_list(cpus)})"
        )
    c = len(cpus)
    return [cpus[i * c // n : (i + 1) * c // n] for i in range(n)]


def cpu_list(cpus: Sequence[int]) -> str:
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"cores {cpus[0]}-{cpus[-1]}"
    return f"core{'s' if len(cpus) > 1 else ''} {', '.join(map(str, cpus))}"
