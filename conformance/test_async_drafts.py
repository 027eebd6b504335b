"""Async rule 8 (spec/async_steps.py): drafts proposed on the device, on every backend (`--backend`).

The scheduler sends placeholders (PLACEHOLDER_TOKEN_ID) for drafts it knows only by count; record_sampled took the
drafter's ids as `next_draft_ids`. Every expected value below is derived from the ids the test hands out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import settings

from conformance.backends import BackendHandle
from conformance.differential import DifferentialRun, budget_for, drive
from conformance.scenario import random_scenario
from spec import (
    CachedRequest,
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
from spec.types import PLACEHOLDER_TOKEN_ID

CONFIG = WorkerConfig(4, 64, 32, 100, (KVCacheGroup(4, 64),), async_scheduling=True)  # block size 4
PROMPT = (10, 11, 12, 13, 14)
P = PLACEHOLDER_TOKEN_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _ids(backend: BackendHandle, ids: list[int] | list[list[int]]) -> object:
    return backend.asarray(np.array(ids, np.int64))


def _prefill(backend: BackendHandle, proposed: list[int] | None, config: WorkerConfig = CONFIG) -> StatePool:
    """Request "a" prefills positions 0-4 in blocks (3, 4), samples 42, and the drafter proposes `proposed`."""
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    batch = pool.prepare(out)
    pool.record_sampled(batch, _ids(backend, [42]), None if proposed is None else _ids(backend, [proposed]))
    return pool


def _placeholders(num_computed: int, k: int, new_blocks: tuple[int, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(
        cached_requests=(CachedRequest("a", num_computed, (new_blocks,) if new_blocks else None),),
        num_scheduled_tokens={"a": 1 + k},
        scheduled_spec_decode_tokens={"a": (P,) * k},
    )


def test_placeholder_drafts_take_the_drafters_ids(backend: BackendHandle) -> None:
    pool = _prefill(backend, [7, 8, 9])
    out = _placeholders(5, 2)  # the sample 42 at position 5, then two of the three proposals
    pool.apply(out)
    batch = pool.prepare(out)
    got = backend.batch_to_numpy(batch)
    assert got["positions"].tolist() == [5, 6, 7] and got["input_ids"].tolist() == [42, 7, 8]
    assert got["draft_token_ids"].tolist() == [7, 8] and got["pending_token_indices"].tolist() == [0]
    assert got["slot_mappings"][0].tolist() == [4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3]
    pool.record_sampled(batch, _ids(backend, [[7, 8, 50]]))  # both kept, 50 sampled after them
    (row,) = pool.snapshot()
    assert row.token_ids == (*PROMPT, 42, 7, 8, 50)


def test_placeholder_drafts_follow_unverified_drafts_at_the_corrected_count(backend: BackendHandle) -> None:
    # Step 1 drafts 7, 8 (proposed at the prefill); the sampler keeps 7, rejects 8 and samples 50; the drafter
    # proposes 60, 61. The scheduler counts 5 + 1 + 3 = 9 tokens and sends step 2 at num_computed 8 with two
    # placeholders before it knows the verdict. Corrected by the one rejection, step 2 runs at positions 7-9:
    # the pending 50, then 60 and 61.
    pool = _prefill(backend, [7, 8])
    first = _placeholders(5, 2)
    pool.apply(first)
    batch = pool.prepare(first)
    pool.record_sampled(batch, _ids(backend, [[7, 50, P]]), _ids(backend, [[60, 61]]))
    second = _placeholders(8, 2, (5,))  # the optimistic reach, position 10, is in entry 2: block 5
    pool.apply(second)
    batch = pool.prepare(second)
    got = backend.batch_to_numpy(batch)
    assert got["positions"].tolist() == [7, 8, 9] and got["seq_lens"].tolist() == [10]
    assert got["input_ids"].tolist() == [50, 60, 61] and got["draft_token_ids"].tolist() == [60, 61]
    assert got["pending_token_indices"].tolist() == [0]
    assert got["slot_mappings"][0].tolist() == [4 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1]
    pool.record_sampled(batch, _ids(backend, [[60, 61, 70]]), _ids(backend, [[80, 81]]))
    third = _placeholders(10, 1)  # exact again: the verdict on 60, 61 is unread but both were kept
    pool.apply(third)
    got = backend.batch_to_numpy(pool.prepare(third))
    assert got["positions"].tolist() == [10, 11] and got["input_ids"].tolist() == [70, 80]
    (row,) = pool.snapshot()
    assert row.token_ids == (*PROMPT, 42, 7, 50, 60, 61, 70)


def test_placeholder_drafts_need_the_blocks_of_the_optimistic_reach(backend: BackendHandle) -> None:
    # Both drafts rejected: the scheduler counts 9 tokens and sends num_computed 8 with one placeholder, positions
    # 8-9 as it counts, 6-7 in truth. Blocks (3, 4) hold positions 0-7: the truth fits, the count does not, and
    # the step is refused before anything is written (a device position past the host's blocks, TensorRT-LLM
    # #16280). With block 5 it runs at positions 6-7.
    pool = _prefill(backend, [7, 8])
    first = _placeholders(5, 2)
    pool.apply(first)
    batch = pool.prepare(first)
    pool.record_sampled(batch, _ids(backend, [[50, P, P]]), _ids(backend, [[60, 61]]))
    before = pool.snapshot()
    with pytest.raises(MissingBlockError):
        pool.apply(_placeholders(8, 1))
    assert pool.snapshot() == before
    second = _placeholders(8, 1, (5,))
    pool.apply(second)
    got = backend.batch_to_numpy(pool.prepare(second))
    assert got["positions"].tolist() == [6, 7] and got["input_ids"].tolist() == [50, 60]
    assert got["slot_mappings"][0].tolist() == [4 * 4 + 2, 4 * 4 + 3]


def test_more_placeholders_than_proposals_are_refused(backend: BackendHandle) -> None:
    pool = _prefill(backend, [7])
    before = pool.snapshot()
    with pytest.raises(UnknownTokenError, match="2 drafts proposed on the device, but the drafter proposed 1"):
        pool.apply(_placeholders(5, 2))
    assert pool.snapshot() == before
    pool.apply(_placeholders(5, 1))  # one is there


def test_a_record_without_proposals_leaves_none(backend: BackendHandle) -> None:
    pool = _prefill(backend, [7, 8])
    out = SchedulerOutput(cached_requests=(CachedRequest("a", 5),), num_scheduled_tokens={"a": 1})
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), _ids(backend, [43]))  # the drafter did not run: 7, 8 are stale
    with pytest.raises(UnknownTokenError, match="the drafter proposed 0 for its row"):
        pool.apply(_placeholders(6, 1))


def test_a_new_request_never_drafts_from_a_previous_owners_proposals(backend: BackendHandle) -> None:
    # "a" leaves proposals 7, 8 on row 0 and finishes; "b" takes the row and, in its very first step, finishes its
    # prompt with placeholder drafts: refused, and so in its second step (its record proposed nothing).
    config = WorkerConfig(1, 64, 32, 100, (KVCacheGroup(4, 64),), async_scheduling=True)
    pool = _prefill(backend, [7, 8], config)
    new_b = NewRequest("b", (20, 21), ((6,),))
    with pytest.raises(UnknownTokenError, match="proposed 0 for a new request"):
        pool.apply(
            SchedulerOutput(
                new_requests=(new_b,),
                num_scheduled_tokens={"b": 3},
                finished_req_ids=frozenset({"a"}),
                scheduled_spec_decode_tokens={"b": (P,)},
            )
        )
    out = SchedulerOutput(new_requests=(new_b,), num_scheduled_tokens={"b": 2}, finished_req_ids=frozenset({"a"}))
    pool.apply(out)
    assert pool.row_of("b") == 0
    pool.record_sampled(pool.prepare(out), _ids(backend, [30]))
    with pytest.raises(UnknownTokenError, match="the drafter proposed 0 for its row"):
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("b", 2),), num_scheduled_tokens={"b": 2},
                                   scheduled_spec_decode_tokens={"b": (P,)}))  # fmt: skip


def test_a_resumed_request_drafts_from_a_new_proposal_only(backend: BackendHandle) -> None:
    pool = _prefill(backend, [7, 8])
    resumed = SchedulerOutput(cached_requests=(CachedRequest("a", 0, ((5, 6),), resumed=True),),
                              num_scheduled_tokens={"a": 7}, scheduled_spec_decode_tokens={"a": (P,)})  # fmt: skip
    with pytest.raises(UnknownTokenError, match="proposed 0 for a resumed request"):
        pool.apply(resumed)


def test_a_proposal_outside_the_vocabulary_is_reported_late(backend: BackendHandle) -> None:
    # The record's proposals are checked with its sampled ids, by the apply after next. As after any faulty
    # record (rule 6), the batch prepared in between carries placeholders: for the sample, and for the drafts
    # instead of the bad id.
    pool = _prefill(backend, [7, 100])
    out = _placeholders(5, 2)
    pool.apply(out)
    got = backend.batch_to_numpy(pool.prepare(out))
    assert got["input_ids"].tolist() == [P, P, P]
    with pytest.raises(TokenIdError, match="100 not in") as caught:
        pool.apply(SchedulerOutput(finished_req_ids=frozenset({"a"})))
    assert (caught.value.req_id, caught.value.field) == ("a", "next_draft_ids")


def test_placeholder_drafts_without_async_scheduling_are_refused(backend: BackendHandle) -> None:
    config = WorkerConfig(4, 64, 32, 100, (KVCacheGroup(4, 64),))
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    batch = pool.prepare(out)
    with pytest.raises(InconsistentSchedulerOutputError, match=r"need WorkerConfig\.async_scheduling"):
        pool.record_sampled(batch, _ids(backend, [42]), _ids(backend, [[7]]))
    pool.record_sampled(batch, _ids(backend, [42]))  # the refused call took nothing
    with pytest.raises(TokenIdError, match="-1 not in"):
        pool.apply(_placeholders(5, 1))


@pytest.mark.parametrize(
    ("proposed", "match"),
    [
        (np.zeros((2, 2), np.int64), r"shape \(2, 2\)"),
        (np.zeros(1, np.int64), r"shape \(1,\)"),
        (np.zeros((1, 2), np.float32), "dtype float32"),
    ],
)
def test_malformed_proposals_are_refused_at_once(backend: BackendHandle, proposed: np.ndarray, match: str) -> None:
    pool = backend.make_pool(CONFIG)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((3, 4),)),), num_scheduled_tokens={"a": 5})
    pool.apply(out)
    batch = pool.prepare(out)
    with pytest.raises(InconsistentSchedulerOutputError, match=match) as caught:
        pool.record_sampled(batch, _ids(backend, [42]), backend.asarray(proposed))
    assert caught.value.field == "next_draft_ids"
    pool.record_sampled(batch, _ids(backend, [42]), _ids(backend, [[7]]))  # nothing was taken
    pool.apply(_placeholders(5, 1))


def test_async_runs_with_drafts_on_the_device_agree_with_spec(backend: BackendHandle, conformance_scale: float) -> None:
    """The reference scheduler with its drafter on the device (knob drafts_on_device): outputs carry placeholders,
    each record the drafter's ids, and requests draft right after unverified drafts; every step and snapshot is
    compared with spec and with the scheduler's own account."""
    budget = budget_for(backend, settings().max_examples, conformance_scale)
    after_unverified = optimistic = 0
    for seed in range(max(2, budget.examples // 4)):
        scenario = random_scenario(seed, spec_decode=True)
        spec_tokens = max(2, scenario.knobs.spec_tokens)
        knobs = dataclasses.replace(scenario.knobs, drafts_on_device=True, spec_tokens=spec_tokens)
        config = dataclasses.replace(scenario.config, async_scheduling=True)
        run = DifferentialRun(dataclasses.replace(scenario, config=config, knobs=knobs), backend)
        drive(run, budget.max_steps)
        after_unverified += run.sched.stats.drafts_after_unverified
        optimistic += run.sched.stats.optimistic_counts
    assert after_unverified > 0, "no request drafted right after unverified drafts"
    assert optimistic > 0, "no step was sent with an optimistic count"
