"""Every record_sampled fault of conformance.sampled_faults under async scheduling, on every backend (`--backend`).

Async rule 6 (spec/async_steps.py): record_sampled checks at once what the host knows without the values (the
ids' dtype and shape), and the values' faults are raised by the apply after next. Each fault is made from a real
step of the reference scheduler in async mode, drafts included (sent by the scheduler, or proposed on the device),
and handed to spec and to the backend: both must raise the fault's class at the same call, naming the same request
and field, and hold the same pool before and after. This generates the invalid side of every sampled-id check in
async mode, every position of an accepted prefix included (a check one position short had passed a suite that
made the fault at the first position only).
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.sampled_faults import SAMPLED_FAULTS, break_sampled
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from conformance.seeded import Sampled
from spec.drafts import pad_accepted
from spec.errors import ScheduleError
from spec.protocol import StatePool
from spec.types import BatchInputs, SchedulerOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py

Recorder = Callable[[StatePool, BackendHandle, BatchInputs], None]
# Under async scheduling the reference scheduler leaves room for the bonus token (its drafts_to_the_end knob is
# synchronous only: the next step goes out before the cut is known), so no row keeps tokens up to max_model_len
# with a draft to spare, which that fault needs.
FAULTS = [name for name in SAMPLED_FAULTS if name != "kept tokens past max_model_len"]


class _Run:
    """An async scenario through spec and one backend, step by step, a record's ids replaceable."""

    def __init__(self, seed: int, backend: BackendHandle) -> None:
        scenario = random_scenario(seed, spec_decode=True)
        spec_tokens = max(2, scenario.knobs.spec_tokens)
        knobs = dataclasses.replace(scenario.knobs, drafts_on_device=seed % 2 == 1, spec_tokens=spec_tokens)
        self.config = dataclasses.replace(scenario.config, async_scheduling=True)
        self.sched = ReferenceScheduler(self.config, scenario.workload, knobs, seed=scenario.seed)
        self.handles = (BackendHandle("spec", spec), backend)
        self.pools = tuple(h.make_pool(self.config) for h in self.handles)
        self.sample_rng = np.random.default_rng(seed + 1)

    def step(self, fault: str | None, rng: random.Random) -> tuple[type[ScheduleError], bool] | None:
        """One step; with `fault`, its record's ids broken that way where this step offers it: (the class, whether
        record_sampled itself raised it). The valid ids are recorded in any case."""
        out = self.sched.schedule()
        known = {row.req_id: len(row.token_ids) for row in self.pools[0].snapshot()}
        for pool in self.pools:
            pool.apply(out)
        batches = [pool.prepare(out) for pool in self.pools]
        _check_same_batch(self.handles, batches)
        req_ids = batches[0].req_ids
        takes = set(self.sched.sampling_req_ids(out))
        targets = {r: int(self.sample_rng.integers(self.config.vocab_size)) for r in takes}
        kept = self.sched.rejection_step(out, targets)
        rows = [list(kept.get(r, (0,))) for r in req_ids]
        known_before = [known[r] if r in known else _prompt_len(out, r) for r in req_ids]
        drafts = [self.sched.drafts_sent(r) for r in req_ids]
        sampled = Sampled(batches[0], rows, drafts, [r in takes for r in req_ids], known_before)
        broken = None if fault is None or not takes else break_sampled(fault, sampled, self.config, rng)
        proposed = self._proposed(out, req_ids)
        refused = None
        if broken is not None:
            refused = _raised_alike(self.pools, self.handles, batches, _recorder(broken[0], proposed))
            if refused is not None and refused is not broken[1]:
                raise AssertionError(f"{fault}: raised {refused.__name__}, expected {broken[1].__name__}")
        if broken is None or refused is not None:  # the valid ids (after a refusal nothing was taken)
            record = _recorder(pad_accepted(rows), proposed)
            for pool, handle, batch in zip(self.pools, self.handles, batches, strict=True):
                record(pool, handle, batch)
        self.sched.update(out, kept)
        return None if broken is None else (broken[1], refused is not None)

    def apply_reporting(self, expected: type[ScheduleError]) -> None:
        """After a faulty record: the next step runs on every pool; the apply after it raises `expected` on every
        pool, for the same request and field, before it changes anything."""
        self.step(None, random.Random(0))
        out = self.sched.schedule()
        before = [pool.snapshot() for pool in self.pools]
        assert before[0] == before[1], "spec and the backend hold different pools after the faulty record"
        errors = [_error_of(_applier(pool, out)) for pool in self.pools]
        assert all(type(e) is expected for e in errors), (expected, errors)
        assert len({(e.req_id, e.field) for e in errors if e is not None}) == 1, errors
        assert [pool.snapshot() for pool in self.pools] == before, "the reporting apply changed the pool"

    def _proposed(self, out: SchedulerOutput, req_ids: Sequence[str]) -> np.ndarray | None:
        """The drafter's ids on the device for the batch rows (drafts proposed on the device), or None."""
        if not self.sched.on_device:
            return None
        proposals, width = self.sched.device_proposals(out), self.sched.knobs.spec_tokens
        return np.array([proposals.get(r, (0,) * width) for r in req_ids], np.int64).reshape(len(req_ids), width)


