"""spec vs the backend under test on realistic schedules: every value of every step must agree.

Each Hypothesis example is a scenario (config, workload, scheduler knobs, attention shapes) that the
reference scheduler runs until it drains (or a per-backend step cap); on a difference the falsifying
example's notes hold a runnable reproduction.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
from hypothesis import HealthCheck, given, note, settings

import spec
from conformance.backends import BackendHandle, load_backend
from conformance.differential import DifferentialRun, MismatchError, budget_for, drive
from conformance.scenario import Scenario, random_scenario
from conformance.scheduler import SchedulerKnobs, make_workload
from conformance.strategies import scenarios
from spec.graphs import CapturedGraphs
from spec.types import BatchInputs, KVCacheGroup, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def test_backends_agree_on_every_step(backend: BackendHandle, conformance_scale: float) -> None:
    budget = budget_for(backend, settings().max_examples, conformance_scale)

    @settings(
        max_examples=budget.examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(max_requests=budget.max_requests, max_model_len=budget.max_model_len))
    def check(scenario: Scenario) -> None:
        run = DifferentialRun(scenario, backend)
        try:
            drive(run, budget.max_steps)
        except MismatchError as exc:
            note(exc.repro)
            raise
        if run.done():  # drained: nothing may be left behind in the pool or the allocators
            assert run.pair.ref.pool.snapshot() == run.pair.cand.pool.snapshot() == ()
            assert all(a.num_used == 0 for a in run.sched.allocators)

    check()


class _PowerOfTwoOffsetPool(spec.RequestStatePool):
    """spec with a classic bug: the slot offset taken as `position & (block_size - 1)` (right for powers of two)."""

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        batch = super().prepare(sched, pad_to, graphs=graphs)
        slots = []
        for mapping, group in zip(batch.slot_mappings, self.config.kv_groups, strict=True):
            bs, real = group.block_size, mapping != -1
            fixed = mapping.copy()
            fixed[real] = mapping[real] // bs * bs + (batch.positions[real] & (bs - 1))
            slots.append(fixed)
        return dataclasses.replace(batch, slot_mappings=tuple(slots))


def broken_backend() -> BackendHandle:
    """A `module:factory` backend for the test below (and an example of plugging in a third-party backend)."""
    module = types.SimpleNamespace(
        RequestStatePool=_PowerOfTwoOffsetPool, write_kv=spec.write_kv, paged_attention=spec.paged_attention
    )
    return BackendHandle("conformance.test_differential:broken_backend", module)


def test_a_broken_backend_is_caught_and_its_reproduction_fails_too() -> None:
    scenario = random_scenario(0)
    config = WorkerConfig(2, 40, 16, 50, (KVCacheGroup(16, 8), KVCacheGroup(3, 20, sliding_window=7)))
    workload = make_workload(1, config, num_requests=3, max_arrival_step=0)
    scenario = dataclasses.replace(scenario, config=config, workload=workload, knobs=SchedulerKnobs())
    run = DifferentialRun(scenario, load_backend("conformance.test_differential:broken_backend"))
    with pytest.raises(MismatchError, match=r"slot_mappings\[1\]") as caught:
        drive(run, 100)
    with pytest.raises(MismatchError, match=r"slot_mappings\[1\]"):
        exec(caught.value.repro, {})  # the printed reproduction is runnable and fails the same way
