"""fast's bulk validation never accepts what spec rejects, and fast's host mirror stays equal to spec's state.

Scheduler outputs come from the reference scheduler (valid) and from conformance.mutations plus a few
decode-step breakages below (invalid); spec.validate.plan_step is the judge of each.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

import fast
import spec
from conformance.backends import BATCH_ARRAY_FIELDS
from conformance.differential import one_torch_thread
from conformance.mutations import break_output
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from fast.runtime import interpret
from fast.validate import plan_cached_step
from spec.errors import (
    ALL_ERRORS,
    BlockIdError,
    BlockTableOverflowError,
    DuplicateSlotError,
    MissingBlockError,
    NullBlockError,
    ScheduleError,
    UnknownTokenError,
)
from spec.state import PoolState
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.validate import plan_step

SEEDS = range(24)
MAX_STEPS = 40


def _decode_breakages(out: SchedulerOutput, state: PoolState, rng: random.Random) -> list[SchedulerOutput]:
    """Small edits of a cached-only output, the shape the bulk path handles; some stay valid."""
    if not out.cached_requests or out.new_requests or out.finished_req_ids:
        return []
    cached = list(out.cached_requests)
    i = rng.randrange(len(cached))
    c = cached[i]
    groups = len(state.config.kv_groups)
    g = rng.randrange(groups)
    row = state.row_of.get(c.req_id)
    held = state.blocks(row, g).tolist() if row is not None else []

    def with_cached(new: CachedRequest) -> SchedulerOutput:
        return replace(out, cached_requests=(*cached[:i], new, *cached[i + 1 :]))

    def with_added(ids: tuple[int, ...]) -> SchedulerOutput:
        added = [list(x) for x in (c.new_block_ids or tuple(() for _ in range(groups)))]
        added[g] = [*added[g], *ids]
        return with_cached(replace(c, new_block_ids=tuple(tuple(x) for x in added)))

    num_blocks = state.config.kv_groups[g].num_blocks
    edits = [
        with_cached(replace(c, num_computed_tokens=c.num_computed_tokens + rng.choice((-1, 1)))),
        with_cached(replace(c, num_computed_tokens=-1)),
        with_cached(replace(c, new_block_ids=())),
        with_added((num_blocks,)),
        with_added((0,)),
        with_added((rng.randrange(1, num_blocks),)),
        replace(out, num_scheduled_tokens={**out.num_scheduled_tokens, c.req_id: 0}),
        replace(out, cached_requests=(*cached, c)),
    ]
    if held:
        edits.append(with_added((rng.choice(held),)))
    other = cached[rng.randrange(len(cached))]
    other_row = state.row_of.get(other.req_id)
    if other_row is not None and other.req_id != c.req_id:  # share the other request's blocks: maybe one slot twice
        edits.append(with_cached(replace(c, num_computed_tokens=other.num_computed_tokens)))
    return edits


def _assert_mirror_equal(fast_pool: fast.RequestStatePool, spec_pool: spec.RequestStatePool) -> None:
    got, want = fast_pool.state, spec_pool.state
    assert got.req_ids == want.req_ids and got.row_of == want.row_of
    np.testing.assert_array_equal(got.num_tokens, want.num_tokens)
    np.testing.assert_array_equal(got.num_computed_tokens, want.num_computed_tokens)
    np.testing.assert_array_equal(got.num_blocks, want.num_blocks)
    for g, table in enumerate(want.block_tables):
        np.testing.assert_array_equal(got.block_tables[g], table)


_BATCH_ARRAYS = (*BATCH_ARRAY_FIELDS, "block_tables", "slot_mappings")


def to_numpy(x: object) -> np.ndarray:
    if isinstance(x, tuple):
        return np.concatenate([t.numpy().reshape(-1) for t in x]) if x else np.zeros(0)
    return x.numpy()  # type: ignore[attr-defined]


def _assert_batch_equal(batch: spec.BatchInputs, arrays: dict[str, np.ndarray]) -> None:
    for name in _BATCH_ARRAYS:
        np.testing.assert_array_equal(to_numpy(getattr(batch, name)), arrays[name], err_msg=name)


def _assert_null_tails(fast_pool: fast.RequestStatePool, state: PoolState) -> None:
    """The pool's per-row last null entry (sliding-window groups) equals a plain scan of spec's tables."""
    for g, group in enumerate(state.config.kv_groups):
        tails = fast_pool._null_tails[g]
        if group.sliding_window is None:
            assert tails is None
            continue
        assert tails is not None
        for row in range(state.config.max_num_reqs):
            nulls = [i for i, block in enumerate(state.blocks(row, g).tolist()) if block == 0]
            assert tails[row] == (nulls[-1] if nulls else -1), (g, row)


@pytest.mark.parametrize("seed", SEEDS)
def test_bulk_path_agrees_with_plan_step(seed: int) -> None:
    with interpret(False), one_torch_thread():  # validation is under test here, not the kernels
        _agree(seed)


def _agree(seed: int) -> None:
    scenario = random_scenario(seed)
    config = scenario.config
    scheduler = ReferenceScheduler(config, scenario.workload, scenario.knobs, scenario.seed)
    spec_pool, fast_pool = spec.RequestStatePool(config), fast.RequestStatePool(config)
    rng = random.Random(seed)
    steps = 0
    previous: tuple[spec.BatchInputs, dict[str, np.ndarray]] | None = None
    while not scheduler.done() and steps < MAX_STEPS:
        out = scheduler.schedule()
        state = spec_pool.state
        invalid = [m[0] for cls in ALL_ERRORS if (m := break_output(cls, out, config, spec_pool.snapshot(), rng))]
        for candidate in [out, *invalid, *_decode_breakages(out, state, rng)]:
            try:
                plan_step(state, candidate)
            except ScheduleError:
                assert plan_cached_step(state, candidate) is None, candidate
        spec_pool.apply(out)
        fast_pool.apply(out)
        _assert_mirror_equal(fast_pool, spec_pool)
        _assert_null_tails(fast_pool, spec_pool.state)
        if previous is not None:  # a later step must not change an earlier batch's arrays
            _assert_batch_equal(previous[0], previous[1])
        batch_spec, batch_fast = spec_pool.prepare(out), fast_pool.prepare(out)
        previous = (batch_fast, {name: to_numpy(getattr(batch_fast, name)).copy() for name in _BATCH_ARRAYS})
        takes = scheduler.sampling_req_ids(out)
        sampled = np.array([rng.randrange(config.vocab_size) for _ in batch_spec.req_ids], np.int64)
        spec_pool.record_sampled(batch_spec, sampled)
        fast_pool.record_sampled(batch_fast, sampled)
        scheduler.update(out, {r: int(t) for r, t in zip(batch_spec.req_ids, sampled, strict=True) if r in takes})
        assert fast_pool.snapshot() == spec_pool.snapshot()
        steps += 1
    assert steps > 0


def test_bulk_path_takes_the_common_decode_step() -> None:
    """Without this, the agreement test above could pass with a bulk path that accepts nothing."""
    accepted = 0
    for seed in SEEDS:
        scenario = random_scenario(seed)
        scheduler = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, scenario.seed)
        pool = spec.RequestStatePool(scenario.config)
        for _ in range(MAX_STEPS):
            if scheduler.done():
                break
            out = scheduler.schedule()
            cached_only = not out.new_requests and not out.finished_req_ids and out.cached_requests
            if cached_only and not any(c.resumed for c in out.cached_requests):
                accepted += plan_cached_step(pool.state, out) is not None
            pool.apply(out)
            batch = pool.prepare(out)
            takes = scheduler.sampling_req_ids(out)
            pool.record_sampled(batch, np.ones(batch.num_reqs, np.int64))
            scheduler.update(out, {r: 1 for r in batch.req_ids if r in takes})
    assert accepted >= 20


def _two_decoding_requests() -> tuple[WorkerConfig, SchedulerOutput, SchedulerOutput]:
    """A and B each hold 4 prompt tokens in one block (block_size 4) and have sampled one more."""
    config = WorkerConfig(4, 16, 32, 50, (KVCacheGroup(4, 16), KVCacheGroup(2, 16, sliding_window=2)))
    first = SchedulerOutput(
        new_requests=(
            NewRequest("A", (1, 2, 3, 4), ((1,), (1, 2))),
            NewRequest("B", (5, 6, 7, 8), ((2,), (3, 4))),
        ),
        num_scheduled_tokens={"A": 4, "B": 4},
    )
    ok = SchedulerOutput(  # the valid decode step the cases below break
        cached_requests=(CachedRequest("A", 4, ((3,), (5,))), CachedRequest("B", 4, ((4,), (6,)))),
        num_scheduled_tokens={"A": 1, "B": 1},
    )
    return config, first, ok


DECODE_CASES = {
    # both requests append block 3 and write its offset 0
    "duplicate slot": (DuplicateSlotError, {"B": CachedRequest("B", 4, ((3,), (6,)))}),
    "missing block": (MissingBlockError, {"A": CachedRequest("A", 4, ((), (5,)))}),
    "unknown token": (UnknownTokenError, {"A": CachedRequest("A", 5, ((3,), (5,)))}),
    "block held twice": (BlockIdError, {"A": CachedRequest("A", 4, ((1,), (5,)))}),
    "block out of range": (BlockIdError, {"A": CachedRequest("A", 4, ((16,), (5,)))}),
    "null without window": (BlockIdError, {"A": CachedRequest("A", 4, ((0,), (5,)))}),
    "null read in window": (NullBlockError, {"A": CachedRequest("A", 4, ((3,), (0,)))}),
    "overflow": (BlockTableOverflowError, {"A": CachedRequest("A", 4, ((3, 5, 6, 7), (5,)))}),
    "valid": (None, {}),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_step_errors_match_spec(case: str) -> None:
    error, changes = DECODE_CASES[case]
    config, first, ok = _two_decoding_requests()
    bad = replace(ok, cached_requests=tuple(changes.get(c.req_id, c) for c in ok.cached_requests))
    with interpret(False):
        spec_pool, fast_pool = spec.RequestStatePool(config), fast.RequestStatePool(config)
        for pool in (spec_pool, fast_pool):
            pool.apply(first)
            pool.record_sampled(pool.prepare(first), np.array([9, 9]))
        if error is None:
            assert plan_cached_step(fast_pool.state, bad) is not None  # the bulk path, not the fallback
            fast_pool.apply(bad)
            spec_pool.apply(bad)
        else:
            assert plan_cached_step(fast_pool.state, bad) is None
            with pytest.raises(error) as want:
                spec_pool.apply(bad)
            with pytest.raises(error) as got:
                fast_pool.apply(bad)
            assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert fast_pool.snapshot() == spec_pool.snapshot()