def test_every_sampled_fault_is_reported_at_the_same_call_in_async_mode(backend: BackendHandle) -> None:
    made: collections.Counter[str] = collections.Counter()
    late: collections.Counter[str] = collections.Counter()
    for seed in range(80):
        for name in FAULTS:
            if made[name] >= 2:
                continue
            run, rng = _Run(seed, backend), random.Random(seed)
            for _ in range(12):
                if run.sched.done():
                    break
                outcome = run.step(name if rng.random() < 0.4 else None, rng)
                if outcome is not None:
                    expected, at_once = outcome
                    if not at_once:
                        run.apply_reporting(expected)
                        late[name] += 1
                    made[name] += 1
                    break
        if all(made[name] >= 2 for name in FAULTS):
            break
    missing = [name for name in FAULTS if not made[name]]
    assert not missing, f"never made: {missing}"
    assert late["accepted tokens that are not the drafts"] and late["a token outside the vocabulary"], late


def _recorder(ids: np.ndarray, proposed: np.ndarray | None) -> Recorder:
    def record(pool: StatePool, handle: BackendHandle, batch: BatchInputs) -> None:
        pool.record_sampled(batch, handle.asarray(ids), None if proposed is None else handle.asarray(proposed))

    return record


def _raised_alike(
    pools: Sequence[StatePool], handles: Sequence[BackendHandle], batches: Sequence[BatchInputs], record: Recorder
) -> type[ScheduleError] | None:
    """The class every pool raised at once for `record` (each pool unchanged then), or None where none raised."""
    classes = []
    for pool, handle, batch in zip(pools, handles, batches, strict=True):
        before = pool.snapshot()
        error = _error_of(_bound(record, pool, handle, batch))
        if error is not None and pool.snapshot() != before:
            raise AssertionError(f"{handle.name}: a refused record changed the pool")
        classes.append(None if error is None else type(error))
    if len(set(classes)) != 1:
        raise AssertionError(f"record_sampled: spec raised {classes[0]}, {handles[1].name} raised {classes[1]}")
    return classes[0]


def _applier(pool: StatePool, out: SchedulerOutput) -> Callable[[], None]:
    return lambda: pool.apply(out)


def _bound(record: Recorder, pool: StatePool, handle: BackendHandle, batch: BatchInputs) -> Callable[[], None]:
    return lambda: record(pool, handle, batch)


def _error_of(call: Callable[[], object]) -> ScheduleError | None:
    try:
        call()
    except ScheduleError as error:
        return error
    return None


def _check_same_batch(handles: Sequence[BackendHandle], batches: Sequence[BatchInputs]) -> None:
    """The fields a faulty record's placeholders reach, equal on spec and the backend."""
    want, got = (h.batch_to_numpy(b) for h, b in zip(handles, batches, strict=True))
    for name in ("input_ids", "positions", "seq_lens", "pending_token_indices", "draft_token_ids"):
        a, b = want.get(name), got.get(name)
        if (a is None) != (b is None) or (a is not None and b is not None and not np.array_equal(a, b)):
            raise AssertionError(f"{name}: spec {a}, {handles[1].name} {b}")


def _prompt_len(out: SchedulerOutput, req_id: str) -> int:
    return next(len(r.prompt_token_ids) for r in out.new_requests if r.req_id == req_id)
