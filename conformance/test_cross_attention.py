"""Encoder-decoder cross-attention (spec/cross_attention.py, docs/semantics.md "Encoder-decoder cross-attention")
pinned on any backend (`--backend NAME`).

The worked numbers: the cross group has block size 4. A's encoder output is 6 tokens in blocks (10, 11), so
its slots are 10*4+0..3 = 40..43 and 11*4+0..1 = 44, 45 (block 11 cut to L = 6); B's is 9 tokens in
(20, 21, 22): 80..83, 84..87, 88. C's is 3 tokens in (30,): 120..122.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conformance.backends import BackendHandle, cross_attention_of
from conformance.driving import step
from conformance.tolerance import assert_attention_close, round_to, spec_in_dtype
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.encoder_attention import cross_attention as spec_cross_attention
from spec.errors import (
    BlockIdError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    ScheduleError,
)

DECODER, CROSS = KVCacheGroup(4, 64), KVCacheGroup(4, 64, kind="cross_attention")


def _config(cross_first: bool = False, max_encoder_len: int = 40) -> WorkerConfig:
    groups = (CROSS, DECODER) if cross_first else (DECODER, CROSS)
    return WorkerConfig(4, 32, 64, 1000, groups, max_encoder_len=max_encoder_len)


def _tables(cross_first: bool, decoder: tuple[int, ...], cross: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return (cross, decoder) if cross_first else (decoder, cross)


def _cross_fields(batch: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    assert batch["encoder_seq_lens"].dtype == batch["scheduled_encoder_lens"].dtype == np.int32
    assert batch["cross_slot_mapping"].dtype == np.int64
    return (
        batch["encoder_seq_lens"].tolist(),
        batch["scheduled_encoder_lens"].tolist(),
        batch["cross_slot_mapping"].tolist(),
    )


@pytest.mark.parametrize("cross_first", [False, True], ids=["cross-last", "cross-first"])
def test_cross_slots_cover_only_the_requests_whose_encoder_runs(backend: BackendHandle, cross_first: bool) -> None:
    """Written on the first step, in batch order, cut to L; every later step reads L keys and writes none."""
    pool, g = backend.make_pool(_config(cross_first)), int(not cross_first)
    first = SchedulerOutput(
        new_requests=(
            NewRequest("A", (1, 2, 3), _tables(cross_first, (1,), (10, 11)), encoder_len=6),
            NewRequest("B", (4, 5), _tables(cross_first, (2,), (20, 21, 22)), encoder_len=9),
        ),
        num_scheduled_tokens={"A": 3, "B": 2},
    )
    batch = step(backend, pool, first)
    assert batch["req_ids"] == ("B", "A")  # fewer tokens first
    assert _cross_fields(batch) == ([9, 6], [9, 6], [80, 81, 82, 83, 84, 85, 86, 87, 88, 40, 41, 42, 43, 44, 45])
    assert batch["slot_mappings"][g].tolist() == [-1] * 5  # decoder tokens write no cross KV
    assert batch["slot_mappings"][1 - g].tolist() == [8, 9, 4, 5, 6]  # the decoder's group is unchanged
    assert batch["block_tables"][g][:, :3].tolist() == [[20, 21, 22], [10, 11, 0]]

    second = SchedulerOutput(
        new_requests=(NewRequest("C", (7, 8), _tables(cross_first, (3,), (30,)), encoder_len=3),),
        cached_requests=(CachedRequest("A", 3), CachedRequest("B", 2)),
        num_scheduled_tokens={"A": 1, "C": 2, "B": 1},
    )
    batch = step(backend, pool, second)
    assert batch["req_ids"] == ("A", "B", "C")
    assert _cross_fields(batch) == ([6, 9, 3], [0, 0, 3], [120, 121, 122])
    assert batch["slot_mappings"][g].tolist() == [-1] * 4


def test_a_chunked_prefill_writes_the_encoder_on_its_first_chunk_only(backend: BackendHandle) -> None:
    pool = backend.make_pool(_config())
    new = NewRequest("A", (1, 2, 3, 4, 5, 6), ((1, 2), (10, 11)), encoder_len=5)
    first = step(backend, pool, SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"A": 3}))
    assert _cross_fields(first) == ([5], [5], [40, 41, 42, 43, 44])
    later = step(
        backend, pool, SchedulerOutput(cached_requests=(CachedRequest("A", 3),), num_scheduled_tokens={"A": 3})
    )
    assert _cross_fields(later) == ([5], [0], [])


def test_a_request_resumed_from_0_writes_its_encoder_again_in_its_new_blocks(backend: BackendHandle) -> None:
    """vLLM frees a preempted request's blocks, the encoder's too, and runs its encoder again when it resumes."""
    pool = backend.make_pool(_config())
    new = NewRequest("A", (1, 2, 3), ((1,), (10, 11)), encoder_len=6)
    step(backend, pool, SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"A": 3}))
    resumed = CachedRequest("A", 0, ((5,), (12, 13)), resumed=True)
    batch = step(backend, pool, SchedulerOutput(cached_requests=(resumed,), num_scheduled_tokens={"A": 4}))
    assert _cross_fields(batch) == ([6], [6], [48, 49, 50, 51, 52, 53])
    assert pool.snapshot()[0].block_ids == ((5,), (12, 13))


def test_a_request_resumed_past_0_with_its_own_cross_blocks_keeps_them(backend: BackendHandle) -> None:
    """Blocks it holds still hold its encoder's KV: nothing is written, L keys are read."""
    pool = backend.make_pool(_config())
    new = NewRequest("A", (1, 2, 3), ((1,), (10, 11)), encoder_len=6)
    step(backend, pool, SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"A": 3}))
    resumed = CachedRequest("A", 3, ((5,), (10, 11)), resumed=True)
    batch = step(backend, pool, SchedulerOutput(cached_requests=(resumed,), num_scheduled_tokens={"A": 1}))
    assert _cross_fields(batch) == ([6], [0], [])


