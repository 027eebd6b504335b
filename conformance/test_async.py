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
    BatchInputs,
    BlockIdError,
    CachedRequest,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    KVCacheGroup,
    MissingBlockError,
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


# ---- Mamba state groups under async scheduling (spec/mamba.py, docs/semantics.md "Mamba state groups") --------

MAMBA_GROUP = KVCacheGroup(4, 40, kind="mamba", num_speculative_blocks=2)  # align mode: an entry per 4 tokens
HYBRID = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 40), MAMBA_GROUP), async_scheduling=True)


MambaFields = tuple[list[list[int]], list[int], list[int], list[int]]


def _mamba_fields(backend: BackendHandle, batch: BatchInputs) -> MambaFields:
    """(written state blocks, read block, num_accepted_tokens, positions) of a hybrid batch (group 1 is mamba)."""
    got = backend.batch_to_numpy(batch)
    written, read = got["mamba_state_indices"][1].tolist(), got["mamba_prev_state_indices"][1].tolist()
    return written, read, got["num_accepted_tokens"].tolist(), got["positions"].tolist()


def _hybrid_drafting_run(backend: BackendHandle, accepted: list[int]) -> StatePool:
    """Request a: prompt 10..14 (attention blocks 3, 4; state blocks 20..23), sampled 42, then position 5 and drafts
    7, 8: the states after positions 5, 6, 7 go to entries 1, 2, 3 (blocks 21, 22, 23); the sampler keeps `accepted`.
    """
    pool = backend.make_pool(HYBRID)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4), (20, 21, 22, 23))),),
                          num_scheduled_tokens={"a": 5})  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    assert _mamba_fields(backend, batch)[:3] == ([[21, -1, -1]], [-1], [1])  # entry (5 - 1) // 4; no prior state
    pool.record_sampled(batch, _ids(backend, [42]))
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": (7, 8)})  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    assert _mamba_fields(backend, batch)[:3] == ([[21, 22, 23]], [21], [1])  # seq_len 8: entry 1, the drafts' 2, 3
    pool.record_sampled(batch, _ids(backend, [[*accepted, -1, -1][:3]]))
    return pool


@pytest.mark.parametrize(
    ("accepted", "read", "written", "kept", "position", "then_read", "then_written"),
    [
        # both drafts kept: runs at 8 (as sent); reads the state after position 7 (entry 3), writes entry 8 // 4
        ([7, 8, 9], 23, 22, 3, 8, 22, 22),
        # draft 8 rejected: runs at 7; the state after position 6 (entry 2, draft 7's), writes entry 7 // 4
        ([7, 9], 22, 21, 2, 7, 21, 22),
        # both rejected: runs at 6; the state after position 5 (entry 1), writes entry 6 // 4
        ([9], 21, 21, 1, 6, 21, 21),
    ],
)
def test_a_mamba_state_is_read_from_the_corrected_count(
    backend: BackendHandle,
    accepted: list[int],
    read: int,
    written: int,
    kept: int,
    position: int,
    then_read: int,
    then_written: int,
) -> None:
    # The step after the drafting one goes out before its verdict, at num_computed 8 (both drafts counted). The
    # pool runs it at 8 - r (rule 2), and its state read and num_accepted_tokens follow that count: the state after
    # position 7 - r, in entry 1 + (3 - r) - 1. The step after it, sent with exact counts at 9 - r, reads the state
    # that step wrote (entry (8 - r) // 4): its last seq_len is the corrected one.
    pool = _hybrid_drafting_run(backend, accepted)
    ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 8, ((5,), (24,))),), num_scheduled_tokens={"a": 1})
    pool.apply(ahead)
    batch = pool.prepare(ahead)
    assert _mamba_fields(backend, batch) == ([[written, -1, -1]], [read], [kept], [position])
    pool.record_sampled(batch, _ids(backend, [11]))
    exact = SchedulerOutput(cached_requests=(CachedRequest("a", position + 1),), num_scheduled_tokens={"a": 1})
    pool.apply(exact)
    batch = pool.prepare(exact)
    assert _mamba_fields(backend, batch) == ([[then_written, -1, -1]], [then_read], [1], [position + 1])
    (row,) = pool.snapshot()
    assert row.token_ids == (*PROMPT, 42, *accepted, 11) and row.num_computed_tokens == position + 1


