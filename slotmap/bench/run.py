"""`slotmap bench`: run the benchmark suites through pytest, keep their JSON, render the page, print the targets.

By default everything goes to benchmarks/.scratch/ (ignored by git): the JSON, a rendered copy of the
page and its plots. `--save` publishes: it pins torch and OpenMP to one thread (or `--threads N`) and
records that in the JSON, keeps the JSON in benchmarks/results/<machine>.json, and re-renders
docs/performance.md from every published results file. The page is generated from saved JSON only, so
every number on it can be traced to a file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

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
    folder, page, images = (RESULTS, PAGE, IMAGES) if options.save else (SCRATCH, SCRATCH / "performance.md",
                                                                         SCRATCH / "img")  # fmt: skip
    ours = folder / f"{name}.json"
    if not options.render_only:
        run(options.quick, options.budget, ours, options.pytest_args, threads)
    paths = published() if options.save else [ours]
    if not paths or not all(p.exists() for p in paths):
        raise SystemExit(f"no results in {folder}: run `slotmap bench{' --save' if options.save else ''}` first")
    render(paths, page, images)
    console.print(f"rendered {page.relative_to(ROOT)} from {', '.join(str(p.relative_to(ROOT)) for p in paths)}")
    if ours.exists():
        _, results = load(ours)
        console.print(rich_table(target_rows(results), f"targets on {name}"))


def published() -> list[Path]:
    """The results files `slotmap bench --save` wrote; any other JSON in the folder is not published."""
    return [p for p in sorted(RESULTS.glob("*.json")) if "slotmap_command" in json.loads(p.read_text())]
