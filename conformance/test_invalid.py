"""Invalid scheduler outputs: both backends raise the same error class, change nothing, and go on working.

Each invalid output is a valid one from the reference scheduler, broken the way one error class
names (conformance.mutations); the class a mutation provokes is known by construction, so the
reference is held to it as well. After every rejection the valid output of that step is applied
and compared as usual.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conformance.backends import BackendHandle
from conformance.differential import Breaker, DifferentialRun, MismatchError, budget_for, drive, one_torch_thread
from conformance.mutations import breaker
from conformance.scenario import Scenario, random_scenario
from conformance.strategies import breakages, scenarios
from spec.errors import ALL_ERRORS, ScheduleError


@pytest.fixture(autouse=True)
def _single_thread() -> object:
    with one_torch_thread():
        yield


def test_invalid_outputs_are_rejected_identically(backend: BackendHandle, conformance_scale: float) -> None:
    budget = budget_for(backend.name, settings().max_examples, conformance_scale / 2)

    @settings(
        max_examples=budget.examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(max_requests=budget.max_requests, max_model_len=budget.max_model_len), st.data())
    def check(scenario: Scenario, data: st.DataObject) -> None:
        run = DifferentialRun(replace(scenario, attention=None), backend)  # rejections are about the pool

        def maybe_break() -> Breaker | None:
            if data.draw(st.integers(0, 2), label="break this step") != 0:
                return None
            return breaker(*data.draw(breakages(), label="error class, mutation randomness"))

        try:
            drive(run, budget.max_steps // 2, maybe_break)
        except MismatchError as exc:
            note(exc.repro)
            raise

    check()


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_class_is_provoked_and_survived(backend: BackendHandle, cls: type[ScheduleError]) -> None:
    """Some early step of some seeded scenario can be broken into `cls`; both backends raise exactly it."""
    for seed in range(50):
        scenario = replace(random_scenario(seed), attention=None)  # pool and batch only: cheap on any backend
        run = DifferentialRun(scenario, backend)
        rng = random.Random(seed)
        for _ in range(6):
            if run.done():
                break
            run.step(breaker(cls, rng))
            if run.rejected[cls.__name__]:
                run.step()  # and the pool keeps working after the rejection
                return
    pytest.fail(f"no scenario offered a way to provoke {cls.__name__}")