def test_a_decoder_only_model_has_no_cross_fields(backend: BackendHandle) -> None:
    pool = backend.make_pool(WorkerConfig(4, 32, 64, 1000, (DECODER,)))
    batch = step(
        backend, pool, SchedulerOutput(new_requests=(NewRequest("A", (1,), ((1,),)),), num_scheduled_tokens={"A": 1})
    )
    assert batch["encoder_seq_lens"] is batch["scheduled_encoder_lens"] is batch["cross_slot_mapping"] is None


def test_every_table_is_as_wide_as_the_longer_of_the_decoder_and_the_encoder() -> None:
    """vLLM sizes every group's table for max(max_model_len, max_encoder_len) tokens (Whisper: 1500 > 448)."""
    config = WorkerConfig(4, 32, 64, 1000, (DECODER, KVCacheGroup(2, 64, kind="cross_attention")), max_encoder_len=45)
    assert [config.max_blocks_per_req(g) for g in range(2)] == [12, 23]  # cdiv(45, 4), cdiv(45, 2)
    assert _config(max_encoder_len=20).max_blocks_per_req(0) == 8  # cdiv(32, 4)


@pytest.mark.parametrize(
    "groups, max_encoder_len, message",
    [
        ((DECODER, CROSS), 0, "max_encoder_len must be >= 1"),
        ((DECODER,), 8, "needs a cross_attention group"),
        ((DECODER, CROSS, CROSS), 8, "one cross_attention group at most"),
        ((CROSS,), 8, "the decoder's own group"),
        ((DECODER, CROSS), -1, "must be >= 0"),
    ],
)
def test_configurations_it_does_not_support_are_refused(groups: Any, max_encoder_len: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(4, 32, 64, 1000, groups, max_encoder_len=max_encoder_len)
    with pytest.raises(ValueError, match="sliding_window applies to attention groups"):
        KVCacheGroup(4, 64, 8, kind="cross_attention")


def _bad_steps() -> dict[str, tuple[WorkerConfig, SchedulerOutput, type[ScheduleError], str]]:
    config, plain = _config(), WorkerConfig(4, 32, 64, 1000, (DECODER,))

    def new(encoder_len: Any = 6, cross: tuple[int, ...] = (10, 11), computed: int = 0, rid: str = "N") -> NewRequest:
        decoder = (7, 8) if rid == "N" else (20, 21)
        return NewRequest(rid, (1, 2, 3, 4, 5, 6), (decoder, cross), computed, encoder_len=encoder_len)

    def one(request: NewRequest, n: int = 2) -> SchedulerOutput:
        return SchedulerOutput(new_requests=(request,), num_scheduled_tokens={request.req_id: n})

    resumed = CachedRequest("A", 3, ((5,), (12, 13)), resumed=True)  # other cross blocks, past 0
    return {
        "encoder_len negative": (config, one(new(-1)), InconsistentSchedulerOutputError, "encoder_len"),
        "encoder_len a float": (config, one(new(1.5)), InconsistentSchedulerOutputError, "encoder_len"),
        "encoder_len past max_encoder_len": (
            config,
            one(new(41, cross=tuple(range(10, 21)))),
            ModelLengthError,
            "encoder_len",
        ),
        "encoder_len past max_encoder_len, its blocks within the table's width": (  # width: max_model_len's 8
            _config(max_encoder_len=20),
            one(new(21, cross=tuple(range(10, 16)))),
            ModelLengthError,
            "encoder_len",
        ),
        "no encoder on a model with a cross group": (config, one(new(0)), ModelLengthError, "encoder_len"),
        "an encoder on a model without a cross group": (
            plain,
            one(NewRequest("N", (1, 2), ((7,),), encoder_len=3)),
            ModelLengthError,
            "encoder_len",
        ),
        "an encoder past its blocks": (config, one(new(9)), MissingBlockError, "block_ids[1]"),
        "a new request's encoder past position 0": (
            config,
            one(new(computed=2)),
            MissingBlockError,
            "num_computed_tokens",
        ),
        "other cross blocks past position 0": (
            config,
            SchedulerOutput(cached_requests=(resumed,), num_scheduled_tokens={"A": 1}),
            MissingBlockError,
            "num_computed_tokens",
        ),
        "the null block among the cross blocks": (config, one(new(cross=(10, 0))), BlockIdError, "block_ids[1]"),
        "two encoders writing one slot": (
            config,
            SchedulerOutput(
                new_requests=(new(rid="N"), new(2, cross=(11,), rid="M")), num_scheduled_tokens={"N": 2, "M": 2}
            ),
            DuplicateSlotError,
            "block_ids[1]",
        ),
    }


@pytest.mark.parametrize("name", sorted(_bad_steps()))
def test_bad_encoder_inputs_are_refused_and_change_nothing(backend: BackendHandle, name: str) -> None:
    config, bad, cls, field = _bad_steps()[name]
    pool = backend.make_pool(config)
    blocks = ((1,), (10, 11)) if len(config.kv_groups) == 2 else ((1,),)
    encoder = 6 if len(config.kv_groups) == 2 else 0
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("A", (1, 2, 3), blocks, encoder_len=encoder),),
                                        num_scheduled_tokens={"A": 3}))  # fmt: skip
    before = pool.snapshot()
    with pytest.raises(cls) as raised:
        pool.apply(bad)
    assert raised.value.field == field
    assert pool.snapshot() == before
    after = step(
        backend, pool, SchedulerOutput(cached_requests=(CachedRequest("A", 3),), num_scheduled_tokens={"A": 1})
    )
    assert after["positions"].tolist() == [3]


