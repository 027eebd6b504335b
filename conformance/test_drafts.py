"""Speculative decoding through the public API, once per backend (`--backend`): spec/drafts.py's rules.

The expected values are worked out by hand below from the block ids and tokens the tests hand out.
Config: block size 4, so positions 8.. of a request live in its third block.
"""

from __future__ import annotations

import dataclasses
import random
import types
from collections.abc import Callable

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.differential import DifferentialRun, MismatchError, drive
from conformance.driving import draft_fields, sampled_array, step
from conformance.mutations_drafts import DRAFT_BREAKERS, break_drafts
from conformance.scenario import random_scenario
from shadow.compare import batch_differences
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.graphs import CapturedGraphs
from spec.protocol import StatePool

CONFIG = WorkerConfig(4, 12, 64, 100, (KVCacheGroup(4, 32),))
A_PROMPT, B_PROMPT, C_PROMPT = tuple(range(10, 16)), tuple(range(20, 30)), (40, 41)
FIRST = SchedulerOutput(
    new_requests=(
        NewRequest("a", A_PROMPT, ((5, 6),)),
        NewRequest("b", B_PROMPT, ((7, 8, 9),)),
        NewRequest("c", C_PROMPT, ((3,),)),
    ),
    num_scheduled_tokens={"a": 6, "b": 4, "c": 2},
)
# a: known 7 (prompt + 50), computed 6; b: known 10, computed 4 (mid-prefill); c: known 3 (+ 51), computed 2
FIRST_SAMPLED = {"a": 50, "c": 51}
# a decodes with 3 drafts: positions 6 (its last known token, 50) and 7, 8, 9 (the drafts), crossing into block 11
DRAFTING = SchedulerOutput(
    cached_requests=(
        CachedRequest("a", 6, ((11,),)),
        CachedRequest("b", 4),
        CachedRequest("c", 2),
    ),
    num_scheduled_tokens={"a": 4, "b": 3, "c": 1},
    scheduled_spec_decode_tokens={"a": (60, 61, 62)},
)


def _started(backend: BackendHandle) -> StatePool:
    pool = backend.make_pool(CONFIG)
    step(backend, pool, FIRST, sampled=FIRST_SAMPLED)
    return pool


def _tokens(pool: StatePool, req_id: str) -> tuple[int, ...]:
    return next(r.token_ids for r in pool.snapshot() if r.req_id == req_id)


def test_drafts_are_input_tokens_with_slots_and_logits(backend: BackendHandle) -> None:
    pool = _started(backend)
    pool.apply(DRAFTING)
    raw = pool.prepare(DRAFTING)
    batch = backend.batch_to_numpy(raw) | draft_fields(backend, raw)
    assert batch["req_ids"] == ("c", "b", "a")  # 1, 3 and 4 tokens
    np.testing.assert_array_equal(batch["query_start_loc"], [0, 1, 4, 8])
    np.testing.assert_array_equal(batch["positions"], [2, 4, 5, 6, 6, 7, 8, 9])
    np.testing.assert_array_equal(batch["input_ids"], [51, 24, 25, 26, 50, 60, 61, 62])
    np.testing.assert_array_equal(batch["seq_lens"], [3, 7, 10])
    # c's slot 3*4+2; b's block 8; a's position 6, 7 in block 6 and the drafts at 8, 9 in block 11
    np.testing.assert_array_equal(batch["slot_mappings"][0], [14, 32, 33, 34, 26, 27, 44, 45])
    np.testing.assert_array_equal(batch["block_tables"][0][2, :3], [5, 6, 11])
    # logits: c's last token, b's last (discarded mid-prefill), a's last 1 + 3
    np.testing.assert_array_equal(batch["logits_indices"], [0, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(batch["num_draft_tokens"], [0, 0, 3])
    np.testing.assert_array_equal(batch["cu_num_draft_tokens"], [0, 0, 3])
    np.testing.assert_array_equal(batch["draft_token_ids"], [60, 61, 62])
    np.testing.assert_array_equal(batch["target_logits_indices"], [2, 3, 4])
    np.testing.assert_array_equal(batch["bonus_logits_indices"], [0, 1, 5])
    for name in ("logits_indices", "num_draft_tokens", "cu_num_draft_tokens", "target_logits_indices",
                 "bonus_logits_indices"):  # fmt: skip
        assert batch[name].dtype == np.int32, name
    assert batch["draft_token_ids"].dtype == np.int64
    # vLLM's identity: the token after each verifying position is the draft it verifies
    verifying = batch["logits_indices"][batch["target_logits_indices"]]
    np.testing.assert_array_equal(batch["input_ids"][verifying + 1], batch["draft_token_ids"])
    assert _tokens(pool, "a") == (*A_PROMPT, 50)  # drafts are not tokens of the request until accepted


def test_accepted_tokens_are_appended_and_the_next_step_rewrites_rejected_slots(backend: BackendHandle) -> None:
    pool = _started(backend)
    # a keeps draft 60 and gets 70 where 61 was rejected; the row of b (mid-prefill) is ignored
    step(backend, pool, DRAFTING, sampled={"c": 52, "b": 9, "a": (60, 70)})
    assert _tokens(pool, "a") == (*A_PROMPT, 50, 60, 70)
    assert _tokens(pool, "c") == (*C_PROMPT, 51, 52)
    assert _tokens(pool, "b") == B_PROMPT
    # rollback: 6 + 4 scheduled - 2 rejected = 8 computed; position 8 is written again, in draft 61's slot 44
    batch = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("a", 8),),
                                                num_scheduled_tokens={"a": 1}))  # fmt: skip
    np.testing.assert_array_equal(batch["positions"], [8])
    np.testing.assert_array_equal(batch["input_ids"], [70])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [44])
    row = next(r for r in pool.snapshot() if r.req_id == "a")
    assert row.block_ids == ((5, 6, 11),)  # the block allocated for the drafts stays in the table
    assert row.num_computed_tokens == 8