def test_a_mamba_record_is_prefilling_as_the_row_classes_are_whatever_the_verdict(backend: BackendHandle) -> None:
    # "a" is sent at 8 before the verdict on its drafts; both were rejected, so it runs at 6: past its prompt of 5
    # either way (drafts ride only on the chunk that ends a prompt). "b" is a new request, 3 of its 6 prompt tokens
    # scheduled: prefilling. The mamba record's flag is the batch's row classes' (spec/classify.py), row by row.
    pool = _hybrid_drafting_run(backend, [9])
    chunk = NewRequest("b", (30, 31, 32, 33, 34, 35), ((6,), (25, 26)))  # writes entry (3 - 1) // 4: block 25
    ahead = SchedulerOutput(new_requests=(chunk,), cached_requests=(CachedRequest("a", 8, ((5,), (24,))),),
                            num_scheduled_tokens={"a": 1, "b": 3})  # fmt: skip
    pool.apply(ahead)
    batch = pool.prepare(ahead)
    got = backend.batch_to_numpy(batch)
    assert got["req_ids"] == ("a", "b") and got["is_prefilling"].tolist() == [False, True]
    assert np.asarray(batch.row_classes.is_prefilling).tolist() == [False, True]
    assert got["mamba_prev_state_indices"][1].tolist() == [21, -1]  # a: the state after position 5; b: none


def test_a_mamba_step_sent_below_the_optimistic_count_is_refused(backend: BackendHandle) -> None:
    # As rule 4 checks windows: the state read is checked for every count a verdict may give. Sent at 7 with two
    # drafts unverified, the step runs at 5 if both were rejected, and the state after position 4 was overwritten
    # (entry 1 holds the state after position 5), whatever this verdict was (here: both drafts kept).
    pool = _hybrid_drafting_run(backend, [7, 8, 9])
    before = pool.snapshot()
    short = SchedulerOutput(cached_requests=(CachedRequest("a", 7, ((5,), (24,))),), num_scheduled_tokens={"a": 1})
    with pytest.raises(MissingBlockError, match=re.escape("7 computed (5 if the unread verdict rejects its 2 drafts)")):
        pool.apply(short)
    assert pool.snapshot() == before


def test_a_mamba_state_block_any_verdict_may_write_is_written_by_no_other_request(backend: BackendHandle) -> None:
    # Sent at 8, "a" writes entry 8 // 4 = 2 (block 22); had the verdict rejected both drafts it would run at 6 and
    # write entry 6 // 4 = 1 (block 21). A new request writing block 21 is refused (check 13) whatever this verdict
    # was (here: both kept), as rule 4 checks windows from the lowest start a verdict may give.
    pool = _hybrid_drafting_run(backend, [7, 8, 9])
    before = pool.snapshot()
    other = NewRequest("b", (30, 31, 32, 33), ((6,), (21, 25, 26)))  # writes entry (4 - 1) // 4 = 0: block 21
    clash = SchedulerOutput(new_requests=(other,), cached_requests=(CachedRequest("a", 8, ((5,), (24,))),),
                            num_scheduled_tokens={"a": 1, "b": 4})  # fmt: skip
    with pytest.raises(DuplicateSlotError):
        pool.apply(clash)
    assert pool.snapshot() == before


@pytest.mark.parametrize("accepted", [[7, 8, 9], [9]])
def test_a_new_request_on_a_row_whose_owner_drafted_reads_its_own_state(
    backend: BackendHandle, accepted: list[int]
) -> None:
    # vllm-ascend #13864: accepted counts kept in persistent rows reached the next request on the row. "a" finishes
    # before its verdict is read and "b" takes row 0 with a prefix hit of 4 tokens: it reads the state cached at
    # the end of its entry 0 (block 25), num_accepted_tokens 1, whatever a's verdict; nothing of a's is corrected
    # into b's counts, on this step or the next.
    pool = _hybrid_drafting_run(backend, accepted)
    new = NewRequest("b", (30, 31, 32, 33, 34, 35), ((6, 7), (25, 26, 27, 28)), num_computed_tokens=4)
    out = SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"b": 2}, finished_req_ids=frozenset({"a"}))
    pool.apply(out)
    batch = pool.prepare(out)
    assert backend.batch_to_numpy(batch)["index_mapping"].tolist() == [0]
    assert _mamba_fields(backend, batch) == ([[26, -1, -1]], [25], [1], [4, 5])  # writes entry (6 - 1) // 4
    assert backend.batch_to_numpy(batch)["pending_token_indices"].size == 0
    pool.record_sampled(batch, _ids(backend, [50]))
    out = SchedulerOutput(cached_requests=(CachedRequest("b", 6),), num_scheduled_tokens={"b": 1})
    pool.apply(out)  # a's record is read by now (fast's host mirror): its rejections are not b's
    assert _mamba_fields(backend, pool.prepare(out)) == ([[26, -1, -1]], [26], [1], [6])
    (row,) = pool.snapshot()
    assert row.token_ids == (30, 31, 32, 33, 34, 35, 50) and row.num_computed_tokens == 6


