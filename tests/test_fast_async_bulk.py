"""Async scheduling: steps sent before their rows' draft verdicts, beside a window or a mamba group, planned in bulk.

Such a step may start anywhere from its count less the unread drafts to the count sent (spec/async_steps.py, rule
4): spec checks a window's reads, the ids a request holds with one block pool, and a mamba group's states for
every start a verdict may give. fast's bulk planner checks them from the same lowest start (fast/validate.py,
fast/mamba_bulk.py). The differential suites compare every batch and snapshot of such runs with spec's; these
tests add that the bulk planner took those steps, with plan_step's plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import fast
import fast.pool
from conformance.backends import load_backend
from conformance.differential import DifferentialRun, drive
from conformance.scenario import random_scenario, with_one_block_pool
from fast.fallback import Fallback
from fast.runtime import interpret
from spec.feature import Feature
from spec.state import PoolState, StepPlan, TableWrites
from spec.types import SchedulerOutput, WorkerConfig
from spec.validate import plan_step

MAX_STEPS = 60
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _optimistic(state: PoolState, sched: SchedulerOutput) -> bool:
    """Some continuing request of the step has drafts whose verdict the host has not read."""
    rows = [state.row_of[r] for r in sched.num_scheduled_tokens if r in state.row_of]
    return bool(state.num_unverified_drafts[rows].any())


def _assert_plans_equal(got: StepPlan, want: StepPlan, where: str) -> None:
    for f in dataclasses.fields(StepPlan):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "tables":
            for g, (x, y) in enumerate(zip(a, b, strict=True)):
                for t in dataclasses.fields(TableWrites):
                    np.testing.assert_array_equal(getattr(x, t.name), getattr(y, t.name), f"{where} {g} {t.name}")
        elif f.name == "features":
            assert a.keys() == b.keys(), where
            for name in a:  # frozen dataclasses of arrays (mamba's MambaSteps)
                for field in dataclasses.fields(a[name]):
                    np.testing.assert_array_equal(getattr(a[name], field.name), getattr(b[name], field.name), where)
        elif isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, f"{where} {f.name}")
        else:
            assert a == b, f"{where} {f.name}"


class _Watch:
    """fast's bulk planner as the pool calls it, compared with plan_step on every optimistic step."""

    def __init__(self) -> None:
        self.optimistic = 0  # optimistic steps the bulk planner planned, each with plan_step's plan
        self.refused: list[Fallback] = []  # optimistic steps it left to plan_step, by reason
        self._plan = fast.pool.plan_bulk_step

    def __call__(self, state: PoolState, sched: SchedulerOutput, features: tuple[Feature, ...], *rest: Any) -> Any:
        planned = self._plan(state, sched, features, *rest)
        if _optimistic(state, sched):
            if isinstance(planned, StepPlan):
                _assert_plans_equal(
                    planned, plan_step(state, sched, features), f"step of {sorted(sched.num_scheduled_tokens)}"
                )
                self.optimistic += 1
            else:
                self.refused.append(planned)
        return planned


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Watch]:
    watching = _Watch()
    monkeypatch.setattr(fast.pool, "plan_bulk_step", watching)
    yield watching


def _drafting_async(seed: int, hybrid: bool) -> tuple[Any, WorkerConfig] | None:
    """The seed's drafting scenario under async scheduling, if its drafts may be rejected (so counts are optimistic)
    and it has the group kind asked for: a mamba group (`hybrid`), else a window, with one block pool."""
    scenario = random_scenario(seed, spec_decode=True, hybrid=hybrid)
    knobs, config = scenario.knobs, scenario.config
    if knobs.spec_tokens == 0 or knobs.acceptance_rate >= 1:
        return None
    if hybrid and not any(g.kind == "mamba" for g in config.kv_groups):
        return None
    if not hybrid and not any(g.sliding_window is not None for g in config.kv_groups):
        return None
    config = dataclasses.replace(config, async_scheduling=True)
    if not hybrid and len(config.kv_groups) > 1:
        config = with_one_block_pool(config)
    return dataclasses.replace(scenario, config=config, attention=None), config


@pytest.mark.parametrize("hybrid", [False, True], ids=["window", "mamba"])
def test_steps_before_a_verdict_are_planned_in_bulk_as_plan_step_plans_them(watch: _Watch, hybrid: bool) -> None:
    runs = 0
    with interpret(False):
        for seed in range(200):
            made = _drafting_async(seed, hybrid)
            if made is None:
                continue
            scenario, _ = made
            run = DifferentialRun(scenario, load_backend("fast"))  # every batch and snapshot compared with spec's
            drive(run, MAX_STEPS)
            runs += 1
            if runs >= 6 and watch.optimistic >= 20:
                break
    assert watch.optimistic >= 20, (runs, watch.optimistic, watch.refused)
    # what a valid step may still be left to plan_step for: a resumed request (a shape the bulk planner does not
    # read), or a check it makes stricter than spec's (a null placeholder appended, a block two requests write at
    # different offsets, a mamba state shared for reading)
    by_design = {Fallback.CACHED_REQUESTS, Fallback.TABLES, Fallback.SHARED_BLOCK, Fallback.FEATURE_RULES}
    assert set(watch.refused) <= by_design, watch.refused