@pytest.mark.parametrize(
    ("accepted", "known_after"),
    [((70,), 8), ((60, 61, 62, 63), 11)],
    ids=["none accepted", "all accepted plus bonus"],
)
def test_none_or_all_drafts_accepted(backend: BackendHandle, accepted: tuple[int, ...], known_after: int) -> None:
    pool = _started(backend)
    step(backend, pool, DRAFTING, sampled={"a": accepted})
    assert _tokens(pool, "a") == (*A_PROMPT, 50, *accepted)
    assert len(_tokens(pool, "a")) == known_after


def test_one_id_per_row_means_no_draft_accepted(backend: BackendHandle) -> None:
    pool = _started(backend)
    step(backend, pool, DRAFTING, sampled={"a": 70})  # [num_reqs] form
    assert _tokens(pool, "a") == (*A_PROMPT, 50, 70)


def test_a_step_without_drafts_is_the_batch_it_always_was(backend: BackendHandle) -> None:
    plain = SchedulerOutput(cached_requests=DRAFTING.cached_requests[1:], num_scheduled_tokens={"b": 3, "c": 1})
    empty = SchedulerOutput(cached_requests=DRAFTING.cached_requests[1:], num_scheduled_tokens={"b": 3, "c": 1},
                            scheduled_spec_decode_tokens={"c": ()})  # fmt: skip
    batches = []
    for out in (plain, empty):
        pool = _started(backend)
        batches.append(step(backend, pool, out))
    for batch in batches:
        assert all(batch[name] is None for name in ("num_draft_tokens", "draft_token_ids", "bonus_logits_indices"))
        np.testing.assert_array_equal(batch["logits_indices"], [0, 3])  # each row's last token
    problems = batch_differences(batches[0], batches[1])
    assert not problems, "\n".join(problems)


def test_drafts_on_the_last_prefill_chunk(backend: BackendHandle) -> None:
    """b (10 tokens known, 4 computed) may draft on the chunk that reaches its last prompt token."""
    pool = _started(backend)
    out = SchedulerOutput(cached_requests=(CachedRequest("b", 4),), num_scheduled_tokens={"b": 8},
                          scheduled_spec_decode_tokens={"b": (80, 81)})  # fmt: skip
    batch = step(backend, pool, out, sampled={"b": (80, 90)})
    np.testing.assert_array_equal(batch["positions"], range(4, 12))
    np.testing.assert_array_equal(batch["input_ids"], [*B_PROMPT[4:], 80, 81])
    np.testing.assert_array_equal(batch["logits_indices"], [5, 6, 7])
    assert _tokens(pool, "b") == (*B_PROMPT, 80, 90)


def _with(**changes: object) -> Callable[[], SchedulerOutput]:
    def make() -> SchedulerOutput:
        fields = {
            "cached_requests": DRAFTING.cached_requests,
            "num_scheduled_tokens": DRAFTING.num_scheduled_tokens,
            "scheduled_spec_decode_tokens": DRAFTING.scheduled_spec_decode_tokens,
        }
        return SchedulerOutput(**{**fields, **changes})  # type: ignore[arg-type]

    return make


