"""A seeded scenario's scheduler driving spec and other backends side by side, with hooks at each call.

The acceptance-rule tests (conformance/test_rules.py, conformance/test_sampled_faults.py) use it to see
each valid step before it is applied (`before_apply`), to offer each step's scheduler output and its
accepted tokens to the fault generators, and to check that every backend refuses a fault the same way
and changes nothing. Samples are drawn as conformance.differential draws them (the scheduler's rejection
step decides what each drafting row keeps).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from conformance.backends import BackendHandle
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from spec.drafts import pad_accepted
from spec.errors import ScheduleError
from spec.protocol import StatePool
from spec.types import BatchInputs, SchedulerOutput, WorkerConfig


@dataclass
class Sampled:
    """A prepared step's accepted tokens, per batch row, as the fault generators read them."""

    batch: BatchInputs  # spec's batch of the step
    rows: list[list[int]]  # [num_reqs] the tokens each batch row keeps (a stand-in token for rows that do not take)
    drafts: list[tuple[int, ...]]  # [num_reqs] each row's drafts
    takes: list[bool]  # [num_reqs] the row reached its last known token: record_sampled appends to it
    known: list[int]  # [num_reqs] tokens each row knew before the step


class Refusals:
    """Faults handed to every pool: each must raise the expected class, and no snapshot may change."""

    def __init__(self, handles: Sequence[BackendHandle], pools: Sequence[StatePool]) -> None:
        self.handles, self.pools = handles, pools
        self.raised: list[ScheduleError] = []  # spec's error for each fault, in order (its traceback intact)

    def apply(self, out: SchedulerOutput, expected: type[ScheduleError]) -> None:
        self._each(lambda pool, handle: pool.apply(out), expected)

    def record(self, batches: Sequence[BatchInputs], ids: np.ndarray, expected: type[ScheduleError]) -> None:
        """`ids` handed with each pool's own batch (`batches[i]` for pool i)."""
        calls = iter(batches)
        self._each(lambda pool, handle: pool.record_sampled(next(calls), handle.asarray(ids)), expected)

    def call(self, call: Callable[[StatePool], object], expected: type[ScheduleError]) -> None:
        """A misused call of the pool (prepare, row_of: conformance.probes.call_faults)."""
        self._each(lambda pool, handle: call(pool), expected)

    def _each(self, call: Callable[[StatePool, BackendHandle], object], expected: type[ScheduleError]) -> None:
        for i, (pool, handle) in enumerate(zip(self.pools, self.handles, strict=True)):
            before = pool.snapshot()
            try:
                call(pool, handle)
            except ScheduleError as exc:
                if type(exc) is not expected:
                    detail = f"{handle.name}: raised {type(exc).__name__}, expected {expected.__name__}"
                    raise AssertionError(detail) from exc
                if i == 0:
                    self.raised.append(exc)
            else:
                raise AssertionError(f"{handle.name}: accepted a fault that {expected.__name__} must refuse")
            if pool.snapshot() != before:
                raise AssertionError(f"{handle.name}: a refused call changed the pool")


def run_seeded(
    seed: int,
    handles: Sequence[BackendHandle],
    max_steps: int,
    before_apply: Callable[[SchedulerOutput, WorkerConfig, Sequence[StatePool], random.Random], None] | None = None,
    before_record: Callable[[Sampled, WorkerConfig, Sequence[BatchInputs], random.Random], None] | None = None,
) -> ReferenceScheduler:
    """Seed `seed`'s scenario (with drafts) through `handles[0]` (spec) and the others; returns its scheduler."""
    every_family = {"encoder_decoder": True, "hybrid": True, "multimodal": True, "async_scheduling": True}
    scenario = replace(random_scenario(seed, spec_decode=True, **every_family), attention=None)
    config = scenario.config
    sched = ReferenceScheduler(config, scenario.workload, scenario.knobs, seed=scenario.seed)
    pools = [h.make_pool(config) for h in handles]
    rng, sample_rng = random.Random(seed), np.random.default_rng(seed + 1)
    for _ in range(max_steps):
        if sched.done():
            break
        out = sched.schedule()
        if before_apply is not None:
            before_apply(out, config, pools, rng)
        known_before = {row.req_id: len(row.token_ids) for row in pools[0].snapshot()}
        for pool in pools:
            pool.apply(out)
        pad_to = sched.pad_to(out)
        batches = [pool.prepare(out, pad_to) for pool in pools]
        spec_batch = batches[0]
        takes_ids = set(sched.sampling_req_ids(out))
        targets = {r: int(sample_rng.integers(config.vocab_size)) for r in takes_ids}
        kept = sched.rejection_step(out, targets)
        sampled = Sampled(
            spec_batch,
            [list(kept.get(r, (0,))) for r in spec_batch.req_ids],
            [tuple(out.scheduled_spec_decode_tokens.get(r, ())) for r in spec_batch.req_ids],
            [r in takes_ids for r in spec_batch.req_ids],
            [known_before[r] if r in known_before else _prompt_len(out, r) for r in spec_batch.req_ids],
        )
        if before_record is not None and not config.async_scheduling:  # async faults are reported late
            before_record(sampled, config, batches, rng)  # (their timing is conformance/test_async.py's)
        ids = pad_accepted(sampled.rows)
        for pool, handle, batch in zip(pools, handles, batches, strict=True):
            pool.record_sampled(batch, handle.asarray(ids))
        sched.update(out, kept)
    return sched


def _prompt_len(out: SchedulerOutput, req_id: str) -> int:
    return next(len(r.prompt_token_ids) for r in out.new_requests if r.req_id == req_id)
