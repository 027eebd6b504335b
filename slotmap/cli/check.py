"""`slotmap check`: the differential suite without pytest, so any backend can be checked from the shell.

Seeded scenarios (config, workload, scheduler knobs) run through spec and the backend until N scheduler
steps have been compared; a share of the steps first sends an invalid variant that both must reject.
On the first difference it prints what differed and a runnable reproduction, and exits with status 1.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.backends import load_backend
from conformance.differential import DifferentialRun, MismatchError, one_torch_thread
from conformance.mutations import breaker
from conformance.scenario import random_scenario
from shadow.private_files import create_new
from spec.errors import ALL_ERRORS


@dataclass(frozen=True)
class CheckOptions:
    backend: str = "fast"
    steps: int = 2000  # scheduler steps to compare in total
    seed: int = 0
    invalid_share: float = 0.2  # share of steps preceded by an invalid variant
    max_steps_per_scenario: int = 200
    repro: Path | None = None  # also write the reproduction to this new file (shadow/private_files.py)


def check_command(options: CheckOptions, console: Console) -> bool:
    candidate = load_backend(options.backend)
    seeds = random.Random(options.seed)
    totals: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    started = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    with one_torch_thread(), progress:
        task = progress.add_task(f"spec vs {candidate.name}", total=options.steps)
        while totals["steps"] < options.steps:
            scenario_seed = seeds.randrange(2**32)
            run = DifferentialRun(random_scenario(scenario_seed, spec_decode=True), candidate)
            rng = random.Random(scenario_seed)
            totals["scenarios"] += 1
            try:
                while not run.done() and run.steps < options.max_steps_per_scenario:
                    if totals["steps"] + run.steps >= options.steps:
                        break
                    broken = breaker(rng.choice(ALL_ERRORS), rng) if rng.random() < options.invalid_share else None
                    run.step(broken)
                    progress.advance(task)
            except MismatchError as exc:
                progress.stop()
                console.print(f"[red bold]MISMATCH[/] in scenario seed {scenario_seed}: {exc.message}")
                console.print("reproduction:")
                console.print(exc.repro, markup=False, highlight=False)
                if options.repro is not None:
                    try:  # created exclusively: a file (or symlink) that appeared there since is left alone
                        create_new(options.repro, exc.repro + "\n")
                        console.print(f"(written to {options.repro})")
                    except FileExistsError:
                        console.print(f"(not written: {options.repro} exists now, and slotmap never replaces a file)")
                return False
            totals["steps"] += run.steps
            totals["requests"] += run.sched.stats.admitted
            totals["preemptions"] += run.sched.stats.preemptions
            totals["prefix hit tokens"] += run.sched.stats.prefix_hit_tokens
            totals["draft tokens"] += run.sched.stats.drafts_scheduled
            totals["draft tokens accepted"] += run.sched.stats.drafts_accepted
            totals["with attention"] += run.steps if run.scenario.attention is not None else 0
            rejected.update(run.rejected)

    table = Table(title=f"slotmap check: spec vs {candidate.name} agree (seed {options.seed})")
    table.add_column("what")
    table.add_column("count", justify="right")
    keys = ("scenarios", "steps", "with attention", "requests", "preemptions", "prefix hit tokens", "draft tokens",
            "draft tokens accepted")  # fmt: skip
    for key in keys:
        table.add_row(key if key != "with attention" else "steps with KV + attention compared", str(totals[key]))
    table.add_row("invalid outputs rejected identically", str(sum(rejected.values())))
    for name, n in sorted(rejected.items()):
        table.add_row(f"  {name}", str(n))
    table.add_row("seconds", f"{time.perf_counter() - started:.1f}")
    console.print(table)
    return True