INVALID_APPLY = {
    "drafts of an unscheduled request": (spec.InconsistentSchedulerOutputError, _with(
        scheduled_spec_decode_tokens={"a": (60,), "zz": (1,)})),
    "drafts not a mapping": (spec.InconsistentSchedulerOutputError, _with(scheduled_spec_decode_tokens=[("a", (60,))])),
    "fewer than 1 + k scheduled": (spec.InconsistentSchedulerOutputError, _with(
        num_scheduled_tokens={"a": 3, "b": 3, "c": 1})),
    "draft outside the vocabulary": (spec.TokenIdError, _with(scheduled_spec_decode_tokens={"a": (60, 100, 62)})),
    "draft ids not integers": (spec.TokenIdError, _with(scheduled_spec_decode_tokens={"a": (60, 61.0, 62)})),
    "drafts past max_model_len": (spec.ModelLengthError, _with(
        num_scheduled_tokens={"a": 7, "b": 3, "c": 1}, scheduled_spec_decode_tokens={"a": (60,) * 6})),
    "step ends before the drafts": (spec.UnknownTokenError, _with(
        cached_requests=(CachedRequest("a", 5, ((11,),)), *DRAFTING.cached_requests[1:]))),
    "drafts on a mid-prefill chunk": (spec.UnknownTokenError, _with(
        scheduled_spec_decode_tokens={"a": (60, 61, 62), "b": (1,)})),
    "no block for the drafts": (spec.MissingBlockError, _with(
        cached_requests=(CachedRequest("a", 6), *DRAFTING.cached_requests[1:]))),
}  # fmt: skip


@pytest.mark.parametrize("case", INVALID_APPLY, ids=list(INVALID_APPLY))
def test_invalid_drafts_are_rejected_atomically(backend: BackendHandle, case: str) -> None:
    cls, make = INVALID_APPLY[case]
    pool = _started(backend)
    before = pool.snapshot()
    with pytest.raises(spec.ScheduleError) as caught:
        pool.apply(make())
    assert type(caught.value) is cls
    assert pool.snapshot() == before
    step(backend, pool, DRAFTING, sampled={"a": (60, 70)})  # the pool goes on working


def test_a_scheduler_that_forgets_to_roll_back_is_rejected(backend: BackendHandle) -> None:
    pool = _started(backend)
    step(backend, pool, DRAFTING, sampled={"a": (60, 70)})  # 2 of 3 drafts rejected: known 9
    before = pool.snapshot()
    with pytest.raises(spec.UnknownTokenError):  # 6 + 4 = 10 computed would read position 10 of 9 known
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("a", 10),), num_scheduled_tokens={"a": 1}))
    assert pool.snapshot() == before


INVALID_ACCEPTED = {  # rows in batch order c, b (mid-prefill: ignored), a (3 drafts)
    "no token": (spec.InconsistentSchedulerOutputError, [[52, -1], [9, -1], [-1, -1]]),
    "a gap": (spec.InconsistentSchedulerOutputError, [[52, -1, -1], [9, -1, -1], [60, -1, 70]]),
    "more than 1 + k": (spec.InconsistentSchedulerOutputError, [[52, 53], [9, 9], [60, 61]]),
    "more than 1 + k (drafting row)": (
        spec.InconsistentSchedulerOutputError,
        [[52] + [-1] * 4, [9] * 5, [60, 61, 62, 63, 64]],
    ),
    "not the drafts' prefix": (spec.InconsistentSchedulerOutputError, [[52, -1], [9, -1], [61, 70]]),
    "outside the vocabulary": (spec.TokenIdError, [[52, -1], [9, -1], [60, 100]]),
    "negative, not the placeholder": (spec.TokenIdError, [[-2, -1], [9, -1], [60, 70]]),
    "too many rows": (spec.InconsistentSchedulerOutputError, [[52], [9], [60], [1]]),
    "three dimensions": (spec.InconsistentSchedulerOutputError, [[[52]], [[9]], [[60]]]),
    "floats": (spec.InconsistentSchedulerOutputError, [[52.0], [9.0], [60.0]]),
}


