"""How every benchmark records itself: extra_info for the results page, and stateful timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks.workloads import Workload

MIN_ROUNDS = 3
MAX_ROUNDS = 200  # stays well inside workloads.MAX_STREAM_STEPS


def record(
    benchmark: Any,
    stage: str,
    workload: Workload,
    provider: str,
    *,
    nbytes: int = 0,
    flops: int = 0,
    what: str = "",
    reference: str | None = None,
) -> None:
    """What the renderer reads: the stage, the workload's shape, and the work done (for GB/s or FLOP/s).

    A stage the renderer (slotmap/bench/page.py) does not list is shown with `what` as its description and
    its ratios divided by `reference`'s median, so a new stage needs no change there.
    """
    benchmark.group = f"{stage}/{workload.name}"
    benchmark.extra_info.update(
        stage=stage,
        workload=workload.name,
        kind=workload.kind,
        provider=provider,
        num_reqs=workload.num_reqs,
        num_tokens=workload.num_tokens,
        num_groups=workload.num_groups,
        bytes=int(nbytes),
        flops=int(flops),
    )
    if what:
        benchmark.extra_info["what"] = what
    if reference is not None:
        benchmark.extra_info["reference"] = reference


def record_fallbacks(benchmark: Any, pool: Any) -> None:
    """The steps fast's bulk planner left to spec's plan_step, by reason (fast/fallback.py): a timed step that
    fell back ran spec's Python walk, so a time is read with these beside it. Pools without a bulk path: none."""
    fallbacks = getattr(pool, "fallbacks", None)
    if fallbacks is not None:
        benchmark.extra_info["fallbacks"] = {reason.name: count for reason, count in fallbacks.items()}


def run_stateful(
    benchmark: Any, target: Callable[..., None], setup: Callable[[], tuple[Any, ...]], budget: float
) -> None:
    """Time `target(*setup())`, a fresh `setup()` (untimed) before every round: for stages that change the pool.

    One untimed call first both warms up and sizes the number of rounds to the time budget.
    """
    if benchmark.disabled:
        benchmark.pedantic(target, setup=lambda: (setup(), {}))
        return
    args = setup()
    start = time.perf_counter()
    target(*args)
    elapsed = max(time.perf_counter() - start, 1e-6)
    rounds = int(min(MAX_ROUNDS, max(MIN_ROUNDS, budget / elapsed)))
    benchmark.pedantic(target, setup=lambda: (setup(), {}), rounds=rounds)


def run_plain(benchmark: Any, target: Callable[[], None], budget: float) -> None:
    """Time a stage that leaves no state behind; a call too slow for the budget gets MIN_ROUNDS rounds (1 past 3 s)."""
    if benchmark.disabled:
        benchmark(target)
        return
    start = time.perf_counter()
    target()  # warm-up, and the size of one call
    elapsed = time.perf_counter() - start
    if elapsed * MIN_ROUNDS <= budget:
        benchmark(target)
    else:
        benchmark.pedantic(target, rounds=MIN_ROUNDS if elapsed < 3 else 1)


def param(workload: Workload, provider: str) -> Any:
    """One (workload, provider) case; in the CI subset when the workload is."""
    marks = [pytest.mark.quick] if workload.quick else []
    return pytest.param(workload, provider, id=f"{workload.name}-{provider}", marks=marks)
