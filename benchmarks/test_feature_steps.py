"""The host step where fast's bulk planner may hand steps to spec's plan_step: model kinds and modes it may not plan.

fast plans a step with compiled passes (fast/validate.py plan_bulk_step) and leaves the shapes those do not model
to spec's Python plan_step, counting each in `pool.fallbacks` (fast/fallback.py): a cross-attention group, new
requests with encoder fields, a mamba group under async scheduling, unverified drafts beside a window or mamba
group. These benchmarks show what such steps cost, fast against spec, and which fell back.

Per workload (benchmarks/feature_workloads.py) the reference scheduler's steps are recorded first, untimed
(benchmarks/feature_trace.py). A fast pool and a spec pool each replay the warm-up to the steady state, untimed;
then every timed round of fast's host step (apply + prepare + record_sampled) follows spec's host step of the same
output, timed by the same clock, as test_host.py's host_step_interleaved does with numpy-vectorised: both medians
see the same machine. The fallbacks recorded are those of fast's steps after the warm-up. At the end both pools
must hold the same rows, tokens and tables, so no time is of a step either got wrong.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import spec
from benchmarks import providers
from benchmarks.feature_trace import TraceStep, record_trace
from benchmarks.feature_workloads import FEATURE_WORKLOADS, FeatureWorkload
from benchmarks.harness import MAX_ROUNDS, param, record, record_fallbacks, run_stateful
from benchmarks.providers import Provider

STAGE = "feature_step_interleaved"
WHAT = (
    "apply + prepare + record_sampled on model kinds and modes fast's bulk planner may leave to spec's plan_step, "
    "fast's rounds interleaved with spec's (benchmarks/test_feature_steps.py)"
)

# steady steps replayed untimed after the prefills: the first steps of the steady shape load its compiled paths,
# which would otherwise size run_stateful's rounds from a first call many times slower than the rest
STEADY_WARMUP = 2

# One step's arguments in a provider's arrays: the output, the sampled ids, and the drafter's ids if it proposed.
Inputs = tuple[spec.SchedulerOutput, Any, tuple[Any, ...]]


def _inputs(provider: Provider, step: TraceStep) -> Inputs:
    proposed = () if step.proposed is None else (provider.asarray(step.proposed),)
    return step.out, provider.asarray(step.sampled), proposed


def _host_step(pool: Any, out: spec.SchedulerOutput, sampled: Any, proposed: tuple[Any, ...]) -> None:
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), sampled, *proposed)


@pytest.mark.parametrize(("workload", "provider_name"), [param(w, "fast") for w in FEATURE_WORKLOADS])
def test_feature_step_interleaved(
    benchmark: Any, bench_budget: float, workload: FeatureWorkload, provider_name: str
) -> None:
    # setup runs once per round and once more for the calibration call (harness.run_stateful), one step each
    trace = record_trace(workload, STEADY_WARMUP + (2 if benchmark.disabled else MAX_ROUNDS + 2))
    warmup, timed = trace.warmup + trace.steady[:STEADY_WARMUP], trace.steady[STEADY_WARMUP:]
    fast_provider, spec_provider = providers.get(provider_name), providers.get("spec")
    fast_pool = fast_provider.make_pool(trace.config)  # type: ignore[misc]
    spec_pool = spec_provider.make_pool(trace.config)  # type: ignore[misc]
    for step in warmup:
        _host_step(fast_pool, *_inputs(fast_provider, step))
        _host_step(spec_pool, *_inputs(spec_provider, step))
    warm = Counter(fast_pool.fallbacks)
    fast_steps = iter([_inputs(fast_provider, s) for s in timed])
    spec_steps = iter([_inputs(spec_provider, s) for s in timed])
    timer, spec_times = benchmark._timer, []

    def target(out: spec.SchedulerOutput, sampled: Any, proposed: tuple[Any, ...]) -> None:
        fast_pool.apply(out)
        fast_pool.record_sampled(fast_pool.prepare(out), sampled, *proposed)

    def setup() -> Inputs:
        inputs = next(spec_steps)
        start = timer()
        _host_step(spec_pool, *inputs)
        spec_times.append(timer() - start)
        return next(fast_steps)

    record(benchmark, STAGE, trace, provider_name, reference="spec", what=WHAT)
    run_stateful(benchmark, target, setup, bench_budget)
    record_fallbacks(benchmark, fast_pool, since=warm, steps=len(spec_times))  # fast ran one step per spec step
    assert fast_pool.snapshot() == spec_pool.snapshot()
    if not benchmark.disabled:
        fast_median = float(benchmark.stats.stats.median)
        spec_median = float(np.median(spec_times[1:] or spec_times))  # the first: the calibration call's
        # per provider, as test_vllm_prep.py records its three: the page reads both medians from one benchmark
        benchmark.extra_info[f"{provider_name}_median"] = fast_median
        benchmark.extra_info["spec_median"] = spec_median
        benchmark.extra_info[f"{provider_name}_over_spec_median"] = fast_median / spec_median
