"""Steps of model kinds and modes whose groups the bulk planner checks by their own rules: planned in bulk, as
plan_step plans them.

- Async scheduling: a step sent before the verdict on its rows' last drafts may start anywhere from its count less
  those drafts to the count sent (spec/async_steps.py, rule 4): spec checks a window's reads, the ids a request
  holds with one block pool, and a mamba group's states for every such start; fast's bulk planner checks them
  from the same lowest start (fast/validate.py, fast/mamba_bulk.py).
- Encoder-decoder models: the cross group's tables hold the encoder's KV, checked by their own rules
  (fast/cross_bulk.py), and new requests bring encoder_len.
- Multimodal models (M-RoPE): new requests bring position tables (fast/mrope.py, FastMRope.plan_in_bulk).
The differential suites compare every batch and snapshot of such runs with spec's; these tests add that the bulk
planner took the steps, with plan_step's plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import fast
import fast.pool
from conformance.backends import load_backend
from conformance.differential import DifferentialRun, drive
from conformance.scenario import random_scenario, with_one_block_pool
from fast.fallback import Fallback
from fast.mrope import _as_table
from fast.runtime import interpret
from spec.feature import Feature
from spec.mrope import as_table
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
            for name in a:  # an array (cross-attention's encoder lengths) or a frozen dataclass of them (mamba's)
                if isinstance(b[name], np.ndarray):
                    assert a[name].dtype == b[name].dtype, f"{where} {name}"
                    np.testing.assert_array_equal(a[name], b[name], f"{where} {name}")
                    continue
                for field in dataclasses.fields(a[name]):
                    np.testing.assert_array_equal(getattr(a[name], field.name), getattr(b[name], field.name), where)
        elif isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, f"{where} {f.name}")
        else:
            assert a == b, f"{where} {f.name}"


class _Watch:
    """fast's bulk planner as the pool calls it, compared with plan_step on every step `watched` picks."""

    def __init__(self) -> None:
        self.watched: Callable[[PoolState, SchedulerOutput], bool] = _optimistic
        self.planned = 0  # watched steps the bulk planner planned, each with plan_step's plan
        self.refused: list[Fallback] = []  # watched steps it left to plan_step, by reason
        self._plan = fast.pool.plan_bulk_step

    def __call__(self, state: PoolState, sched: SchedulerOutput, features: tuple[Feature, ...], *rest: Any) -> Any:
        planned = self._plan(state, sched, features, *rest)
        if self.watched(state, sched):
            if isinstance(planned, StepPlan):
                where = f"the step of {sorted(sched.num_scheduled_tokens)}"
                _assert_plans_equal(planned, plan_step(state, sched, features), where)
                self.planned += 1
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


# what a valid step may still be left to plan_step for: a step without tokens, or a resumed request without a table
# for every group (shapes the bulk planner does not read), or a check it makes stricter than spec's (a null
# placeholder appended, a block two requests write at different offsets, a mamba state shared for reading)
BY_DESIGN = {Fallback.REQUEST_KEYS, Fallback.CACHED_REQUESTS, Fallback.TABLES, Fallback.SHARED_BLOCK,
             Fallback.FEATURE_RULES}  # fmt: skip


def _drive(scenarios: Iterator[Any], watch: _Watch, runs: int = 6, steps: int = 20) -> None:
    """Each scenario's run on fast, compared with spec on every step, until `runs` ran and `steps` were watched."""
    done = 0
    with interpret(False):
        for scenario in scenarios:
            drive(DifferentialRun(scenario, load_backend("fast")), MAX_STEPS)
            done += 1
            if done >= runs and watch.planned >= steps:
                return


@pytest.mark.parametrize("hybrid", [False, True], ids=["window", "mamba"])
def test_steps_before_a_verdict_are_planned_in_bulk_as_plan_step_plans_them(watch: _Watch, hybrid: bool) -> None:
    _drive((made[0] for seed in range(200) if (made := _drafting_async(seed, hybrid)) is not None), watch)
    assert watch.planned >= 20, (watch.planned, watch.refused)
    assert set(watch.refused) <= BY_DESIGN - {Fallback.CACHED_REQUESTS}, watch.refused  # resumptions too (rule 7)


def test_encoder_decoder_steps_are_planned_in_bulk_as_plan_step_plans_them(watch: _Watch) -> None:
    encoders: list[int] = []  # new requests with an encoder_len among the planned steps

    def with_cross_group(state: PoolState, sched: SchedulerOutput) -> bool:
        if not any(g.kind == "cross_attention" for g in state.config.kv_groups):
            return False
        encoders.append(sum(r.encoder_len > 0 for r in sched.new_requests))
        return True

    watch.watched = with_cross_group
    scenarios = (random_scenario(seed, encoder_decoder=True) for seed in range(200))
    _drive((dataclasses.replace(s, attention=None) for s in scenarios if _has_cross(s.config)), watch, steps=60)
    assert watch.planned >= 60 and sum(encoders) >= 10, (watch.planned, sum(encoders), watch.refused)
    assert set(watch.refused) <= BY_DESIGN, watch.refused
    assert len(watch.refused) <= watch.planned // 4, watch.refused


def _has_cross(config: WorkerConfig) -> bool:
    return any(g.kind == "cross_attention" for g in config.kv_groups)


def test_multimodal_steps_are_planned_in_bulk_as_plan_step_plans_them(watch: _Watch) -> None:
    tables: list[int] = []  # new requests with an M-RoPE position table among the watched steps

    def with_mrope(state: PoolState, sched: SchedulerOutput) -> bool:
        if not state.config.uses_mrope:
            return False
        tables.append(sum(r.mrope_positions is not None for r in sched.new_requests))
        return True

    watch.watched = with_mrope
    scenarios = (random_scenario(seed, multimodal=True) for seed in range(200))
    _drive((dataclasses.replace(s, attention=None) for s in scenarios if s.config.uses_mrope), watch, steps=60)
    assert watch.planned >= 60 and sum(tables) >= 10, (watch.planned, sum(tables), watch.refused)
    assert set(watch.refused) <= BY_DESIGN, watch.refused
    assert len(watch.refused) <= watch.planned // 4, watch.refused


TABLES = [
    ((1, 2), (3, 4), (5, 6)),
    [[1, 2], [3, 4], [5, 6]],
    ((True, 2), (3, 4), (5, 6)),  # operator.index takes a bool
    ((), (), ()),
    ((1, 2), (3, 4), (5, 6.0)),  # a float: no position
    ((1, 2), (3, 4), (5,)),  # rows of two lengths
    ((2**63, 2), (3, 4), (5, 6)),  # past int64
    ((1, 2), (3, 4)),  # two rows
    ((1, "2"), (3, 4), (5, 6)),
    np.arange(6, dtype=np.int32).reshape(3, 2),
    np.arange(6, dtype=np.float64).reshape(3, 2),
]


@pytest.mark.parametrize("table", TABLES, ids=range(len(TABLES)))
def test_the_bulk_read_of_a_position_table_is_specs(table: object) -> None:
    got, want = _as_table(table), as_table(table)
    assert (got is None) == (want is None), (got, want)
    if got is not None and want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
