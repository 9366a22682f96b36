"""Cache directories: created 0700, refused when others may write them or another user owns them;
the conversion cache writes under unique names and never replaces an entry another process
finished first."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from inferd.loader import conversion_cache
from inferd.loader.default_model import cache_dir
from inferd.private_dir import UnsafeDirectoryError, private_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_0700_with_missing_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert private_dir(target) == target
    for p in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert mode(p) == 0o700
    assert private_dir(target) == target  # again: accepted as it is


def test_an_existing_safe_dir_is_kept(tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir(mode=0o755)
    os.chmod(tmp_path / "shared", 0o755)
    private_dir(tmp_path / "shared")
    assert mode(tmp_path / "shared") == 0o755


@pytest.mark.parametrize("bits,who", [(0o775, "its group"), (0o757, "others"), (0o777, "others")])
def test_writable_by_others_is_refused(tmp_path: Path, bits: int, who: str) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    os.chmod(bad, bits)
    with pytest.raises(UnsafeDirectoryError, match=f"writable by {who}.*chmod go-w"):
        private_dir(bad)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeDirectoryError, match="owned by uid 12345"):
        private_dir(theirs)


def test_caches_use_private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from inferd.kernels.build import build_dir

    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("INFERD_KERNEL_CACHE_DIR", raising=False)
    assert mode(cache_dir()) == 0o700
    folder = build_dir("probe", "cpu_kernels.cpp")
    assert mode(folder) == mode(folder.parent) == 0o700
    os.chmod(tmp_path / "cache" / "kernels", 0o777)
    with pytest.raises(UnsafeDirectoryError):
        build_dir("probe", "cpu_kernels.cpp")  # no native code from a folder others can write


def test_conversion_cache_never_clobbers_a_fresh_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store` writes under a unique temporary name and renames only into an empty place: an
    entry another process finished meanwhile stays as it is, and no temporary is left."""
    import dataclasses

    import torch

    from inferd.loader import load_model
    from inferd.loader.default_model import default_model_path
    from inferd.loader.weights import LoadedModel

    # The real model's config and tokenizer (from the real cache, before the test sets its own).
    real = load_model(default_model_path(), verbose=False, quantization="auto")
    model = LoadedModel(real.config, {"w": torch.ones(2)}, real.tokenizer, "m", "test")
    assert dataclasses.is_dataclass(model.config)
    monkeypatch.setenv("INFERD_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"stand-in: the entry's key is the path, size and mtime")
    entry = conversion_cache._entry(gguf)
    entry.mkdir()
    (entry / "meta.json").write_text("theirs")
    conversion_cache.store(gguf, model)
    assert (entry / "meta.json").read_text() == "theirs"
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    # With no entry there, the store lands whole.
    (entry / "meta.json").unlink()
    entry.rmdir()
    conversion_cache.store(gguf, model)
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "weights.safetensors"]
    assert conversion_cache.load_cached(gguf) is not None
