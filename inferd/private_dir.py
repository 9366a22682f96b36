"""Cache directories only their owner can write: the kernel cache holds native code the server
loads, the model and conversion caches hold weights it trusts.

`private_dir(path)` creates the missing folders of `path` with mode 0700 and refuses a folder that
exists but is owned by another user or writable by group or others (an attacker able to write
there could plant a `.so` the server would load, or weights it would serve). Folders that exist
with a safe mode (0755, say) are accepted as they are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeDirectoryError(PermissionError):
    """A cache directory another user could write to."""


def check_private(path: Path) -> None:
    """Raise `UnsafeDirectoryError` unless `path` is a directory owned by this user (or root's, for
    root) that neither group nor others may write."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        st = path.stat()  # a link to a folder is judged by the folder (its owner may be us)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"{path} is not a directory")
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeDirectoryError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}); inferd keeps "
            "native code and weights there and will not use it. Point INFERD_CACHE_DIR "
            "(or INFERD_KERNEL_CACHE_DIR) at a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"{path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); inferd keeps native code and weights there "
            f"and will not use it. Fix it with `chmod go-w {path}` or point INFERD_CACHE_DIR "
            "elsewhere"
        )


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path`, created (with its missing parents) mode 0700, checked with `check_private`."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass  # another process made it meanwhile; checked below
    check_private(path)
    return path