@pytest.mark.parametrize("case", INVALID_ACCEPTED, ids=list(INVALID_ACCEPTED))
def test_invalid_accepted_tokens_are_rejected_atomically(backend: BackendHandle, case: str) -> None:
    cls, ids = INVALID_ACCEPTED[case]
    pool = _started(backend)
    pool.apply(DRAFTING)
    batch = pool.prepare(DRAFTING)
    before = pool.snapshot()
    with pytest.raises(spec.ScheduleError) as caught:
        pool.record_sampled(batch, backend.asarray(np.array(ids)))
    assert type(caught.value) is cls
    assert pool.snapshot() == before
    pool.record_sampled(batch, backend.asarray(sampled_array([52, 9, (60, 61, 70)])))  # still the batch to record
    assert _tokens(pool, "a") == (*A_PROMPT, 50, 60, 61, 70)


def test_accepted_tokens_past_max_model_len_are_rejected(backend: BackendHandle) -> None:
    config = WorkerConfig(1, 8, 16, 100, (KVCacheGroup(4, 8),))
    pool = backend.make_pool(config)
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("x", (1, 2, 3, 4, 5), ((1, 2),)),),
                                        num_scheduled_tokens={"x": 5}), sampled={"x": 6})  # fmt: skip
    # known 6, drafts at positions 6, 7 (the last two of max_model_len 8): 3 tokens would make 9
    out = SchedulerOutput(cached_requests=(CachedRequest("x", 5),), num_scheduled_tokens={"x": 3},
                          scheduled_spec_decode_tokens={"x": (7, 8)})  # fmt: skip
    pool.apply(out)
    batch = pool.prepare(out)
    before = pool.snapshot()
    with pytest.raises(spec.ModelLengthError):
        pool.record_sampled(batch, backend.asarray(np.array([[7, 8, 9]])))
    assert pool.snapshot() == before
    pool.record_sampled(batch, backend.asarray(np.array([[7, 8]])))  # 8 tokens: exactly max_model_len
    assert _tokens(pool, "x") == (1, 2, 3, 4, 5, 6, 7, 8)


@pytest.mark.parametrize("cls", list(DRAFT_BREAKERS), ids=lambda c: c.__name__)
def test_every_draft_fault_is_provoked_and_survived(backend: BackendHandle, cls: type[spec.ScheduleError]) -> None:
    """Some early step of some drafting scenario can be broken into `cls` by its drafts; both raise exactly it."""
    for seed in range(60):
        scenario = random_scenario(seed)
        knobs = dataclasses.replace(scenario.knobs, spec_tokens=3)
        run = DifferentialRun(dataclasses.replace(scenario, attention=None, knobs=knobs), backend)
        rng = random.Random(seed)

        def broken(
            out: SchedulerOutput, config: WorkerConfig, snapshot: spec.PoolSnapshot, rng: random.Random = rng
        ) -> tuple[SchedulerOutput, type[spec.ScheduleError]] | None:
            return break_drafts(cls, out, config, snapshot, rng)

        for _ in range(8):
            if run.done():
                break
            run.step(broken)
            if run.rejected[cls.__name__]:
                run.step()  # and the pool keeps working after the rejection
                return
    pytest.fail(f"no scenario offered a draft fault of class {cls.__name__}")


class _DraftsNotStoredPool(spec.RequestStatePool):
    """spec with a classic bug: draft positions read the token storage (where nobody wrote the drafts)."""

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> spec.BatchInputs:
        batch = super().prepare(sched, pad_to, graphs=graphs)
        if batch.num_draft_tokens is not None:
            ends = batch.query_start_loc[1:]
            for b, k in enumerate(batch.num_draft_tokens.tolist()):
                rows = self.token_ids[batch.index_mapping[b]]
                batch.input_ids[ends[b] - k : ends[b]] = rows[batch.positions[ends[b] - k : ends[b]]]
        return batch


def test_the_differential_suite_catches_drafts_read_from_storage() -> None:
    """Control: a backend that never places the drafts as input ids fails on the first drafting step."""
    module = types.SimpleNamespace(
        RequestStatePool=_DraftsNotStoredPool, write_kv=spec.write_kv, paged_attention=spec.paged_attention
    )
    broken = BackendHandle("drafts-not-stored", module)
    for seed in range(20):
        scenario = random_scenario(seed, spec_decode=True)
        scenario = dataclasses.replace(
            scenario, attention=None, knobs=dataclasses.replace(scenario.knobs, spec_tokens=3)
        )
        run = DifferentialRun(scenario, broken)
        try:
            drive(run, 60)
        except MismatchError as exc:
            assert "input_ids" in exc.message
            return
    pytest.fail("no scenario exposed drafts missing from the input ids")
