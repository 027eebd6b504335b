"""How every benchmark records itself: extra_info for the results page, and stateful timing."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import pytest

MIN_ROUNDS = 3
MAX_ROUNDS = 200  # stays well inside workloads.MAX_STREAM_STEPS


class Case(Protocol):
    """A workload as a parametrised case names it (benchmarks.workloads.Workload, feature_workloads.FeatureWorkload)."""

    @property
    def name(self) -> str: ...

    @property
    def quick(self) -> bool: ...


class Shape(Protocol):
    """What `record` states of a workload: benchmarks.workloads.Workload, or a recorded trace's steady state."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def num_reqs(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_groups(self) -> int: ...


def record(
    benchmark: Any,
    stage: str,
    workload: Shape,
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


def record_fallbacks(benchmark: Any, pool: Any, since: Counter[Any] | None = None, steps: int | None = None) -> None:
    """The steps fast's bulk planner left to spec's plan_step, by reason (fast/fallback.py): a timed step that
    fell back ran spec's Python walk, so a time is read with these beside it. Pools without a bulk path: none.

    `since`: a copy of `pool.fallbacks` taken earlier (after a warm-up), so only the steps after it count; `steps`:
    how many steps the pool applied in that span, recorded so a count reads as "n of these steps".
    """
    fallbacks = getattr(pool, "fallbacks", None)
    if fallbacks is not None:
        counted = fallbacks - since if since is not None else fallbacks
        benchmark.extra_info["fallbacks"] = {reason.name: count for reason, count in counted.items()}
        if steps is not None:
            benchmark.extra_info["counted_steps"] = steps


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


def param(workload: Case, provider: str) -> Any:
    """One (workload, provider) case; in the CI subset when the workload is."""
    marks = [pytest.mark.quick] if workload.quick else []
    return pytest.param(workload, provider, id=f"{workload.name}-{provider}", marks=marks)
