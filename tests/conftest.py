"""Shared fixtures: an isolated inferd cache dir; tiny random models written once per session."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import tiny_models`

from tiny_models import KQUANT_SPEC, TinyModel, TinySpec, write_gguf, write_hf_dir


@pytest.fixture(scope="session", autouse=True)
def inferd_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point INFERD_CACHE_DIR at a session tmp dir: tests never read or write ~/.cache."""
    path = tmp_path_factory.mktemp("inferd-cache")
    # Compiled C++ kernels are keyed by their source and flags: keep them across test sessions
    # (compiling takes ~40 s each) in the usual place, while models and conversions stay isolated.
    from inferd.loader.default_model import cache_dir

    os.environ.setdefault("INFERD_KERNEL_CACHE_DIR", str(cache_dir() / "kernels"))
    old = os.environ.get("INFERD_CACHE_DIR")
    os.environ["INFERD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("INFERD_CACHE_DIR", None)
    else:
        os.environ["INFERD_CACHE_DIR"] = old


class TinyModels:
    """Writes each named tiny model on first use and keeps it for the session.

    Names: "{arch}[-tied]-hf", "{arch}-hf-sharded", "{arch}[-tied]-{quant}.gguf" with arch
    llama|qwen2 and quant f32|q8_0|q4_0|q4_1|f16|mixed|kquants|lowbit (see tiny_models._quant_type;
    the last two have KQUANT_SPEC's sizes).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, TinyModel] = {}

    def __getitem__(self, name: str) -> TinyModel:
        if name not in self._models:
            self._models[name] = self._write(name)
        return self._models[name]

    def _write(self, name: str) -> TinyModel:
        stem, _, ext = name.partition(".")
        parts = stem.split("-")
        spec = TinySpec(arch=parts[0], tied="tied" in parts)
        if parts[-1] in ("kquants", "lowbit"):
            spec = dataclasses.replace(KQUANT_SPEC, arch=parts[0], tied="tied" in parts)
        if ext == "gguf":
            return write_gguf(self.root / name, spec, quant=parts[-1])
        assert "hf" in parts, name
        return write_hf_dir(self.root / name, spec, num_shards=2 if "sharded" in parts else 1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_models: TinyModels) -> TinyModel:
    """Untied Llama, HF directory (config.json, model.safetensors, tokenizer.json, ...)."""
    return tiny_models["llama-hf"]


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_models: TinyModels) -> TinyModel:
    """The same weights as `tiny_llama_hf`, as an F32 GGUF file."""
    return tiny_models["llama-f32.gguf"]


@pytest.fixture(scope="session")
def hf_transformers():
    """The `transformers` module (imported once; slow to import); skips when it is missing."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def packed_tiles_ext():
    """The CPU kernels, for tests of weights packed in VNNI tiles (the int4 head, the C++ draft
    chain): packing needs AVX512-VNNI, so on an AVX2-only CPU, where weights keep the row layout
    and the head drafts on the Python path, such a test skips."""
    from inferd.kernels.quant_gemm import extension

    ext = extension()
    if ext is None or not ext.has_int8_gemm:
        pytest.skip("no packed int8 tiles here (they need AVX512-VNNI)")
    return ext


def _kernel_builds() -> list[str]:
    """The kernel builds worth testing here: this CPU's, and the AVX2-only one where this CPU has
    AVX-512 (without it the two are the same code)."""
    from inferd.kernels.build import cpu_flags

    return ["native", "avx2"] if "avx512f" in cpu_flags().split() else ["native"]


@pytest.fixture(scope="module", params=_kernel_builds())
def kernel_build(request):
    """The CPU kernels as built for this CPU (-march=native) and, on an AVX-512 CPU, as the
    AVX2-only build (what the baseline CPUs run): kernel tests hold for both."""
    from inferd.kernels.quant_gemm import extension, extension_avx2

    e = extension() if request.param == "native" else extension_avx2()
    if e is None:
        pytest.skip("CPU kernels unavailable here (no compiler or no AVX2)")
    return e
