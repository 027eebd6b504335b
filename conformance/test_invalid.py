"""Invalid scheduler outputs: both backends raise the same error class, change nothing, and go on working.

Each invalid output is a valid one from the reference scheduler, broken the way one error class
names (conformance.mutations); the class a mutation provokes is known by construction, so the
reference is held to it as well. After every rejection the valid output of that step is applied
and compared as usual. The breakers also malform types and containers and list ids twice
(conformance.malformed, `MALFORMATIONS`), and conformance.probes tries stale batches and outputs
mutated after apply between the calls of valid steps.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conformance.backends import BackendHandle
from conformance.differential import Breaker, DifferentialRun, MismatchError, budget_for, drive
from conformance.mutations import MALFORMATIONS, breaker, malformation_breaker
from conformance.padded_steps import COUNTS as PROBED
from conformance.probes import ProbedPool
from conformance.scenario import Scenario, random_scenario
from conformance.strategies import breakages, scenarios
from spec.errors import ALL_ERRORS, ScheduleError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def test_invalid_outputs_are_rejected_identically(backend: BackendHandle, conformance_scale: float) -> None:
    budget = budget_for(backend, settings().max_examples, conformance_scale / 2)

    @settings(
        max_examples=budget.examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(max_requests=budget.max_requests, max_model_len=budget.max_model_len), st.data())
    def check(scenario: Scenario, data: st.DataObject) -> None:
        # rejections are about the pool; misuse: graphs, pad_to and splits misused on the steps that have them
        run = DifferentialRun(replace(scenario, attention=None), backend, misuse=True)

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
        # pool and batch only: cheap on any backend; every model family, so each family's refusals are provoked
        scenario = replace(random_scenario(seed, encoder_decoder=True, hybrid=True, multimodal=True), attention=None)
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


@pytest.mark.parametrize("name", sorted(MALFORMATIONS))
def test_every_malformation_is_provoked_and_survived(backend: BackendHandle, name: str) -> None:
    """Each type-, container- or repeated-id fault, on some early step: both raise its class, then go on."""
    cls = MALFORMATIONS[name][0]
    for seed in range(50):
        scenario = random_scenario(seed, encoder_decoder=True, hybrid=True, multimodal=True)  # every family's faults
        run = DifferentialRun(replace(scenario, attention=None), backend)
        rng = random.Random(seed)
        for _ in range(6):
            if run.done():
                break
            run.step(malformation_breaker(name, rng))
            if run.rejected[cls.__name__]:
                run.step()
                return
    pytest.fail(f"no scenario offered a way to make {name!r}")


def test_misuse_between_the_calls_changes_nothing(backend: BackendHandle, conformance_scale: float) -> None:
    """Between the calls of valid steps: an earlier or recorded batch is refused, a mutated output ignored,
    misused prepare and row_of calls refused with the batch just prepared intact."""
    budget = budget_for(backend, settings().max_examples, conformance_scale / 8)
    probed = {"mutated": 0, "stale": 0, "misused": 0}

    @settings(
        max_examples=budget.examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenarios(max_requests=budget.max_requests, max_model_len=budget.max_model_len), st.randoms())
    def check(scenario: Scenario, rng: random.Random) -> None:
        run = DifferentialRun(replace(scenario, attention=None), backend)
        pools = []
        for side in (run.pair.ref, run.pair.cand):
            side.pool = ProbedPool(side.pool, side.handle, rng)
            pools.append(side.pool)
        try:
            drive(run, budget.max_steps // 2)
        except MismatchError as exc:
            note(exc.repro)
            raise
        for pool in pools:
            for what, n in pool.counts.items():
                probed[what] += n

    check()
    assert all(probed.values()), f"a probe never ran: {probed}"


def test_misused_graphs_pad_to_and_splits_are_refused_identically(backend: BackendHandle) -> None:
    """Capture sizes unsorted, non-positive or duplicated; pad_to with graphs; a split past the batch: both
    backends refuse each with the same error, the pool and the batch unchanged, and the run goes on."""
    before = dict(PROBED)
    for seed in range(8):
        scenario = replace(random_scenario(seed, spec_decode=True, padded=True), attention=None)
        drive(DifferentialRun(scenario, backend, misuse=True), 12)
    ran = {k: PROBED[k] - before.get(k, 0) for k in ("capture sizes unsorted", "capture sizes non-positive",
                                                    "capture sizes duplicated", "pad_to with graphs",
                                                    "split past the batch")}  # fmt: skip
    assert all(ran.values()), f"a misuse was never probed: {ran}"
