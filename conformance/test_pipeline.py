"""The pipeline's semantics through the public API, once per backend (`--backend`).

Expected values come from the articles or are derived here from the block ids the test hands out,
never from the code under test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conformance.backends import BackendHandle
from conformance.driving import run, step
from conformance.examples import A_PROMPT, B_SAMPLED, worked_example
from conformance.tolerance import assert_attention_close
from shadow.compare import batch_differences, copy_batch
from spec import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    BlockIdError,
    CachedRequest,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
)

INDEX, TOKEN = np.int32, np.int64


def test_worked_example_from_the_articles(backend: BackendHandle) -> None:
    ex = worked_example()
    pool = backend.make_pool(ex.config)
    step(backend, pool, ex.step1, sampled={"B": B_SAMPLED})
    assert pool.row_of("A") == 6 and pool.row_of("B") == 7
    batch = step(backend, pool, ex.step2)

    assert batch["req_ids"] == ("B", "A")
    np.testing.assert_array_equal(batch["index_mapping"], [7, 6])
    np.testing.assert_array_equal(batch["num_scheduled_tokens"], [1, 8])
    np.testing.assert_array_equal(batch["query_start_loc"], [0, 1, 9])
    np.testing.assert_array_equal(batch["positions"], [31, *range(16, 24)])
    np.testing.assert_array_equal(batch["seq_lens"], [32, 24])
    np.testing.assert_array_equal(batch["logits_indices"], [0, 8])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [207, *range(704, 712)])
    np.testing.assert_array_equal(batch["input_ids"], [B_SAMPLED, *A_PROMPT[16:24]])
    np.testing.assert_array_equal(batch["block_tables"][0][:, :2], [[37, 12], [81, 44]])
    assert batch["num_tokens"] == batch["num_tokens_padded"] == 9


def test_batch_arrays_have_the_documented_dtypes(backend: BackendHandle) -> None:
    ex = worked_example()
    pool = backend.make_pool(ex.config)
    batch = step(backend, pool, ex.step1)
    for name in ("index_mapping", "num_scheduled_tokens", "query_start_loc", "seq_lens", "logits_indices"):
        assert batch[name].dtype == INDEX, name
    assert batch["positions"].dtype == TOKEN and batch["input_ids"].dtype == TOKEN
    assert batch["block_tables"][0].dtype == np.int32 and batch["slot_mappings"][0].dtype == np.int64


def _expected_slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def test_several_groups_with_different_block_sizes(backend: BackendHandle) -> None:
    groups = (KVCacheGroup(16, 64), KVCacheGroup(5, 200), KVCacheGroup(1, 300))
    config = WorkerConfig(4, 40, 64, 500, groups)
    prompt = tuple(range(10, 30))  # 20 tokens
    tables = ((3, 9), (7, 2, 11, 5), tuple(range(100, 120)))
    pool = backend.make_pool(config)
    batch = step(
        backend, pool, SchedulerOutput(new_requests=(NewRequest("x", prompt, tables),), num_scheduled_tokens={"x": 20})
    )
    for g, group in enumerate(groups):
        expected = _expected_slots(list(tables[g]), range(20), group.block_size)
        np.testing.assert_array_equal(batch["slot_mappings"][g], expected)
        assert batch["block_tables"][g].shape == (1, config.max_blocks_per_req(g))
        np.testing.assert_array_equal(batch["block_tables"][g][0, : len(tables[g])], tables[g])
        assert (batch["block_tables"][g][0, len(tables[g]) :] == NULL_BLOCK_ID).all()


def test_sliding_window_group_with_null_early_entries(backend: BackendHandle) -> None:
    # Window 8, block 4: a query at position 19 reads positions 12..19 = blocks 3..4; blocks 0..2 may be null.
    groups = (KVCacheGroup(4, 64), KVCacheGroup(4, 64, sliding_window=8))
    config = WorkerConfig(2, 32, 32, 100, groups)
    prompt = tuple(range(1, 21))
    full = tuple(range(10, 15))
    windowed = (NULL_BLOCK_ID, NULL_BLOCK_ID, NULL_BLOCK_ID, 31, 32)
    pool = backend.make_pool(config)
    sched = SchedulerOutput(
        new_requests=(NewRequest("w", prompt, (full, windowed), num_computed_tokens=19),),  # prefix hit
        num_scheduled_tokens={"w": 1},
    )
    batch = step(backend, pool, sched)
    np.testing.assert_array_equal(batch["positions"], [19])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [14 * 4 + 3])
    np.testing.assert_array_equal(batch["slot_mappings"][1], [32 * 4 + 3])
    np.testing.assert_array_equal(batch["block_tables"][1][0, :5], windowed)
    assert pool.snapshot()[0].block_ids[1] == windowed


def _window_reuse_pool(backend: BackendHandle) -> tuple[Any, SchedulerOutput]:
    """Window 8, block 4: "r" holds 12 tokens in blocks (5, 6, 7); its next query (position 12) reads 5..12."""
    config = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(4, 16, sliding_window=8),))
    pool = backend.make_pool(config)
    prefill = SchedulerOutput(new_requests=(NewRequest("r", tuple(range(1, 13)), ((5, 6, 7),)),),
                              num_scheduled_tokens={"r": 12})  # fmt: skip
    step(backend, pool, prefill, {"r": 13})
    return pool, prefill


def test_a_block_the_window_released_may_come_back_to_the_same_request(backend: BackendHandle) -> None:
    # Position 12 reads positions 5..12, so entry 0 (positions 0..3) is released: vLLM's allocator hands
    # its block straight back, and the worker's append-only table lists 5 twice, once released.
    pool, _ = _window_reuse_pool(backend)
    batch = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("r", 12, ((5,),)),),
                                                num_scheduled_tokens={"r": 1}))  # fmt: skip
    np.testing.assert_array_equal(batch["slot_mappings"][0], [5 * 4 + 0])  # logical block 3, offset 0
    np.testing.assert_array_equal(batch["block_tables"][0][0, :4], [5, 6, 7, 5])
    assert pool.snapshot()[0].block_ids == ((5, 6, 7, 5),)
    for position in (13, 14, 15):  # the decodes that follow write the reused block; entry 0 stays released
        batch = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("r", position, None),),
                                                    num_scheduled_tokens={"r": 1}))  # fmt: skip
        np.testing.assert_array_equal(batch["slot_mappings"][0], [5 * 4 + position % 4])


@pytest.mark.parametrize(
    ("num_computed", "new_ids", "why"),
    [
        (12, (6,), "entry 1 (positions 4..7) is still read at position 12"),
        (12, (8, 8), "two appended entries"),
        (8, (5,), "position 8 reads 1..8: entry 0 is not released yet"),
    ],
)
def test_a_block_twice_among_live_entries_is_refused(
    backend: BackendHandle, num_computed: int, new_ids: tuple[int, ...], why: str
) -> None:
    pool, _ = _window_reuse_pool(backend)
    before = pool.snapshot()
    sched = SchedulerOutput(cached_requests=(CachedRequest("r", num_computed, (new_ids,)),),
                            num_scheduled_tokens={"r": 13 - num_computed})  # fmt: skip
    with pytest.raises(BlockIdError, match="appears twice"):
        pool.apply(sched)
    assert pool.snapshot() == before, why


def test_a_released_duplicate_read_again_is_refused(backend: BackendHandle) -> None:
    # After the reuse is committed, a step that starts early enough to read entry 0 again reads block 5
    # twice (entries 0 and 3): refused, though the same table was accepted by the step before.
    pool, _ = _window_reuse_pool(backend)
    step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("r", 12, ((5,),)),),
                                        num_scheduled_tokens={"r": 1}))  # fmt: skip
    before = pool.snapshot()
    with pytest.raises(BlockIdError, match="appears twice"):
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("r", 4, None),), num_scheduled_tokens={"r": 9}))
    assert pool.snapshot() == before


def test_padding_gives_pad_slots_and_monotone_query_start_loc(backend: BackendHandle) -> None:
    ex = worked_example()
    pool = backend.make_pool(ex.config)
    step(backend, pool, ex.step1)
    batch = step(backend, pool, ex.step2, pad_to=16)
    assert batch["num_tokens"] == 9 and batch["num_tokens_padded"] == 16
    assert (np.diff(batch["query_start_loc"]) >= 0).all() and batch["query_start_loc"][-1] == 9
    assert (batch["slot_mappings"][0][9:] == PAD_SLOT_ID).all()
    assert (batch["positions"][9:] == 0).all() and (batch["input_ids"][9:] == 0).all()
    np.testing.assert_array_equal(batch["slot_mappings"][0][:9], [207, *range(704, 712)])


def test_finished_row_is_reused_lowest_first_with_a_clean_table(backend: BackendHandle) -> None:
    config = WorkerConfig(3, 32, 64, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    news = tuple(NewRequest(r, (5,) * 8, (ids,)) for r, ids in (("a", (1, 2)), ("b", (3, 4)), ("c", (5, 6))))
    step(backend, pool, SchedulerOutput(new_requests=news, num_scheduled_tokens={"a": 8, "b": 8, "c": 8}))
    # a and b finish; the next new request takes row 0 (the lowest free), with a one-block table
    sched = SchedulerOutput(
        new_requests=(NewRequest("d", (7, 7), ((9,),)),),
        num_scheduled_tokens={"d": 2},
        finished_req_ids=frozenset({"a", "b"}),
    )
    batch = step(backend, pool, sched)
    assert pool.row_of("d") == 0
    np.testing.assert_array_equal(batch["block_tables"][0][0], [9] + [NULL_BLOCK_ID] * 7)
    assert [r.req_id for r in pool.snapshot()] == ["d", "c"]


def test_prefix_cache_hit_starts_at_num_computed_tokens(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 32, 64, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    prompt = tuple(range(40, 50))
    shared = (1, 2)  # two full blocks computed by an earlier request, shared
    step(
        backend,
        pool,
        SchedulerOutput(new_requests=(NewRequest("p", prompt, ((*shared, 3),)),), num_scheduled_tokens={"p": 10}),
    )
    hit = NewRequest("q", prompt, ((*shared, 4),), num_computed_tokens=8)
    batch = step(backend, pool, SchedulerOutput(new_requests=(hit,), num_scheduled_tokens={"q": 2}))
    np.testing.assert_array_equal(batch["positions"], [8, 9])
    np.testing.assert_array_equal(batch["input_ids"], prompt[8:10])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [16, 17])
    np.testing.assert_array_equal(batch["seq_lens"], [10])


def test_resume_after_preemption_replaces_a_longer_table(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 32, 64, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    prompt = tuple(range(1, 11))
    steps = [
        SchedulerOutput(new_requests=(NewRequest("r", prompt, ((5, 6, 7),)),), num_scheduled_tokens={"r": 10}),
        SchedulerOutput(cached_requests=(CachedRequest("r", 10),), num_scheduled_tokens={"r": 1}),
        # preempted for a step (not scheduled), then resumed: recompute all 11 known tokens on new blocks
        SchedulerOutput(),
        SchedulerOutput(
            cached_requests=(CachedRequest("r", 0, ((9, 8, 10),), resumed=True),), num_scheduled_tokens={"r": 11}
        ),
    ]
    batches = run(backend, pool, steps)
    last = batches[-1]
    np.testing.assert_array_equal(last["positions"], range(11))
    np.testing.assert_array_equal(last["slot_mappings"][0], _expected_slots([9, 8, 10], range(11), 4))
    np.testing.assert_array_equal(last["block_tables"][0][0], [9, 8, 10] + [NULL_BLOCK_ID] * 5)
    assert pool.snapshot()[0].block_ids == ((9, 8, 10),)
    # the resumed step reached the end of the known tokens: its sample was recorded
    assert len(pool.snapshot()[0].token_ids) == 12


def test_mid_prefill_rows_discard_their_sample(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 32, 64, 100, (KVCacheGroup(4, 32),))
    pool = backend.make_pool(config)
    sched = SchedulerOutput(
        new_requests=(NewRequest("m", tuple(range(12)), ((1, 2, 3),)),), num_scheduled_tokens={"m": 5}
    )
    step(backend, pool, sched, sampled={"m": 99})
    assert pool.snapshot()[0].token_ids == tuple(range(12))


def _dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA attention over one request's contiguous keys, in q's dtype, written out independently."""
    group = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape, q.dtype)
    for h in range(q.shape[1]):
        logits = q[:, h] @ k[:, h // group].T * scale  # [q, k]
        logits[np.arange(k.shape[0])[None, :] > q_pos[:, None]] = -np.inf
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, h] = (w / w.sum(-1, keepdims=True)) @ v[:, h // group]
    return out


def _attention_after_writes_matches_dense(
    backend: BackendHandle,
    seed: int,
    key_gain: float,
    empty_cache: np.ndarray,  # [16, 4, 2, 8] each cache before any write: NaN (or its code), so a stray read shows
    scale_args: dict[str, Any],  # write_kv's and paged_attention's cache format and scales
    stored: Callable[[np.ndarray, str], np.ndarray],  # (x, "k" or "v") -> what the cache holds for x, float64
) -> None:
    """A prefill chunk and a decode in one batch, GQA 4:2, every key written through slot mappings: attention
    over the caches equals dense attention over what they hold, by the tolerance rule."""
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    config = WorkerConfig(2, 32, 64, 100, (KVCacheGroup(bs, 16),))
    pool = backend.make_pool(config)
    rng = np.random.default_rng(seed)
    seqs = {"d": 9, "p": 7}  # d: 9 tokens known; p: a 7-token prompt
    news = (NewRequest("d", tuple(range(9)), ((3, 11, 6),)), NewRequest("p", tuple(range(7)), ((8, 2),)))
    keys = {r: rng.standard_normal((n, kv_heads, dim)).astype(np.float32) * key_gain for r, n in seqs.items()}
    values = {r: rng.standard_normal((n, kv_heads, dim)).astype(np.float32) for r, n in seqs.items()}
    queries = {r: rng.standard_normal((n, heads, dim)).astype(np.float32) for r, n in seqs.items()}
    k_cache, v_cache = backend.asarray(empty_cache.copy()), backend.asarray(empty_cache.copy())

    def forward(batch: dict, starts: dict[str, int]) -> np.ndarray:
        tok = {
            r: slice(starts[r], starts[r] + int(n))
            for r, n in zip(batch["req_ids"], batch["num_scheduled_tokens"], strict=True)
        }
        order = batch["req_ids"]
        k = np.concatenate([keys[r][tok[r]] for r in order])
        v = np.concatenate([values[r][tok[r]] for r in order])
        q = np.concatenate([queries[r][tok[r]] for r in order])
        backend.module.write_kv(
            k_cache,
            v_cache,
            backend.asarray(k),
            backend.asarray(v),
            backend.asarray(batch["slot_mappings"][0]),
            **scale_args,
        )
        return backend.to_numpy(
            backend.module.paged_attention(
                backend.asarray(q),
                k_cache,
                v_cache,
                backend.asarray(batch["block_tables"][0]),
                backend.asarray(batch["seq_lens"]),
                backend.asarray(batch["query_start_loc"]),
                scale=dim**-0.5,
                **scale_args,
            )
        )

    # step 1: all of p, the first 8 of d; step 2: d's last token (a decode) and nothing else
    b1 = step(backend, pool, SchedulerOutput(new_requests=news, num_scheduled_tokens={"d": 8, "p": 7}))
    out1 = forward(b1, {"d": 0, "p": 0})
    b2 = step(backend, pool, SchedulerOutput(cached_requests=(CachedRequest("d", 8),), num_scheduled_tokens={"d": 1}))
    out2 = forward(b2, {"d": 8})

    def dense(r: str, n: int, dtype: type[np.floating]) -> np.ndarray:
        k, v = stored(keys[r], "k").astype(dtype), stored(values[r], "v").astype(dtype)
        return _dense_attention(queries[r].astype(dtype), k, v, np.arange(n), float(dtype(dim**-0.5)))

    assert b1["req_ids"] == ("p", "d")
    exp_p, low_p = dense("p", 7, np.float64), dense("p", 7, np.float32)
    exp_d, low_d = dense("d", 9, np.float64), dense("d", 9, np.float32)
    assert_attention_close(out1[:7], exp_p, low_p, np.float32)
    assert_attention_close(out1[7:15], exp_d[:8], low_d[:8], np.float32)
    assert_attention_close(out2[:1], exp_d[8:], low_d[8:], np.float32)


def test_write_kv_then_paged_attention_matches_dense_attention(backend: BackendHandle) -> None:
    empty = np.full((16, 4, 2, 8), np.nan, np.float32)
    _attention_after_writes_matches_dense(backend, 0, 1.0, empty, {}, lambda x, _: x.astype(np.float64))


def _fp8_stored(x: np.ndarray, scales: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """What an fp8 cache holds for x, as float64: torch's float8 conversion (saturated first), times the scale."""
    import torch  # torch's conversions are the independent implementation (tests/test_fp8.py pins them)

    dtype, top = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}[kv_cache_dtype]
    per_head = torch.from_numpy(scales.astype(np.float32))[None, :, None]  # [1, num_kv_heads, 1]
    scaled = (torch.from_numpy(x.astype(np.float32)) / per_head).clamp(-top, top)
    return (scaled.to(dtype).double() * per_head.double()).numpy()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_fp8_write_kv_then_paged_attention_matches_dense_attention(
    backend: BackendHandle, kv_cache_dtype: str, per_head: bool
) -> None:
    """As above, into fp8 caches of uint8 codes (NaN codes where nothing was written): attention equals dense
    attention over the values the codes stand for (decode(code) * the KV head's scale), by the tolerance rule."""
    k_scales = np.array([0.006, 0.7] if per_head else [0.3, 0.3], np.float32)  # 0.006 saturates e4m3 keys
    v_scales = np.array([1.9, 0.05] if per_head else [0.05, 0.05], np.float32)
    scale_args: dict[str, Any] = {
        "kv_cache_dtype": kv_cache_dtype,
        "k_scale": backend.asarray(k_scales) if per_head else float(k_scales[0]),
        "v_scale": backend.asarray(v_scales) if per_head else float(v_scales[0]),
    }
    empty = np.full((16, 4, 2, 8), 0x7F, np.uint8)  # the NaN code of both formats
    scales = {"k": k_scales, "v": v_scales}

    def stored(x: np.ndarray, kv: str) -> np.ndarray:
        return _fp8_stored(x, scales[kv], kv_cache_dtype)

    _attention_after_writes_matches_dense(backend, 1, 3.0, empty, scale_args, stored)


@pytest.mark.parametrize("pad_to", [None, 80])
def test_prepare_is_repeatable(backend: BackendHandle, pad_to: int | None) -> None:
    ex = worked_example()
    pool = backend.make_pool(ex.config)
    pool.apply(ex.step1)
    first = copy_batch(backend.batch_to_numpy(pool.prepare(ex.step1, pad_to)))  # the second may reuse buffers
    problems = batch_differences(first, backend.batch_to_numpy(pool.prepare(ex.step1, pad_to)))
    assert not problems, "\n".join(problems)
