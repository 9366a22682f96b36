"""Every `INFERD_*` environment variable: its kind, default and meaning, read here and only here.

Code reads a variable as an attribute (`envs.INFERD_CACHE_DIR`); each access reads the environment
afresh, so a variable set after import (by a launcher, a test) is seen by code reaching it later.
A few are read once by their consumer and then hold for the process: INFERD_MALLOPT when inferd
is imported, INFERD_INT8_ACTIVATIONS when inferd.quantization.formats is imported,
INFERD_ONEDNN_LINEAR at its first use, INFERD_STREAM_PREFETCH when the CPU kernels load,
INFERD_FUSED_DECODE when inferd.models.decoder is imported.

These are process-wide by nature: where files go, the allocator, and switches of the compiled
kernels and their process-global state, which every engine in the process shares. Per-engine
settings are fields of inferd.config and `inferd serve` / `LLM(...)` arguments instead;
INFERD_API_KEY is only the default of `--api-key`.

This module imports nothing from inferd or torch: `inferd/__init__.py` reads INFERD_MALLOPT before
torch is imported. `describe()` gives the table the docs show.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the attributes `__getattr__` serves, for type checkers
    INFERD_API_KEY: str | None
    INFERD_CACHE_DIR: str
    INFERD_KERNEL_CACHE_DIR: str
    INFERD_INSTALLED_KERNELS: bool
    INFERD_MALLOPT: bool
    INFERD_FUSED_DECODE: bool
    INFERD_WEIGHT_ARENA: bool
    INFERD_ONEDNN_LINEAR: bool
    INFERD_STREAM_PREFETCH: str | None
    INFERD_INT8_ACTIVATIONS: bool | None

# The values INFERD_STREAM_PREFETCH takes (csrc/stream_prefetch.h; inferd.kernels.quant_gemm maps
# them to the kernels' codes).
STREAM_PREFETCH_CHOICES = ("nta", "t0", "off", "l2", "l2-rows")

_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One variable: `kind` and `default` as the docs show them; `parse` maps the raw value (None
    when unset) to what the code receives."""

    name: str
    kind: str
    default: str
    meaning: str
    parse: Callable[[str | None], Any]

    def value(self) -> Any:
        return self.parse(os.environ.get(self.name))


def _switch(raw: str | None) -> bool:
    """On unless set to 0 / false / no / off."""
    return raw is None or raw.strip().lower() not in _FALSE


def _tristate(raw: str | None) -> bool | None:
    """None when unset or empty (the code decides), else on unless 0 / false / no / off."""
    if raw is None or not raw.strip():
        return None
    return raw.strip().lower() not in _FALSE


def _text(raw: str | None) -> str | None:
    return raw or None


def _cache_dir(raw: str | None) -> str:
    if raw:
        return raw
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "inferd")


def _kernel_cache_dir(raw: str | None) -> str:
    return raw or os.path.join(_cache_dir(os.environ.get("INFERD_CACHE_DIR")), "kernels")


def _stream_prefetch(raw: str | None) -> str | None:
    value = (raw or "").strip().lower()
    if not value:
        return None
    if value not in STREAM_PREFETCH_CHOICES:
        choices = ", ".join(STREAM_PREFETCH_CHOICES)
        raise ValueError(f"INFERD_STREAM_PREFETCH={value!r}: expected one of {choices}")
    return value


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "INFERD_CACHE_DIR", "path", "$XDG_CACHE_HOME/inferd, else ~/.cache/inferd",
            "where inferd keeps fetched models, converted weights, trained draft heads and their "
            "training data",
            _cache_dir,
        ),
        EnvVar(
            "INFERD_KERNEL_CACHE_DIR", "path", "$INFERD_CACHE_DIR/kernels",
            "where the C++ kernels are compiled on first use, one folder per source, flags, CPU "
            "and torch version",
            _kernel_cache_dir,
        ),
        EnvVar(
            "INFERD_INSTALLED_KERNELS", "switch", "1",
            "0 ignores the C++ kernels `pip install` built and compiles them on first use instead "
            "(inferd/kernels/build.py)",
            _switch,
        ),
        EnvVar(
            "INFERD_API_KEY", "string", "unset (no key)",
            "the default of `inferd serve --api-key`: requests must carry "
            "'Authorization: Bearer KEY'",
            _text,
        ),
        EnvVar(
            "INFERD_MALLOPT", "switch", "1",
            "0 leaves glibc's allocator as it is; on, importing inferd keeps freed blocks under "
            "32 MiB in the heap, so a step's large temporaries are not page-faulted afresh",
            _switch,
        ),
        EnvVar(
            "INFERD_WEIGHT_ARENA", "switch", "1",
            "0 leaves CPU weights where the loader put them; on, they move into one huge-page "
            "block in layer order (inferd/layers/weight_arena.py)",
            _switch,
        ),
        EnvVar(
            "INFERD_ONEDNN_LINEAR", "switch", "1",
            "without the C++ kernels: 0 runs fp32 matmuls of many rows on at::linear; on, "
            "through oneDNN with the weight "
            "packed once (inferd/layers/onednn_linear.py; same results to rounding)",
            _switch,
        ),
        EnvVar(
            "INFERD_STREAM_PREFETCH", "one of " + ", ".join(STREAM_PREFETCH_CHOICES),
            "by CPU vendor: l2-rows on AMD, t0 elsewhere",
            "how the CPU kernels prefetch the weights a step streams (csrc/stream_prefetch.h); "
            "a hint only: every choice gives the same bits",
            _stream_prefetch,
        ),
        EnvVar(
            "INFERD_FUSED_DECODE", "switch", "1",
            "0 runs decode steps through the per-layer Python path instead of the fused C++ step "
            "(csrc/decoder_layers.h; the same bits), to compare the two: tensor-parallel worker "
            "ranks inherit it",
            _switch,
        ),
        EnvVar(
            "INFERD_INT8_ACTIVATIONS", "switch or unset", "unset: on where the CPU kernels have "
            "AVX512-VNNI tiles",
            "1 / 0 forces int8 and int4 weight matmuls to round activations to int8 per 32-block "
            "(faster; perplexity slightly higher) or to keep them fp32",
            _tristate,
        ),
    )
}  # fmt: skip


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.value()


def __dir__() -> list[str]:
    return sorted([*globals(), *ENV_VARS])


def settings() -> dict[str, str]:
    """Every INFERD_* variable set in this process, as set: what a process started elsewhere (a
    Ray actor) needs to behave as this one."""
    return {k: v for k, v in os.environ.items() if k.startswith("INFERD_")}


def describe() -> str:
    """One Markdown table row per variable: name, kind, default, meaning."""
    rows = ["| variable | kind | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind} | {v.default} | {v.meaning} |" for v in ENV_VARS.values()]
    return "\n".join(rows)

