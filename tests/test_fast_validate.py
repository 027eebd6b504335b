"""fast's bulk validation never accepts what spec rejects, and fast's host mirror stays equal to spec's state.

Scheduler outputs come from the reference scheduler (valid) and from conformance.mutations plus a few
decode-step breakages below (invalid); spec.validate.plan_step is the judge of each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import fast
import spec
from conformance.backends import BackendHandle
from conformance.differential import one_torch_thread
from conformance.driving import sampled_array
from conformance.mutations import break_output
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from fast.bulk_read import RowMemo
from fast.fallback import Fallback
from fast.runtime import interpret
from fast.validate import plan_bulk_step
from shadow.compare import batch_differences, copy_batch
from spec.errors import (
    ALL_ERRORS,
    BlockIdError,
    BlockTableOverflowError,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    NullBlockError,
    PoolFullError,
    ScheduleError,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
)
from spec.model_kinds import features_for
from spec.state import PoolState, StepPlan, TableWrites
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
    np.testing.assert_array_equal(got.num_known_tokens, want.num_known_tokens)
    np.testing.assert_array_equal(got.num_computed_tokens, want.num_computed_tokens)
    np.testing.assert_array_equal(got.num_blocks, want.num_blocks)
    for g, table in enumerate(want.block_tables):
        np.testing.assert_array_equal(got.block_tables[g], table)


SPEC, FAST = BackendHandle("spec", spec), BackendHandle("fast", fast)


def _assert_batch_equal(batch: spec.BatchInputs, arrays: dict[str, Any]) -> None:
    problems = batch_differences(arrays, FAST.batch_to_numpy(batch))
    assert not problems, "\n".join(problems)


def _assert_released_tails(fast_pool: fast.RequestStatePool, state: PoolState) -> None:
    """The pool's per-row last released entry (sliding-window groups) equals a plain scan of spec's tables."""
    for g, group in enumerate(state.config.kv_groups):
        tails = fast_pool.released.tails[g]
        if group.sliding_window is None:
            assert tails is None
            continue
        assert tails is not None
        for row in range(state.config.max_num_reqs):
            blocks = state.blocks(row, g).tolist()
            released = [i for i, block in enumerate(blocks) if block == 0 or block in blocks[i + 1 :]]
            assert tails[row] == (released[-1] if released else -1), (g, row)


@pytest.mark.parametrize("seed", SEEDS)
def test_bulk_path_agrees_with_plan_step(seed: int) -> None:
    with interpret(False), one_torch_thread():  # validation is under test here, not the kernels
        _agree(seed)


def _agree(seed: int) -> None:
    scenario = random_scenario(seed, spec_decode=seed % 2 == 1)  # odd seeds draft: their breakages too
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
                plan_step(state, candidate, spec_pool.features)
            except ScheduleError:
                assert isinstance(plan_bulk_step(state, candidate, spec_pool.features), Fallback), candidate
        spec_pool.apply(out)
        fast_pool.apply(out)
        _assert_mirror_equal(fast_pool, spec_pool)
        _assert_released_tails(fast_pool, spec_pool.state)
        if previous is not None:  # a later step must not change an earlier batch's arrays
            _assert_batch_equal(previous[0], previous[1])
        batch_spec, batch_fast = spec_pool.prepare(out), fast_pool.prepare(out)
        previous = (batch_fast, copy_batch(FAST.batch_to_numpy(batch_fast)))
        takes = scheduler.sampling_req_ids(out)
        drawn = {r: rng.randrange(config.vocab_size) for r in batch_spec.req_ids}
        kept = scheduler.rejection_step(out, {r: t for r, t in drawn.items() if r in takes})
        sampled = sampled_array([kept.get(r, t) for r, t in drawn.items()])
        spec_pool.record_sampled(batch_spec, sampled)
        fast_pool.record_sampled(batch_fast, sampled)
        scheduler.update(out, kept)
        assert fast_pool.snapshot() == spec_pool.snapshot()
        steps += 1
    assert steps > 0


def test_bulk_path_takes_the_common_steps() -> None:
    """Without this, the agreement test above could pass with a bulk path that accepts nothing."""
    accepted = mixed = 0
    for seed in SEEDS:
        scenario = random_scenario(seed)
        scheduler = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, scenario.seed)
        pool = spec.RequestStatePool(scenario.config)
        for _ in range(MAX_STEPS):
            if scheduler.done():
                break
            out = scheduler.schedule()
            cached_only = not out.new_requests and not out.finished_req_ids and out.cached_requests
            if not any(c.resumed for c in out.cached_requests):
                taken = isinstance(plan_bulk_step(pool.state, out, pool.features), StepPlan)
                accepted += taken and bool(cached_only)
                mixed += taken and bool(out.new_requests) and bool(out.finished_req_ids or out.cached_requests)
            pool.apply(out)
            batch = pool.prepare(out)
            takes = scheduler.sampling_req_ids(out)
            pool.record_sampled(batch, np.ones(batch.num_reqs, np.int64))
            scheduler.update(out, {r: 1 for r in batch.req_ids if r in takes})
    assert accepted >= 20
    assert mixed >= 20  # steps with new requests beside finished or continuing ones


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


DECODE_CASES = {  # (spec's error, the changed requests, the bulk check that refuses it: fast/fallback.py)
    # both requests append block 3 and write its offset 0
    "duplicate slot": (DuplicateSlotError, {"B": CachedRequest("B", 4, ((3,), (6,)))}, Fallback.SHARED_BLOCK),
    "missing block": (MissingBlockError, {"A": CachedRequest("A", 4, ((), (5,)))}, Fallback.TABLES),
    "unknown token": (UnknownTokenError, {"A": CachedRequest("A", 5, ((3,), (5,)))}, Fallback.PROGRESS),
    "block held twice": (BlockIdError, {"A": CachedRequest("A", 4, ((1,), (5,)))}, Fallback.TABLES),
    "block out of range": (BlockIdError, {"A": CachedRequest("A", 4, ((16,), (5,)))}, Fallback.TABLES),
    "null without window": (BlockIdError, {"A": CachedRequest("A", 4, ((0,), (5,)))}, Fallback.TABLES),
    "null read in window": (NullBlockError, {"A": CachedRequest("A", 4, ((3,), (0,)))}, Fallback.TABLES),
    "overflow": (BlockTableOverflowError, {"A": CachedRequest("A", 4, ((3, 5, 6, 7), (5,)))}, Fallback.TABLES),
    "valid": (None, {}, None),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_step_errors_match_spec(case: str) -> None:
    """spec's error, and the bulk check named for it: a check that lets a fault through to a later one (a missing
    block read as an id past the appended ones) would still end in spec's error, by another fallback."""
    error, changes, refused_by = DECODE_CASES[case]
    config, first, ok = _two_decoding_requests()
    bad = replace(ok, cached_requests=tuple(changes.get(c.req_id, c) for c in ok.cached_requests))
    with interpret(False):
        spec_pool, fast_pool = spec.RequestStatePool(config), fast.RequestStatePool(config)
        for pool in (spec_pool, fast_pool):
            pool.apply(first)
            pool.record_sampled(pool.prepare(first), np.array([9, 9]))
        _apply_to_both(spec_pool, fast_pool, bad, error)
    assert fast_pool.snapshot() == spec_pool.snapshot()
    assert fast_pool.fallbacks == (Counter({refused_by: 1}) if refused_by else Counter())


