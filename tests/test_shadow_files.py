"""Files slotmap writes on its own initiative land where only the user can write and never replace anything.

The shadow checker's reproductions (issue 25: the old default `<tmp>/slotmap-shadow` could be created first
by another user, as a folder or a symlink), `slotmap check --repro`, and `slotmap bench`'s scratch folder.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shadow.checker import ShadowChecker, ShadowMismatchError
from shadow.private_files import create_new, create_unique
from slotmap.cli import app
from spec.types import KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 10),))


def _mismatch(checker: ShadowChecker) -> ShadowMismatchError:
    out = SchedulerOutput(new_requests=(NewRequest("a", (5, 6, 7), ((3,),)),), num_scheduled_tokens={"a": 3})
    with pytest.raises(ShadowMismatchError) as caught:
        checker.check(out, {"positions": np.array([0, 1, 7])}, ["a"])
    assert caught.value.repro_path is not None
    return caught.value


def _private_under(path: Path, shared: Path) -> None:
    folder = path.parent
    assert folder.parent == shared and folder.name.startswith("slotmap-shadow-") and folder.name != "slotmap-shadow"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert folder.stat().st_uid == os.getuid() and not path.is_symlink()


def test_a_folder_and_a_symlink_at_the_old_default_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    old = shared / "slotmap-shadow"
    old.mkdir()
    planted = old / "shadow_repro_step0.py"
    planted.write_text("print('not yours')\n")

    error = _mismatch(ShadowChecker(CONFIG))
    assert error.repro_path is not None
    _private_under(error.repro_path, shared)
    assert sorted(old.iterdir()) == [planted] and planted.read_text() == "print('not yours')\n"
    assert f"reproduction: python {error.repro_path}" in str(error)  # the path written is the path shown
    assert "replay(config, steps" in error.repro_path.read_text()

    shutil.rmtree(old)
    victim = tmp_path / "victim"
    victim.mkdir()
    old.symlink_to(victim)
    again = _mismatch(ShadowChecker(CONFIG))
    assert again.repro_path is not None
    _private_under(again.repro_path, shared)
    assert again.repro_path.parent != error.repro_path.parent  # one private folder per checker
    assert list(victim.iterdir()) == [] and old.is_symlink() and os.readlink(old) == str(victim)


OPTIMIZED = """
import json, os, sys
import numpy as np
from shadow.checker import ShadowChecker, ShadowMismatchError
from spec.types import KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

shared, victim = sys.argv[1], sys.argv[2]
os.symlink(victim, os.path.join(shared, "slotmap-shadow"))
checker = ShadowChecker(WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 10),)))
out = SchedulerOutput(new_requests=(NewRequest("a", (5, 6, 7), ((3,),)),), num_scheduled_tokens={"a": 3})
try:
    checker.check(out, {"positions": np.array([0, 1, 7])}, ["a"])
except ShadowMismatchError as e:
    print(json.dumps({"debug": __debug__, "path": str(e.repro_path), "message": str(e)}))
"""


def test_the_same_under_python_dash_o(tmp_path: Path) -> None:
    """Assertions stripped: the checks that keep the script private are real code, not asserts."""
    shared, victim = tmp_path / "shared-tmp", tmp_path / "victim"
    shared.mkdir()
    victim.mkdir()
    env = {"TMPDIR": str(shared), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run([sys.executable, "-O", "-c", OPTIMIZED, str(shared), str(victim)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert seen["debug"] is False  # -O really ran
    path = Path(seen["path"])
    _private_under(path, shared)
    assert list(victim.iterdir()) == [] and f"reproduction: python {path}" in seen["message"]


def test_a_named_folder_keeps_what_it_holds(tmp_path: Path) -> None:
    """In a folder the caller names, an existing script and a symlink under the next name stay as they are."""
    theirs = tmp_path / "shadow_repro_step0.py"
    theirs.write_text("mine\n")
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep\n")
    (tmp_path / "shadow_repro_step0-2.py").symlink_to(target)
    error = _mismatch(ShadowChecker(CONFIG, repro_dir=tmp_path))
    assert error.repro_path == tmp_path / "shadow_repro_step0-3.py"
    assert theirs.read_text() == "mine\n" and target.read_text() == "keep\n"


def test_exclusive_creation_refuses_files_and_dangling_symlinks(tmp_path: Path) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "dangling", "x")
    assert not (tmp_path / "nowhere").exists()
    assert create_unique(tmp_path, "dangling", "", "y") == tmp_path / "dangling-2"


# ---- slotmap check --repro ----------------------------------------------------------------------------
BROKEN_BACKEND = """
import dataclasses
import types

import spec


class Pool(spec.RequestStatePool):
    def prepare(self, sched, pad_to=None):
        batch = super().prepare(sched, pad_to)
        return dataclasses.replace(batch, positions=batch.positions + 1)


def factory():
    return types.SimpleNamespace(RequestStatePool=Pool, write_kv=spec.write_kv, paged_attention=spec.paged_attention)
"""


def test_check_repro_writes_a_new_file_and_refuses_an_existing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shifted_backend.py").write_text(BROKEN_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = tmp_path / "repro.py"
    args = ["check", "--backend", "shifted_backend:factory", "--steps", "20", "--invalid-share", "0", "--repro"]
    result = CliRunner().invoke(app, [*args, str(target)], env={"COLUMNS": "200"})
    assert result.exit_code == 1 and f"(written to {target})" in result.output, result.output
    assert "shifted_backend:factory" in target.read_text()  # the script reloads the backend that differed
    again = CliRunner().invoke(app, [*args, str(target)], env={"COLUMNS": "200"})
    assert again.exit_code == 2 and "exists" in again.output and "never replaces" in again.output
    link = tmp_path / "link.py"
    link.symlink_to(tmp_path / "nowhere.py")
    linked = CliRunner().invoke(app, [*args, str(link)], env={"COLUMNS": "200"})
    assert linked.exit_code == 2 and not (tmp_path / "nowhere.py").exists()


# ---- slotmap bench's scratch folder -------------------------------------------------------------------
def test_bench_scratch_is_the_checkouts_only_where_no_one_else_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slotmap.bench import run as bench_run

    checkout = tmp_path / "benchmarks"
    checkout.mkdir(mode=0o755)
    monkeypatch.setattr(bench_run, "SCRATCH", checkout / ".scratch")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench_run.scratch_folder() == checkout / ".scratch"  # absent: made there by the run
    (checkout / ".scratch").symlink_to(tmp_path)
    swapped = bench_run.scratch_folder()
    assert swapped != checkout / ".scratch" and swapped.name.startswith("slotmap-bench-")
    assert stat.S_IMODE(swapped.stat().st_mode) == 0o700
    (checkout / ".scratch").unlink()
    checkout.chmod(0o777)  # anyone may write in the parent: anyone could plant the folder
    try:
        assert bench_run.scratch_folder().name.startswith("slotmap-bench-")
    finally:
        checkout.chmod(0o755)
