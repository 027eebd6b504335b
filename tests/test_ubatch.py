"""Micro-batches (spec/ubatch.py, fast/ubatch.py): the split of a prepared batch in two, as vLLM 0.32's DBO.

Hand cases state their expectations as derived by hand from the rules (comments show the arithmetic); random
reference-scheduler runs check spec against fast field by field, and the attention property: each half's
paged attention is the whole batch's attention on the half's tokens.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
import torch

import fast
import fast.ubatch
import spec
from conformance.differential import one_torch_thread
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from conformance.tolerance import assert_attention_close, round_to, spec_in_dtype
from fast.runtime import HostSyncCounter, interpret
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.cross_attention import CrossInputs
from spec.mamba import StateIndices
from spec.types import PAD_SLOT_ID, BatchInputs
from spec.ubatch import MicroBatch, UbatchSplitError, host_query_lens, should_split, split_batch

BLOCK = 4
CONFIG = WorkerConfig(8, 64, 64, 100, (KVCacheGroup(BLOCK, 64), KVCacheGroup(BLOCK, 64, sliding_window=3)))
CACHE_SLOT_LIMIT = 1 << 18  # random scenarios' "huge" groups (2**31 slots) are left out of the attention check
SPLITS = {"spec": split_batch, "fast": fast.ubatch.split_batch}


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _pool(side: str) -> Any:
    return spec.RequestStatePool(CONFIG) if side == "spec" else fast.RequestStatePool(CONFIG)


def _blocks(first: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (tuple(range(first, first + n)), tuple(range(first, first + n)))  # both groups alike


def _three_decodes_and_a_prefill(side: str, pad_to: int | None = 16) -> tuple[Any, BatchInputs, SchedulerOutput]:
    """a, b, c: 5-token prompts run, then one decode each (num_computed 5); q: a 10-token prefill.
    Batch order (by tokens): a, b, c, q; query_start_loc [0, 1, 2, 3, 13]; seq_lens [6, 6, 6, 10]."""
    pool = _pool(side)
    first = SchedulerOutput(
        new_requests=tuple(NewRequest(r, (1, 2, 3, 4, 5), _blocks(1 + 2 * i, 2)) for i, r in enumerate("abc")),
        num_scheduled_tokens={"a": 5, "b": 5, "c": 5},
    )
    pool.apply(first)
    batch = pool.prepare(first)
    pool.record_sampled(batch, np.array([7, 7, 7]) if side == "spec" else torch.tensor([7, 7, 7]))
    step = SchedulerOutput(
        new_requests=(NewRequest("q", tuple(range(1, 11)), _blocks(20, 3)),),
        cached_requests=tuple(CachedRequest(r, 5) for r in "abc"),
        num_scheduled_tokens={"q": 10, "a": 1, "b": 1, "c": 1},
    )
    pool.apply(step)
    return pool, pool.prepare(step, pad_to), step


def _assert_half(
    half: MicroBatch,
    requests: tuple[int, int],
    tokens: tuple[int, int],
    req_ids: tuple[str, ...],
    qsl: list[int],
    seq_lens: list[int],
    num_tokens: int,
) -> None:
    assert (half.request_slice.start, half.request_slice.stop) == requests
    assert (half.token_slice.start, half.token_slice.stop) == tokens
    assert half.req_ids == req_ids
    assert _np(half.query_start_loc).tolist() == qsl
    assert _np(half.seq_lens).tolist() == seq_lens
    assert _np(half.num_scheduled_tokens).tolist() == np.diff(qsl)[: len(req_ids)].tolist()
    assert (half.num_tokens, half.num_tokens_padded) == (num_tokens, tokens[1] - tokens[0])
    assert _np(half.query_start_loc).dtype == np.int32 and _np(half.seq_lens).dtype == np.int32


@pytest.mark.parametrize("side", SPLITS)
def test_straddling_request_is_in_both_halves_by_hand(side: str) -> None:
    _, batch, _ = _three_decodes_and_a_prefill(side)
    first, second = SPLITS[side](batch)
    # T = 16, split at 16 // 2 = 8, inside q's tokens [3, 13). First half: rows searchsorted([0,1,2,3,13], 8,
    # left) = [0, 4); q keeps 8 - 3 = 5 tokens (13 clamped to 8); its seq_len 10 - (13 - 8) = 5.
    _assert_half(first, (0, 4), (0, 8), ("a", "b", "c", "q"), [0, 1, 2, 3, 8], [6, 6, 6, 5], 8)
    # second: from searchsorted(.., 8, right) - 1 = 3 (q) to num_reqs_padded = 4; offsets [3, 13] - 8 clamped
    # to [0, 8] = [0, 5]; q's seq_len whole (its first 5 tokens ran in the first half); 13 - 8 = 5 real tokens
    _assert_half(second, (3, 4), (8, 16), ("q",), [0, 5], [10], 5)
    # q holds blocks 20, 21, 22 (block size 4) and starts at 0: positions 5..9 -> slots 21*4+1 .. 22*4+1
    assert _np(second.positions).tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert _np(second.slot_mappings[0]).tolist() == [85, 86, 87, 88, 89] + [PAD_SLOT_ID] * 3
    # first half: the decodes at position 5, entry 1 of their tables (a's blocks 1, 2 -> slot 2*4+1 = 9; b's 3, 4
    # -> 17; c's 5, 6 -> 25), then q's positions 0..4 (block 20 -> 80..83, block 21 -> 84)
    assert _np(first.slot_mappings[1]).tolist() == [9, 17, 25, 80, 81, 82, 83, 84]
    assert _np(first.index_mapping).tolist() == _np(batch.index_mapping).tolist()
    assert _np(second.index_mapping).tolist() == _np(batch.index_mapping)[3:].tolist()
    assert _np(second.block_tables[0])[0, :3].tolist() == [20, 21, 22]


@pytest.mark.parametrize("side", SPLITS)
def test_split_point_on_a_request_boundary_splits_no_request(side: str) -> None:
    _, batch, _ = _three_decodes_and_a_prefill(side)
    first, second = SPLITS[side](batch, 3)  # q starts at token 3
    # first: searchsorted([0,1,2,3,13], 3, left) = 3 -> a, b, c; second: searchsorted(.., 3, right) - 1 = 3 -> q
    _assert_half(first, (0, 3), (0, 3), ("a", "b", "c"), [0, 1, 2, 3], [6, 6, 6], 3)
    _assert_half(second, (3, 4), (3, 16), ("q",), [0, 10], [10], 10)


@pytest.mark.parametrize("side", SPLITS)
def test_decode_only_batch_splits_between_requests(side: str) -> None:
    pool = _pool(side)
    names = "abcdef"
    first = SchedulerOutput(
        new_requests=tuple(NewRequest(r, (1, 2, 3), _blocks(1 + 2 * i, 2)) for i, r in enumerate(names)),
        num_scheduled_tokens=dict.fromkeys(names, 3),
    )
    pool.apply(first)
    batch = pool.prepare(first)
    pool.record_sampled(batch, np.full(6, 9) if side == "spec" else torch.full((6,), 9))
    step = SchedulerOutput(cached_requests=tuple(CachedRequest(r, 3) for r in names),
                           num_scheduled_tokens=dict.fromkeys(names, 1))  # fmt: skip
    pool.apply(step)
    first_half, second_half = SPLITS[side](pool.prepare(step))
    # 6 one-token rows, T = 6, split 3: rows [0, 3) and [3, 6), offsets [0, 1, 2, 3] each, seq_lens 3 + 1
    _assert_half(first_half, (0, 3), (0, 3), ("a", "b", "c"), [0, 1, 2, 3], [4, 4, 4], 3)
    _assert_half(second_half, (3, 6), (3, 6), ("d", "e", "f"), [0, 1, 2, 3], [4, 4, 4], 3)


@pytest.mark.parametrize("side", SPLITS)
def test_one_long_prefill_is_split_in_two(side: str) -> None:
    pool = _pool(side)
    step = SchedulerOutput(new_requests=(NewRequest("p", tuple(range(1, 13)), _blocks(1, 3)),),
                           num_scheduled_tokens={"p": 12})  # fmt: skip
    pool.apply(step)
    first, second = SPLITS[side](pool.prepare(step))
    # T = 12, split 6: p is in both; first keeps tokens 0..5 (seq_len 12 - (12 - 6) = 6), second 6..11 (12)
    _assert_half(first, (0, 1), (0, 6), ("p",), [0, 6], [6], 6)
    _assert_half(second, (0, 1), (6, 12), ("p",), [0, 6], [12], 6)
    assert _np(second.positions).tolist() == list(range(6, 12))


@pytest.mark.parametrize("side", SPLITS)
def test_second_half_in_padding_holds_the_last_request_with_no_tokens(side: str) -> None:
    pool = _pool(side)
    step = SchedulerOutput(
        new_requests=(NewRequest("a", (1,), _blocks(1, 1)), NewRequest("b", (1, 2), _blocks(2, 1))),
        num_scheduled_tokens={"a": 1, "b": 2},
    )
    pool.apply(step)
    batch = pool.prepare(step, 8)
    first, second = SPLITS[side](batch)
    # T = 8, split 4 past the 3 real tokens: first = rows [0, 2) (searchsorted([0,1,3], 4, left) = 3, capped at
    # 2 rows), tokens [0, 4); second = row min(3 - 1, 2 - 1) = 1 (v2's clamp), offsets [1, 3] - 4 clamped = [0, 0]
    _assert_half(first, (0, 2), (0, 4), ("a", "b"), [0, 1, 3], [1, 2], 3)
    _assert_half(second, (1, 2), (4, 8), ("b",), [0, 0], [2], 0)
    assert _np(second.slot_mappings[0]).tolist() == [PAD_SLOT_ID] * 4
    # v1 refuses to split such a step (its last half is empty), v2 splits it
    assert not should_split(3, 8, uniform_decode=False, prefill_token_threshold=2)
    assert should_split(3, 8, uniform_decode=False, prefill_token_threshold=2, refuse_empty_last=False)


def test_should_split_thresholds_by_hand() -> None:
    # vLLM's defaults: a uniform decode batch from 32 tokens, any other from 512
    assert not should_split(31, 32, uniform_decode=True) and should_split(32, 32, uniform_decode=True)
    assert not should_split(511, 512, uniform_decode=False) and should_split(512, 512, uniform_decode=False)
    assert not should_split(100, 100, uniform_decode=False)  # a mixed batch of 100 tokens stays whole
    # the last half is empty when T // 2 >= num_tokens: 40 real of 80 padded, not 41
    assert not should_split(40, 80, uniform_decode=True) and should_split(41, 80, uniform_decode=True)
    for bad in ({"num_tokens": -1}, {"num_tokens_padded": 2.0}, {"num_tokens": 9, "num_tokens_padded": 8}):
        args = {"num_tokens": 4, "num_tokens_padded": 8, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            should_split(args["num_tokens"], args["num_tokens_padded"], uniform_decode=True)


def _padded_rows_batch(side: str) -> BatchInputs:
    """Two real rows (3 and 2 tokens) and two padded request rows (index_mapping -1, no tokens), T = 8, as a
    batch with CUDA-graph request padding would carry them: every per-request array has 4 rows."""
    to: Any = np.asarray if side == "spec" else torch.from_numpy
    table = np.zeros((4, 4), np.int32)
    table[0, :1], table[1, :1] = 1, 2
    slots = np.array([4, 5, 6, 8, 9, -1, -1, -1], np.int64)
    return BatchInputs(
        req_ids=("a", "b"), index_mapping=to(np.array([0, 1, -1, -1], np.int32)),
        num_scheduled_tokens=to(np.array([3, 2, 0, 0], np.int32)),
        query_start_loc=to(np.array([0, 3, 5, 5, 5], np.int32)), positions=to(np.array([0, 1, 2, 0, 1, 0, 0, 0])),
        input_ids=to(np.array([1, 2, 3, 1, 2, 0, 0, 0])), seq_lens=to(np.array([3, 2, 0, 0], np.int32)),
        logits_indices=to(np.array([2, 4], np.int32)), block_tables=(to(table),), slot_mappings=(to(slots),),
        num_tokens=5, num_tokens_padded=8,
    )  # fmt: skip


@pytest.mark.parametrize("side", SPLITS)
def test_padded_request_rows_are_sliced_with_the_rest(side: str) -> None:
    batch = _padded_rows_batch(side)
    first, second = SPLITS[side](batch)
    # split 4: first rows [0, searchsorted([0,3,5], 4, left) = 2); second from searchsorted(.., right) - 1 = 1
    # to num_reqs_padded = 4, offsets [3, 5, 5, 5] - 4 clamped to [0, 4] = [0, 1, 1, 1]; b cut at 4: 2 - 1 = 1
    _assert_half(first, (0, 2), (0, 4), ("a", "b"), [0, 3, 4], [3, 1], 4)
    _assert_half(second, (1, 4), (4, 8), ("b",), [0, 1, 1, 1], [2, 0, 0], 1)
    assert _np(second.index_mapping).tolist() == [1, -1, -1]
    first, second = SPLITS[side](batch, 6)
    # split 6 past the 5 real tokens: first stop searchsorted(.., 6, left) = 3 (a padded row, as vLLM's); second
    # from min(2, num_reqs - 1) = 1, offsets [3, 5, 5, 5] - 6 clamped to [0, 2] = all 0
    _assert_half(first, (0, 3), (0, 6), ("a", "b"), [0, 3, 5, 5], [3, 2, 0], 5)
    _assert_half(second, (1, 4), (6, 8), ("b",), [0, 0, 0, 0], [2, 0, 0], 0)


def _batch_arrays(batch: BatchInputs) -> list[np.ndarray]:
    return [_np(x).copy() for x in (batch.query_start_loc, batch.seq_lens, batch.positions, *batch.slot_mappings)]


@pytest.mark.parametrize("side", SPLITS)
def test_refusals_name_the_argument_and_change_nothing(side: str) -> None:
    _, batch, step = _three_decodes_and_a_prefill(side)
    before = _batch_arrays(batch)
    split = SPLITS[side]
    lens = host_query_lens(step, batch)
    bad_calls: list[tuple[str, dict[str, Any]]] = [
        ("split_point", {"split_point": -1}),
        ("split_point", {"split_point": 0}),
        ("split_point", {"split_point": 16}),  # the second half would hold no token
        ("split_point", {"split_point": 40}),  # past the batch
        ("split_point", {"split_point": 4.0}),
        ("split_point", {"split_point": True}),
        ("query_lens_np", {"query_lens_np": lens[:3]}),
        ("query_lens_np", {"query_lens_np": lens + 1}),
        ("query_lens_np", {"query_lens_np": lens.astype(np.float64)}),
        ("query_lens_np", {"query_lens_np": np.array([0, 2, 1, 10])}),
    ]
    if side == "spec":  # fast cannot read the device's counts without a sync; spec checks them all
        bad_calls.append(("query_lens_np", {"query_lens_np": np.array([1, 1, 10, 1])}))
    for argument, kwargs in bad_calls:
        with pytest.raises(UbatchSplitError, match=argument) as info:
            split(batch, **kwargs)
        assert info.value.argument == argument
    for record in (StateIndices((None,), (None,), np.zeros(4, bool), None), CrossInputs(lens, lens, lens)):
        with pytest.raises(UbatchSplitError, match=type(record).__name__) as info:
            split(dataclasses.replace(batch, features=(record,)))
        assert info.value.argument == "batch.features"
    empty = dataclasses.replace(batch, req_ids=(), num_tokens=0)
    with pytest.raises(UbatchSplitError, match="no request"):
        split(empty)
    assert all(np.array_equal(a, b) for a, b in zip(_batch_arrays(batch), before, strict=True))
    split(batch)  # a split leaves the batch as it was too: the halves' rebased arrays are new
    assert all(np.array_equal(a, b) for a, b in zip(_batch_arrays(batch), before, strict=True))


def test_fast_split_waits_for_nothing_given_host_counts() -> None:
    _, batch, step = _three_decodes_and_a_prefill("fast")
    with HostSyncCounter() as counted:
        first, second = fast.ubatch.split_batch(batch, query_lens_np=host_query_lens(step, batch))
    assert counted.calls == []
    with HostSyncCounter() as without:  # the documented cost of leaving the host counts out: one read
        fast.ubatch.split_batch(batch)
    assert without.calls == ["cpu", "numpy"]
    assert _np(second.seq_lens).tolist() == [10] and _np(first.seq_lens).tolist() == [6, 6, 6, 5]


# ---- the attention property -------------------------------------------------------------------------------


def _whole_and_halves(
    module: Any, batch: Any, halves: tuple[MicroBatch, ...], query: Any, caches: Any, g: int, window: int | None
) -> tuple[Any, list[Any]]:
    key_cache, value_cache = caches
    kw: dict[str, Any] = {"scale": 0.5, "sliding_window": window}
    whole = module.paged_attention(query, key_cache, value_cache, batch.block_tables[g], batch.seq_lens,
                                   batch.query_start_loc, **kw)  # fmt: skip
    parts = [
        module.paged_attention(
            query[h.token_slice], key_cache, value_cache, h.block_tables[g], h.seq_lens, h.query_start_loc, **kw
        )
        for h in halves
    ]
    return whole, parts


def _random_caches(rng: np.random.Generator, group: KVCacheGroup, heads: int, dim: int) -> tuple[np.ndarray, ...]:
    shape = (group.num_blocks, group.block_size, heads, dim)
    return round_to(rng.standard_normal(shape), "float32"), round_to(rng.standard_normal(shape), "float32")


def _check_attention_property(
    spec_batch: BatchInputs, spec_halves: tuple[MicroBatch, ...], config: WorkerConfig, rng: np.random.Generator,
    fast_batch: BatchInputs | None = None, fast_halves: tuple[MicroBatch, ...] | None = None,
) -> None:  # fmt: skip
    """Per attention group: spec's halves (float64) give the whole batch's output on their tokens, within the
    float64 floor; fast's halves (float32) are within conformance/tolerance.py's rule of spec's whole output."""
    heads, kv_heads, dim = 2, 1, 4
    query = round_to(rng.standard_normal((spec_batch.num_tokens_padded, heads, dim)), "float32")
    for g, group in enumerate(config.kv_groups):
        if group.kind != "attention" or group.num_blocks * group.block_size > CACHE_SLOT_LIMIT:
            continue
        caches = _random_caches(rng, group, kv_heads, dim)
        window = group.sliding_window
        whole, parts = _whole_and_halves(spec, spec_batch, spec_halves, query, caches, g, window)
        merged = np.concatenate(parts)
        n = spec_batch.num_tokens
        assert not merged[n:].any()  # padding rows are zero in every half, as in the whole batch
        assert_attention_close(merged[:n], whole[:n], whole[:n], "float64")
        if fast_batch is None or fast_halves is None:
            continue
        table, seq_lens, qsl = spec_batch.block_tables[g], spec_batch.seq_lens, spec_batch.query_start_loc
        low = spec_in_dtype(
            spec.paged_attention, "float32", (query, *caches), table, seq_lens, qsl, scale=0.5, sliding_window=window
        )
        t = [torch.from_numpy(np.asarray(a, np.float32)) for a in (query, *caches)]
        _, fast_parts = _whole_and_halves(fast, fast_batch, fast_halves, t[0], (t[1], t[2]), g, window)
        fast_merged = torch.cat(fast_parts).double().numpy()
        assert not fast_merged[n:].any()
        assert_attention_close(fast_merged[:n], whole[:n], low[:n], "float32")


