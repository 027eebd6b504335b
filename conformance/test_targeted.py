"""Targeted cases for bugs other engines have shipped, once per backend (`--backend`).

Every expected value is derived here from the block ids the test hands out, never from a backend.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import BackendHandle
from conformance.driving import step
from spec import (
    PAD_SLOT_ID,
    CachedRequest,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _config(block_size: int = 4, num_blocks: int = 16, max_model_len: int = 16) -> WorkerConfig:
    return WorkerConfig(4, max_model_len, 64, 100, (KVCacheGroup(block_size, num_blocks),))


def _slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def test_pad_slot_is_never_used_as_an_index(backend: BackendHandle) -> None:
    config = _config(block_size=4, num_blocks=4)
    pool = backend.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("A", (5, 6, 7), ((1,),)),), num_scheduled_tokens={"A": 3})
    pool.apply(out)
    batch = pool.prepare(out, pad_to=8)
    arrays = backend.batch_to_numpy(batch)
    np.testing.assert_array_equal(arrays["slot_mappings"][0], [4, 5, 6] + [PAD_SLOT_ID] * 5)
    np.testing.assert_array_equal(arrays["positions"], [0, 1, 2, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(arrays["input_ids"], [5, 6, 7, 0, 0, 0, 0, 0])

    shape = (4, 4, 1, 2)  # [num_blocks, block_size, num_kv_heads, head_dim]
    key = np.arange(1, 17, dtype=np.float32).reshape(8, 1, 2)  # padding rows carry nonzero garbage too
    k_cache, v_cache = backend.asarray(np.zeros(shape, np.float32)), backend.asarray(np.zeros(shape, np.float32))
    backend.module.write_kv(k_cache, v_cache, backend.asarray(key), backend.asarray(key * 10), batch.slot_mappings[0])
    expected = np.zeros(shape, np.float32)
    expected[1, :3] = key[:3]  # block 1, offsets 0..2; slot -1 would have hit block 3 offset 3
    np.testing.assert_array_equal(backend.to_numpy(k_cache), expected)
    np.testing.assert_array_equal(backend.to_numpy(v_cache), expected * 10)

    query = backend.asarray(np.ones((8, 1, 2), np.float32))
    att = backend.module.paged_attention(
        query, k_cache, v_cache, batch.block_tables[0], batch.seq_lens, batch.query_start_loc, scale=1.0
    )
    np.testing.assert_array_equal(backend.to_numpy(att)[3:], 0)  # padding rows of the output are zero


def test_no_stale_block_ids_past_a_reused_rows_block_count(backend: BackendHandle) -> None:
    config = _config()
    pool = backend.make_pool(config)
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("X", tuple(range(12)), ((1, 2, 3),)),),
                                        num_scheduled_tokens={"X": 12}))  # fmt: skip
    batch = step(
        backend,
        pool,
        SchedulerOutput(
            new_requests=(NewRequest("Y", (1, 2), ((5,),)),),
            num_scheduled_tokens={"Y": 2},
            finished_req_ids=frozenset({"X"}),
        ),
    )
    assert pool.row_of("Y") == 0  # X's row, the lowest free one
    np.testing.assert_array_equal(batch["block_tables"][0], [[5, 0, 0, 0]])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [20, 21])
    assert pool.snapshot()[0].block_ids == ((5,),)


def test_shorter_table_replaces_a_longer_one_on_resume(backend: BackendHandle) -> None:
    config = _config()
    pool = backend.make_pool(config)
    prompt = tuple(range(10, 22))
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("X", prompt, ((1, 2, 3),)),),
                                        num_scheduled_tokens={"X": 12}), sampled={"X": 99})  # fmt: skip
    step(backend, pool, SchedulerOutput())  # X is preempted: not scheduled, keeps its row
    resume = SchedulerOutput(
        cached_requests=(CachedRequest("X", 0, ((7,),), resumed=True),), num_scheduled_tokens={"X": 4}
    )
    batch = step(backend, pool, resume)
    np.testing.assert_array_equal(batch["block_tables"][0], [[7, 0, 0, 0]])
    np.testing.assert_array_equal(batch["slot_mappings"][0], _slots([7], range(4), 4))
    np.testing.assert_array_equal(batch["input_ids"], prompt[:4])
    assert pool.snapshot()[0].block_ids == ((7,),)
    assert pool.snapshot()[0].token_ids == (*prompt, 99)


@pytest.mark.parametrize("pad_to", [4, 10])
def test_query_start_loc_never_decreases_under_padding(backend: BackendHandle, pad_to: int) -> None:
    config = _config()
    pool = backend.make_pool(config)
    pool.apply(SchedulerOutput())
    empty = backend.batch_to_numpy(pool.prepare(SchedulerOutput(), pad_to=pad_to))
    np.testing.assert_array_equal(empty["query_start_loc"], [0])
    np.testing.assert_array_equal(empty["slot_mappings"][0], [PAD_SLOT_ID] * pad_to)

    out = SchedulerOutput(
        new_requests=(NewRequest("A", (1, 2, 3), ((1,),)), NewRequest("B", (4,), ((2,),))),
        num_scheduled_tokens={"A": 3, "B": 1},
    )
    pool.apply(out)
    batch = backend.batch_to_numpy(pool.prepare(out, pad_to=pad_to))
    np.testing.assert_array_equal(batch["query_start_loc"], [0, 1, 4])  # B (1 token) first; the end is real tokens
    np.testing.assert_array_equal(batch["logits_indices"], [0, 3])
    np.testing.assert_array_equal(batch["positions"], [0, 0, 1, 2] + [0] * (pad_to - 4))
    np.testing.assert_array_equal(batch["slot_mappings"][0], [8, 4, 5, 6] + [PAD_SLOT_ID] * (pad_to - 4))
    assert batch["num_tokens"] == 4 and batch["num_tokens_padded"] == pad_to


def test_slot_arithmetic_does_not_overflow_int32(backend: BackendHandle) -> None:
    high = 2**26 + 1  # block id * 64 is past 2**32
    config = WorkerConfig(2, 256, 64, 100, (KVCacheGroup(64, 2**26 + 2), KVCacheGroup(1, 2**31 - 1)))
    pool = backend.make_pool(config)
    unit_blocks = tuple(2**31 - 2 - i for i in range(3))
    out = SchedulerOutput(
        new_requests=(NewRequest("A", (1, 2, 3), ((high,), unit_blocks)),), num_scheduled_tokens={"A": 3}
    )
    batch = step(backend, pool, out, sampled={"A": 4})
    assert batch["slot_mappings"][0].dtype == np.int64
    np.testing.assert_array_equal(batch["slot_mappings"][0], [high * 64 + p for p in range(3)])
    np.testing.assert_array_equal(batch["slot_mappings"][1], list(unit_blocks))
    decode = SchedulerOutput(cached_requests=(CachedRequest("A", 3, ((), (5,))),), num_scheduled_tokens={"A": 1})
    batch = step(backend, pool, decode)
    np.testing.assert_array_equal(batch["slot_mappings"][0], [high * 64 + 3])
    np.testing.assert_array_equal(batch["slot_mappings"][1], [5])
    np.testing.assert_array_equal(batch["block_tables"][0][0, :1], [high])


def test_a_table_with_a_single_column(backend: BackendHandle) -> None:
    config = _config(block_size=4, max_model_len=4)  # max_blocks_per_req = 1
    pool = backend.make_pool(config)
    batch = step(backend, pool, SchedulerOutput(new_requests=(NewRequest("A", (1, 2, 3), ((2,),)),),
                                                num_scheduled_tokens={"A": 3}), sampled={"A": 9})  # fmt: skip
    assert batch["block_tables"][0].shape == (1, 1)
    decode = SchedulerOutput(cached_requests=(CachedRequest("A", 3),), num_scheduled_tokens={"A": 1})
    pool.apply(decode)  # no record_sampled: a sample would exceed max_model_len, the scheduler finishes A instead
    batch = backend.batch_to_numpy(pool.prepare(decode))
    np.testing.assert_array_equal(batch["block_tables"][0], [[2]])
    np.testing.assert_array_equal(batch["slot_mappings"][0], [2 * 4 + 3])
    np.testing.assert_array_equal(batch["input_ids"], [9])


def test_zero_length_query_rows_are_rejected(backend: BackendHandle) -> None:
    pool = backend.make_pool(_config())
    step(backend, pool, SchedulerOutput(new_requests=(NewRequest("A", (1, 2, 3), ((1,),)),),
                                        num_scheduled_tokens={"A": 2}))  # fmt: skip
    before = pool.snapshot()
    with pytest.raises(InconsistentSchedulerOutputError) as err:
        pool.apply(SchedulerOutput(cached_requests=(CachedRequest("A", 2),), num_scheduled_tokens={"A": 0}))
    assert err.value.req_id == "A" and err.value.field == "num_scheduled_tokens"
    assert pool.snapshot() == before
    batch = step(
        backend, pool, SchedulerOutput(cached_requests=(CachedRequest("A", 2),), num_scheduled_tokens={"A": 1})
    )
    np.testing.assert_array_equal(batch["slot_mappings"][0], [6])


def test_duplicate_slots_within_a_step_are_rejected(backend: BackendHandle) -> None:
    pool = backend.make_pool(_config())
    clash = SchedulerOutput(
        new_requests=(NewRequest("A", (1,), ((1,),)), NewRequest("B", (2,), ((1,),))),
        num_scheduled_tokens={"A": 1, "B": 1},
    )
    with pytest.raises(DuplicateSlotError):
        pool.apply(clash)
    assert pool.snapshot() == ()
    # sharing a full prefix block is fine as long as each writes its own block
    shared = SchedulerOutput(
        new_requests=(NewRequest("A", (1, 2, 3, 4, 5), ((1, 2),), 4), NewRequest("B", (1, 2, 3, 4, 6), ((1, 3),), 4)),
        num_scheduled_tokens={"A": 1, "B": 1},
    )
    batch = step(backend, pool, shared)
    np.testing.assert_array_equal(batch["slot_mappings"][0], [8, 12])


def test_block_ids_past_int32_are_refused_when_the_group_is_made() -> None:
    assert KVCacheGroup(1, 2**31).num_blocks == 2**31  # largest id 2**31 - 1 still fits the int32 tables
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheGroup(1, 2**31 + 1)
