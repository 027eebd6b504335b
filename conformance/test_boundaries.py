"""Boundary cases the generators once missed, once per backend (`--backend`).

Each case is a bug that was planted in fast and went unnoticed by the rest of the suite (issue 24); each
test here fails with that bug in place. Expected values are derived from the ids the tests hand out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance.backends import BackendHandle
from conformance.driving import step
from shadow.checker import ShadowChecker, ShadowMismatchError
from spec import (
    PAD_SLOT_ID,
    CachedRequest,
    InconsistentSchedulerOutputError,
    KVCacheGroup,
    ModelLengthError,
    NewRequest,
    NullBlockError,
    SchedulerOutput,
    TokenIdError,
    WorkerConfig,
)
from spec.protocol import StatePool

CONFIG = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(4, 32),))
PROMPT = (11, 12, 13)


def _prefilled(backend: BackendHandle) -> tuple[StatePool, SchedulerOutput]:
    pool = backend.make_pool(CONFIG)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((5,),)),), num_scheduled_tokens={"a": 3})
    pool.apply(out)
    return pool, out


def test_a_negative_id_in_the_one_id_per_row_form_is_refused(backend: BackendHandle) -> None:
    # [num_reqs] has no placeholders: -1 there is a token id outside the vocabulary, not "no token"
    # (an async engine's placeholder leaking into the next step's input ids, vLLM #37159).
    pool, out = _prefilled(backend)
    batch = pool.prepare(out)
    before = pool.snapshot()
    with pytest.raises(TokenIdError, match="-1 not in"):
        pool.record_sampled(batch, backend.asarray(np.array([-1], np.int64)))
    assert pool.snapshot() == before


def test_a_null_placeholder_appended_by_a_continuing_request_is_never_written(backend: BackendHandle) -> None:
    # Window 8, block 4, prompt of 20: chunk 2 (positions 12..15) appends (8, null): entry 4 is unread, so
    # valid; chunk 3 (positions 16..19) would write through that null entry.
    config = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(4, 32, sliding_window=8),))
    pool = backend.make_pool(config)
    prompt = tuple(range(1, 21))
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("w", prompt, ((5, 6, 7),)),),
                                        num_scheduled_tokens={"w": 12}))  # fmt: skip
    batch = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("w", 12, ((8, 0),)),),
                                                num_scheduled_tokens={"w": 4}))  # fmt: skip
    np.testing.assert_array_equal(batch["slot_mappings"][0], [32, 33, 34, 35])
    assert pool.snapshot()[0].block_ids == ((5, 6, 7, 8, 0),)
    before = pool.snapshot()
    with pytest.raises(NullBlockError):
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("w", 16, None),), num_scheduled_tokens={"w": 4}))
    assert pool.snapshot() == before


def test_a_copy_of_the_batch_with_its_rows_permuted_is_refused(backend: BackendHandle) -> None:
    # Same request ids, same lengths, rows swapped: the sampled ids would land in the other request's row.
    pool = backend.make_pool(CONFIG)
    out = SchedulerOutput(
        new_requests=(NewRequest("a", PROMPT, ((5,),)), NewRequest("b", (21, 22, 23), ((6,),))),
        num_scheduled_tokens={"a": 3, "b": 3},
    )
    pool.apply(out)
    batch = pool.prepare(out)
    rows = backend.to_numpy(batch.index_mapping)
    assert rows.tolist() == [0, 1]
    permuted = dataclasses.replace(batch, index_mapping=backend.asarray(rows[::-1].copy()))
    before = pool.snapshot()
    with pytest.raises(InconsistentSchedulerOutputError, match="batch"):
        pool.record_sampled(permuted, backend.asarray(np.array([7, 8], np.int64)))
    assert pool.snapshot() == before
    pool.record_sampled(batch, backend.asarray(np.array([7, 8], np.int64)))  # the real one is still taken
    assert [r.token_ids[-1] for r in pool.snapshot()] == [7, 8]


def test_a_new_request_drafting_on_its_first_step_in_a_row_freed_by_that_step(backend: BackendHandle) -> None:
    # "x" holds row 0 with 11 known tokens; it finishes and "y" (3 prompt tokens, 2 drafts) takes row 0 in the
    # same step. y's drafts are its positions 3 and 4, not past the previous owner's 11 tokens.
    pool = backend.make_pool(CONFIG)
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("x", tuple(range(30, 40)), ((1, 2, 3),)),),
                                        num_scheduled_tokens={"x": 10}), {"x": 40})  # fmt: skip
    out = SchedulerOutput(
        new_requests=(NewRequest("y", PROMPT, ((9, 10),)),),
        num_scheduled_tokens={"y": 5},
        finished_req_ids=frozenset({"x"}),
        scheduled_spec_decode_tokens={"y": (14, 15)},
    )
    batch = step(backend, pool, out, {"y": (14, 77)})  # draft 14 accepted, 15 rejected, 77 sampled
    assert pool.row_of("y") == 0
    np.testing.assert_array_equal(batch["input_ids"], [*PROMPT, 14, 15])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [36, 37, 38, 39, 40])
    assert pool.snapshot()[0].token_ids == (*PROMPT, 14, 77)
    # the next step starts at the rejected draft's position: its input is the sampled token
    batch = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("y", 4, None),),
                                                num_scheduled_tokens={"y": 1}))  # fmt: skip
    np.testing.assert_array_equal(batch["input_ids"], [77])
    np.testing.assert_array_equal(batch["positions"], [4])


def test_the_shadow_checker_notices_a_real_slot_on_the_first_padding_token() -> None:
    # The engine pads 3 tokens to 4; token 3 (the first padding token) must carry PAD_SLOT_ID.
    checker = ShadowChecker(CONFIG, write_repro=False)
    out = SchedulerOutput(new_requests=(NewRequest("a", PROMPT, ((5,),)),), num_scheduled_tokens={"a": 3})
    slots = np.array([20, 21, 22, 23], np.int64)  # 23: a real slot where PAD_SLOT_ID belongs
    arrays = {"positions": np.array([0, 1, 2, 0]), "input_ids": np.array([*PROMPT, 0]), "slot_mapping": slots}
    with pytest.raises(ShadowMismatchError) as raised:
        checker.check(out, arrays, ["a"])
    assert raised.value.field == "slot_mapping" and "padding token 3" in raised.value.detail
    fine = ShadowChecker(CONFIG, write_repro=False)
    fine.check(out, {**arrays, "slot_mapping": np.array([20, 21, 22, PAD_SLOT_ID])}, ["a"])


def test_a_step_up_to_max_model_len_is_valid_and_its_sample_has_no_room(backend: BackendHandle) -> None:
    # The valid side of checks 7 (a prompt of max_model_len; a step ending there): accepted and prepared, but
    # the row reaches its last token with no room for a sample, so its record is refused. vLLM's scheduler
    # (and the reference one) never sends such a step; an engine that does must drop that row's sample.
    config = WorkerConfig(2, 8, 32, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    prompt = tuple(range(1, 9))
    out = SchedulerOutput(new_requests=(NewRequest("m", prompt, ((5, 6),)),), num_scheduled_tokens={"m": 8})
    pool.apply(out)
    batch = pool.prepare(out)
    np.testing.assert_array_equal(backend.to_numpy(batch.positions), range(8))
    np.testing.assert_array_equal(backend.to_numpy(batch.seq_lens), [8])
    before = pool.snapshot()
    with pytest.raises(ModelLengthError):
        pool.record_sampled(batch, backend.asarray(np.array([3], np.int64)))
    assert pool.snapshot() == before
    too_long = SchedulerOutput(new_requests=(NewRequest("n", (*prompt, 9), ((7, 8, 9),)),),
                               num_scheduled_tokens={"n": 9})  # fmt: skip
    with pytest.raises(ModelLengthError):
        pool.apply(too_long)
