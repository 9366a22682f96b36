"""Builds inferd's C++ CPU kernels at install time (pyproject.toml holds the rest of the metadata).

The kernels in inferd/kernels/build.py's INSTALL_TIME compile here, with the flags and under the
module names that build.py looks for at run time, against the torch the build requirements pin
(the same release the package depends on). A build that cannot happen or fails (no compiler, not
x86 with AVX2/FMA/F16C, no torch in a `--no-build-isolation` install, a compile error) leaves the
install intact: inferd then compiles the kernels on first use, as it always can.
INFERD_SKIP_KERNEL_BUILD=1 skips the build.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import setup

ROOT = Path(__file__).parent.resolve()


def _warn(message: str) -> None:
    print(f"inferd setup: {message}; the kernels will compile on first use", file=sys.stderr)


def _kernel_build_module() -> ModuleType:
    """inferd/kernels/build.py on its own: importing the inferd package would need its
    dependencies, which the build environment does not have."""
    path = ROOT / "inferd" / "kernels" / "build.py"
    spec = importlib.util.spec_from_file_location("_inferd_kernel_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NamedTuple and annotations resolve through sys.modules
    spec.loader.exec_module(module)
    return module


def _kernel_extensions() -> dict[str, Any]:
    """setup() arguments that build the install-time kernels; {} where they cannot be built."""
    if os.environ.get("INFERD_SKIP_KERNEL_BUILD", "").strip().lower() in ("1", "true", "yes", "on"):
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _warn("torch is not importable in the build environment")
        return {}
    build = _kernel_build_module()
    if not build.cpu_supports_avx2_fma():
        return {}  # the kernels never run on this CPU: nothing to build, nothing to compile later

    class OptionalBuildExtension(BuildExtension):
        """Compiles as the first-use build does; a kernel that fails to build is left to it."""

        def build_extensions(self) -> None:
            # Python's own CFLAGS (-g, -DNDEBUG, -fwrapv, ...) would make this build differ from
            # the first-use one (torch's flags and the kernel's only) and -g doubles its time.
            # torch's ninja build takes its flags from compiler_so[1:].
            cmd = self.compiler.compiler_so
            keep = [a for a in cmd[1:] if a in ("-fPIC", "-pthread")]
            self.compiler.compiler_so = [cmd[0], *keep]
            super().build_extensions()

        def build_extension(self, ext: Any) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # compiler missing or failing: install without this kernel
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _warn(f"cannot build {ext.name} ({first})")

    extensions = [
        CppExtension(
            name=f"inferd.kernels.{build.installed_module_name(kernel)}",
            sources=[f"inferd/kernels/csrc/{kernel.source}"],
            extra_compile_args=kernel.cflags,
            extra_link_args=build.LDFLAGS,
        )
        for kernel in build.INSTALL_TIME
    ]
    return {"ext_modules": extensions, "cmdclass": {"build_ext": OptionalBuildExtension}}


setup(**_kernel_extensions())