# ---- attention over the encoder's KV ---------------------------------------------------------------------


def _cross_attention(backend: BackendHandle) -> Any:
    fn = cross_attention_of(backend)
    if fn is None:
        pytest.skip(f"{backend.name} has no cross_attention")
    return fn


def _inputs(dtype: str, seed: int = 0) -> dict[str, Any]:
    """Rows of 1 query (L = 7), 5 queries (L = 12), 2 queries (L = 0: no encoder), then 3 padding tokens."""
    rng = np.random.default_rng(seed)
    num_blocks, block_size, kv_heads, group, head_dim = 16, 4, 2, 2, 8
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    return {
        "query": round_to(rng.standard_normal((11, kv_heads * group, head_dim)), dtype).astype(dtype),
        "key_cache": round_to(rng.standard_normal(cache_shape), dtype).astype(dtype),
        "value_cache": round_to(rng.standard_normal(cache_shape), dtype).astype(dtype),
        "block_table": np.array([[5, 2, 0, 0], [9, 3, 14, 0], [0, 0, 0, 0]], np.int32),
        "encoder_seq_lens": np.array([7, 12, 0], np.int32),
        "query_start_loc": np.array([0, 1, 6, 8], np.int32),
    }


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cross_attention_matches_the_float64_reference_by_the_tolerance_rule(
    backend: BackendHandle, dtype: str
) -> None:
    cross = _cross_attention(backend)
    x = _inputs(dtype)
    floats = (x["query"], x["key_cache"], x["value_cache"])
    table, lens, starts = x["block_table"], x["encoder_seq_lens"], x["query_start_loc"]
    q64, k64, v64 = (np.asarray(a, np.float64) for a in floats)
    ref64 = spec_cross_attention(q64, k64, v64, table, lens, starts, scale=0.35)
    low = spec_in_dtype(spec_cross_attention, dtype, floats, table, lens, starts, scale=0.35)
    inputs = [backend.asarray(a) for a in (*floats, table, lens, starts)]
    out = backend.to_numpy(cross(*inputs, scale=0.35))
    assert out.dtype == np.dtype(dtype)
    assert_attention_close(out[:6], ref64[:6], low[:6], dtype)
    assert not np.asarray(out[6:], np.float64).any()  # the row without an encoder and the padding are zero


