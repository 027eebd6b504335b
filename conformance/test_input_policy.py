"""The input policy, one defect of issue 14 at a time: a typed error naming the request and field, nothing lost.

Every case runs on every backend next to spec (conformance.differential.Pair): a refused input must
raise the same ScheduleError subclass in both, leave both snapshots as they were, and the next valid
step must give the same batch in both. That batch gathers the rows' whole block tables, so a device
table left stale by a half-done rejection (the interpreter's separate device state) shows there.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.differential import Pair
from conformance.malformed import CHECK_ONE
from conformance.mutations import MALFORMATIONS
from conformance.probes import EDITS
from shadow.compare import batch_differences
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.errors import (
    InconsistentSchedulerOutputError,
    ModelLengthError,
    ScheduleError,
    TokenBudgetError,
    TokenIdError,
)
from spec.types import PAD_SLOT_ID, BatchInputs, CachedRequestColumns

# one full-attention group and one sliding-window group, block size 4 in both
CONFIG = WorkerConfig(
    max_num_reqs=4,
    max_model_len=32,
    max_num_batched_tokens=16,
    vocab_size=100,
    kv_groups=(KVCacheGroup(4, 64), KVCacheGroup(4, 64, sliding_window=4)),
)
# row 0: 'a' (6 prompt tokens), row 1: 'b' (4 prompt tokens); two blocks per group each
FIRST = SchedulerOutput(
    new_requests=(
        NewRequest("a", (1, 2, 3, 4, 5, 6), ((41, 42), (43, 44))),
        NewRequest("b", (7, 8, 9, 10), ((5, 7), (6, 8))),
    ),
    num_scheduled_tokens={"a": 6, "b": 4},
)


# the cases below break the field annotations on purpose: built through untyped names
AnyOutput: Any = SchedulerOutput
AnyNew: Any = NewRequest
AnyCached: Any = CachedRequest
AnyColumns: Any = CachedRequestColumns


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _ones(batch: BatchInputs) -> list[int]:
    return [1] * batch.num_reqs


def _pair(backend: BackendHandle, config: WorkerConfig = CONFIG, first: SchedulerOutput | None = FIRST) -> Pair:
    """spec and `backend` side by side, after the same first step (a: 7 known tokens, b: 5)."""
    pair = Pair(BackendHandle("spec", spec), backend, config, None, seed=0)
    if first is not None:
        pair.run_step(first, None, _ones)
    return pair


def _refused(
    pair: Pair, call: Callable[[Any], object], error: type[ScheduleError], req_id: str | None, field: str
) -> None:
    """`call(pool)` raises exactly `error` naming req_id and field on both sides, and changes neither snapshot."""
    for side in (pair.ref, pair.cand):
        before = side.pool.snapshot()
        with pytest.raises(ScheduleError) as info:
            call(side.pool)
        name = side.handle.name
        assert type(info.value) is error, f"{name}: {info.value!r}"
        assert info.value.field == field, f"{name}: {info.value!r}"
        assert info.value.req_id == req_id, f"{name}: {info.value!r}"
        if req_id is not None:
            assert repr(req_id) in str(info.value), name
        assert side.pool.snapshot() == before, f"{name}: the refused call changed the pool"


def _decode_both(pair: Pair) -> None:
    """The next valid step (a and b decode one token each) works and agrees on both sides."""
    known = {row.req_id: len(row.token_ids) for row in pair.ref.pool.snapshot()}
    out = SchedulerOutput(
        cached_requests=tuple(CachedRequest(r, known[r] - 1) for r in ("a", "b") if r in known),
        num_scheduled_tokens={r: 1 for r in ("a", "b") if r in known},
    )
    pair.run_step(out, None, _ones)


# ---- 1. repeated finished ids --------------------------------------------------------------------
def test_repeated_finished_id_is_refused_before_anything_is_freed(backend: BackendHandle) -> None:
    pair = _pair(backend)
    takes_row = AnyOutput(
        new_requests=(AnyNew("c", (1, 2), ((9,), (10,))),),
        num_scheduled_tokens={"c": 2},
        finished_req_ids=frozenset({"a"}),
    )
    twice = replace(takes_row, finished_req_ids=("a", "a"))
    _refused(pair, lambda pool: pool.apply(twice), InconsistentSchedulerOutputError, "a", "finished_req_ids")
    # c takes a's row with one block where a had two: the row's whole gathered table must read [9, 0, ...]
    pair.run_step(takes_row, None, _ones)
    assert pair.ref.pool.row_of("c") == 0


@pytest.mark.parametrize("finished", [["b", "a", "b"], ("a", "a")], ids=["list", "tuple"])
def test_every_sequence_of_finished_ids_must_be_distinct(backend: BackendHandle, finished: Any) -> None:
    pair = _pair(backend)
    out = AnyOutput(finished_req_ids=finished)
    repeated = "b" if "b" in finished else "a"
    _refused(pair, lambda pool: pool.apply(out), InconsistentSchedulerOutputError, repeated, "finished_req_ids")
    pair.run_step(AnyOutput(finished_req_ids=tuple(dict.fromkeys(finished))), None, _ones)


# ---- 2. vocabularies past int32, ids past int64 ------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [2**31 + 1, 2**63, 2**64])
def test_vocabulary_larger_than_int32_ids_is_refused(vocab_size: int) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        WorkerConfig(4, 32, 16, vocab_size, (KVCacheGroup(4, 16),))


@pytest.mark.parametrize("bad_id", [2**31, 2**63, 2**64, -(2**63) - 1])
def test_prompt_id_past_the_vocabulary_is_refused_whole(backend: BackendHandle, bad_id: int) -> None:
    config = replace(CONFIG, vocab_size=2**31)
    pair = _pair(backend, config)
    out = AnyOutput(new_requests=(AnyNew("c", (1, bad_id, 3), ((9,), (10,))),), num_scheduled_tokens={"c": 3})
    _refused(pair, lambda pool: pool.apply(out), TokenIdError, "c", "prompt_token_ids")
    # the largest id of the vocabulary is stored and read back exactly
    top = AnyOutput(new_requests=(AnyNew("c", (1, 2**31 - 1, 3), ((9,), (10,))),), num_scheduled_tokens={"c": 3})
    pair.run_step(top, None, _ones)
    c = next(row for row in pair.cand.pool.snapshot() if row.req_id == "c")
    assert c.token_ids[:3] == (1, 2**31 - 1, 3)


# ---- 3. stale batches --------------------------------------------------------------------------------
def test_record_sampled_takes_only_the_batch_of_the_last_prepare(backend: BackendHandle) -> None:
    pair = _pair(backend, first=None)
    batches = {}
    for side in (pair.ref, pair.cand):
        side.pool.apply(FIRST)
        batches[side.handle.name, "first"] = side.pool.prepare(FIRST)
    for side in (pair.ref, pair.cand):
        side.pool.record_sampled(batches[side.handle.name, "first"], side.handle.asarray(np.array([11, 12])))

    def stale(pool: Any) -> None:
        side = pair.ref if pool is pair.ref.pool else pair.cand
        pool.record_sampled(batches[side.handle.name, "first"], side.handle.asarray(np.array([13, 14])))

    # recorded already: once is the rule
    _refused(pair, stale, InconsistentSchedulerOutputError, None, "batch")
    # a's row changes owner: c takes it; the first step's batch names row 0 for 'a'
    handover = AnyOutput(
        new_requests=(AnyNew("c", (1, 2, 3, 4), ((9,), (10,))),),
        num_scheduled_tokens={"c": 4},
        finished_req_ids=frozenset({"a"}),
    )
    for side in (pair.ref, pair.cand):
        side.pool.apply(handover)
    _refused(pair, stale, InconsistentSchedulerOutputError, None, "batch")  # applied, not yet prepared
    current = {}
    for side in (pair.ref, pair.cand):
        current[side.handle.name] = side.pool.prepare(handover)
    _refused(pair, stale, InconsistentSchedulerOutputError, None, "batch")  # prepared: only that batch goes
    for side in (pair.ref, pair.cand):
        side.pool.record_sampled(current[side.handle.name], side.handle.asarray(np.array([15])))
    assert pair.ref.pool.snapshot() == pair.cand.pool.snapshot()
    c = next(row for row in pair.ref.pool.snapshot() if row.req_id == "c")
    assert c.token_ids == (1, 2, 3, 4, 15)


# ---- 4. malformed fields and containers --------------------------------------------------------------------
# One named output per case, applied after FIRST, each tagged with its kind in conformance.mutations'
# MALFORMATIONS (check 1's kinds are conformance.malformed.CHECK_ONE; checks 6 and 9 own the id types), which
# gives the class refused; (kind, the request and the field the error names, the output).
MALFORMED: dict[str, tuple[str, str | None, str, Callable[[], SchedulerOutput]]] = {
    "bytes req id beside str": ("non-str req id", None, "req_id",
        lambda: AnyOutput(new_requests=(AnyNew(b"a", (1,), ((9,), (10,))),), num_scheduled_tokens={b"a": 1})),
    "int req id": ("non-str req id", None, "req_id",
        lambda: AnyOutput(new_requests=(AnyNew(7, (1,), ((9,), (10,))),), num_scheduled_tokens={7: 1})),
    "int finished id": ("non-str req id", None, "finished_req_ids",
        lambda: AnyOutput(finished_req_ids=frozenset({0}))),
    "finished ids as one str": ("str as finished_req_ids", None, "finished_req_ids",
        lambda: AnyOutput(finished_req_ids="a")),
    "a finished id twice": ("repeated finished id", "a", "finished_req_ids",
        lambda: AnyOutput(finished_req_ids=("a", "a"))),
    "a new request twice": ("repeated new request", "c", "new_requests/cached_requests",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1,), ((9,), (10,))),) * 2, num_scheduled_tokens={"c": 1})),
    "a cached request twice": ("repeated cached request", "a", "new_requests/cached_requests",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),) * 2, num_scheduled_tokens={"a": 1})),
    "one id new and cached": ("new and cached", "a", "new_requests/cached_requests",
        lambda: AnyOutput(new_requests=(AnyNew("a", (0,), ((), ())),), cached_requests=(AnyCached("a", 6),),
                          num_scheduled_tokens={"a": 1})),
    "fractional prompt id": ("prompt not integer ids", "c", "prompt_token_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1, 1.5), ((9,), (10,))),), num_scheduled_tokens={"c": 2})),
    "whole float prompt ids": ("prompt not integer ids", "c", "prompt_token_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", np.array([1.0, 2.0]), ((9,), (10,))),),
                          num_scheduled_tokens={"c": 2})),
    "nested prompt ids": ("prompt not integer ids", "c", "prompt_token_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", ((1, 2),), ((9,), (10,))),), num_scheduled_tokens={"c": 1})),
    "None among prompt ids": ("prompt not integer ids", "c", "prompt_token_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1, None), ((9,), (10,))),), num_scheduled_tokens={"c": 2})),
    "prompt ids as a str": ("prompt not integer ids", "c", "prompt_token_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", "12", ((9,), (10,))),), num_scheduled_tokens={"c": 2})),
    "fractional block id of a new request": ("block ids not integers", "c", "block_ids[0]",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1,), ((9.7,), (10,))),), num_scheduled_tokens={"c": 1})),
    "whole float block id appended": ("block ids not integers", "a", "block_ids[1]",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6, ((), (45.0,))),), num_scheduled_tokens={"a": 1})),
    "block ids not per group": ("block ids not per group", "c", "block_ids",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1,), None),), num_scheduled_tokens={"c": 1})),
    "bool scheduled count": ("bool count", "a", "num_scheduled_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": True})),
    "float scheduled count": ("float count", "a", "num_scheduled_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": 1.0})),
    "float computed count": ("float count", "a", "num_computed_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6.0),), num_scheduled_tokens={"a": 1})),
    "bool computed count": ("bool count", "c", "num_computed_tokens",
        lambda: AnyOutput(new_requests=(AnyNew("c", (1,), ((9,), (10,)), False),), num_scheduled_tokens={"c": 1})),
    "None computed count": ("None count", "a", "num_computed_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", None),), num_scheduled_tokens={"a": 1})),
    "int resumed flag": ("non-bool resumed", "a", "resumed",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 0, ((41, 42), (43, 44)), 1),),
                          num_scheduled_tokens={"a": 7})),
    "num_scheduled_tokens as pairs": ("items container", None, "num_scheduled_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens=[("a", 1)])),
    "num_scheduled_tokens as dict items": ("items container", None, "num_scheduled_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": 1}.items())),
    "finished_req_ids as dict keys": ("items container", None, "finished_req_ids",
        lambda: AnyOutput(finished_req_ids={"a": 0}.keys())),
    "new_requests as a generator": ("generator container", None, "new_requests",
        lambda: AnyOutput(new_requests=(r for r in (AnyNew("c", (1,), ((9,), (10,))),)),
                          num_scheduled_tokens={"c": 1})),
    "cached_requests as a generator": ("generator container", None, "cached_requests",
        lambda: AnyOutput(cached_requests=(r for r in (AnyCached("a", 6),)), num_scheduled_tokens={"a": 1})),
    "new request as a tuple": ("request not a NewRequest", None, "new_requests",
        lambda: AnyOutput(new_requests=(("c", (1,), ((9,), (10,))),), num_scheduled_tokens={"c": 1})),
    "cached request as a tuple": ("request not a CachedRequest", None, "cached_requests",
        lambda: AnyOutput(cached_requests=(("a", 6),), num_scheduled_tokens={"a": 1})),
    "a bytes key among the counts": ("non-str count key", None, "num_scheduled_tokens",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": 1, b"a": 1})),
    "new block ids for one group of two": ("new block ids not per group", "a", "new_block_ids",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6, ((45,),)),), num_scheduled_tokens={"a": 1})),
    # an array's truth is ambiguous: a reader that tests an entry's truth, or compares it with None, must not raise
    "new block ids as an array": ("new block ids not per group", "a", "new_block_ids",
        lambda: AnyOutput(cached_requests=(AnyCached("a", 6, np.array([45, 46])),), num_scheduled_tokens={"a": 1})),
    "a column of new block ids holding an array": ("new block ids not per group", "a", "new_block_ids",
        lambda: AnyOutput(cached_requests=AnyColumns(["a"], [6], [np.array([45, 46])]),
                          num_scheduled_tokens={"a": 1})),
    "a column of new block ids that is no sequence": ("columns of unequal length", None,
        "cached_requests.new_block_ids",
        lambda: AnyOutput(cached_requests=AnyColumns(["a"], [6], 3), num_scheduled_tokens={"a": 1})),
    "no column of num_computed_tokens": ("columns of unequal length", None, "cached_requests.num_computed_tokens",
        lambda: AnyOutput(cached_requests=AnyColumns(["a"], None), num_scheduled_tokens={"a": 1})),
    "req ids that are no sequence": ("columns of unequal length", None, "cached_requests.req_ids",
        lambda: AnyOutput(cached_requests=AnyColumns(3.5, [6]), num_scheduled_tokens={"a": 1})),
    "a column one short": ("columns of unequal length", None, "cached_requests.num_computed_tokens",
        lambda: AnyOutput(cached_requests=CachedRequestColumns(["a", "b"], [6]),
                          num_scheduled_tokens={"a": 1, "b": 1})),
    "resumed ids as a list": ("resumed ids not a set", None, "cached_requests.resumed_req_ids",
        lambda: AnyOutput(cached_requests=AnyColumns(["a"], [0], [((41, 42), (43, 44))], ["a"]),
                          num_scheduled_tokens={"a": 7})),
    "a resumed id not among the columns": ("resumed id not cached", None, "cached_requests.resumed_req_ids",
        lambda: AnyOutput(cached_requests=CachedRequestColumns(["a"], [6], None, frozenset({"b"})),
                          num_scheduled_tokens={"a": 1})),
}  # fmt: skip


CONTAINERS = (
    "generator container",
    "items container",
    "request not a NewRequest",
    "request not a CachedRequest",
    "columns of unequal length",
    "resumed ids not a set",
    "resumed id not cached",
)
REPEATS = ("repeated finished id", "repeated new request", "repeated cached request", "new and cached")


def _cases(kinds: tuple[str, ...], inside: bool = True) -> list[str]:
    return sorted(case for case, (kind, *_) in MALFORMED.items() if (kind in kinds) == inside)


def _refused_after_first(backend: BackendHandle, case: str) -> None:
    kind, req_id, field, make = MALFORMED[case]
    error = MALFORMATIONS[kind][0]
    pair = _pair(backend)
    _refused(pair, lambda pool: pool.apply(make()), error, req_id, field)
    _decode_both(pair)


# integers past int64 (a NumPy conversion's OverflowError, were a backend to convert first) get the check that bounds
# them: a count past the token budget (check 5), a new request's num_computed past max_model_len (check 7)
PAST_INT64 = {
    "count": (TokenBudgetError, "a", "num_scheduled_tokens",
              lambda: SchedulerOutput(cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"a": 2**70})),
    "new request's num_computed_tokens": (ModelLengthError, "c", "num_scheduled_tokens",
        lambda: SchedulerOutput(new_requests=(NewRequest("c", (1,), ((9,), (10,)), num_computed_tokens=2**70),),
                                num_scheduled_tokens={"c": 1})),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PAST_INT64))
def test_an_integer_past_int64_gets_the_check_that_bounds_it(backend: BackendHandle, case: str) -> None:
    error, req_id, field, make = PAST_INT64[case]
    pair = _pair(backend)
    _refused(pair, lambda pool: pool.apply(make()), error, req_id, field)
    _decode_both(pair)


# ---- odd values in every field -----------------------------------------------------------------------------------
# Each value below in each field of an output after FIRST: spec and the backend agree on the outcome (the same
# error class, request and field with both pools unchanged, or both accept with the same rows), and neither
# raises anything but a ScheduleError. Arrays are the values a reader can trip on: their truth is ambiguous and
# their comparison with None is elementwise.
ODD_VALUES: tuple[Any, ...] = (
    np.array([3, 4]), np.array([[3, 4]]), np.array([3.0]), np.array([True]), np.array([], np.int64),
    np.array(["a"]), np.array([3], object), np.float64(3.0), np.int64(3), np.bool_(True),
    None, (), [], {}, "ab", 3.5, -1, 2**70, (np.array([3]),), ((None,),), ([3], [4]),
)  # fmt: skip
_DECODES = {"a": 1, "b": 1}
_AFTER_A_B = frozenset({"a", "b"})
ODD_FIELDS: dict[str, Callable[[Any], SchedulerOutput]] = {
    "columns' new_block_ids entry":
        lambda v: AnyOutput(cached_requests=AnyColumns(["a", "b"], [6, 4], [v, None]), num_scheduled_tokens=_DECODES),
    "columns' new_block_ids":
        lambda v: AnyOutput(cached_requests=AnyColumns(["a", "b"], [6, 4], v), num_scheduled_tokens=_DECODES),
    "columns' num_computed_tokens":
        lambda v: AnyOutput(cached_requests=AnyColumns(["a", "b"], v), num_scheduled_tokens=_DECODES),
    "columns' num_computed_tokens entry":
        lambda v: AnyOutput(cached_requests=AnyColumns(["a", "b"], [v, 4]), num_scheduled_tokens=_DECODES),
    "columns' req_ids":
        lambda v: AnyOutput(cached_requests=AnyColumns(v, [6, 4]), num_scheduled_tokens=_DECODES),
    "cached request's new_block_ids":
        lambda v: AnyOutput(cached_requests=(AnyCached("a", 6, v), AnyCached("b", 4)), num_scheduled_tokens=_DECODES),
    "count":
        lambda v: AnyOutput(cached_requests=(AnyCached("a", 6), AnyCached("b", 4)),
                            num_scheduled_tokens={"a": v, "b": 1}),
    "new request's prompt":
        lambda v: AnyOutput(new_requests=(AnyNew("c", v, ((9,), (10,))),), num_scheduled_tokens={"c": 1},
                            finished_req_ids=_AFTER_A_B),
    "new request's block_ids":
        lambda v: AnyOutput(new_requests=(AnyNew("c", (1, 2), v),), num_scheduled_tokens={"c": 1},
                            finished_req_ids=_AFTER_A_B),
    "new request's group ids":
        lambda v: AnyOutput(new_requests=(AnyNew("c", (1, 2), (v, (10,))),), num_scheduled_tokens={"c": 1},
                            finished_req_ids=_AFTER_A_B),
    "new request's num_computed_tokens":
        lambda v: AnyOutput(new_requests=(AnyNew("c", (1, 2), ((9,), (10,)), num_computed_tokens=v),),
                            num_scheduled_tokens={"c": 1}, finished_req_ids=_AFTER_A_B),
    "cached request's num_computed_tokens":
        lambda v: AnyOutput(cached_requests=(AnyCached("a", v), AnyCached("b", 4)), num_scheduled_tokens=_DECODES),
    "cached request's req_id":
        lambda v: AnyOutput(cached_requests=(AnyCached(v, 6), AnyCached("b", 4)), num_scheduled_tokens=_DECODES),
    "new request's req_id":
        lambda v: AnyOutput(new_requests=(AnyNew(v, (1, 2), ((9,), (10,))),), num_scheduled_tokens={"c": 1},
                            finished_req_ids=_AFTER_A_B),
    "columns' resumed_req_ids":
        lambda v: AnyOutput(cached_requests=AnyColumns(["a", "b"], [6, 4], None, v), num_scheduled_tokens=_DECODES),
    "finished_req_ids":
        lambda v: AnyOutput(cached_requests=(AnyCached("a", 6), AnyCached("b", 4)), num_scheduled_tokens=_DECODES,
                            finished_req_ids=v),
    "drafts":
        lambda v: AnyOutput(cached_requests=(AnyCached("a", 6), AnyCached("b", 4)),
                            num_scheduled_tokens={"a": 2, "b": 1}, scheduled_spec_decode_tokens={"a": v}),
}  # fmt: skip


def _outcome(side: Any, out: SchedulerOutput) -> tuple[Any, ...]:
    before = side.pool.snapshot()
    try:
        side.pool.apply(out)
    except ScheduleError as error:
        assert side.pool.snapshot() == before, f"{side.handle.name}: the refused call changed the pool"
        return type(error), error.req_id, error.field
    return ("accepted", side.pool.snapshot())


@pytest.mark.not_on_backends("fast-interpret", reason="the output is read on the host, by fast's own code")
@pytest.mark.parametrize("field", sorted(ODD_FIELDS))
def test_an_odd_value_in_any_field_gets_spec_s_outcome(backend: BackendHandle, field: str) -> None:
    for value in ODD_VALUES:
        pair = _pair(backend)
        outcomes = [_outcome(side, ODD_FIELDS[field](value)) for side in (pair.ref, pair.cand)]
        assert outcomes[0] == outcomes[1], f"{field} = {value!r}: spec {outcomes[0]}, {backend.name} {outcomes[1]}"


@pytest.mark.parametrize("case", _cases(CONTAINERS + REPEATS, inside=False))
def test_a_field_of_the_wrong_type_is_refused(backend: BackendHandle, case: str) -> None:
    _refused_after_first(backend, case)


@pytest.mark.parametrize("case", _cases(CONTAINERS))
def test_a_container_of_the_wrong_kind_is_refused(backend: BackendHandle, case: str) -> None:
    _refused_after_first(backend, case)


@pytest.mark.parametrize("case", _cases(REPEATS))
def test_an_id_listed_twice_is_refused(backend: BackendHandle, case: str) -> None:
    _refused_after_first(backend, case)


def test_every_kind_of_check_one_malformation_has_a_named_case() -> None:
    """The cases name the generators' kinds (so a renamed or new kind shows here) and cover all of check 1's."""
    kinds = {kind for kind, *_ in MALFORMED.values()}
    assert kinds <= set(MALFORMATIONS), sorted(kinds - set(MALFORMATIONS))
    assert set(CHECK_ONE) <= kinds, f"no named case of {sorted(set(CHECK_ONE) - kinds)}"


@pytest.mark.parametrize(
    "sampled",
    [np.array([-0.5, 1.0]), np.array([1.0, 2.0]), np.array([True, False]), ["1", "2"]],
    ids=["fractional", "whole floats", "bools", "strs"],
)
def test_sampled_ids_need_an_integer_dtype(backend: BackendHandle, sampled: Any) -> None:
    pair = _pair(backend, first=None)
    batches = {}
    for side in (pair.ref, pair.cand):
        side.pool.apply(FIRST)
        batches[side.handle.name] = side.pool.prepare(FIRST)

    def record(pool: Any) -> None:
        side = pair.ref if pool is pair.ref.pool else pair.cand
        ids = side.handle.asarray(sampled) if isinstance(sampled, np.ndarray) else sampled
        pool.record_sampled(batches[side.handle.name], ids)

    _refused(pair, record, InconsistentSchedulerOutputError, None, "sampled_token_ids")
    for side in (pair.ref, pair.cand):  # the same batch still takes integer ids
        side.pool.record_sampled(batches[side.handle.name], side.handle.asarray(np.array([3, 4], np.int32)))
    assert pair.ref.pool.snapshot() == pair.cand.pool.snapshot()
    _decode_both(pair)


def test_lists_numpy_ints_and_arrays_are_read_as_their_tuple_and_int_forms(backend: BackendHandle) -> None:
    """What the policy accepts beyond the plain form gives the batch and state of the plain form."""
    plain = AnyOutput(
        new_requests=(AnyNew("c", (1, 2, 3), ((9,), (10,)), 1),),
        cached_requests=(AnyCached("a", 6, ((), (45,))),),
        num_scheduled_tokens={"c": 2, "a": 1},
        finished_req_ids=frozenset({"b"}),
    )
    disguised = AnyOutput(
        new_requests=[AnyNew("c", np.array([1, 2, 3], np.uint16), [np.array([9]), [10]], np.int8(1))],
        cached_requests=[AnyCached("a", np.int64(6), [[], np.array([45], np.int32)])],
        num_scheduled_tokens={"c": np.int32(2), "a": np.uint8(1)},
        finished_req_ids=["b"],
    )
    pair = _pair(backend)
    reference = _pair(BackendHandle("spec", spec))
    reference.run_step(plain, None, _ones)
    pair.run_step(disguised, None, _ones)  # spec and the backend agree on the disguised form...
    assert pair.ref.pool.snapshot() == reference.ref.pool.snapshot()  # ...which is the plain form


def test_counts_of_unsigned_and_signed_numpy_types_together(backend: BackendHandle) -> None:
    """uint64 + int64 is float64 in NumPy: a count must be read as the integer it is, not mixed as NumPy mixes."""
    pair = _pair(backend)
    out = AnyOutput(
        cached_requests=(AnyCached("a", np.int64(6)), AnyCached("b", np.uint64(4))),
        num_scheduled_tokens={"a": np.uint64(1), "b": np.int64(1)},
    )
    pair.run_step(out, None, _ones)


@pytest.mark.parametrize("pad_to", [np.int64(12), np.int32(12), 12])
def test_pad_to_of_any_integer_type(backend: BackendHandle, pad_to: Any) -> None:
    """The batch is padded to 12 tokens (run_step holds the backend's batch equal to spec's, checked here)."""
    pair = _pair(backend)
    out = AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": 1})
    seen: list[BatchInputs] = []

    def sampled(batch: BatchInputs) -> list[int]:
        seen.append(batch)
        return _ones(batch)

    pair.run_step(out, pad_to, sampled)
    batch = seen[0]
    assert (batch.num_tokens, batch.num_tokens_padded) == (1, 12)
    assert np.asarray(batch.positions).tolist() == [6] + [0] * 11
    assert np.asarray(batch.slot_mappings[0])[1:].tolist() == [PAD_SLOT_ID] * 11


@pytest.mark.parametrize("pad_to", [True, 12.0, "12", 0], ids=["bool", "float", "str", "too small"])
def test_pad_to_that_is_not_an_integer_at_least_the_tokens_is_refused(backend: BackendHandle, pad_to: Any) -> None:
    pair = _pair(backend)
    out = AnyOutput(cached_requests=(AnyCached("a", 6),), num_scheduled_tokens={"a": 1})
    for side in (pair.ref, pair.cand):
        side.pool.apply(out)
    _refused(pair, lambda pool: pool.prepare(out, pad_to), InconsistentSchedulerOutputError, None, "pad_to")
    pair.run_step(out, None, _ones)  # prepare with a valid pad_to still works (apply again: same state)


# ---- 5. an output is frozen at apply ----------------------------------------------------------------------
@pytest.mark.parametrize("mutation", sorted(EDITS))
def test_mutating_the_output_after_apply_changes_nothing(backend: BackendHandle, mutation: str) -> None:
    """conformance.probes' edits of num_scheduled_tokens (the ones the probed differential runs make at random)."""
    pair = _pair(backend)
    reference = _pair(BackendHandle("spec", spec))

    def out() -> Any:  # a and b tie on one token each: the mapping's order decides the batch
        prompt = [21, 22]  # a list: mutable too
        return AnyOutput(
            new_requests=(AnyNew("c", prompt, ((9,), (10,))),),
            cached_requests=(AnyCached("a", 6), AnyCached("b", 4)),
            num_scheduled_tokens={"a": 1, "b": 1, "c": 2},
        )

    want = reference.ref.pool
    unmutated = out()
    want.apply(unmutated)
    want_batch = BackendHandle("spec", spec).batch_to_numpy(want.prepare(unmutated))
    for side in (pair.ref, pair.cand):
        sched = out()
        side.pool.apply(sched)
        EDITS[mutation](sched.num_scheduled_tokens, random.Random(0))
        sched.new_requests[0].prompt_token_ids.append(23)
        problems = batch_differences(want_batch, side.handle.batch_to_numpy(side.pool.prepare(sched)))
        assert not problems, f"{side.handle.name}: " + "\n".join(problems)
        assert side.pool.snapshot() == want.snapshot(), side.handle.name
