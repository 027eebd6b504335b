"""spec vs fast on batches prepared with captured graphs: padded rows, classification and descriptor, step by step.

The reference scheduler's runs (conformance/differential.py), every step prepared with `graphs=` in place of the
scheduler's pad_to, on both sides; the comparison covers every BatchInputs field (conformance/backends.py
batch_to_numpy: row_classes and descriptor included) and the feature records' padded rows (Mamba's, cross-
attention's). Attention is left out (its kernels read only the real rows; the padded rows' inputs are compared).
A small suite: the lead wires the full one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import spec
from conformance.backends import BackendHandle, fast_handle
from conformance.differential import COUNTS, DifferentialRun, MismatchError, drive
from conformance.padded_steps import COUNTS as PADDED
from conformance.scenario import Scenario, random_scenario
from conformance.scheduler.step_shapes import StepShape
from conformance.strategies import scenarios
from spec.graphs import GRAPH_MODES, CapturedGraphs
from spec.padding_profiles import PROFILES
from spec.protocol import StatePool
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


class _GraphsPool:
    """A pool whose every prepare is for `graphs` (the scheduler's pad_to is set aside: the two are exclusive)."""

    def __init__(self, pool: StatePool, graphs: CapturedGraphs) -> None:
        self.pool, self.graphs = pool, graphs

    def apply(self, sched: SchedulerOutput) -> None:
        self.pool.apply(sched)

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        return self.pool.prepare(sched, graphs=self.graphs)

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any, next_draft_ids: Any = None) -> None:
        self.pool.record_sampled(batch, sampled_token_ids, next_draft_ids)

    def row_of(self, req_id: str) -> int:
        return self.pool.row_of(req_id)

    def snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()


@dataclasses.dataclass
class _GraphsHandle(BackendHandle):
    graphs: CapturedGraphs | None = None

    def make_pool(self, config: WorkerConfig) -> StatePool:
        assert self.graphs is not None
        return _GraphsPool(super().make_pool(config), self.graphs)


def _with_graphs(handle: BackendHandle, graphs: CapturedGraphs) -> _GraphsHandle:
    fields = {f.name: getattr(handle, f.name) for f in dataclasses.fields(BackendHandle)}
    return _GraphsHandle(**fields, graphs=graphs)


@st.composite
def captured_graphs(draw: st.DrawFn, scenario: Scenario) -> CapturedGraphs:
    # small sizes (decode steps: up to max_num_reqs rows of 1 + K tokens) and, often, the step budget itself
    uq = 1 + scenario.knobs.spec_tokens
    small = draw(st.sets(st.integers(1, 2 * uq * scenario.config.max_num_reqs), min_size=1, max_size=5))
    budget = {scenario.config.max_num_batched_tokens} if draw(st.booleans()) else set()
    sizes = small | budget
    return CapturedGraphs(
        tuple(sorted(sizes)),
        max_num_reqs=draw(st.integers(1, scenario.config.max_num_reqs)),
        mode=draw(st.sampled_from(GRAPH_MODES[1:])),  # NONE dispatches nothing
        uniform_decode_query_len=uq,
        profile=draw(st.sampled_from(sorted(PROFILES.values(), key=lambda p: p.name))),
    )


def _check(candidate: BackendHandle, examples: int, max_steps: int, max_requests: int) -> None:
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data: st.DataObject) -> None:
        scenario = data.draw(scenarios(max_requests=max_requests, max_model_len=64))
        scenario = dataclasses.replace(scenario, attention=None)
        graphs = data.draw(captured_graphs(scenario))
        note(repr(graphs))
        ref = _with_graphs(BackendHandle("spec", spec), graphs)
        run = DifferentialRun(scenario, _with_graphs(candidate, graphs), ref)
        try:
            drive(run, max_steps)
        except MismatchError as exc:
            note(exc.repro)
            raise

    check()


def test_spec_and_fast_agree_on_padded_batches() -> None:
    _check(fast_handle(False), examples=25, max_steps=40, max_requests=6)


def test_spec_and_fast_interpreted_agree_on_a_tiny_padded_run() -> None:
    _check(fast_handle(True), examples=2, max_steps=4, max_requests=2)


def test_graph_dp_and_dbo_steps_agree_with_spec() -> None:
    """Seeded runs whose scheduler shapes steps (conformance/scheduler/step_shapes.py): graph steps, DP peers'
    padding and dummy batches, DBO splits at the default and a drawn point, each compared field by field."""
    before = dict(COUNTS) | {f"checked {k}": v for k, v in PADDED.items()}
    fast_side = fast_handle(False)
    for seed in range(12):
        scenario = random_scenario(seed, spec_decode=True, hybrid=True, multimodal=True, padded=True)
        run = DifferentialRun(scenario, fast_side)
        drive(run, 40)
    after = dict(COUNTS) | {f"checked {k}": v for k, v in PADDED.items()}
    ran = {k: after.get(k, 0) - before.get(k, 0) for k in ("graph steps", "dummy steps", "split steps",
                                                            "checked dummy", "checked split")}  # fmt: skip
    assert all(ran.values()), f"a kind of step never ran: {ran}"


def test_a_step_shape_draws_split_points_inside_the_batch() -> None:
    shape = StepShape(None, None, None, True, 0.999)
    assert shape.split_points(3, 10) == (None, 9)  # 1 + int(0.999 * 9): the last token of the batch at most
    assert StepShape(None, None, None, True, 0.0).split_points(3, 10) == (None, 1)
    assert shape.split_points(0, 10) == () and shape.split_points(1, 1) == ()  # no request, or one token
    assert StepShape(None, None, None, False, 0.5).split_points(3, 10) == ()