@pytest.mark.parametrize(
    ("kept", "read", "accepted", "positions"),
    [([7, 8, 50], 23, 3, [8, 9, 10]), ([7, 50, -1], 22, 2, [7, 8, 9]), ([50, -1, -1], 21, 1, [6, 7, 8])],
)
def test_mamba_drafts_proposed_on_the_device_after_unverified_drafts_follow_the_corrected_count(
    backend: BackendHandle, kept: list[int], read: int, accepted: int, positions: list[int]
) -> None:
    # Rule 8: placeholder drafts may follow unverified ones. Step 2 (drafts 7, 8 proposed at the prefill) stores the
    # states after positions 5, 6, 7 in entries 1, 2, 3 (blocks 21, 22, 23); the sampler keeps `kept` and the
    # drafter proposes 60, 61. Step 3 goes out at 8 with two placeholders and runs at 8 - r: it reads the state
    # after position 7 - r (entry 3 - r), num_accepted_tokens 3 - r, and writes seq_len (11 - r) - 1 = 10 - r's
    # entry 2 and the drafts' 3, 4 (blocks 22, 23, 24) for every r here.
    pool = backend.make_pool(HYBRID)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4), (20, 21, 22, 23))),),
                          num_scheduled_tokens={"a": 5})  # fmt: skip
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [42]), _ids(backend, [[7, 8]]))
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": (-1, -1)})  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    assert _mamba_fields(backend, batch) == ([[21, 22, 23]], [21], [1], [5, 6, 7])
    pool.record_sampled(batch, _ids(backend, [kept]), _ids(backend, [[60, 61]]))
    ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 8, ((5,), (24,))),), num_scheduled_tokens={"a": 3},
                            scheduled_spec_decode_tokens={"a": (-1, -1)})  # fmt: skip
    pool.apply(ahead)
    batch = pool.prepare(ahead)
    assert _mamba_fields(backend, batch) == ([[22, 23, 24]], [read], [accepted], positions)
    assert backend.batch_to_numpy(batch)["input_ids"].tolist()[1:] == [60, 61]


def test_async_hybrid_runs_agree_with_spec_on_every_step(backend: BackendHandle, conformance_scale: float) -> None:
    # the reference scheduler drafting on hybrid models, one step ahead: every batch (the mamba fields included) and
    # every snapshot compared with spec's and the scheduler's own account. Only scenarios whose drafts may be
    # rejected send optimistic counts; their runs draft once their prefills are done, so each runs 16 steps or more,
    # and the seeds go on past the budget's count until one step was sent with an optimistic count
    budget = budget_for(backend, settings().max_examples, conformance_scale)
    seeds = [s for s in range(60) if _may_reject_drafts(random_scenario(s, spec_decode=True, hybrid=True))]
    optimistic = 0
    for done, seed in enumerate(seeds):
        if done >= max(2, budget.examples // 4) and optimistic:
            break
        scenario = random_scenario(seed, spec_decode=True, hybrid=True)
        scenario = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, async_scheduling=True))
        run = DifferentialRun(scenario, backend)
        drive(run, max(budget.max_steps, 16))
        optimistic += run.sched.stats.optimistic_counts
    assert optimistic > 0, "no hybrid step was sent with an optimistic count"


def _may_reject_drafts(scenario: Scenario) -> bool:
    knobs = scenario.knobs
    return _has_mamba(scenario) and knobs.spec_tokens > 0 and knobs.acceptance_rate < 1


def _has_mamba(scenario: Scenario) -> bool:
    return any(g.kind == "mamba" for g in scenario.config.kv_groups)