@pytest.mark.parametrize("split_point", [None, 3, 10, 13, 15])
def test_attention_of_the_halves_is_the_whole_batch_attention_by_hand(split_point: int | None) -> None:
    # None: split 8 inside q; 3: on q's start; 10: inside q; 13: at the padding's start; 15: inside the padding.
    # Group 1's window of 3 makes the straddling request's second half start past its first keys.
    rng = np.random.default_rng(split_point or 0)
    _, spec_batch, _ = _three_decodes_and_a_prefill("spec")
    _, fast_batch, _ = _three_decodes_and_a_prefill("fast")
    _check_attention_property(spec_batch, split_batch(spec_batch, split_point), CONFIG, rng,
                              fast_batch, fast.ubatch.split_batch(fast_batch, split_point))  # fmt: skip


def test_attention_of_an_all_padding_half_is_zero() -> None:
    _, spec_batch, _ = _three_decodes_and_a_prefill("spec", pad_to=32)  # split 16 > 13 real tokens
    _, fast_batch, _ = _three_decodes_and_a_prefill("fast", pad_to=32)
    halves = split_batch(spec_batch)
    assert halves[1].num_tokens == 0 and _np(halves[1].query_start_loc).tolist() == [0, 0]
    _check_attention_property(spec_batch, halves, CONFIG, np.random.default_rng(1),
                              fast_batch, fast.ubatch.split_batch(fast_batch))  # fmt: skip