def test_every_query_sees_all_encoder_keys_with_no_causal_mask(backend: BackendHandle) -> None:
    """Zero keys make every logit equal: each query's output is the mean of its row's L values, whatever its
    position; a causal mask would give the first query of a row only the first value."""
    cross = _cross_attention(backend)
    x = _inputs("float32")
    x["key_cache"] = np.zeros_like(x["key_cache"])
    out = backend.to_numpy(cross(*(backend.asarray(a) for a in x.values()), scale=1.0))
    values = x["value_cache"].astype(np.float64)
    for b, rows in ((0, range(0, 1)), (1, range(1, 6))):
        length = int(x["encoder_seq_lens"][b])
        blocks = x["block_table"][b][np.arange(length) // 4]
        mean = values[blocks, np.arange(length) % 4].mean(axis=0)  # [kv_heads, head_dim]
        for t in rows:
            np.testing.assert_allclose(out[t], np.repeat(mean, 2, axis=0), rtol=1e-5, atol=1e-6)


def test_cross_attention_refuses_inputs_outside_its_contract(backend: BackendHandle) -> None:
    cross = _cross_attention(backend)
    x = _inputs("float32")
    x["encoder_seq_lens"] = np.array([7, 12], np.int32)  # two rows, three in the table
    with pytest.raises(ValueError, match="cross_attention"):
        cross(*(backend.asarray(a) for a in x.values()), scale=1.0)


def test_sglang_layout_puts_the_encoder_first_and_decoder_position_p_at_encoder_len_plus_p(
    backend: BackendHandle,
) -> None:
    """A's row: its 6 encoder slots 40..45, then its decoder tokens' slots 4, 5, 6 (block 1); after a decode,
    position 3 (slot 7) is column 6 + 3 = 9, and last_loc reads it there, not at column seq_len - 1 = 3 (slot 43)."""
    interop = getattr(backend.module, "interop", None)
    if interop is None:
        pytest.skip(f"{backend.name} has no interop functions")
    config, pad = _config(), -1
    pool = backend.make_pool(config)
    new = NewRequest("A", (1, 2, 3), ((1,), (10, 11)), encoder_len=6)
    first = SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"A": 3})
    pool.apply(first)
    layout = interop.sglang_layout(pool.prepare(first), config, 0)
    row = backend.to_numpy(layout.req_to_token)[0]
    assert row.shape == (40 + 32,)
    assert row[:10].tolist() == [40, 41, 42, 43, 44, 45, 4, 5, 6, pad]
    assert backend.to_numpy(layout.last_loc).tolist() == [6]
    assert backend.to_numpy(layout.encoder_cached).tolist() == [False]
    assert backend.to_numpy(layout.encoder_out_cache_loc).tolist() == [40, 41, 42, 43, 44, 45]
    pool.record_sampled(pool.prepare(first), backend.asarray(np.array([9])))
    decode = SchedulerOutput(cached_requests=(CachedRequest("A", 3),), num_scheduled_tokens={"A": 1})
    pool.apply(decode)
    layout = interop.sglang_layout(pool.prepare(decode), config, 0)
    assert backend.to_numpy(layout.req_to_token)[0][6:11].tolist() == [4, 5, 6, 7, pad]
    assert backend.to_numpy(layout.last_loc).tolist() == [7]
    assert backend.to_numpy(layout.encoder_lens).tolist() == [6]
    assert backend.to_numpy(layout.encoder_cached).tolist() == [True]
    with pytest.raises(ValueError, match="cross group"):
        interop.sglang_layout(pool.prepare(decode), config, 1)


def test_context_parallelism_does_not_shard_the_encoders_kv() -> None:
    """The CP transform splits a group's KV by decoder position; the cross group is replicated, never sharded."""
    from spec.context_parallel import ContextParallel

    with pytest.raises(ValueError, match="holds the encoder's KV"):
        ContextParallel(2, 0, sharded_groups=(1,)).check_config(_config())
    ContextParallel(2, 0, sharded_groups=(0,)).check_config(_config())  # the decoder's group may be
