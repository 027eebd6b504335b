"""Every error class, once per backend: the right type, a message naming the request, nothing changed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.driving import step
from spec import (
    CachedRequest,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
)
from spec.protocol import StatePool

# Two groups: a full-attention one and a sliding-window one (window 4), block size 4 in both.
CONFIG = WorkerConfig(
    max_num_reqs=4,
    max_model_len=32,
    max_num_batched_tokens=16,
    vocab_size=100,
    kv_groups=(KVCacheGroup(4, 16), KVCacheGroup(4, 16, sliding_window=4)),
)


def _pool(backend: BackendHandle) -> StatePool:
    """Row 0: 'a' (7 known tokens, 6 computed, 2 blocks per group); row 1: 'b' (5 known, 4 computed, 1 block)."""
    pool = backend.make_pool(CONFIG)
    first = SchedulerOutput(
        new_requests=(
            NewRequest("a", (1, 2, 3, 4, 5, 6), ((1, 2), (3, 4))),
            NewRequest("b", (7, 8, 9, 10), ((5,), (6,))),
        ),
        num_scheduled_tokens={"a": 6, "b": 4},
    )
    step(backend, pool, first)
    return pool


def _new(req_id: str, prompt: tuple[int, ...], blocks: tuple[tuple[int, ...], ...], n: int) -> SchedulerOutput:
    return SchedulerOutput(new_requests=(NewRequest(req_id, prompt, blocks),), num_scheduled_tokens={req_id: n})


def _cached(req_id: str, computed: int, n: int, blocks: tuple[tuple[int, ...], ...] | None = None) -> SchedulerOutput:
    return SchedulerOutput(cached_requests=(CachedRequest(req_id, computed, blocks),), num_scheduled_tokens={req_id: n})


BAD: dict[str, tuple[type[spec.ScheduleError], str, Callable[[], SchedulerOutput]]] = {
    "scheduled but not listed": (
        spec.InconsistentSchedulerOutputError,
        "a",
        lambda: SchedulerOutput(num_scheduled_tokens={"a": 1}),
    ),
    "new and finished": (
        spec.InconsistentSchedulerOutputError,
        "c",
        lambda: SchedulerOutput(
            new_requests=(NewRequest("c", (1,), ((7,), (8,))),),
            num_scheduled_tokens={"c": 1},
            finished_req_ids=frozenset({"c"}),
        ),
    ),
    "zero-length query row": (spec.InconsistentSchedulerOutputError, "a", lambda: _cached("a", 6, 0)),
    "block ids for the wrong number of groups": (
        spec.InconsistentSchedulerOutputError,
        "c",
        lambda: _new("c", (1,), ((7,),), 1),
    ),
    "unknown cached request": (spec.UnknownRequestError, "zz", lambda: _cached("zz", 0, 1)),
    "unknown finished request": (
        spec.UnknownRequestError,
        "zz",
        lambda: SchedulerOutput(finished_req_ids=frozenset({"zz"})),
    ),
    "duplicate request": (spec.DuplicateRequestError, "a", lambda: _new("a", (1,), ((7,), (8,)), 1)),
    "pool full": (
        spec.PoolFullError,
        "e",
        lambda: SchedulerOutput(
            new_requests=tuple(NewRequest(r, (1,), ((7 + i,), (10 + i,))) for i, r in enumerate("cde")),
            num_scheduled_tokens={"c": 1, "d": 1, "e": 1},
        ),
    ),
    "token budget": (spec.TokenBudgetError, "c", lambda: _new("c", tuple(range(20)), ((7, 8, 9, 10, 11), ()), 17)),
    "token id out of vocabulary": (spec.TokenIdError, "c", lambda: _new("c", (1, 100), ((7,), (8,)), 2)),
    "prompt longer than max_model_len": (spec.ModelLengthError, "c", lambda: _new("c", (1,) * 33, ((7,), (8,)), 1)),
    "seq_len past max_model_len": (spec.ModelLengthError, "a", lambda: _cached("a", 31, 2)),
    "position past the known tokens": (spec.UnknownTokenError, "a", lambda: _cached("a", 6, 2)),
    "block id out of range": (spec.BlockIdError, "a", lambda: _cached("a", 6, 1, ((16,), ()))),
    "block repeated in one table": (spec.BlockIdError, "a", lambda: _cached("a", 6, 1, ((1,), ()))),
    "null block without a window": (spec.BlockIdError, "c", lambda: _new("c", (1,), ((0,), (8,)), 1)),
    "block table overflow": (spec.BlockTableOverflowError, "a", lambda: _cached("a", 6, 1, (tuple(range(7, 14)), ()))),
    "missing block for a scheduled token": (spec.MissingBlockError, "b", lambda: _cached("b", 4, 1)),
    "null block inside the window": (spec.NullBlockError, "c", lambda: _new("c", tuple(range(8)), ((7, 8), (0, 9)), 8)),
    "two tokens write one slot": (
        spec.DuplicateSlotError,
        "d",
        lambda: SchedulerOutput(
            new_requests=(NewRequest("c", (1, 2, 3, 4), ((7,), (8,))), NewRequest("d", (1, 2, 3, 4), ((7,), (9,)))),
            num_scheduled_tokens={"c": 4, "d": 4},
        ),
    ),
}


def test_every_error_class_is_exercised() -> None:
    assert {cls for cls, _, _ in BAD.values()} == set(spec.ALL_ERRORS)


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_output_is_rejected_atomically(backend: BackendHandle, case: str) -> None:
    error, req_id, make = BAD[case]
    pool = _pool(backend)
    before = pool.snapshot()
    with pytest.raises(spec.ScheduleError) as info:
        pool.apply(make())
    assert type(info.value) is error
    assert info.value.req_id == req_id and repr(req_id) in str(info.value)
    assert pool.snapshot() == before
    # the pool still works: a valid decode of 'a' goes through
    batch = step(backend, pool, _cached("a", 6, 1))
    np.testing.assert_array_equal(batch["positions"], [6])


def test_sampled_token_out_of_vocabulary_is_rejected(backend: BackendHandle) -> None:
    pool = _pool(backend)
    sched = _cached("a", 6, 1)
    pool.apply(sched)
    batch = pool.prepare(sched)
    before = pool.snapshot()
    with pytest.raises(spec.TokenIdError, match="'a'"):
        pool.record_sampled(batch, backend.asarray(np.array([100])))
    assert pool.snapshot() == before


def test_wrong_number_of_sampled_tokens_is_rejected(backend: BackendHandle) -> None:
    pool = _pool(backend)
    sched = _cached("a", 6, 1)
    pool.apply(sched)
    batch = pool.prepare(sched)
    before = pool.snapshot()
    with pytest.raises(spec.InconsistentSchedulerOutputError, match="sampled_token_ids"):
        pool.record_sampled(batch, backend.asarray(np.array([1, 2])))
    assert pool.snapshot() == before


def test_sampled_token_past_max_model_len_is_rejected(backend: BackendHandle) -> None:
    config = WorkerConfig(1, 4, 8, 100, (KVCacheGroup(4, 4),))
    pool = backend.make_pool(config)
    sched = _new("full", (1, 2, 3, 4), ((1,),), 4)
    pool.apply(sched)
    batch = pool.prepare(sched)
    before = pool.snapshot()
    with pytest.raises(spec.ModelLengthError, match="'full'"):
        pool.record_sampled(batch, backend.asarray(np.array([5])))
    assert pool.snapshot() == before


def test_row_of_an_unknown_request(backend: BackendHandle) -> None:
    with pytest.raises(spec.UnknownRequestError, match="'nobody'"):
        _pool(backend).row_of("nobody")
