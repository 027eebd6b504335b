"""Decisions of docs/semantics.md pinned on any backend (`--backend NAME`): batch ties, appended blocks,
slots past 2**31, the order of checks, prepare's one applied output. Expected values are worked out by
hand in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.driving import step
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig


def test_batch_ties_keep_the_scheduler_order(backend: BackendHandle) -> None:
    config = WorkerConfig(4, 16, 32, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    news = tuple(NewRequest(r, (1, 2), ((i + 1,),)) for i, r in enumerate("cabd"))
    # counts c:2 a:1 b:2 d:1 -> ascending, ties in the order given: a, d (1 token), then c, b (2 tokens)
    sched = SchedulerOutput(new_requests=news, num_scheduled_tokens={"c": 2, "a": 1, "b": 2, "d": 1})
    batch = step(backend, pool, sched)
    assert batch["req_ids"] == ("a", "d", "c", "b")
    # rows follow the order of new_requests (c, a, b, d -> rows 0, 1, 2, 3)
    assert batch["index_mapping"].tolist() == [1, 3, 0, 2]
    assert batch["query_start_loc"].tolist() == [0, 1, 2, 4, 6]


def test_cached_new_block_ids_are_appended(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 16, 32, 100, (KVCacheGroup(2, 32),))
    pool = backend.make_pool(config)
    step(
        backend,
        pool,
        SchedulerOutput(new_requests=(NewRequest("x", (1, 2, 3), ((5, 9),)),), num_scheduled_tokens={"x": 3}),
    )
    # 4 known tokens (3 + 1 sampled); positions 3 and 4 would need block 2: block 7 is appended
    batch = step(
        backend, pool, SchedulerOutput(cached_requests=(CachedRequest("x", 3, ((7,),)),), num_scheduled_tokens={"x": 1})
    )
    assert batch["slot_mappings"][0].tolist() == [9 * 2 + 1]  # position 3: block 1 (id 9), offset 1
    assert pool.snapshot()[0].block_ids == ((5, 9, 7),)


def test_slots_past_2_31_are_exact(backend: BackendHandle) -> None:
    block_size = num_blocks = 2**16  # slots up to 2**32 - 1
    config = WorkerConfig(1, 4, 4, 100, (KVCacheGroup(block_size, num_blocks),))
    pool = backend.make_pool(config)
    last = num_blocks - 1
    batch = step(
        backend,
        pool,
        SchedulerOutput(new_requests=(NewRequest("big", (1, 2, 3), ((last,),)),), num_scheduled_tokens={"big": 3}),
    )
    assert batch["slot_mappings"][0].dtype == np.int64
    assert batch["slot_mappings"][0].tolist() == [last * block_size + p for p in range(3)]
    assert last * block_size > 2**31


def test_the_first_check_in_order_decides_the_error_class(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 16, 4, 100, (KVCacheGroup(4, 8),))
    pool = backend.make_pool(config)
    # unknown cached request (check 2) and a token budget overrun (check 5): check 2 wins
    two_faults = SchedulerOutput(
        new_requests=(NewRequest("n", tuple(range(8)), ((1, 2),)),),
        cached_requests=(CachedRequest("ghost", 0),),
        num_scheduled_tokens={"n": 8, "ghost": 1},
    )
    with pytest.raises(spec.UnknownRequestError):
        pool.apply(two_faults)
    # a block id out of range (check 9) and a missing block (check 11): check 9 wins
    # (positions 0..3 fit block 0 of "m", so a missing block needs a position in block 1: schedule from 4)
    block_id_and_missing = SchedulerOutput(
        new_requests=(NewRequest("m", tuple(range(8)), ((99,),), num_computed_tokens=4),),
        num_scheduled_tokens={"m": 4},
    )
    with pytest.raises(spec.BlockIdError):
        pool.apply(block_id_and_missing)
    assert pool.snapshot() == ()


def test_prepare_only_accepts_the_last_applied_output(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 16, 32, 100, (KVCacheGroup(4, 8),))
    pool = backend.make_pool(config)
    applied = SchedulerOutput(new_requests=(NewRequest("a", (1, 2), ((1,),)),), num_scheduled_tokens={"a": 2})
    pool.apply(applied)
    other = SchedulerOutput(new_requests=(NewRequest("b", (1, 2), ((2,),)),), num_scheduled_tokens={"b": 2})
    with pytest.raises(spec.InconsistentSchedulerOutputError):
        pool.prepare(other)
    assert pool.prepare(applied).req_ids == ("a",)