def test_triton_interpreter_split_and_attention_match_spec() -> None:
    """One tiny case through the kernels: the pool's prepare, the split and paged attention all in Triton's
    interpreter, against spec's whole-batch attention."""
    _, spec_batch, _ = _three_decodes_and_a_prefill("spec")
    with interpret(True), one_torch_thread():
        _, fast_batch, step = _three_decodes_and_a_prefill("fast")
        halves = fast.ubatch.split_batch(fast_batch, query_lens_np=host_query_lens(step, fast_batch))
        _check_attention_property(spec_batch, split_batch(spec_batch), CONFIG, np.random.default_rng(2),
                                  fast_batch, halves)  # fmt: skip


# ---- random reference-scheduler runs ----------------------------------------------------------------------


def _assert_halves_equal(spec_half: MicroBatch, fast_half: MicroBatch) -> None:
    for name in ("request_slice", "token_slice", "req_ids", "num_tokens", "num_tokens_padded"):
        assert getattr(spec_half, name) == getattr(fast_half, name), name
    for name in ("index_mapping", "num_scheduled_tokens", "query_start_loc", "seq_lens", "positions", "input_ids"):
        want, got = _np(getattr(spec_half, name)), _np(getattr(fast_half, name))
        assert want.dtype == got.dtype and np.array_equal(want, got), name
    for name in ("block_tables", "slot_mappings"):
        for want, got in zip(getattr(spec_half, name), getattr(fast_half, name), strict=True):
            assert want.dtype == _np(got).dtype and np.array_equal(want, _np(got)), name
    assert len(spec_half.features) == len(fast_half.features)
    for want, got in zip(spec_half.features, fast_half.features, strict=True):
        assert np.array_equal(want.mrope_positions, _np(got.mrope_positions))


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_split_alike_and_keep_attention(seed: int) -> None:
    scenario = random_scenario(seed, multimodal=True)
    config = scenario.config
    scheduler = ReferenceScheduler(config, scenario.workload, scenario.knobs, scenario.seed)
    rng, draw = np.random.default_rng(seed), random.Random(seed)
    splits = 0
    with one_torch_thread():
        reference, pool = spec.RequestStatePool(config), fast.RequestStatePool(config)
        for _ in range(12):
            if scheduler.done():
                break
            out = scheduler.schedule()
            reference.apply(out)
            pool.apply(out)
            pad_to = scheduler.pad_to(out)
            spec_batch, fast_batch = reference.prepare(out, pad_to), pool.prepare(out, pad_to)
            if spec_batch.num_reqs and spec_batch.num_tokens_padded >= 2:
                for split_point in (None, draw.randrange(1, spec_batch.num_tokens_padded)):
                    spec_halves = split_batch(spec_batch, split_point)
                    with HostSyncCounter() as counted:
                        fast_halves = fast.ubatch.split_batch(
                            fast_batch, split_point, query_lens_np=host_query_lens(out, fast_batch)
                        )
                    assert counted.calls == []
                    for s, f in zip(spec_halves, fast_halves, strict=True):
                        _assert_halves_equal(s, f)
                    for half in spec_halves:  # rule 8: M-RoPE's columns go with the tokens
                        if spec_batch.mrope_positions is not None:
                            assert np.array_equal(half.mrope_positions, spec_batch.mrope_positions[:, half.token_slice])
                    _check_attention_property(spec_batch, spec_halves, config, rng, fast_batch, fast_halves)
                    splits += 1
            sampled = np.array([draw.randrange(config.vocab_size) for _ in spec_batch.req_ids], np.int64)
            reference.record_sampled(spec_batch, sampled)
            pool.record_sampled(fast_batch, torch.from_numpy(sampled))
            takes = scheduler.sampling_req_ids(out)
            scheduler.update(out, {r: int(t) for r, t in zip(spec_batch.req_ids, sampled, strict=True) if r in takes})
    assert splits > 0
