"""benchmarks/mrv2_prep.py still runs: its one tiny workload, in a process of its own (MRv2 needs Triton's
stand-in "cpu" backend installed before vLLM is imported, and this process may have imported vLLM already).

It times in that child process, not through pytest-benchmark, so this test only checks that a report
comes out whole. Not in the `quick` subset: it starts a vLLM engine (about half a minute on 2 cores).
The published report: `python -m benchmarks.mrv2_prep --out benchmarks/results/mrv2-prep-<machine>.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run with .venv-vllm/bin/python (scripts/setup-vllm)")

ROOT = Path(__file__).resolve().parent.parent


def test_mrv2_prep_reports_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "mrv2-prep.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTMAP_SHADOW", "SLOTMAP_TRITON_INTERPRET")}
    env.update(NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.mrv2_prep", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(out.read_text())
    assert set(report["includes"]) == {"mrv2", "fast", "excluded"}
    assert set(report["machine"]["flags"]) == {"amx_bf16", "amx_tile", "avx512f"}
    (w,) = report["workloads"].values()
    assert w["steps"] > 0 and w["torch_threads"] == 1 and len(w["pinned_to_cores"]) == 1, w
    assert all(t > 0 for t in w["median_us"].values()), w["median_us"]
    assert w["mrv2_launches_per_step"]["max"] > 0  # MRv2's kernels were launched (and stubbed), not skipped
