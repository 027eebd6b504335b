"""`slotmap simulate`: a synthetic workload through scheduler -> pool -> tiny decoder, checked as it runs.

Requests arrive over time with shared prompt prefixes; the reference scheduler batches them (chunked
prefill, prefix caching, preemption, padding) over two KV groups, one with a sliding window. Every K-th
step is replayed through spec (BatchInputs exact, logits within tolerance), and every finished request
is recomputed densely (slotmap.simulate.dense_check). With `spec_tokens` > 0 the scheduler carries
n-gram drafts and the engine verifies them greedily; the same workload also runs without drafts, and
every request's tokens must be the same (slotmap.simulate.speculative).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conformance.backends import load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from slotmap.simulate.dense_check import check_request
from slotmap.simulate.report import SimulationReport
from slotmap.simulate.speculative import SpeculativeComparison, compare, plain_greedy_run, prefix_check
from slotmap.simulate.verify import SpecVerifier
from slotmap.tiny.drafting import NgramDrafter
from slotmap.tiny.engine import Engine, RequestRecord, StepResult, StepStats, drive
from slotmap.tiny.model import ModelConfig
from spec.types import KVCacheGroup, SchedulerOutput, WorkerConfig


@dataclass(frozen=True)
class SimulateOptions:
    backend: str = "fast"
    requests: int = 200
    seed: int = 0
    verify_every: int = 10  # 0: never replay through spec
    dense_check: bool = True
    max_prompt_len: int = 96
    max_new_tokens: int = 32
    arrival_steps: int | None = None  # arrivals spread over this many steps (default: one per 2 requests)
    num_blocks: int = 64  # group 0 (block size 16): small enough that busy stretches preempt
    spec_tokens: int = 0  # most drafts per request per step (speculative decoding with an n-gram drafter)


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


def run_simulation(options: SimulateOptions, console: Console | None = None) -> SimulationReport:
    config = simulation_config(options)
    backend = load_backend(options.backend)
    workload = make_workload(
        options.seed,
        config,
        num_requests=options.requests,
        max_arrival_step=options.arrival_steps if options.arrival_steps is not None else options.requests // 2,
        num_prefixes=4,
        shared_prefix_prob=0.6,
        max_prompt_len=options.max_prompt_len,
        max_new_tokens=options.max_new_tokens,
    )
    model_config = ModelConfig(vocab_size=config.vocab_size)
    knobs = replace(simulation_knobs(), spec_tokens=options.spec_tokens)
    drafter = NgramDrafter(options.spec_tokens) if options.spec_tokens else None
    scheduler = ReferenceScheduler(config, workload, knobs=knobs, seed=options.seed, proposer=drafter)
    engine = Engine(backend, config, model_config, record_logits=options.dense_check)
    verifier = SpecVerifier(engine, options.verify_every) if options.verify_every > 0 else None
    report = SimulationReport(options.backend, config, verifier=verifier, prompt_tokens=workload.num_prompt_tokens)
    finished: list[RequestRecord] = []
    plain_check = None
    if options.spec_tokens:
        report.speculative = comparison = SpeculativeComparison(options.spec_tokens)
        plain, comparison.plain_steps = plain_greedy_run(
            backend, config, workload, simulation_knobs(), options.seed, model_config
        )
        plain_check = prefix_check(comparison, plain, engine)

    def on_finished(record: RequestRecord) -> None:
        finished.append(record)
        report.finished += 1
        if options.dense_check:
            start = time.perf_counter()
            report.dense.append(check_request(engine.model, record))
            dense_seconds[0] += time.perf_counter() - start

    dense_seconds = [0.0]

    with Progress(
        TextColumn("[bold]simulate[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step {task.fields[step]}"),
        TimeElapsedColumn(),
        console=console or Console(),
        transient=False,
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
            if plain_check is not None:
                plain_check(out, result)

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
    if report.speculative is not None:
        report.speculative.drafts, report.speculative.accepted = stats.drafts_scheduled, stats.drafts_accepted
        report.speculative.speculative_steps = report.steps
        compare(report.speculative, workload, plain, finished)
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
