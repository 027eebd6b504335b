"""The command line as a new user meets it: misuse ends in one line saying what to do, before any work.

Also `--version`, `python -m slotmap`, SLOTMAP_TRITON_INTERPRET under `--backend fast`, and the pytest
plugin staying out of other projects' test runs.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slotmap.cli import app

WIDE = {"COLUMNS": "200"}


def _misuse(args: list[str], *expected: str) -> str:
    """Exit status 2, typer's usage line and one error message (a long one may wrap in the box), no traceback."""
    result = CliRunner().invoke(app, args, env=WIDE)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("Usage:") and lines[-1].startswith("╰"), result.output
    assert sum(line.startswith("╭─ Error") for line in lines) == 1, result.output
    message = " ".join(line.strip("│ ") for line in lines if line.startswith("│"))
    for text in expected:
        assert text in message, result.output
    return message


@pytest.mark.parametrize("command", ["demo", "explain", "simulate", "check"])
@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("cuda", "use spec, fast, fast-interpret, or package.module:factory"),
        ("nosuchmod:factory", "cannot import 'nosuchmod'"),
        ("spec:nosuchfactory", "spec.nosuchfactory is not defined"),
        ("spec:NULL_BLOCK_ID", "spec.NULL_BLOCK_ID is not callable"),
    ],
)
def test_a_wrong_backend_is_one_line(command: str, name: str, says: str) -> None:
    _misuse([command, "--backend", name], "--backend", says)


def test_a_factory_that_fails_or_returns_no_backend_is_one_line() -> None:
    _misuse(["check", "--backend", "spec:WorkerConfig"], "WorkerConfig() raised TypeError")
    _misuse(["check", "--backend", "spec:SchedulerOutput"], "returned SchedulerOutput, not a spec.Backend")


def test_simulate_rejects_a_plot_format_before_running() -> None:
    line = _misuse(["simulate", "--requests", "100000", "--plot", "run.xyz"], "--plot", "run.xyz", ".png")
    assert ".svg" in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["explain", "--svg", "step.png"], ".svg"),
        (["explain", "--png", "step.svg"], ".png"),
        (["explain", "--step", "0"], "--step"),
        (["simulate", "--seed", "-1"], "--seed"),
        (["bench", "--budget", "0"], "more than 0"),
        (["bench", "--machine", "../x"], "not a file name"),
        (["bench", "--quick", "--save"], "drop --quick"),
    ],
)
def test_other_misuse_is_one_line(args: list[str], says: str) -> None:
    _misuse(args, says)


def test_an_output_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    _misuse(["check", "--repro", str(tmp_path)], "is a directory")
    _misuse(["simulate", "--plot", str(tmp_path)], "is a directory")


def test_fast_honours_the_interpreter_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.backends import canonical_name, load_backend

    monkeypatch.setenv("SLOTMAP_TRITON_INTERPRET", "1")
    cuda = __import__("torch").cuda.is_available()
    assert canonical_name("fast") == ("fast" if cuda else "fast-interpret")
    handle = load_backend("fast")
    assert handle.name == canonical_name("fast") and handle.module.enabled is not cuda  # type: ignore[attr-defined]
    result = CliRunner().invoke(app, ["check", "--backend", "fast", "--steps", "2", "--invalid-share", "0"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"spec vs {canonical_name('fast')} agree" in result.output
    monkeypatch.setenv("SLOTMAP_TRITON_INTERPRET", "0")
    assert load_backend("fast").name == "fast" and canonical_name("fast") == "fast"


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"slotmap {version('slotmap')}"


def test_python_dash_m_runs_the_same_command() -> None:
    done = subprocess.run([sys.executable, "-m", "slotmap", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage: slotmap" in done.stdout and "simulate" in done.stdout


def test_the_pytest_plugin_stays_out_of_other_projects(tmp_path: Path) -> None:
    """Another project with its own `backend` fixture: installing slotmap must not take it over."""
    (tmp_path / "test_theirs.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef backend():\n    return 'theirs'\n\n"
        "def test_own_fixture(backend):\n    assert backend == 'theirs'\n"
    )
    run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
    done = subprocess.run([*run, "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
    helped = subprocess.run([*run, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "--conformance-scale" not in helped.stdout and "--backend" not in helped.stdout
    asked = subprocess.run(
        [*run, "-p", "conformance.pytest_plugin", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert "--backend" in asked.stdout  # still there for a project that asks for it