def _mixed_step() -> SchedulerOutput:
    """After _two_decoding_requests' first step: A finishes, B decodes, and C, D, E arrive.

    C takes A's freed row 0 (the lowest free row), D and E rows 2 and 3. D and E enter with a prefix hit;
    E's windowed table starts with the null block, which its window no longer reads.
    """
    return SchedulerOutput(
        new_requests=(
            NewRequest("C", (7, 8, 9, 10, 11, 12), ((5, 6), (7, 8, 9))),
            NewRequest("D", (1, 2, 3), ((9,), (10, 11)), num_computed_tokens=1),
            NewRequest("E", (4, 5, 6, 7, 8, 9), ((7, 8), (0, 12, 13)), num_computed_tokens=4),
        ),
        cached_requests=(CachedRequest("B", 4, ((4,), (6,))),),
        num_scheduled_tokens={"B": 1, "C": 6, "D": 2, "E": 2},
        finished_req_ids=frozenset({"A"}),
    )


def _started_pools(config: WorkerConfig, first: SchedulerOutput) -> tuple[spec.RequestStatePool, fast.RequestStatePool]:
    spec_pool, fast_pool = spec.RequestStatePool(config), fast.RequestStatePool(config)
    for pool in (spec_pool, fast_pool):
        pool.apply(first)
        pool.record_sampled(pool.prepare(first), np.array([9, 9]))
    return spec_pool, fast_pool


