"""M-RoPE tables (spec/mrope.py, fast/mrope.py) take memory only as multimodal requests arrive, and growing keeps them.

An engine-sized pool would need [4096, 3, 131072] int64 = 12 GiB if the tables were allocated up front.
"""

from __future__ import annotations

import numpy as np

import fast
import spec
from fast.mrope import FastMRope
from spec.mrope import MRope, MRopeRows
from spec.types import KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

HUGE = WorkerConfig(4096, 131072, 8192, 32000, (KVCacheGroup(16, 1 << 20),), uses_mrope=True)


def _image_request(req_id: str, n: int, blocks: tuple[int, ...]) -> NewRequest:
    table = (tuple(range(n)), tuple(p // 2 for p in range(n)), tuple(p % 7 for p in range(n)))
    return NewRequest(req_id, tuple(range(n)), (blocks,), mrope_positions=table, mrope_position_delta=-5)


def test_spec_keeps_one_table_per_row_as_long_as_its_prompt() -> None:
    pool = spec.RequestStatePool(HUGE)
    feature = pool.feature(MRope)
    assert feature is not None and isinstance(feature.rows, MRopeRows)
    rows = feature.rows
    assert all(t.size == 0 for t in rows.tables)
    sched = SchedulerOutput(new_requests=(_image_request("a", 40, (1, 2, 3)),), num_scheduled_tokens={"a": 40})
    pool.apply(sched)
    batch = pool.prepare(sched)
    assert sum(t.size for t in rows.tables) == 3 * 40
    assert batch.mrope_positions[2].tolist() == [p % 7 for p in range(40)]


def test_fast_grows_the_tables_with_the_longest_held_and_keeps_the_rows(mode: str) -> None:
    pool = fast.RequestStatePool(HUGE)
    feature = pool.feature(FastMRope)
    assert feature is not None
    tables = feature.tables
    assert tables.capacity == 0  # nothing for tables at construction
    first = SchedulerOutput(new_requests=(_image_request("a", 40, (1, 2, 3)),), num_scheduled_tokens={"a": 40})
    pool.apply(first)
    pool.record_sampled(pool.prepare(first), np.array([7]))
    held = tables.capacity
    assert 40 <= held < 4 * 1000  # the minimum capacity, far from max_model_len
    # a longer table grows the storage: the first row's table must survive the copy
    blocks = tuple(range(10, 10 + 63))
    second = SchedulerOutput(new_requests=(_image_request("b", 1000, blocks),), num_scheduled_tokens={"b": 8})
    pool.apply(second)
    pool.prepare(second)
    assert 1000 <= tables.capacity < 4 * 1000 and tables.capacity > held
    resumed = SchedulerOutput(  # "a" recomputes its prompt from the table it held before the growth
        cached_requests=(spec.CachedRequest("a", 0, ((4, 5, 6),), resumed=True),), num_scheduled_tokens={"a": 41}
    )
    pool.apply(resumed)
    batch = pool.prepare(resumed)
    assert np.asarray(batch.mrope_positions)[1].tolist() == [p // 2 for p in range(40)] + [40 - 5]
