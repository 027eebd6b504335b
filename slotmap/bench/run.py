"""`slotmap bench`: run the benchmark suites through pytest, keep their JSON, render the page, print the targets.

By default everything goes to benchmarks/.scratch/ (ignored by git): the JSON, a rendered copy of the
page and its plots (where another user could write there, to a new private folder: `scratch_folder`).
`--save` publishes: it pins torch and OpenMP to one thread (or `--threads N`) and records that in the
JSON, keeps the JSON in benchmarks/results/<machine>.json, and re-renders docs/performance.md from every
published results file. The page is generated from saved JSON only, so every number on it can be traced
to a file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from shadow.private_files import private_dir
from slotmap.bench.page import render
from slotmap.bench.results import load
from slotmap.bench.targets import rich_table, target_rows

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"  # published: one JSON per machine, made by `slotmap bench --save`
SCRATCH = ROOT / "benchmarks" / ".scratch"  # everything else
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "img"
PUBLISH_THREADS = 1  # a published run's torch/OpenMP threads unless --threads says otherwise

QUICK_ARGS = ["-m", "quick", "--benchmark-min-rounds=3", "--benchmark-max-time=0.05", "--bench-budget=0.05"]
FULL_ARGS = ["--benchmark-min-rounds=3", "--benchmark-max-time=0.5", "--bench-budget=0.5"]


@dataclass(frozen=True)
class BenchOptions:
    quick: bool = False
    save: bool = False  # publish to benchmarks/results/ and docs/performance.md
    render_only: bool = False
    budget: float | None = None
    machine: str | None = None
    threads: int | None = None
    pytest_args: list[str] = field(default_factory=list)


def machine_name() -> str:
    """`<cpu or gpu model>-<cores>c`, filesystem-safe: the results file's name."""
    import torch

    if torch.cuda.is_available():
        model = torch.cuda.get_device_name(0)
    else:
        import cpuinfo  # a dependency of pytest-benchmark

        model = cpuinfo.get_cpu_info().get("brand_raw", "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{slug}-{os.cpu_count()}c"


def run(quick: bool, budget: float | None, json_path: Path, extra: list[str], threads: int | None = None) -> str:
    """Run the suites through pytest; returns the command line (recorded in the JSON and on the page)."""
    args = list(QUICK_ARGS if quick else FULL_ARGS)
    if budget is not None:
        args = [a for a in args if not a.startswith(("--benchmark-max-time", "--bench-budget"))]
        args += [f"--benchmark-max-time={budget}", f"--bench-budget={budget}"]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "benchmarks", "--benchmark-enable", f"--benchmark-json={json_path}",
           "-q", "-p", "no:cacheprovider", *args, *extra]  # fmt: skip
    env = dict(os.environ)
    prefix = ""
    if threads is not None:  # torch intra-op threads, and OpenMP/BLAS pools to match
        pinned = {"SLOTMAP_BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        env.update(pinned)
        prefix = " ".join(f"{k}={v}" for k, v in pinned.items()) + " "
    shown = prefix + " ".join(shlex.quote(c) for c in ["python", *cmd[1:]]).replace(str(ROOT) + "/", "")
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code not in (0, 5) or not json_path.exists():  # 5: nothing collected (e.g. a -k that matches nothing)
        raise SystemExit(f"benchmarks failed (pytest exit code {code})")
    data = json.loads(json_path.read_text())
    data["slotmap_command"] = shown
    data["slotmap_threads"] = threads  # None: torch's own choice
    for b in data["benchmarks"]:
        b["stats"].pop("data", None)  # every round's raw time: megabytes, and the page needs only the summary
    json_path.write_text(json.dumps(data, indent=1))
    return shown


def main(options: BenchOptions, console: Console) -> None:
    name = options.machine or machine_name()
    threads = options.threads if options.threads is not None or not options.save else PUBLISH_THREADS
    scratch = None if options.save else scratch_folder()
    folder, page, images = (RESULTS, PAGE, IMAGES) if scratch is None else (scratch, scratch / "performance.md",
                                                                            scratch / "img")  # fmt: skip
    ours = folder / f"{name}.json"
    if not options.render_only:
        run(options.quick, options.budget, ours, options.pytest_args, threads)
    paths = published() if options.save else [ours]
    if not paths or not all(p.exists() for p in paths):
        raise SystemExit(f"no results in {folder}: run `slotmap bench{' --save' if options.save else ''}` first")
    render(paths, page, images)
    console.print(f"rendered {_shown(page)} from {', '.join(_shown(p) for p in paths)}")
    if ours.exists():
        _, results = load(ours)
        console.print(rich_table(target_rows(results), f"targets on {name}"))


def scratch_folder() -> Path:
    """benchmarks/.scratch when only this user can write there (their own checkout), else a new private folder.

    The bench rewrites its scratch files every run, so the folder must be one no other user can create or
    swap for a symlink: a real directory owned by the user, in a parent only the user can write.
    """
    if _only_mine(SCRATCH.parent) and (not os.path.lexists(SCRATCH) or _only_mine(SCRATCH)):
        return SCRATCH
    return private_dir("slotmap-bench-")


def _only_mine(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISDIR(st.st_mode) and mine and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def published() -> list[Path]:
    """The results files `slotmap bench --save` wrote; any other JSON in the folder is not published."""
    return [p for p in sorted(RESULTS.glob("*.json")) if "slotmap_command" in json.loads(p.read_text())]
