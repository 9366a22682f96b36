"""benchmarks/gpu_check.py runs end to end on the CPU (`--device cpu --quick`): the run a GPU
machine gets once must not be the first time its code runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    return proc, {s["name"]: s for s in summary["sections"]}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory):
    return run_check(tmp_path_factory.mktemp("gpu-check"))


def test_every_section_runs_on_the_cpu(dry_run):
    proc, sections = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(sections) == ["environment", "triton", "parity", "speculation", "memory_plan", "step_time", "syncs",
                              "cuda_graphs"]
    try:
        import inferd.kernels.triton.selfcheck  # noqa: F401
        expected_triton = "ok"
    except ImportError:
        expected_triton = "skipped"
    assert sections["triton"]["status"] == expected_triton
    for name, section in sections.items():
        if name != "triton":
            assert section["status"] == "ok", (name, section["note"])
    # The CPU engine's greedy tokens equal the committed reference; speculation changed nothing.
    assert sections["parity"]["result"]["first_differing_token"] == [None] * 4
    assert sections["speculation"]["result"]["draft_tokens"] > 0
    # Both ways on the engine (eager both on the CPU); the CPU captures no graph.
    step_times = sections["step_time"]["result"]
    assert {"cuda_graphs batch 1", "cuda_graphs batch 4", "eager batch 1", "eager batch 4",
            "speedup batch 4"} <= set(step_times)  # fmt: skip
    assert step_times["graphs"] == "none captured"
    assert sections["syncs"]["result"]["readbacks_per_decode_step"] == 1
    graphs = sections["cuda_graphs"]["result"]["batch 4, context 64"]
    assert graphs["eager_ms"] > 0 and graphs["graph"] == "CUDA only"
    assert "[gpu_check +" in proc.stdout and "summary in" in proc.stdout
    assert (Path(proc.args[proc.args.index("--out") + 1]) / "summary.md").read_text().startswith("# inferd GPU check")


def test_the_budget_skips_the_sections_left(tmp_path: Path):
    proc, sections = run_check(tmp_path, "--budget-s", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sections["environment"]["status"] == "ok"
    assert all(sections[n]["status"] == "skipped" and "budget" in sections[n]["note"]
               for n in ("parity", "speculation", "memory_plan", "step_time", "syncs", "cuda_graphs"))  # fmt: skip
