"""The differential run as a Hypothesis RuleBasedStateMachine: Hypothesis chooses, step by step, whether
the next scheduler output goes through as it is or is first broken into an invalid one.

Where test_differential and test_invalid draw a whole scenario and drive it to the end, here the
interleaving of valid and invalid steps is part of what Hypothesis explores and shrinks. Every step
compares snapshots, every BatchInputs field, the KV caches and attention (conformance.differential).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conformance import mutations
from conformance.backends import BackendHandle
from conformance.differential import Breaker, Budget, DifferentialRun, MismatchError, budget_for, one_torch_thread
from conformance.scenario import Scenario
from conformance.strategies import breakages, scenarios
from spec.errors import ScheduleError


def breaker(cls: type[ScheduleError], rng: random.Random) -> Breaker:
    """conformance.mutations' breaker (draft faults included)."""
    return lambda out, config, snapshot: mutations.break_output(cls, out, config, snapshot, rng)


def _machine(backend: BackendHandle, budget: Budget) -> type[RuleBasedStateMachine]:
    class DifferentialMachine(RuleBasedStateMachine):
        run: DifferentialRun

        @initialize(scenario=scenarios(max_requests=budget.max_requests, max_model_len=budget.max_model_len))
        def start(self, scenario: Scenario) -> None:
            self.run = DifferentialRun(scenario, backend)

        def _step(self, breakage: tuple[type[ScheduleError], random.Random] | None) -> None:
            try:
                self.run.step(breaker(*breakage) if breakage is not None else None)
            except MismatchError as exc:
                note(exc.repro)
                raise

        @precondition(lambda self: not self.run.done())
        @rule()
        def valid_step(self) -> None:
            self._step(None)

        @precondition(lambda self: not self.run.done())
        @rule(breakage=breakages())
        def invalid_then_valid_step(self, breakage: tuple[type[ScheduleError], random.Random]) -> None:
            self._step(breakage)

        @rule()
        def snapshots_agree(self) -> None:  # always enabled, so a drained run still has a rule to take
            self.run.pair.compare_snapshots("between steps", expected=self.run.sched.expected_snapshot())

        @invariant()
        def nothing_leaks_once_drained(self) -> None:
            if hasattr(self, "run") and self.run.done():
                assert self.run.pair.cand.pool.snapshot() == ()
                assert all(a.num_used == 0 for a in self.run.sched.allocators)

    return DifferentialMachine


def test_state_machine_agrees_with_spec(backend: BackendHandle, conformance_scale: float) -> None:
    budget = budget_for(backend, settings().max_examples, conformance_scale / 2)
    machine = _machine(backend, budget)
    with one_torch_thread():
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=budget.examples,
                stateful_step_count=min(budget.max_steps, 25),
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )


@pytest.mark.parametrize("seed", [0])
def test_state_machine_catches_a_planted_bug(seed: int) -> None:
    """Control: the machine must fail against a backend whose slots ignore non-power-of-two block sizes."""
    from conformance.test_differential import broken_backend

    budget = Budget(examples=40, max_steps=40, max_requests=4, max_model_len=48)
    with one_torch_thread(), pytest.raises(MismatchError):
        run_state_machine_as_test(
            _machine(broken_backend(), budget),
            settings=settings(
                max_examples=budget.examples,
                stateful_step_count=10,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            ),
        )
