"""One block pool across KV groups (WorkerConfig.one_block_pool, vLLM's form), once per backend (`--backend`).

vLLM's KVCacheManager hands every group its blocks from one BlockPool: an id belongs to one group at a
time, and where groups share KV memory an id in two groups would alias two layers' KV. Expected values
are the block ids the tests hand out.
"""

from __future__ import annotations

import pytest

from conformance.backends import BackendHandle
from conformance.driving import step
from spec import BlockIdError, CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.protocol import StatePool

PROMPT = tuple(range(1, 9))  # 8 tokens: two blocks of 4


def _config(one_block_pool: bool, window: int | None = None) -> WorkerConfig:
    """Group 0 (block 4, optional window) and group 1 (block 4, full attention), 32 ids each."""
    groups = (KVCacheGroup(4, 32, sliding_window=window), KVCacheGroup(4, 32))
    return WorkerConfig(4, 32, 64, 100, groups, one_block_pool=one_block_pool)


def _tables(pool: StatePool, req_id: str) -> tuple[tuple[int, ...], ...]:
    return next(r.block_ids for r in pool.snapshot() if r.req_id == req_id)


def _prefill(*requests: tuple[str, tuple[int, ...], tuple[int, ...]]) -> SchedulerOutput:
    news = tuple(NewRequest(r, PROMPT, (g0, g1)) for r, g0, g1 in requests)
    return SchedulerOutput(new_requests=news, num_scheduled_tokens={r: 8 for r, _, _ in requests})


@pytest.mark.parametrize("one_block_pool", [True, False])
def test_an_id_held_in_two_groups_is_refused_with_one_pool_only(backend: BackendHandle, one_block_pool: bool) -> None:
    # b's group 1 holds block 2, which a holds in group 0: two layers' KV in one block under one pool,
    # two unrelated blocks under a pool per group
    pool = backend.make_pool(_config(one_block_pool))
    sched = _prefill(("a", (1, 2), (3, 4)), ("b", (5, 6), (2, 7)))
    if not one_block_pool:
        step(backend, pool, sched)
        assert _tables(pool, "b") == ((5, 6), (2, 7))
        return
    before = pool.snapshot()
    with pytest.raises(BlockIdError, match="block 2 is held in group 0 by 'a' too") as err:
        pool.apply(sched)
    assert (err.value.req_id, err.value.field) == ("b", "block_ids[1]")
    assert pool.snapshot() == before


def test_one_request_may_not_hold_an_id_in_two_groups(backend: BackendHandle) -> None:
    pool = backend.make_pool(_config(True))
    before = pool.snapshot()
    with pytest.raises(BlockIdError, match="block 2 is held in group 0 by 'a' too") as err:
        pool.apply(_prefill(("a", (1, 2), (2, 3))))
    assert (err.value.req_id, err.value.field) == ("a", "block_ids[1]")
    assert pool.snapshot() == before


def test_an_appended_id_another_group_holds_is_refused(backend: BackendHandle) -> None:
    # both decode position 8 and get a third block per group; b's new group-1 block is a's new group-0 block
    pool = backend.make_pool(_config(True))
    step(backend, pool, _prefill(("a", (1, 2), (3, 4)), ("b", (5, 6), (7, 8))))
    before = pool.snapshot()
    decode = SchedulerOutput(
        cached_requests=(CachedRequest("a", 8, ((9,), (10,))), CachedRequest("b", 8, ((11,), (9,)))),
        num_scheduled_tokens={"a": 1, "b": 1},
    )
    with pytest.raises(BlockIdError, match="block 9 is held in group 0 by 'a' too") as err:
        pool.apply(decode)
    assert (err.value.req_id, err.value.field) == ("b", "block_ids[1]")
    assert pool.snapshot() == before


def test_a_block_the_window_released_may_go_to_another_group(backend: BackendHandle) -> None:
    # window 4: a's decode at position 8 reads positions 5..8, so group 0's entry 0 (block 1) is released;
    # the pool hands block 1 to b's group 1 while a's append-only table still lists it below its window
    pool = backend.make_pool(_config(True, window=4))
    step(backend, pool, _prefill(("a", (1, 2), (3, 4))))
    sched = SchedulerOutput(
        new_requests=(NewRequest("b", PROMPT[:4], ((7,), (1,))),),
        cached_requests=(CachedRequest("a", 8, ((5,), (6,))),),
        num_scheduled_tokens={"b": 4, "a": 1},
    )
    step(backend, pool, sched)
    assert _tables(pool, "a") == ((1, 2, 5), (3, 4, 6)) and _tables(pool, "b") == ((7,), (1,))


def test_only_scheduled_requests_are_known_to_hold_their_blocks(backend: BackendHandle) -> None:
    # a is not scheduled (it may have been preempted, its blocks back in the pool): b may take its ids
    pool = backend.make_pool(_config(True))
    step(backend, pool, _prefill(("a", (1, 2), (3, 4))))
    step(backend, pool, _prefill(("b", (3, 4), (1, 2))))
    assert _tables(pool, "b") == ((3, 4), (1, 2))


def test_one_pool_means_one_num_blocks() -> None:
    groups = (KVCacheGroup(4, 32), KVCacheGroup(4, 16))
    with pytest.raises(ValueError, match="one num_blocks, got \\[32, 16\\]"):
        WorkerConfig(4, 32, 64, 100, groups, one_block_pool=True)
    with pytest.raises(ValueError, match="one_block_pool must be a bool"):
        WorkerConfig(4, 32, 64, 100, groups[:1], one_block_pool=1)  # type: ignore[arg-type]
