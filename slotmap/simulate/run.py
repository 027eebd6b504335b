"""`slotmap simulate`: a synthetic workload through scheduler -> pool -> tiny decoder, checked as it runs.

Requests arrive over time with shared prompt prefixes; the reference scheduler batches them (chunked
prefill, prefix caching, preemption, padding) over two KV groups, one with a sliding window. Every K-th
step is replayed through spec (BatchInputs exact, logits within tolerance), and every finished request
is recomputed densely (slotmap.simulate.dense_check).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conformance.backends import load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from slotmap.simulate.dense_check import DenseCheck, check_request
from slotmap.simulate.verify import SpecVerifier
from slotmap.tiny.engine import STAGES, Engine, RequestRecord, StepResult, StepStats, drive
from slotmap.tiny.model import ModelConfig
from spec.types import KVCacheGroup, SchedulerOutput, WorkerConfig


@dataclass(frozen=True)
class SimulateOptions:
    backend: str = "fast"
    requests: int = 200
    seed: int = 0
    verify_every: int = 10  # 0: never replay through spec
    dense_check: bool = True
    plot: Path | None = None
    max_prompt_len: int = 96
    max_new_tokens: int = 32
    arrival_steps: int | None = None  # arrivals spread over this many steps (default: one per 2 requests)
    num_blocks: int = 64  # group 0 (block size 16): small enough that busy stretches preempt


def simulation_config(options: SimulateOptions) -> WorkerConfig:
    return WorkerConfig(
        max_num_reqs=24,
        max_model_len=options.max_prompt_len + options.max_new_tokens,
        max_num_batched_tokens=256,
        vocab_size=2048,
        kv_groups=(
            KVCacheGroup(block_size=16, num_blocks=options.num_blocks),
            KVCacheGroup(block_size=8, num_blocks=2 * options.num_blocks, sliding_window=24),
        ),
    )


def simulation_knobs() -> SchedulerKnobs:
    return SchedulerKnobs(max_chunk=64, pad_buckets=(8, 16, 24, 32, 48, 64, 96, 128, 192, 256), reuse_freed_first=True)


@dataclass
class SimulationReport:
    backend: str
    config: WorkerConfig
    steps: int = 0
    seconds: float = 0.0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_stats: list[StepStats] = field(default_factory=list)
    block_usage: list[list[int]] = field(default_factory=list)  # per step: blocks in use per group
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    verifier: SpecVerifier | None = None
    dense: list[DenseCheck] = field(default_factory=list)

    @property
    def all_matched(self) -> bool:
        return (self.verifier is None or self.verifier.all_matched) and all(c.ok for c in self.dense)


def run_simulation(options: SimulateOptions, console: Console | None = None) -> SimulationReport:
    config = simulation_config(options)
    backend = load_backend(options.backend)
    workload = make_workload(
        options.seed, config, num_requests=options.requests,
        max_arrival_step=options.arrival_steps if options.arrival_steps is not None else options.requests // 2,
        num_prefixes=4, shared_prefix_prob=0.6, max_prompt_len=options.max_prompt_len,
        max_new_tokens=options.max_new_tokens,
    )
    scheduler = ReferenceScheduler(config, workload, knobs=simulation_knobs(), seed=options.seed)
    engine = Engine(backend, config, ModelConfig(vocab_size=config.vocab_size),
                    record_logits=options.dense_check)
    verifier = SpecVerifier(engine, options.verify_every) if options.verify_every > 0 else None
    report = SimulationReport(options.backend, config, verifier=verifier,
                              prompt_tokens=workload.num_prompt_tokens)

    def on_finished(record: RequestRecord) -> None:
        report.finished += 1
        if options.dense_check:
            start = time.perf_counter()
            report.dense.append(check_request(engine.model, record))
            dense_seconds[0] += time.perf_counter() - start

    dense_seconds = [0.0]

    with Progress(
        TextColumn("[bold]simulate[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("step {task.fields[step]}"), TimeElapsedColumn(),
        console=console or Console(), transient=False,
    ) as progress:
        task = progress.add_task(f"{options.backend}: requests finished", total=options.requests, step=0)

        def on_step(out: SchedulerOutput, result: StepResult | None) -> None:
            report.scheduled_tokens += out.total_num_scheduled_tokens
            if result is not None:
                report.step_stats.append(result.stats)
                report.generated_tokens += result.stats.sampled
            else:
                report.step_stats.append(StepStats(0, 0, 0, 0, 0))
            done = scheduler.stats.finished + scheduler.stats.aborted
            progress.update(task, completed=done, step=len(report.step_stats))

        start = time.perf_counter()
        with _cpu_threads(1 if engine.device.type == "cpu" else None):
            report.steps = drive(engine, scheduler, observer=verifier, on_step=on_step, on_finished=on_finished)
            for record in engine.finish(set(engine.requests)):  # the last finishes never reach a scheduler output
                on_finished(record)
        report.seconds = time.perf_counter() - start
    stats = scheduler.stats
    report.stage_seconds = {**engine.stage_seconds, "dense check": dense_seconds[0]}
    report.block_usage = [list(u) for u in stats.block_usage]
    report.preemptions = stats.preemptions
    report.prefix_hit_tokens = stats.prefix_hit_tokens
    return report


@contextlib.contextmanager
def _cpu_threads(count: int | None) -> Iterator[None]:
    """The tiny model's CPU matmuls are too small to share: extra intra-op threads only spin and wait."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def render_report(report: SimulationReport, console: Console) -> None:
    table = Table(title=f"slotmap simulate --backend {report.backend}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    engine_seconds = sum(report.stage_seconds.get(s, 0.0) for s in STAGES if s != "verify")
    table.add_row("steps", str(report.steps))
    table.add_row("requests finished", str(report.finished))
    table.add_row("tokens scheduled / generated", f"{report.scheduled_tokens} / {report.generated_tokens}")
    table.add_row("wall time", f"{report.seconds:.2f} s")
    if engine_seconds > 0:
        rate = report.scheduled_tokens / engine_seconds
        table.add_row("tokens/s (scheduled, excluding verification)", f"{rate:,.0f}")
    padding = sum(s.padding_tokens for s in report.step_stats)
    table.add_row("padding tokens", str(padding))
    table.add_row("preemptions", str(report.preemptions))
    hit_rate = report.prefix_hit_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    table.add_row("prefix-cache hits", f"{report.prefix_hit_tokens} tokens ({hit_rate:.1%} of prompt tokens)")
    for g, group in enumerate(report.config.kv_groups):
        usage = [u[g] for u in report.block_usage] or [0]
        real = group.num_blocks - 1
        window = f", window {group.sliding_window}" if group.sliding_window else ""
        table.add_row(
            f"KV group {g} blocks in use (of {real}{window})",
            f"mean {sum(usage) / len(usage) / real:.0%}, peak {max(usage) / real:.0%}",
        )
    if report.verifier is not None:
        v = report.verifier
        table.add_row(
            f"verified against spec (every {v.every} steps)",
            f"{v.steps_checked} steps, worst logit error {v.worst_ratio:.2f} x bound: "
            + ("all matched" if v.all_matched else f"{len(v.mismatches)} MISMATCHES"),
        )
    if report.dense:
        bad = [c for c in report.dense if not c.ok]
        worst = max(c.max_error / c.tolerance for c in report.dense)
        table.add_row(
            "dense recompute (every request, every token)",
            f"{len(report.dense)} requests, worst error {worst:.1e} x tolerance: "
            + ("all matched" if not bad else f"{len(bad)} FAILED"),
        )
    table.add_row("every checked step matched", "[green]yes[/]" if report.all_matched else "[red]NO[/]")
    console.print(table)

    split = Table(title="time per stage")
    for col in ("stage", "seconds", "share"):
        split.add_column(col, justify="right" if col != "stage" else "left")
    total = sum(report.stage_seconds.values()) or 1.0
    for stage in (*STAGES, "dense check"):
        seconds = report.stage_seconds.get(stage, 0.0)
        split.add_row(stage, f"{seconds:.3f}", f"{seconds / total:.1%}")
    console.print(split)
    problems = (report.verifier.mismatches if report.verifier else []) + [f for c in report.dense for f in c.failures]
    for line in problems[:10]:
        console.print(f"[red]{line}[/]")


def simulate_command(options: SimulateOptions, console: Console) -> bool:
    """Run, print the summary, save the plot if asked; True when every checked step matched."""
    report = run_simulation(options, console)
    render_report(report, console)
    if options.plot is not None:
        from slotmap.simulate.plot import save_plot

        save_plot(report, options.plot)
        console.print(f"plot saved to {options.plot}")
    return report.all_matched
