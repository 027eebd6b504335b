"""Padded batches and captured graphs (spec/classify.py, spec/graphs.py, spec/padding.py, spec/dummy.py), by hand.

Every expectation below is worked out by hand from the rules in those files' docstrings (and vLLM 0.32's
dispatcher they follow), never read back from the code under test. Each pool test runs on spec, fast in host
mode, and (tiny) fast through Triton's interpreter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fast
import spec
from conformance.backends import BackendHandle, fast_handle
from shadow.compare import copy_batch, differing_fields
from spec.classify import classify
from spec.dummy import dummy_batch
from spec.errors import InconsistentSchedulerOutputError
from spec.graphs import BatchDescriptor, CapturedGraphs, check_descriptor, dispatch
from spec.padding_profiles import FLASH_ATTENTION, FLASHINFER, FLASHMLA, PaddingProfile
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

BS = 4  # block size
CONFIG = WorkerConfig(max_num_reqs=8, max_model_len=32, max_num_batched_tokens=64, vocab_size=50,
                      kv_groups=(KVCacheGroup(BS, 40),))  # fmt: skip
WIDTH = CONFIG.max_blocks_per_req(0)  # 8

HANDLES = {
    "spec": lambda: BackendHandle("spec", spec),
    "fast": lambda: fast_handle(False),
    "fast-interpret": lambda: fast_handle(True),
}


@pytest.fixture(params=list(HANDLES))
def handle(request: pytest.FixtureRequest) -> BackendHandle:
    return HANDLES[request.param]()


def _np(handle: BackendHandle, x: Any) -> np.ndarray:
    return handle.to_numpy(x)


def _classes(q: list[int], c: list[int], p: list[int], uq: int) -> Any:
    return classify(np.array(q), np.array(c), np.array(p), uq)


# ---- classification ---------------------------------------------------------------------------------------------
def test_prompt_chunk_of_one_plus_k_tokens_is_a_prefill_not_a_uniform_decode() -> None:
    # K = 1: two verification rows (2 tokens, past their prompts) and a 2-token prompt chunk (c=4 < P=10) between them
    got = _classes(q=[2, 2, 2], c=[12, 4, 9], p=[6, 10, 9], uq=2)
    assert got.is_prefilling.tolist() == [False, True, False]
    assert got.is_decode.tolist() == [True, False, True]
    assert got.uniform_decode is False  # V1's shape test says uniform: 6 tokens == 2 * 3 rows
    assert (got.num_decodes, got.num_decode_tokens, got.max_query_len) == (1, 2, 2)  # the chunk ends the decode run


def test_uniform_decode_needs_every_row_exactly_one_plus_k() -> None:
    assert _classes([2, 2], [7, 9], [3, 9], 2).uniform_decode is True  # c == P: the prompt is done
    short = _classes([1, 2], [7, 9], [3, 9], 2)  # a row with fewer drafts: a decode, but not uniform
    assert short.is_decode.tolist() == [True, True] and short.uniform_decode is False
    assert _classes([], [], [], 1).uniform_decode is False  # no rows: nothing to replay as a decode


def test_a_short_prompt_chunk_before_a_verification_takes_both_to_the_prefill_path() -> None:
    # slotmap's order sorts by q: a 2-token chunk (row 0) before a 3-token verification (K = 2): num_decodes = 0
    got = _classes([2, 3], [0, 20], [8, 5], 3)
    assert got.is_decode.tolist() == [False, True]
    assert (got.num_decodes, got.num_decode_tokens) == (0, 0)


# ---- dispatch ---------------------------------------------------------------------------------------------------
SIZES = (1, 2, 4, 8)
UNIFORM3 = _classes([1, 1, 1], [5, 6, 7], [5, 6, 7], 1)  # 3 decodes of 1 token
MIXED3 = _classes([1, 2], [5, 0], [5, 9], 1)  # a decode and a 2-token first chunk


@pytest.mark.parametrize(
    ("mode", "classes", "num_reqs", "want"),
    [
        ("FULL_AND_PIECEWISE", UNIFORM3, 3, BatchDescriptor("FULL", 4, 4, True, 1)),
        ("FULL_AND_PIECEWISE", MIXED3, 2, BatchDescriptor("PIECEWISE", 4, 2, False, 2)),
        ("FULL", MIXED3, 2, BatchDescriptor("FULL", 4, 4, False, 2)),  # mixed FULL: rows min(4, max_num_reqs)
        ("FULL", UNIFORM3, 3, BatchDescriptor("FULL", 4, 4, False, 1)),  # no separate decode routine: not uniform
        ("FULL_DECODE_ONLY", UNIFORM3, 3, BatchDescriptor("FULL", 4, 4, True, 1)),
        ("FULL_DECODE_ONLY", MIXED3, 2, BatchDescriptor("NONE", 3, 2, False, 2)),
        ("PIECEWISE", UNIFORM3, 3, BatchDescriptor("PIECEWISE", 4, 3, False, 1)),
        ("NONE", UNIFORM3, 3, BatchDescriptor("NONE", 3, 3, False, 1)),
    ],
)
def test_dispatch_by_mode(mode: str, classes: Any, num_reqs: int, want: BatchDescriptor) -> None:
    assert dispatch(CapturedGraphs(SIZES, max_num_reqs=4, mode=mode), 3, num_reqs, classes) == want


def test_dispatch_past_the_largest_graph_and_past_max_num_reqs_runs_eager() -> None:
    graphs = CapturedGraphs(SIZES, max_num_reqs=4, mode="FULL_AND_PIECEWISE")
    nine = _classes([9], [0], [9], 1)
    assert dispatch(graphs, 9, 1, nine) == BatchDescriptor("NONE", 9, 1, False, 9)
    # FULL graph of 8 tokens captured for min(8, 2) = 2 requests: 3 requests do not fit, and FULL has no fallback
    three = _classes([2, 2, 3], [0, 0, 0], [5, 5, 5], 1)
    assert dispatch(CapturedGraphs((8,), max_num_reqs=2, mode="FULL"), 7, 3, three).mode == "NONE"


def test_fasts_dispatcher_answers_each_question_by_its_own_counts_graphs_and_classes() -> None:
    """fast's Dispatcher keeps the last answer: a question differing in any one part gets that question's answer
    (the expected descriptors are the hand-worked ones of the tests above)."""
    full = CapturedGraphs(SIZES, max_num_reqs=4, mode="FULL")
    mixed = CapturedGraphs(SIZES, max_num_reqs=4, mode="FULL_DECODE_ONLY")
    nine = _classes([9], [0], [9], 1)
    ask = fast.graphs.Dispatcher()
    questions = [
        (full, 3, 3, UNIFORM3, BatchDescriptor("FULL", 4, 4, False, 1)),
        (full, 3, 3, UNIFORM3, BatchDescriptor("FULL", 4, 4, False, 1)),  # asked again: the same answer
        (mixed, 3, 3, UNIFORM3, BatchDescriptor("FULL", 4, 4, True, 1)),  # other graphs, equal counts and classes
        (mixed, 3, 2, MIXED3, BatchDescriptor("NONE", 3, 2, False, 2)),  # other classes and rows
        (mixed, 3, 2, UNIFORM3, BatchDescriptor("FULL", 4, 4, True, 1)),  # other classes alone
        (full, 9, 1, nine, BatchDescriptor("NONE", 9, 1, False, 9)),
        (full, 9, 1, nine, BatchDescriptor("NONE", 9, 1, False, 9)),
        (full, 8, 1, nine, BatchDescriptor("FULL", 8, 4, False, 9)),  # the same classes object, fewer tokens
        (full, 8, 5, nine, BatchDescriptor("NONE", 8, 5, False, 9)),  # more rows than the FULL graph of 8 holds
    ]
    for graphs, num_tokens, num_reqs, classes, want in questions:
        assert ask(graphs, num_tokens, num_reqs, classes) == want, (graphs.mode, num_tokens, num_reqs)
        assert dispatch(graphs, num_tokens, num_reqs, classes) == want


def test_dispatch_uniform_with_drafts_pads_rows_to_tokens_over_one_plus_k() -> None:
    # uq = 2; sizes 2, 3, 4, 8: size 3 is no uniform-decode graph (2 does not divide it), so 2 rows of 2 tokens pad
    # to size 4 = 2 rows exactly; one row of 2 tokens fits size 2 = 1 row
    graphs = CapturedGraphs((2, 3, 4, 8), max_num_reqs=8, mode="FULL_DECODE_ONLY", uniform_decode_query_len=2)
    assert dispatch(graphs, 4, 2, _classes([2, 2], [5, 5], [5, 5], 2)) == BatchDescriptor("FULL", 4, 2, True, 2)
    assert dispatch(graphs, 2, 1, _classes([2], [5], [5], 2)) == BatchDescriptor("FULL", 2, 1, True, 2)
    # 3 rows, 6 tokens: size 8 = 4 rows of 2, the 4th row padding
    assert dispatch(graphs, 6, 3, _classes([2] * 3, [5] * 3, [5] * 3, 2)) == BatchDescriptor("FULL", 8, 4, True, 2)
    # the 1 + K-token prompt chunk: the same shape, not a uniform decode, so no FULL_DECODE_ONLY graph
    chunk = _classes([2, 2], [5, 2], [5, 9], 2)
    assert dispatch(graphs, 4, 2, chunk) == BatchDescriptor("NONE", 4, 2, False, 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capture_sizes": (4, 2)},  # not sorted
        {"capture_sizes": (0, 2)},  # not positive
        {"capture_sizes": (2, 2, 4)},  # repeated
        {"capture_sizes": (2, 4), "mode": "FULL_GRAPH"},  # unknown mode
        {"capture_sizes": (2, 4), "max_num_reqs": 0},
        {"capture_sizes": (2, 4), "uniform_decode_query_len": 0},
        {"capture_sizes": (), "mode": "FULL"},
        {"capture_sizes": (2.0, 4)},
    ],
)
def test_bad_capture_config_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="CapturedGraphs"):
        CapturedGraphs(**{"max_num_reqs": 4, **kwargs})


def test_a_descriptor_smaller_than_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        check_descriptor(BatchDescriptor("FULL", 4, 4, False, 1), 5, 2)
    with pytest.raises(ValueError, match="num_reqs"):
        check_descriptor(BatchDescriptor("FULL", 8, 2, False, 1), 5, 3)
    with pytest.raises(ValueError, match="mode"):
        check_descriptor(BatchDescriptor("FULL_AND_PIECEWISE", 8, 4, False, 1), 5, 3)
    with pytest.raises(ValueError, match="pad_seq_len"):
        PaddingProfile("x", -1)


# ---- padded batches from a pool ---------------------------------------------------------------------------------
def _new(req_id: str, prompt_len: int, blocks: tuple[int, ...], computed: int = 0) -> NewRequest:
    return NewRequest(req_id, tuple(range(1, prompt_len + 1)), (blocks,), computed)


BIG = SchedulerOutput(  # four prompts of 4 tokens: one block each (blocks 1..4)
    new_requests=tuple(_new(r, 4, (i + 1,)) for i, r in enumerate("abcd")),
    num_scheduled_tokens={r: 4 for r in "abcd"},
)


def _decode_after_big(*, finished: str = "bcd") -> SchedulerOutput:
    """'a' decodes its 5th token (position 4, block 5 appended); the others finish."""
    return SchedulerOutput(
        cached_requests=(CachedRequest("a", 4, ((5,),)),),
        num_scheduled_tokens={"a": 1},
        finished_req_ids=frozenset(finished),
    )


def test_small_padded_batch_after_a_big_one_has_zero_rows_and_pad_slots(handle: BackendHandle) -> None:
    graphs = CapturedGraphs((1, 2, 4, 8, 16), max_num_reqs=4, mode="FULL")
    pool = handle.make_pool(CONFIG)
    pool.apply(BIG)
    big = pool.prepare(BIG, graphs=graphs)  # 16 tokens: FULL graph of 16 tokens, min(16, 4) = 4 rows, all real
    assert big.descriptor == BatchDescriptor("FULL", 16, 4, False, 4)
    pool.record_sampled(big, handle.asarray(np.array([7, 7, 7, 7])))
    small = _decode_after_big()
    pool.apply(small)
    b = handle.batch_to_numpy(pool.prepare(small, graphs=graphs))
    assert b["descriptor"] == BatchDescriptor("FULL", 1, 1, False, 1)  # size 1: min(1, 4) = 1 row, nothing padded
    # with a FULL graph captured at 4 tokens (and 16) the decode pads to 4 tokens and min(4, 4) = 4 rows
    pool2 = handle.make_pool(CONFIG)
    pool2.apply(BIG)
    pool2.record_sampled(pool2.prepare(BIG), handle.asarray(np.array([7, 7, 7, 7])))
    pool2.apply(small)
    b = handle.batch_to_numpy(pool2.prepare(small, graphs=CapturedGraphs((4, 16), max_num_reqs=4, mode="FULL")))
    assert b["descriptor"] == BatchDescriptor("FULL", 4, 4, False, 1)
    assert b["req_ids"] == ("a",) and b["num_tokens"] == 1 and b["num_tokens_padded"] == 4
    assert b["index_mapping"].tolist() == [0, -1, -1, -1]
    assert b["num_scheduled_tokens"].tolist() == [1, 0, 0, 0]
    assert b["query_start_loc"].tolist() == [0, 1, 1, 1, 1]  # padded rows: length 0 at the real count
    assert b["seq_lens"].tolist() == [5, 0, 0, 0]  # FlashAttention's profile (the default): 0
    table = b["block_tables"][0]
    assert table.shape == (4, WIDTH) and table[0].tolist() == [1, 5] + [0] * (WIDTH - 2)
    assert not table[1:].any()  # rows 'b', 'c', 'd' held blocks 2..4 in the big batch: none left here
    assert b["positions"].tolist() == [4, 0, 0, 0] and b["input_ids"].tolist() == [7, 0, 0, 0]
    assert b["slot_mappings"][0].tolist() == [5 * BS + 0, -1, -1, -1]  # position 4: block 5, offset 0
    assert b["logits_indices"].tolist() == [0]  # per real row


def test_stale_rows_in_a_reused_buffer_are_overwritten(handle: BackendHandle) -> None:
    # one pool: a padded 3-row batch, then a padded 1-row batch in the same buffers: rows 1..3 hold padding again
    graphs = CapturedGraphs((4, 16), max_num_reqs=4, mode="FULL")
    pool = handle.make_pool(CONFIG)
    three = SchedulerOutput(new_requests=tuple(_new(r, 1, (i + 1,)) for i, r in enumerate("abc")),
                            num_scheduled_tokens={r: 1 for r in "abc"})  # fmt: skip
    pool.apply(three)
    batch = pool.prepare(three, graphs=graphs)
    first = handle.batch_to_numpy(batch)
    assert first["index_mapping"].tolist() == [0, 1, 2, -1] and first["block_tables"][0][:3, 0].tolist() == [1, 2, 3]
    pool.record_sampled(batch, handle.asarray(np.array([9, 9, 9])))
    one = SchedulerOutput(cached_requests=(CachedRequest("c", 1),), num_scheduled_tokens={"c": 1},
                          finished_req_ids=frozenset("ab"))  # fmt: skip
    pool.apply(one)
    b = handle.batch_to_numpy(pool.prepare(one, graphs=graphs))
    assert b["index_mapping"].tolist() == [2, -1, -1, -1]
    assert b["block_tables"][0][:, 0].tolist() == [3, 0, 0, 0] and not b["block_tables"][0][1:].any()
    assert b["seq_lens"].tolist() == [2, 0, 0, 0] and b["query_start_loc"].tolist() == [0, 1, 1, 1, 1]
    assert b["slot_mappings"][0].tolist() == [3 * BS + 1, -1, -1, -1]


@pytest.mark.parametrize(("profile", "pad"), [(FLASH_ATTENTION, 0), (FLASHINFER, 0), (FLASHMLA, 1)])
def test_each_profile_pads_seq_lens_with_its_value(profile: PaddingProfile, pad: int) -> None:
    for h in (BackendHandle("spec", spec), fast_handle(False)):
        pool = h.make_pool(CONFIG)
        sched = SchedulerOutput(new_requests=(_new("a", 3, (1,)),), num_scheduled_tokens={"a": 3})
        pool.apply(sched)
        b = h.batch_to_numpy(pool.prepare(sched, graphs=CapturedGraphs((8,), max_num_reqs=3, mode="FULL",
                                                                        profile=profile)))  # fmt: skip
        assert b["seq_lens"].tolist() == [3, pad, pad]  # rows min(8, 3) = 3
        assert b["query_start_loc"].tolist() == [0, 3, 3, 3] and not b["block_tables"][0][1:].any()


def test_prompt_chunk_of_one_token_is_not_replayed_as_a_uniform_decode(handle: BackendHandle) -> None:
    # K = 0: 'a' decodes (1 token, past its prompt) and 'b' prefills its prompt's last token (1 token, c=3 < P=4):
    # every row schedules 1 token, the V1 shape of a uniform decode; by progress it is not one
    pool = handle.make_pool(CONFIG)
    first = SchedulerOutput(
        new_requests=(_new("a", 2, (1,)), _new("b", 4, (2,))), num_scheduled_tokens={"a": 2, "b": 3}
    )
    pool.apply(first)
    pool.record_sampled(pool.prepare(first), handle.asarray(np.array([5, 5])))
    step = SchedulerOutput(cached_requests=(CachedRequest("a", 2), CachedRequest("b", 3)),
                           num_scheduled_tokens={"a": 1, "b": 1})  # fmt: skip
    pool.apply(step)
    graphs = CapturedGraphs((2, 4), max_num_reqs=4, mode="FULL_DECODE_ONLY")
    b = handle.batch_to_numpy(pool.prepare(step, graphs=graphs))
    assert b["row_classes.is_prefilling"].tolist() == [False, True]
    assert b["row_classes.uniform_decode"] is False
    assert b["descriptor"] == BatchDescriptor("NONE", 2, 2, False, 1)  # no decode graph for it: eager
    assert b["index_mapping"].tolist() == [0, 1] and b["query_start_loc"].tolist() == [0, 1, 2]


def test_an_earlier_batch_of_the_same_rows_and_lengths_is_told_apart_by_its_padding(handle: BackendHandle) -> None:
    # a one-draft step whose draft is rejected, then a plain decode: both batches hold 'a' in row 0 at seq_len 2, so
    # only the graph the decode was padded for tells the first batch apart: recording it again is refused on both
    # backends (found by the invalid suite: spec took it for a copy of the last batch, fast refused it)
    pool = handle.make_pool(CONFIG)
    first = SchedulerOutput(new_requests=(_new("a", 1, (1,)),), num_scheduled_tokens={"a": 2},
                            scheduled_spec_decode_tokens={"a": (7,)})  # fmt: skip
    pool.apply(first)
    old = pool.prepare(first)
    pool.record_sampled(old, handle.asarray(np.array([[5, -1]])))  # the draft rejected: 1 token kept
    step = SchedulerOutput(cached_requests=(CachedRequest("a", 1),), num_scheduled_tokens={"a": 1})
    pool.apply(step)
    batch = pool.prepare(step, graphs=CapturedGraphs((2, 4), max_num_reqs=2, mode="FULL", uniform_decode_query_len=2))
    assert _np(handle, old.seq_lens).tolist() == _np(handle, batch.seq_lens)[:1].tolist() == [2]
    before = pool.snapshot()
    with pytest.raises(InconsistentSchedulerOutputError, match="batch"):
        pool.record_sampled(old, handle.asarray(np.array([3])))
    assert pool.snapshot() == before
    pool.record_sampled(batch, handle.asarray(np.array([3])))


def test_pad_to_and_graphs_together_are_refused_and_change_nothing(handle: BackendHandle) -> None:
    pool = handle.make_pool(CONFIG)
    sched = SchedulerOutput(new_requests=(_new("a", 3, (1,)),), num_scheduled_tokens={"a": 3})
    pool.apply(sched)
    before = pool.snapshot()
    with pytest.raises(InconsistentSchedulerOutputError, match="graphs"):
        pool.prepare(sched, 8, graphs=CapturedGraphs((8,), max_num_reqs=2))
    with pytest.raises(InconsistentSchedulerOutputError, match="graphs"):
        pool.prepare(sched, graphs=(8,))  # type: ignore[arg-type]
    assert pool.snapshot() == before
    b = handle.batch_to_numpy(pool.prepare(sched))  # the step still prepares, as if nothing had been asked
    assert b["descriptor"] is None and b["num_tokens_padded"] == 3 and b["seq_lens"].tolist() == [3]


def test_a_refused_pad_to_leaves_the_batch_prepared_with_graphs_as_it_was(handle: BackendHandle) -> None:
    # a decode of 2 tokens (a token and a draft): no decode row for graphs captured for 1-token decodes, but one for
    # the step's own decode length (2). A prepare of the same step with a bad pad_to, which classifies with the
    # step's own, is refused and changes nothing of the batch prepared with the graphs.
    pool = handle.make_pool(CONFIG)
    first = SchedulerOutput(new_requests=(_new("a", 3, (1,)),), num_scheduled_tokens={"a": 3})
    pool.apply(first)
    pool.record_sampled(pool.prepare(first), handle.asarray(np.array([5])))
    drafting = SchedulerOutput(cached_requests=(CachedRequest("a", 3, ((2,),)),), num_scheduled_tokens={"a": 2},
                               scheduled_spec_decode_tokens={"a": (7,)})  # fmt: skip
    pool.apply(drafting)
    batch = pool.prepare(drafting, graphs=CapturedGraphs((2, 4), max_num_reqs=2, mode="FULL"))
    want = copy_batch(handle.batch_to_numpy(batch))
    assert want["row_classes.is_decode"].tolist() == [False]
    for bad in (1.5, 1):
        with pytest.raises(InconsistentSchedulerOutputError, match="pad_to"):
            pool.prepare(drafting, bad)  # type: ignore[arg-type]
        assert not differing_fields(want, handle.batch_to_numpy(batch)), bad


def test_a_batch_without_graphs_is_unpadded_in_its_rows(handle: BackendHandle) -> None:
    pool = handle.make_pool(CONFIG)
    sched = SchedulerOutput(new_requests=(_new("a", 3, (1,)),), num_scheduled_tokens={"a": 3})
    pool.apply(sched)
    b = handle.batch_to_numpy(pool.prepare(sched, 6))
    assert b["descriptor"] is None and b["index_mapping"].tolist() == [0] and b["query_start_loc"].tolist() == [0, 3]
    assert b["slot_mappings"][0].tolist() == [4, 5, 6, -1, -1, -1]  # a DP peer's 6 tokens: PAD past the real 3
    assert b["row_classes.is_prefilling"].tolist() == [True] and b["row_classes.decode_query_len"] == 1


# ---- dummy batches ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graphs", [None, CapturedGraphs((4, 8), max_num_reqs=4, mode="FULL")])
def test_a_dummy_batch_writes_no_cache_byte(graphs: CapturedGraphs | None) -> None:
    batch = dummy_batch(CONFIG, 5, graphs)
    t = 5 if graphs is None else 8  # with graphs: 5 tokens dispatch to the 8-token FULL graph, min(8, 4) = 4 rows
    assert batch.num_tokens == 0 and batch.num_tokens_padded == t and batch.req_ids == ()
    assert batch.slot_mappings[0].tolist() == [-1] * t and not batch.positions.any() and not batch.input_ids.any()
    if graphs is not None:
        assert batch.descriptor == BatchDescriptor("FULL", 8, 4, False, 0)
        assert batch.index_mapping.tolist() == [-1] * 4 and batch.query_start_loc.tolist() == [0] * 5
        assert not batch.block_tables[0].any() and batch.block_tables[0].shape == (4, WIDTH)
    rng = np.random.default_rng(0)
    shape = (40, BS, 2, 8)
    for backend, wrap in ((spec, np.asarray), (fast, __import__("torch").from_numpy)):
        key_cache = rng.standard_normal(shape).astype(np.float32)
        value_cache = rng.standard_normal(shape).astype(np.float32)
        k0, v0 = key_cache.copy(), value_cache.copy()
        key = rng.standard_normal((t, 2, 8)).astype(np.float32)
        k_arg, v_arg = wrap(key_cache), wrap(value_cache)
        backend.write_kv(k_arg, v_arg, wrap(key), wrap(key.copy()), wrap(np.asarray(batch.slot_mappings[0])))
        assert np.array_equal(np.asarray(k_arg), k0) and np.array_equal(np.asarray(v_arg), v0)


def test_a_real_batch_padded_to_a_peers_count_writes_only_its_own_slots() -> None:
    pool = spec.RequestStatePool(CONFIG)
    sched = SchedulerOutput(new_requests=(_new("a", 3, (2,)),), num_scheduled_tokens={"a": 3})
    pool.apply(sched)
    batch = pool.prepare(sched, 7)  # a DP peer runs 7 tokens
    rng = np.random.default_rng(1)
    cache = np.zeros((40, BS, 1, 4), np.float32)
    values = cache.copy()
    key = rng.standard_normal((7, 1, 4)).astype(np.float32)
    spec.write_kv(cache, values, key, key, batch.slot_mappings[0])
    written = np.flatnonzero(cache.reshape(40 * BS, -1).any(axis=1))
    assert written.tolist() == [2 * BS, 2 * BS + 1, 2 * BS + 2]  # block 2, offsets 0..2: the real tokens only


def test_dummy_batch_refuses_a_bad_count() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        dummy_batch(CONFIG, -1)


# ---- the model kinds' padded rows (Feature.pad) -----------------------------------------------------------------
def test_feature_records_pad_their_rows_by_hand() -> None:
    from spec.cross_attention import CrossAttention, CrossInputs
    from spec.mamba import Mamba, StateIndices
    from spec.padding import pad_rows

    mamba_group = KVCacheGroup(32, 9, kind="mamba", num_speculative_blocks=1)
    hybrid = WorkerConfig(8, 32, 64, 50, kv_groups=(KVCacheGroup(4, 40), mamba_group))
    record = StateIndices(
        mamba_state_indices=(None, np.array([[3, 4], [5, -1]], np.int32)),
        mamba_prev_state_indices=(None, np.array([2, -1], np.int32)),
        is_prefilling=np.array([True, False]),
        num_accepted_tokens=np.array([2, 1], np.int32),
    )
    got = Mamba(hybrid).pad(record, 4, pad_rows)
    assert got.mamba_state_indices[0] is None and got.mamba_prev_state_indices[0] is None
    assert got.mamba_state_indices[1].tolist() == [[3, 4], [5, -1], [-1, -1], [-1, -1]]
    assert got.mamba_prev_state_indices[1].tolist() == [2, -1, -1, -1]
    assert got.is_prefilling.tolist() == [True, False, False, False]
    assert got.num_accepted_tokens.tolist() == [2, 1, 1, 1]

    cross = WorkerConfig(8, 32, 64, 50, kv_groups=(KVCacheGroup(4, 40), KVCacheGroup(4, 40, kind="cross_attention")),
                         max_encoder_len=12)  # fmt: skip
    slots = np.array([8, 9, 10], np.int64)
    padded = CrossAttention(cross).pad(
        CrossInputs(np.array([3], np.int32), np.array([3], np.int32), slots), 3, pad_rows
    )
    assert padded.encoder_seq_lens.tolist() == [3, 0, 0] and padded.scheduled_encoder_lens.tolist() == [3, 0, 0]
    assert padded.cross_slot_mapping.tolist() == [8, 9, 10]  # per encoder token written: nothing to pad
