"""Async scheduling (spec/async_steps.py) on every backend (`--backend`): the rules by hand, then random runs.

The hand-built cases derive their expected values from the ids they hand out; the random runs drive the reference
scheduler in async mode (optimistic counts one step ahead, no drafts right after drafts) and compare every step
and every snapshot with spec and with the scheduler's own (synchronous) account of the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import numpy as np
import pytest
from hypothesis import settings

from conformance.backends import BackendHandle, load_backend
from conformance.differential import DifferentialRun, budget_for, drive
from conformance.scenario import Scenario, random_scenario
from spec import (
    BlockIdError,
    CachedRequest,
    InconsistentSchedulerOutputError,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    TokenIdError,
    UnknownTokenError,
    WorkerConfig,
)
from spec.protocol import StatePool

CONFIG = WorkerConfig(4, 64, 32, 100, (KVCacheGroup(16, 64),), async_scheduling=True)
PROMPT = (10, 11, 12, 13, 14)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _ids(backend: BackendHandle, ids: list[int] | list[list[int]]) -> object:
    return backend.asarray(np.array(ids, np.int64))


def _prefill(backend: BackendHandle, config: WorkerConfig = CONFIG) -> StatePool:
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3,),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    batch = pool.prepare(out)
    assert backend.batch_to_numpy(batch)["pending_token_indices"].size == 0
    pool.record_sampled(batch, _ids(backend, [42]))
    return pool


def _drafting_step(backend: BackendHandle, pool: StatePool, accepted: list[int]) -> None:
    """Position 5 (the sample 42) and drafts 7, 8; the sampler keeps `accepted`."""
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": (7, 8)})  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    got = backend.batch_to_numpy(batch)
    assert got["pending_token_indices"].tolist() == [0] and got["pending_prev_batch_idx"].tolist() == [0]
    assert got["input_ids"].tolist() == [42, 7, 8]
    pool.record_sampled(batch, _ids(backend, [[*accepted, -1, -1][:3]]))


def test_an_optimistic_count_is_corrected_by_the_rejected_drafts(backend: BackendHandle) -> None:
    # Draft 7 kept, 8 rejected, 9 sampled: known 5 + 1 + 2 = 8 for the scheduler, 7 in truth. It sends the next
    # step at num_computed 8 (as if both drafts were kept); the pool runs it at position 7, whose id 9 is pending.
    pool = _prefill(backend)
    _drafting_step(backend, pool, [7, 9])
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 8),), num_scheduled_tokens={"a": 1})
    pool.apply(out)
    got = backend.batch_to_numpy(pool.prepare(out))
    assert got["positions"].tolist() == [7] and got["seq_lens"].tolist() == [8]
    assert got["input_ids"].tolist() == [9] and got["slot_mappings"][0].tolist() == [3 * 16 + 7]
    assert got["pending_token_indices"].tolist() == [0]
    (row,) = pool.snapshot()
    assert row.token_ids == (*PROMPT, 42, 7, 9) and row.num_computed_tokens == 7


def test_drafts_right_after_unverified_drafts_are_refused(backend: BackendHandle) -> None:
    pool = _prefill(backend)
    _drafting_step(backend, pool, [7, 8, 9])
    before = pool.snapshot()
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 8),), num_scheduled_tokens={"a": 2},
                          scheduled_spec_decode_tokens={"a": (5,)})  # fmt: skip
    with pytest.raises(UnknownTokenError, match="verdict"):
        pool.apply(out)
    assert pool.snapshot() == before


@pytest.mark.parametrize("num_tokens", [7, 9])
def test_a_resumption_past_the_tokens_held_before_unread_drafts_is_refused(
    backend: BackendHandle, num_tokens: int
) -> None:
    # Both drafts rejected, 9 sampled: the scheduler counts 5 + 1 + 3 = 9 tokens, 7 in truth. Preempted and
    # resumed at once, "a" may run over the 6 tokens it held before that record: position 6 holds 7 or 9 and
    # position 8 a token or none, as the unread verdict says (the case, with n = 12 and 14 there).
    pool = _prefill(backend)
    _drafting_step(backend, pool, [9])
    before = pool.snapshot()
    resumed = SchedulerOutput(cached_requests=(CachedRequest("a", 0, ((5,),), resumed=True),),
                              num_scheduled_tokens={"a": num_tokens})  # fmt: skip
    with pytest.raises(UnknownTokenError, match="unread verdict on its 2 drafts decides the tokens from position 6"):
        pool.apply(resumed)
    assert pool.snapshot() == before


def test_a_resumption_over_the_tokens_held_before_unread_drafts_runs(backend: BackendHandle) -> None:
    pool = _prefill(backend)
    _drafting_step(backend, pool, [9])
    resumed = SchedulerOutput(cached_requests=(CachedRequest("a", 0, ((5,),), resumed=True),),
                              num_scheduled_tokens={"a": 6})  # fmt: skip
    pool.apply(resumed)
    got = backend.batch_to_numpy(pool.prepare(resumed))
    assert got["positions"].tolist() == list(range(6)) and got["input_ids"].tolist() == [*PROMPT, 42]
    assert got["pending_token_indices"].size == 0 and got["slot_mappings"][0].tolist() == [5 * 16 + p for p in range(6)]
    (row,) = pool.snapshot()
    assert row.token_ids == (*PROMPT, 42, 9)  # the correction took the two rejected drafts out


def test_a_window_is_checked_from_the_lowest_start_a_verdict_gives(backend: BackendHandle) -> None:
    # Window 4, block 2. Prompt 5 in blocks (3, 4, 5), then a decode with drafts at positions 6, 7 (block 6); the
    # sampler keeps no draft. The scheduler counts 9 tokens and sends the next step at num_computed 8, whose window
    # starts at position 5 (entry 2): block 4, entry 1, looks released, and it hands it back. But with both drafts
    # rejected the step runs at position 6, whose window reads position 3, in entry 1: block 4 twice.
    config = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(2, 32, sliding_window=4),), async_scheduling=True)
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4, 5),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [42]))
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5, ((6,),)),), num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": (7, 8)})  # fmt: skip
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [[1, -1, -1]]))
    before = pool.snapshot()
    reuse = SchedulerOutput(cached_requests=(CachedRequest("a", 8, ((4,),)),), num_scheduled_tokens={"a": 1})
    with pytest.raises(BlockIdError, match="block 4 appears twice among the entries from 1 on"):
        pool.apply(reuse)
    assert pool.snapshot() == before


def test_a_new_request_on_a_row_whose_owner_just_sampled_has_no_pending_token(backend: BackendHandle) -> None:
    # vLLM #37159: the -1 placeholder of the previous owner's sample reached a new request's input ids.
    pool = _prefill(backend)
    out = SchedulerOutput(new_requests=(NewRequest("b", (20, 21), ((4,),)),), num_scheduled_tokens={"b": 2},
                          finished_req_ids=frozenset({"a"}))  # fmt: skip
    pool.apply(out)
    got = backend.batch_to_numpy(pool.prepare(out))
    assert got["index_mapping"].tolist() == [0]  # the row "a" held
    assert got["pending_token_indices"].size == 0 and got["input_ids"].tolist() == [20, 21]


def test_a_faulty_record_is_reported_by_the_apply_after_next(backend: BackendHandle) -> None:
    pool = _prefill(backend)
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 1})
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [100]))  # outside the vocabulary of 100: not raised here
    ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"a": 1})
    pool.apply(ahead)  # scheduled before the fault could be known
    batch = pool.prepare(ahead)
    assert backend.batch_to_numpy(batch)["input_ids"].tolist() == [-1]  # a placeholder, never a plausible id
    pool.record_sampled(batch, _ids(backend, [3]))
    before = pool.snapshot()
    with pytest.raises(TokenIdError, match="100 not in"):
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("a", 7),), num_scheduled_tokens={"a": 1}))
    assert pool.snapshot() == before
    assert before[0].token_ids == (*PROMPT, 42, -1, 3)


@pytest.mark.parametrize(("accepted", "why"), [([7, 9, 11], "accepted [7, 9]"), ([9, 8, 11], "accepted [9, 8]")])
def test_every_position_of_an_accepted_prefix_is_checked_late(
    backend: BackendHandle, accepted: list[int], why: str
) -> None:
    # Drafts 7, 8: a record whose second or first kept token is not the draft at its position is a fault, reported
    # by the apply after next. A check one position short (the last draft before the bonus token unchecked) passed
    # [7, 9, 11] in both of fast's paths and the whole suite; the synchronous form of that bug was caught.
    pool = _prefill(backend)
    _drafting_step(backend, pool, accepted)
    ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 8),), num_scheduled_tokens={"a": 1})
    pool.apply(ahead)  # scheduled counting all three tokens, before the fault could be known
    pool.record_sampled(pool.prepare(ahead), _ids(backend, [3]))
    before = pool.snapshot()
    with pytest.raises(InconsistentSchedulerOutputError, match=re.escape(f"{why} but the drafts were [7, 8]")):
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("a", 9),), num_scheduled_tokens={"a": 1}))
    assert pool.snapshot() == before


def test_async_scheduling_with_a_mamba_group_is_refused() -> None:
    with pytest.raises(ValueError, match="async_scheduling with a mamba group"):
        dataclasses.replace(CONFIG, kv_groups=(KVCacheGroup(16, 64), KVCacheGroup(64, 8, kind="mamba")))


def test_async_runs_agree_with_spec_on_every_step(backend: BackendHandle, conformance_scale: float) -> None:
    budget = budget_for(backend, settings().max_examples, conformance_scale)
    optimistic = 0
    for seed in range(max(2, budget.examples // 4)):
        scenario = random_scenario(seed, spec_decode=True)
        scenario = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, async_scheduling=True))
        run = DifferentialRun(scenario, backend)
        drive(run, budget.max_steps)
        optimistic += run.sched.stats.optimistic_counts
    assert optimistic > 0, "no step was sent with an optimistic count"


def test_a_refused_output_in_between_moves_no_clock(backend: BackendHandle) -> None:
    # A refused output between the drafting record and the step sent ahead of its verdict: that step is still
    # validated on the optimistic count (8 known), and the correction still applies to it.
    pool = _prefill(backend)
    _drafting_step(backend, pool, [7, 9])
    with pytest.raises(UnknownTokenError):  # 2 tokens from 8: position 9 is not known even optimistically
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("a", 8),), num_scheduled_tokens={"a": 2}))
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 8),), num_scheduled_tokens={"a": 1})
    pool.apply(out)
    assert backend.batch_to_numpy(pool.prepare(out))["positions"].tolist() == [7]


# ---- the neighbours of rule 7: a resumption at once, after a step with no tokens, a row retaken after an abort ----


def test_a_resumption_at_once_is_checked_from_its_own_window_start(backend: BackendHandle) -> None:
    # Window 2, block 2. Prompt 5 in blocks (3, 4, 5), sample 42; drafts 7, 8 at positions 6, 7 (block 6), both
    # rejected. Resumed at once at 4 over positions 4, 5 (the 6 tokens held before), in table (null, 7, 8): the
    # step reads positions 3..5, entries 1 and 2. Rule 2 does not correct a resumed count, so no verdict moves
    # its start to 2 (entry 0, null): before, spec and fast refused it with a NullBlockError.
    config = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(2, 32, sliding_window=2),), async_scheduling=True)
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4, 5),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [42]))
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5, ((6,),)),), num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": (7, 8)})  # fmt: skip
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [[9, -1, -1]]))
    resumed = SchedulerOutput(cached_requests=(CachedRequest("a", 4, ((0, 7, 8),), resumed=True),),
                              num_scheduled_tokens={"a": 2})  # fmt: skip
    pool.apply(resumed)
    got = backend.batch_to_numpy(pool.prepare(resumed))
    assert got["positions"].tolist() == [4, 5] and got["input_ids"].tolist() == [14, 42]
    assert got["slot_mappings"][0].tolist() == [8 * 2, 8 * 2 + 1] and got["seq_lens"].tolist() == [6]
    assert got["pending_token_indices"].size == 0
    (row,) = pool.snapshot()
    assert (row.token_ids, row.num_computed_tokens, row.block_ids) == ((*PROMPT, 42, 9), 4, ((0, 7, 8),))


@pytest.mark.parametrize("recorded", [False, True])
@pytest.mark.parametrize("resumed", [False, True])
def test_a_step_after_a_step_with_no_tokens_takes_no_pending_token(
    backend: BackendHandle, recorded: bool, resumed: bool
) -> None:
    # "a" samples 42 and "b" 50; the next output only finishes "b" (no tokens: an engine runs no model on it, and
    # may not record its empty batch). The step after it runs "a" over position 5, whose 42 the host has read by
    # then: no pending token, whichever batch is the last recorded (rule 3: only the batch run just before).
    pool = backend.make_pool(CONFIG)
    first = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3,),)), NewRequest("b", (20, 21), ((4,),))),
                            num_scheduled_tokens={"a": 5, "b": 2})  # fmt: skip
    pool.apply(first)
    batch = pool.prepare(first)
    pool.record_sampled(batch, _ids(backend, [{"a": 42, "b": 50}[r] for r in batch.req_ids]))
    finish = SchedulerOutput(finished_req_ids=frozenset({"b"}))
    pool.apply(finish)
    empty = pool.prepare(finish)
    if recorded:
        pool.record_sampled(empty, _ids(backend, []))
    if resumed:
        out = SchedulerOutput(cached_requests=(CachedRequest("a", 0, ((5,),), resumed=True),),
                              num_scheduled_tokens={"a": 6})  # fmt: skip
    else:
        out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 1})
    pool.apply(out)
    got = backend.batch_to_numpy(pool.prepare(out))
    start, block = (0, 5) if resumed else (5, 3)
    assert got["positions"].tolist() == list(range(start, 6))
    assert got["input_ids"].tolist() == [*PROMPT, 42][start:]
    assert got["slot_mappings"][0].tolist() == [block * 16 + p for p in range(start, 6)]
    assert got["pending_token_indices"].size == 0 and got["pending_prev_batch_idx"].size == 0


def test_a_new_request_on_the_row_of_one_aborted_before_its_verdict_takes_nothing_of_it(
    backend: BackendHandle,
) -> None:
    # vllm-ascend #13864's class: "a" drafts 7, 8, both rejected (9 sampled), and is aborted by the next output,
    # which gives its row to "b". "b" gets no pending token and none of the 2 rejected drafts off its count, now
    # or when the host reads the verdict (the apply after next): its prompt, its sample 30, then position 3.
    pool = _prefill(backend)
    _drafting_step(backend, pool, [9])
    out = SchedulerOutput(new_requests=(NewRequest("b", (20, 21, 22), ((4,),)),), num_scheduled_tokens={"b": 3},
                          finished_req_ids=frozenset({"a"}))  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    got = backend.batch_to_numpy(batch)
    assert got["index_mapping"].tolist() == [0] and got["input_ids"].tolist() == [20, 21, 22]
    assert got["positions"].tolist() == [0, 1, 2] and got["pending_token_indices"].size == 0
    pool.record_sampled(batch, _ids(backend, [30]))
    for step, num_computed in ((0, 3), (1, 4)):  # the second apply reads "a"'s verdict
        out = SchedulerOutput(cached_requests=(CachedRequest("b", num_computed),), num_scheduled_tokens={"b": 1})
        pool.apply(out)
        batch = pool.prepare(out)
        got = backend.batch_to_numpy(batch)
        assert got["positions"].tolist() == [num_computed]
        assert got["slot_mappings"][0].tolist() == [4 * 16 + num_computed]
        assert got["input_ids"].tolist() == [[30, 31][step]] and got["pending_token_indices"].tolist() == [0]
        pool.record_sampled(batch, _ids(backend, [31 + step]))
    (row,) = pool.snapshot()
    assert (row.req_id, row.token_ids, row.num_computed_tokens) == ("b", (20, 21, 22, 30, 31, 32), 4)


NEIGHBOURS = (  # SchedulerStats of rule 7's neighbours, each reached by some random run
    "resumed_before_verdict_rejected",  # resumed at once over the tokens held before rejected drafts
    "resumed_before_verdict_accepted",  # and before accepted ones
    "resumed_after_idle_step",  # resumed over its last sample right after a step with no tokens (not recorded)
    "continued_after_idle_step",  # continued over it
    "retaken_after_abort",  # a new request on the row of one aborted right after it sampled
    "retaken_after_abort_rejected",  # whose sample came with rejected drafts
)


def _async_scenario(seed: int, attention: bool = True) -> Scenario:
    scenario = random_scenario(seed, spec_decode=True)
    config = dataclasses.replace(scenario.config, async_scheduling=True)
    return dataclasses.replace(scenario, config=config, attention=scenario.attention if attention else None)


@functools.cache
def _first_seed_reaching(stat: str, max_steps: int, seeds: int = 200) -> int:
    """The first seed whose async run reaches `stat` within max_steps (the scheduler's path does not depend on the
    backend, nor on the attention comparisons: spec alone finds it)."""
    for seed in range(seeds):
        run = DifferentialRun(_async_scenario(seed, attention=False), load_backend("spec"))
        drive(run, max_steps)
        if getattr(run.sched.stats, stat):
            return seed
    raise AssertionError(f"no async run of seeds 0..{seeds - 1} reaches {stat} within {max_steps} steps")


def test_async_runs_reach_every_neighbour_of_a_resumption(backend: BackendHandle, conformance_scale: float) -> None:
    # Each neighbour on this backend, compared with spec on every step: the first seed that reaches it in the
    # backend's step budget, run there with its attention comparisons.
    budget = budget_for(backend, settings().max_examples, conformance_scale)
    seen: collections.Counter[str] = collections.Counter()
    for seed in sorted({_first_seed_reaching(stat, budget.max_steps) for stat in NEIGHBOURS}):
        run = DifferentialRun(_async_scenario(seed), backend)
        drive(run, budget.max_steps)
        seen.update({stat: getattr(run.sched.stats, stat) for stat in NEIGHBOURS})
    assert all(seen[stat] > 0 for stat in NEIGHBOURS), f"not reached on {backend.name}: {seen}"