@pytest.mark.parametrize("kernels", [False, True], ids=["host", "interpreted"])
def test_mixed_step_takes_the_bulk_path(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """New, finished and continuing requests in one step: no fallback, and spec's effect on the mirror and device."""
    config, first, _ = _two_decoding_requests()
    step = _mixed_step()
    with interpret(kernels):  # interpreted: the device state is separate and written by fast.writes
        spec_pool, fast_pool = _started_pools(config, first)
        plan = plan_bulk_step(fast_pool.state, step)
        assert isinstance(plan, StepPlan), plan
        assert (plan.freed_rows.tolist(), plan.new_rows.tolist()) == ([0], [0, 2, 3])

        def no_fallback(*args: object) -> None:
            raise AssertionError("the mixed step fell back to spec's plan_step")

        monkeypatch.setattr(fast.pool, "plan_step", no_fallback)
        fast_pool.apply(step)
        spec_pool.apply(step)
        _assert_mirror_equal(fast_pool, spec_pool)
        _assert_released_tails(fast_pool, spec_pool.state)
        assert fast_pool.released.tails[1] is not None and fast_pool.released.tails[1][3] == 0  # E's null entry
        assert fast_pool.snapshot() == spec_pool.snapshot()
        want, got = spec_pool.prepare(step), fast_pool.prepare(step)
        _assert_batch_equal(got, SPEC.batch_to_numpy(want))
        if kernels:  # the device tensors themselves, not the mirror
            rows = [r.row for r in spec_pool.snapshot()]
            np.testing.assert_array_equal(fast_pool.dev.num_computed.numpy(), spec_pool.state.num_computed_tokens)
            for g, table in enumerate(spec_pool.state.block_tables):
                np.testing.assert_array_equal(fast_pool.dev.table(g).numpy()[rows], table[rows])
            np.testing.assert_array_equal(fast_pool.dev.num_blocks.numpy(), spec_pool.state.num_blocks)


def _edit_new(step: SchedulerOutput, req_id: str, **changes: object) -> SchedulerOutput:
    return replace(
        step, new_requests=tuple(replace(r, **changes) if r.req_id == req_id else r for r in step.new_requests)
    )


def _mixed_cases() -> dict[str, tuple[type[ScheduleError], SchedulerOutput]]:
    step = _mixed_step()
    scheduled = dict(step.num_scheduled_tokens)
    extra = NewRequest("F", (1,), ((14,), (14,)))
    return {
        "finished and scheduled": (InconsistentSchedulerOutputError, replace(step, finished_req_ids=frozenset("AB"))),
        "new listed twice": (
            InconsistentSchedulerOutputError,
            replace(step, new_requests=(*step.new_requests, step.new_requests[0])),
        ),
        "new not scheduled": (
            InconsistentSchedulerOutputError,
            replace(step, num_scheduled_tokens={k: v for k, v in scheduled.items() if k != "D"}),
        ),
        "new missing a group": (InconsistentSchedulerOutputError, _edit_new(step, "C", block_ids=((5, 6),))),
        "new negative computed": (InconsistentSchedulerOutputError, _edit_new(step, "D", num_computed_tokens=-1)),
        "unknown finished": (UnknownRequestError, replace(step, finished_req_ids=frozenset({"A", "Z"}))),
        "new holds a row": (  # B continues, but is listed as new
            DuplicateRequestError,
            replace(step, new_requests=(*step.new_requests, NewRequest("B", (1,), ((14,), (14,)))), cached_requests=()),
        ),
        "pool full": (
            PoolFullError,
            replace(step, new_requests=(*step.new_requests, extra), num_scheduled_tokens={**scheduled, "F": 1}),
        ),
        "token budget": (TokenBudgetError, replace(step, num_scheduled_tokens={**scheduled, "C": 30})),
        "prompt token past vocab": (TokenIdError, _edit_new(step, "C", prompt_token_ids=(7, 8, 9, 50, 11, 12))),
        "float prompt token": (TokenIdError, _edit_new(step, "D", prompt_token_ids=(1, -0.5, 3))),
        "negative prompt token": (TokenIdError, _edit_new(step, "D", prompt_token_ids=(1, -1, 3))),
        "prompt past max_model_len": (ModelLengthError, _edit_new(step, "D", prompt_token_ids=tuple(range(17)))),
        "more scheduled than the prompt": (
            UnknownTokenError,
            replace(step, num_scheduled_tokens={**scheduled, "D": 3}),
        ),
        "block out of range": (BlockIdError, _edit_new(step, "C", block_ids=((5, 16), (7, 8, 9)))),
        "block twice in a table": (BlockIdError, _edit_new(step, "C", block_ids=((5, 6), (7, 8, 7)))),
        "null without window": (BlockIdError, _edit_new(step, "C", block_ids=((5, 0), (7, 8, 9)))),
        "overflow": (BlockTableOverflowError, _edit_new(step, "D", block_ids=((9, 10, 11, 12, 13), (10, 11)))),
        "missing block": (MissingBlockError, _edit_new(step, "C", block_ids=((5,), (7, 8, 9)))),
        "null read in window": (NullBlockError, _edit_new(step, "C", block_ids=((5, 6), (7, 0, 9)))),
        "slot of a continuing request": (DuplicateSlotError, _edit_new(step, "C", block_ids=((4, 6), (7, 8, 9)))),
        "slot of another new request": (DuplicateSlotError, _edit_new(step, "D", block_ids=((5,), (10, 11)))),
        "valid": (type(None), step),  # type: ignore[dict-item]
    }


@pytest.mark.parametrize("case", sorted(_mixed_cases()))
def test_mixed_step_errors_match_spec(case: str) -> None:
    """Every error class a new or finished request can raise: the bulk path declines, and fast raises spec's error."""
    error, bad = _mixed_cases()[case]
    config, first, _ = _two_decoding_requests()
    with interpret(False):
        spec_pool, fast_pool = _started_pools(config, first)
        _apply_to_both(spec_pool, fast_pool, bad, None if error is type(None) else error)
    assert fast_pool.snapshot() == spec_pool.snapshot()
    _assert_mirror_equal(fast_pool, spec_pool)


# where each of _mixed_cases leaves the bulk planner (fast/fallback.py): the check of its that fails first
_MIXED_FALLBACKS = {
    "finished and scheduled": Fallback.ROWS,
    "new listed twice": Fallback.REQUEST_SET,  # five requests listed, four scheduled
    "new not scheduled": Fallback.REQUEST_SET,
    "new missing a group": Fallback.NEW_REQUESTS,
    "new negative computed": Fallback.NEW_REQUESTS,
    "unknown finished": Fallback.ROWS,
    "new holds a row": Fallback.ROWS,
    "pool full": Fallback.ROWS,
    "token budget": Fallback.BUDGET,
    "prompt token past vocab": Fallback.NEW_REQUESTS,
    "float prompt token": Fallback.NEW_REQUESTS,
    "negative prompt token": Fallback.NEW_REQUESTS,
    "prompt past max_model_len": Fallback.NEW_REQUESTS,
    "more scheduled than the prompt": Fallback.NEW_REQUESTS,
    "block out of range": Fallback.NEW_REQUESTS,
    "block twice in a table": Fallback.NEW_REQUESTS,
    "null without window": Fallback.NEW_REQUESTS,
    "overflow": Fallback.NEW_REQUESTS,
    "missing block": Fallback.NEW_REQUESTS,
    "null read in window": Fallback.NEW_REQUESTS,
    "slot of a continuing request": Fallback.SHARED_BLOCK,
    "slot of another new request": Fallback.SHARED_BLOCK,
}


@pytest.mark.parametrize("case", sorted(_mixed_cases()))
def test_each_fallback_is_named_and_counted(case: str) -> None:
    """The bulk planner names why it leaves a step to plan_step, and the pool counts it, refused or not."""
    _, bad = _mixed_cases()[case]
    config, first, _ = _two_decoding_requests()
    with interpret(False):
        _, fast_pool = _started_pools(config, first)
        want = _MIXED_FALLBACKS.get(case)
        planned = plan_bulk_step(fast_pool.state, bad)
        assert planned is want if want else isinstance(planned, StepPlan), planned
        with contextlib.suppress(ScheduleError):
            fast_pool.apply(bad)
    assert fast_pool.fallbacks == (Counter({want: 1}) if want else Counter())
    assert want is None or want.failed_check  # each is a check the bulk path makes, not a shape it leaves


def test_fallbacks_of_shapes_the_bulk_planner_leaves() -> None:
    """A resumed request, a feature's fields, a feature whose group only plan_step checks: named, counted, then
    spec's."""
    config, first, _ = _two_decoding_requests()
    step = _mixed_step()
    resumed = replace(step, cached_requests=(CachedRequest("B", 4, None, resumed=True),))  # no table given
    encoder = _edit_new(step, "C", encoder_len=3)  # on a model without a cross group: check 1 refuses it
    mrope = _edit_new(step, "C", mrope_position_delta=2)  # on a model without M-RoPE: refused too
    with interpret(False):
        for sched, want in ((resumed, Fallback.CACHED_REQUESTS), (encoder, Fallback.FEATURE_FIELDS),
                            (mrope, Fallback.FEATURE_FIELDS)):  # fmt: skip
            _, fast_pool = _started_pools(config, first)
            assert plan_bulk_step(fast_pool.state, sched, fast_pool.features) is want
            with contextlib.suppress(ScheduleError):
                fast_pool.apply(sched)
            assert fast_pool.fallbacks == Counter({want: 1}) and not want.failed_check
    # a feature whose group only plan_step checks (spec's cross-attention; fast's checks it in bulk)
    cross = WorkerConfig(4, 16, 32, 50, (KVCacheGroup(4, 16), KVCacheGroup(4, 16, kind="cross_attention")),
                         max_encoder_len=8)  # fmt: skip
    start = SchedulerOutput(new_requests=(NewRequest("A", (1, 2), ((1,), (2,)), encoder_len=3),),
                            num_scheduled_tokens={"A": 2})  # fmt: skip
    with interpret(False):
        pool = fast.RequestStatePool(cross)
        assert plan_bulk_step(pool.state, start, features_for(cross)) is Fallback.FEATURE
        pool.apply(start)
    assert pool.fallbacks == Counter()


def _apply_to_both(spec_pool: Any, fast_pool: Any, sched: Any, error: Any) -> None:
    """Valid (error None): the bulk path takes it and both apply it. Else both raise spec's exact error."""
    if error is None:
        assert isinstance(plan_bulk_step(fast_pool.state, sched), StepPlan)  # the bulk path, not the fallback
        fast_pool.apply(sched)
        spec_pool.apply(sched)
        return
    assert isinstance(plan_bulk_step(fast_pool.state, sched), Fallback)
    with pytest.raises(error) as want:
        spec_pool.apply(sched)
    with pytest.raises(error) as got:
        fast_pool.apply(sched)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


def _assert_plans_equal(got: StepPlan, want: StepPlan) -> None:
    for f in dataclasses.fields(StepPlan):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "tables":
            for g, (x, y) in enumerate(zip(a, b, strict=True)):
                for t in dataclasses.fields(TableWrites):
                    np.testing.assert_array_equal(getattr(x, t.name), getattr(y, t.name), err_msg=f"{g} {t.name}")
        elif isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
            assert a is not None and b is not None, f.name
            assert a.dtype == b.dtype, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name


def test_drafting_steps_take_the_bulk_path_with_plan_steps_plan() -> None:
    """Drafting steps (the reference scheduler with spec_tokens), and steps resuming preempted requests: the compiled
    checks plan them as spec does."""
    drafting = resuming = 0
    for seed in range(12):
        scenario = random_scenario(seed, spec_decode=True)
        knobs = replace(scenario.knobs, spec_tokens=3)
        scheduler = ReferenceScheduler(scenario.config, scenario.workload, knobs, scenario.seed)
        pool = spec.RequestStatePool(scenario.config)
        for _ in range(MAX_STEPS):
            if scheduler.done():
                break
            out = scheduler.schedule()
            # appended null placeholders (knob null_lookahead) and M-RoPE tables are plan_step's by design (a resumed
            # request's whole table may hold the null block in a window's released entries)
            appended = (ids for c in out.cached_requests if not c.resumed for ids in (c.new_block_ids or ()))
            appends_null = any(0 in ids for ids in appended)
            by_design = appends_null or any(r.mrope_positions is not None for r in out.new_requests)  # M-RoPE tables
            if out.num_scheduled_tokens and not by_design:
                plan = plan_bulk_step(pool.state, out, pool.features)
                assert isinstance(plan, StepPlan), (plan, out)
                _assert_plans_equal(plan, plan_step(pool.state, out, pool.features))
                drafting += plan.num_drafts is not None
                resuming += any(c.resumed for c in out.cached_requests)
            pool.apply(out)
            batch = pool.prepare(out)
            takes = scheduler.sampling_req_ids(out)
            kept = scheduler.rejection_step(out, {r: 1 for r in batch.req_ids if r in takes})
            pool.record_sampled(batch, sampled_array([kept.get(r, 1) for r in batch.req_ids]))
            scheduler.update(out, kept)
    assert drafting >= 20
    assert resuming >= 5, resuming  # steps resuming a preempted request, planned in bulk


def test_async_drafts_proposed_on_the_device_take_the_bulk_path() -> None:
    """Placeholder drafts right after unverified drafts (async rule 8) are planned in bulk; drafts the scheduler
    sends after unverified ones (rule 5) are left to spec, which refuses them, and counted as ASYNC_RULES."""
    config = spec.WorkerConfig(4, 64, 32, 100, (spec.KVCacheGroup(4, 64),), async_scheduling=True)
    pool = fast.RequestStatePool(config)
    first = spec.SchedulerOutput(new_requests=(spec.NewRequest("a", (1, 2, 3, 4, 5), ((3, 4),)),),
                                 num_scheduled_tokens={"a": 5})  # fmt: skip
    pool.apply(first)
    pool.record_sampled(pool.prepare(first), np.array([42]), np.array([[7, 8]]))
    drafting = spec.SchedulerOutput(cached_requests=(spec.CachedRequest("a", 5),), num_scheduled_tokens={"a": 3},
                                    scheduled_spec_decode_tokens={"a": (-1, -1)})  # fmt: skip
    pool.apply(drafting)
    pool.record_sampled(pool.prepare(drafting), np.array([[7, 50, -1]]), np.array([[60, 61]]))
    ahead = spec.SchedulerOutput(
        cached_requests=(spec.CachedRequest("a", 8, ((5,),)),),
        num_scheduled_tokens={"a": 3},
        scheduled_spec_decode_tokens={"a": (-1, -1)},
    )
    pool.apply(ahead)
    assert pool.fallbacks == Counter()
    pool.record_sampled(pool.prepare(ahead), np.array([[60, 61, 70]]), np.array([[80, 81]]))
    sent = spec.SchedulerOutput(cached_requests=(spec.CachedRequest("a", 10),), num_scheduled_tokens={"a": 2},
                                scheduled_spec_decode_tokens={"a": (9,)})  # fmt: skip
    with pytest.raises(spec.UnknownTokenError, match="verdict"):
        pool.apply(sent)
    assert pool.fallbacks == Counter({Fallback.ASYNC_RULES: 1})


def test_row_memo_follows_a_request_that_left_and_came_back() -> None:
    """The bulk planner remembers the continuing requests' rows (fast.bulk_read.RowMemo) while they hold them: when
    a commit frees one of them, the memo is forgotten, and the same list of ids read again finds the request's new
    row. Here 'a' leaves row 0, 'c' takes it, and 'a' comes back in row 2."""
    config = WorkerConfig(4, 16, 64, 10, (KVCacheGroup(4, 20),))
    pool = spec.RequestStatePool(config)
    first = SchedulerOutput(
        new_requests=(NewRequest("a", (1, 2), ((1,),)), NewRequest("b", (1, 2), ((2,),))),
        num_scheduled_tokens={"a": 2, "b": 2},
    )
    pool.apply(first)
    memo = RowMemo(config.max_num_reqs)
    assert memo.rows_of(pool.state, ["a", "b"]).tolist() == [0, 1]
    swap = SchedulerOutput(new_requests=(NewRequest("c", (3,), ((3,),)),), num_scheduled_tokens={"c": 1},
                           finished_req_ids=frozenset({"a"}))  # fmt: skip
    pool.apply(swap)
    memo.freed(np.array([0]))  # what the fast pool's commit tells its memo
    back = SchedulerOutput(new_requests=(NewRequest("a", (1, 2), ((4,),)),), num_scheduled_tokens={"a": 2})
    pool.apply(back)
    assert pool.state.row_of["a"] == 2
    assert memo.rows_of(pool.state, ["a", "b"]).tolist() == [2, 1]
    memo.freed(np.array([3]))  # a row it does not remember: the memo stands
    assert memo.req_ids == ["a", "b"]
