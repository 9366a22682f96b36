"""Where the CPU kernels cannot be built, the engine still serves (the PyTorch path, same
outputs) and says so as a warning: a failed build once made every benchmark ~3x slower with
nothing but one stderr line to show for it. The failure is real: a fresh kernel cache and a
compiler that always fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tiny_models import TinySpec, write_gguf

from inferd.kernels import build

SCRIPT = """
import sys
from inferd import LLM, SamplingParams
llm = LLM(model=sys.argv[1], verbose=False)
out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids))
"""


@pytest.mark.skipif(not build.cpu_supports_avx2_fma(), reason="the kernels are never built here")
def test_engine_warns_when_the_kernels_fail_to_build(tmp_path) -> None:
    tiny = write_gguf(tmp_path / "tiny.gguf", TinySpec())
    env = {**os.environ, "INFERD_KERNEL_CACHE_DIR": str(tmp_path / "kernels"), "CXX": "/bin/false"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny.path)], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "tokens 4" in run.stdout
    assert "cannot build the CPU kernels" in run.stderr
    assert "CPU kernels are not loaded" in run.stderr
