"""The rule list (conformance/rules.py) is complete, and the generators reach both sides of every rule.

Spec only: which sides the generators reach does not depend on the backend; every backend then meets the
same generated inputs in the differential, invalid-output and sampled-fault suites.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

import spec
from conformance.backends import BackendHandle
from conformance.mutations import MALFORMATIONS, breaker, malformation_breaker
from conformance.probes import call_faults
from conformance.rule_sites import SPEC_DIR, Site, site_of, sites
from conformance.rules import EVERY_STEP, GENERATED, RULES, SAMPLED_EDGES, VALID_EDGES, Rule
from conformance.sampled_faults import SAMPLED_FAULTS, break_sampled, stale_batch
from conformance.seeded import Refusals, Sampled, run_seeded
from spec.drafts import pad_accepted
from spec.errors import ALL_ERRORS, InconsistentSchedulerOutputError
from spec.protocol import StatePool
from spec.types import BatchInputs, SchedulerOutput, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(60)
MAX_STEPS = 14


def _rules_of(site: Site) -> list[Rule]:
    return [r for r in RULES if r.matches(site)]


def test_every_refusal_site_has_a_rule() -> None:
    missing = [f"spec/{s.file}:{s.line} {s.function}: {s.source}" for s in sites() if not _rules_of(s)]
    assert not missing, "refusals of spec with no entry in conformance/rules.py:\n" + "\n".join(missing)


def test_every_rule_names_a_site_an_edge_and_tests_that_exist() -> None:
    for rule in RULES:
        assert any(rule.matches(s) for s in sites()), f"{rule.summary}: no site of spec matches {rule.text!r}"
        by_hand = [side for side in (rule.valid, rule.invalid) if "::" in side]
        assert rule.valid in (EVERY_STEP, *VALID_EDGES, *SAMPLED_EDGES) or by_hand, rule.summary
        for test in (*rule.tests, *by_hand):
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text()
            assert not name or f"def {name}(" in source, f"{rule.summary}: no test {test}"
    assert (SPEC_DIR / "validate.py").is_file()


class _Reach:
    """What the seeded runs generate: valid edges met, and the sites their faults were refused at."""

    def __init__(self) -> None:
        self.edges: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[Site | None] = collections.Counter()
        self.handles = [BackendHandle("spec", spec)]
        self.pools: Sequence[StatePool] = ()  # the run's pools, as the last before_apply saw them
        self.applied: list[SchedulerOutput] = []  # the run's valid outputs so far

    def before_apply(self, out: SchedulerOutput, config: WorkerConfig, pools: Sequence[StatePool],
                     rng: random.Random) -> None:  # fmt: skip
        self.pools = pools
        self.applied.append(out)
        rows = {row.req_id: row for row in pools[0].snapshot()}
        self.edges.update(name for name, edge in VALID_EDGES.items() if edge(config, rows, out))
        refusals = Refusals(self.handles, pools)
        makers = [breaker(cls, rng) for cls in ALL_ERRORS] + [malformation_breaker(n, rng) for n in MALFORMATIONS]
        for make in makers:
            broken = make(out, config, pools[0].snapshot())
            if broken is not None:
                refusals.apply(*broken)
        self.sites.update(site_of(exc) for exc in refusals.raised)

    def before_record(self, sampled: Sampled, config: WorkerConfig, batches: Sequence[BatchInputs],
                      rng: random.Random) -> None:  # fmt: skip
        self.edges.update(name for name, edge in SAMPLED_EDGES.items() if edge(sampled, config))
        refusals = Refusals(self.handles, self.pools)
        for name in SAMPLED_FAULTS:
            broken = break_sampled(name, sampled, config, rng)
            if broken is not None:
                refusals.record(batches, *broken)
        handle = self.handles[0]
        stale = stale_batch(sampled.batch, handle.to_numpy, handle.asarray, rng)
        if stale is not None:
            refusals.record([stale], pad_accepted(sampled.rows), InconsistentSchedulerOutputError)
        out, earlier = self.applied[-1], (self.applied[-2] if len(self.applied) > 1 else None)
        held = [row.req_id for row in self.pools[0].snapshot()]
        for _, call, cls in call_faults(out, earlier, sampled.batch.num_tokens, held, rng):
            refusals.call(call, cls)
        self.sites.update(site_of(exc) for exc in refusals.raised)


@pytest.fixture(scope="module")
def reach() -> _Reach:
    seen = _Reach()
    for seed in SEEDS:
        run_seeded(seed, seen.handles, MAX_STEPS, seen.before_apply, seen.before_record)
    return seen


def test_valid_sides_are_generated(reach: _Reach) -> None:
    edges = {r.valid for r in RULES if r.valid in VALID_EDGES or r.valid in SAMPLED_EDGES}
    missing = sorted(e for e in edges if not reach.edges[e])
    assert not missing, f"no seeded step is valid at: {missing} (met: {dict(reach.edges)})"


def test_invalid_sides_are_generated(reach: _Reach) -> None:
    assert None not in reach.sites, "a fault was refused outside spec's check files"
    missing = [
        f"spec/{s.file}:{s.line} {s.function}: {s.source}"
        for s in sites()
        if any(r.invalid == GENERATED for r in _rules_of(s)) and not reach.sites[s]
    ]
    assert not missing, "rules marked generated whose faults no generator made:\n" + "\n".join(missing)
