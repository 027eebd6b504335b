"""Pools brought to a workload's steady state, and spec's answer for one step (shared by the suites)."""

from __future__ import annotations

import functools
from typing import Any

import spec
from benchmarks import providers
from benchmarks.providers import Provider
from benchmarks.workloads import StepStream, Workload


def started(provider: Provider, stream: StepStream) -> Any:
    """A pool of `provider` holding every request of the workload, after its first step."""
    pool = provider.make_pool(stream.config)  # type: ignore[misc]
    sched = stream.first()
    pool.apply(sched)
    batch = pool.prepare(sched)
    proposed = stream.next_drafts(batch.num_reqs)  # the drafter's ids for the next step's placeholders, or None
    sampled = stream.sampled(batch.num_reqs)
    ids = provider.asarray(sampled[:, :1] if stream.workload.drafts else sampled)  # the first step drafts nothing
    if proposed is None:
        pool.record_sampled(batch, ids)
    else:
        pool.record_sampled(batch, ids, provider.asarray(proposed))
    return pool


@functools.lru_cache(maxsize=1)
def reference(workload: Workload) -> tuple[spec.RequestStatePool, spec.SchedulerOutput, spec.BatchInputs]:
    """spec's pool after one steady-state step is applied, that step, and its batch (treat as read-only)."""
    stream = StepStream(workload)
    pool = started(providers.get("spec"), stream)
    sched = stream.next()
    pool.apply(sched)
    return pool, sched, pool.prepare(sched)
