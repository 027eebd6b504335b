"""vLLM's default process layout: the engine core (and its worker) in processes of their own, where only the
plugin can attach. A slot shifted inside vLLM there is named by the checker in that process, the engine stops,
and the reproduction script it wrote replays the divergence here (tests/live_vllm/plugin_engine_process.py)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from shadow.checker import ShadowMismatchError

ROOT = Path(__file__).resolve().parents[2]


def test_the_plugin_reports_from_the_engine_core_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTMAP_")}
    done = subprocess.run([sys.executable, "-m", "tests.live_vllm.plugin_engine_process", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["planted"] is not None, "the bug was never planted"
    assert result["planted"]["pid"] != result["pid"]  # planted, and checked, in another process than this one's child
    assert result["error"] is not None and "EngineDeadError" in result["error"]  # the checker stopped the engine
    scripts = sorted((tmp_path / "repro").glob("shadow_repro_step*.py"))
    assert len(scripts) == 1, scripts
    logged = [line for line in done.stdout.splitlines() if "ShadowMismatchError: step" in line]
    assert logged and "slot_mapping[0]" in logged[0], done.stdout[-4000:]  # the report, in vLLM's log
    with pytest.raises(ShadowMismatchError) as replayed:
        runpy.run_path(str(scripts[0]))
    assert replayed.value.field == "slot_mapping[0]"
    assert f"step {replayed.value.step}: request {replayed.value.req_id!r}: slot_mapping[0]" in logged[0]
