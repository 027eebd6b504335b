"""fast/one_pool.py: the one-block-pool marks kept from step to step are, after every step, the marks made afresh.

The conformance suite (conformance/test_one_pool.py, and every one-pool scenario of the differential suites)
shows fast refuses what spec refuses. A mark left behind or missed there would only send a valid step to
spec's plan_step (the same outcome, slower): these tests see it, by comparing the kept marks with a count made
from the committed state and by counting the steps a valid run sends to plan_step for a clash.
"""

from __future__ import annotations

import numpy as np
import pytest

import fast
from conformance.scenario import random_scenario, with_one_block_pool
from conformance.scheduler import ReferenceScheduler
from fast.fallback import Fallback
from fast.one_pool import HeldIds
from fast.validate import MAX_HELD_MAP
from spec import BlockIdError, CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.types import NULL_BLOCK_ID

MAX_STEPS = 40


def _fresh_marks(pool: fast.RequestStatePool) -> tuple[np.ndarray, np.ndarray]:
    """(owner, count) over the pool's ids for the last applied step's requests, from the committed tables: each
    request's non-null entries from its first live one on (spec.group_rules.AttentionRules.held_ids)."""
    state, plan = pool.state, pool._plan
    assert plan is not None
    num_ids = state.config.kv_groups[0].num_blocks
    owner, count = np.zeros(num_ids, np.int8), np.zeros(num_ids, np.int32)
    for row, computed in zip(plan.rows.tolist(), plan.num_computed.tolist(), strict=True):
        for g, group in enumerate(state.config.kv_groups):
            window = group.sliding_window or 0
            lo = 0 if window == 0 else max(0, computed - window + 1) // group.block_size
            for block in state.block_tables[g][row, lo : state.num_blocks[g][row]].tolist():
                if block != NULL_BLOCK_ID:
                    assert owner[block] in (0, g + 1), f"block {block} in groups {owner[block] - 1} and {g}"
                    owner[block], count[block] = g + 1, count[block] + 1
    return owner, count


def _one_pool_scenarios(wanted: int) -> list[int]:
    """The first `wanted` seeds whose scenario has two groups or more (made one pool below), of a pool fast keeps
    marks for (larger ones sort each step's held ids: fast.bulk_checks.held_in_two_groups)."""
    seeds: list[int] = []
    seed = 0
    while len(seeds) < wanted:
        config = random_scenario(seed).config
        if len(config.kv_groups) > 1 and with_one_block_pool(config).kv_groups[0].num_blocks <= MAX_HELD_MAP:
            seeds.append(seed)
        seed += 1
    return seeds


@pytest.mark.parametrize("seed", _one_pool_scenarios(12))
def test_kept_marks_are_the_committed_states_marks_after_every_step(seed: int) -> None:
    scenario = random_scenario(seed)
    config = with_one_block_pool(scenario.config)
    scheduler = ReferenceScheduler(config, scenario.workload, scenario.knobs, scenario.seed)
    pool = fast.RequestStatePool(config)
    held = pool._planner.held
    assert isinstance(held, HeldIds)
    checked = 0
    for _ in range(MAX_STEPS):
        if scheduler.done():
            break
        out = scheduler.schedule()
        pool.apply(out)
        assert not held._pending  # every step is committed: no marks of an uncommitted step
        if held._valid:  # the step went through the bulk planner (resumed requests go to plan_step)
            owner, count = _fresh_marks(pool)
            np.testing.assert_array_equal(held.count, count, err_msg=f"seed {seed}: counts")
            np.testing.assert_array_equal(held.owner, owner, err_msg=f"seed {seed}: owners")
            checked += 1
        batch = pool.prepare(out)
        takes = scheduler.sampling_req_ids(out)
        pool.record_sampled(batch, np.ones(batch.num_reqs, np.int64))
        scheduler.update(out, {r: 1 for r in batch.req_ids if r in takes})
    assert pool.fallbacks[Fallback.ONE_POOL] == 0  # a valid run: no clash to send to plan_step
    assert checked > 0
    # marked afresh only at the first check and after a step plan_step planned (the marks then follow the steps)
    assert held.remade <= 1 + pool.fallbacks.total(), (held.remade, pool.fallbacks)


def _config() -> WorkerConfig:
    """Group 0 with a window of 4 and group 1 of full attention, blocks of 4, one pool of 32 ids."""
    return WorkerConfig(
        4, 32, 64, 100, (KVCacheGroup(4, 32, sliding_window=4), KVCacheGroup(4, 32)), one_block_pool=True
    )


def _decode(computed: int, *blocks: tuple[str, tuple[tuple[int, ...], tuple[int, ...]] | None]) -> SchedulerOutput:
    return SchedulerOutput(
        cached_requests=tuple(CachedRequest(r, computed, b) for r, b in blocks),
        num_scheduled_tokens={r: 1 for r, _ in blocks},
    )


def test_marks_after_a_refused_step_and_a_request_that_leaves() -> None:
    """A refused step changes nothing the next steps see: a valid step after it is accepted by the bulk planner and
    a clash after that is still found; a request that leaves the batch frees its ids for the other group."""
    pool = fast.RequestStatePool(_config())
    held = pool._planner.held
    assert isinstance(held, HeldIds)
    prompt = tuple(range(1, 9))  # two blocks of 4
    first = SchedulerOutput(
        new_requests=(NewRequest("a", prompt, ((1, 2), (3, 4))), NewRequest("b", prompt, ((5, 6), (7, 8)))),
        num_scheduled_tokens={"a": 8, "b": 8},
    )
    steps = [first]
    pool.apply(first)
    pool.record_sampled(pool.prepare(first), np.array([9, 9]))
    with pytest.raises(BlockIdError, match="block 3 is held in group 1 by 'a' too"):  # b's new group-0 id is a's
        pool.apply(_decode(8, ("a", ((9,), (10,))), ("b", ((3,), (11,)))))
    valid = _decode(8, ("a", ((9,), (10,))), ("b", ((12,), (11,))))
    steps.append(valid)
    pool.apply(valid)
    np.testing.assert_array_equal(held.count, _fresh_marks(pool)[1])
    pool.record_sampled(pool.prepare(valid), np.array([9, 9]))
    with pytest.raises(BlockIdError, match="block 10 is held in group 1 by 'a' too"):
        pool.apply(_decode(9, ("a", None), ("b", ((10,), ()))))  # a later clash: still found
    # a leaves (not scheduled): b may take a's group-1 block 4 in group 0
    only_b = _decode(9, ("b", ((4,), ())))
    pool.apply(only_b)
    owner, count = _fresh_marks(pool)
    np.testing.assert_array_equal(held.count, count)
    np.testing.assert_array_equal(held.owner, owner)
    assert owner[4] == 1 and count[3] == 0  # b's now, in group 0; a's ids unmarked
    assert pool.fallbacks[Fallback.ONE_POOL] == 2  # the two refused steps only
