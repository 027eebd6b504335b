"""Hypothesis plans for a drive: scheduler knobs, seeds and workload shapes, none of them tied to an engine.

    ENGINE = build_llm(EngineSpec(MODEL, spec_tokens=3))    # once per test module (~10 s)

    @given(plan=drive_plans("v1"))
    def test_driven(plan):
        drive(ENGINE, plan)   # a fresh scheduler, fresh request ids; the runner is empty again afterwards

Knobs the runner cannot take (gates.py) are never drawn. `scheduler_blocks` draws few blocks (preemption,
requests that never fit alone and are dropped) or the runner's whole pool.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from conformance.scheduler import SchedulerKnobs
from conformance.scheduler.allocator import ALLOCATION_ORDERS
from conformance.vllm_drive.gates import FORCED, RUNNER_GATES
from conformance.vllm_drive.plan import DrivePlan


@st.composite
def drive_knobs(draw: st.DrawFn, runner: str = "v1", spec_tokens: tuple[int, ...] = (0, 2, 3)) -> SchedulerKnobs:
    knobs = SchedulerKnobs(
        token_budget=draw(st.none() | st.integers(1, 64)),  # the scheduler cuts it to the runner's budget
        max_running=draw(st.none() | st.integers(1, 8)),
        max_chunk=draw(st.none() | st.integers(1, 64)),
        enable_prefix_caching=draw(st.booleans()),
        allocation_order=draw(st.sampled_from(ALLOCATION_ORDERS)),
        reuse_freed_first=draw(st.booleans()),
        abort_prob=draw(st.sampled_from([0.0, 0.05, 0.2])),
        shuffle_order=draw(st.booleans()),
        spec_tokens=draw(st.sampled_from(spec_tokens)),
        drafts_on_admission=draw(st.booleans()),
        null_lookahead=draw(st.booleans()),
        zero_new_blocks=draw(st.booleans()),
        common_prefix_blocks=draw(st.booleans()),
        pipeline_parallel=draw(st.booleans()),
    )
    defaults = SchedulerKnobs()
    gated = {k: getattr(defaults, k) for k in RUNNER_GATES[runner] if hasattr(defaults, k)}
    return replace(knobs, **gated, **{k: v for k, (v, _) in FORCED[runner].items()})


@st.composite
def drive_plans(draw: st.DrawFn, runner: str = "v1", spec_tokens: tuple[int, ...] = (0, 2, 3),
                max_requests: int = 8) -> DrivePlan:  # fmt: skip
    return DrivePlan(
        knobs=draw(drive_knobs(runner, spec_tokens)),
        seed=draw(st.integers(0, 2**32 - 1)),
        num_requests=draw(st.integers(1, max_requests)),
        max_arrival_step=draw(st.integers(0, 8)),
        max_new_tokens=draw(st.integers(1, 32)),
        num_prefixes=draw(st.integers(0, 3)),
        random_share=draw(st.sampled_from([0.0, 0.25, 1.0])),
        scheduler_blocks=draw(st.none() | st.integers(3, 24)),
    )
