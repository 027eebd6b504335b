"""Token ids are stored int32 and the token array grows with what the pool holds, in every backend and mode."""

from __future__ import annotations

import numpy as np
import pytest

import fast
import spec
from fast.runtime import HAVE_TRITON, interpret
from spec.types import MAX_VOCAB_SIZE, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

MODES = [pytest.param(False, id="host")]
if HAVE_TRITON:
    MODES.append(pytest.param(True, id="interpret", marks=pytest.mark.interpret))

# an engine-sized pool: [4096, 131072] int32 token ids would be 2 GiB if allocated up front
HUGE = WorkerConfig(4096, 131072, 8192, 32000, (KVCacheGroup(16, 1 << 20),))


@pytest.mark.parametrize("kernels", MODES)
def test_huge_pool_allocates_tokens_only_as_requests_arrive(kernels: bool) -> None:
    with interpret(kernels):
        pool = fast.RequestStatePool(HUGE)
        assert pool.dev.token_ids.numel() == 0  # nothing for tokens at construction
        prompt = tuple(range(1000))
        sched = SchedulerOutput(new_requests=(NewRequest("a", prompt, (tuple(range(1, 64)),)),),
                                num_scheduled_tokens={"a": 1000})  # fmt: skip
        pool.apply(sched)
        pool.record_sampled(pool.prepare(sched), np.array([7]))
        capacity = pool.dev.token_ids.shape[1]
        assert 1001 <= capacity < 4 * 1001  # grows with the longest request held, not to max_model_len
        (row,) = pool.snapshot()
        assert row.token_ids == (*prompt, 7)


@pytest.mark.parametrize("kernels", MODES)
def test_growth_keeps_every_row_tokens(kernels: bool) -> None:
    """Growing the array copies the rows already held (the prepare kernel reads with the new row stride)."""
    config = WorkerConfig(3, 4096, 4096, 100, (KVCacheGroup(16, 1024),))
    with interpret(kernels):
        fast_pool, spec_pool = fast.RequestStatePool(config), spec.RequestStatePool(config)
        first = SchedulerOutput(new_requests=(NewRequest("a", tuple(i % 100 for i in range(20)), ((1, 2),)),),
                                num_scheduled_tokens={"a": 20})  # fmt: skip
        long = tuple((3 * i) % 100 for i in range(1500))
        second = SchedulerOutput(
            new_requests=(NewRequest("b", long, (tuple(range(3, 3 + 94)),)),), num_scheduled_tokens={"b": 1500}
        )
        for sched in (first, second):
            for pool in (fast_pool, spec_pool):
                pool.apply(sched)
                batch = pool.prepare(sched)
                ids = batch.input_ids.numpy() if hasattr(batch.input_ids, "numpy") else batch.input_ids
                np.testing.assert_array_equal(ids, np.asarray(sched.new_requests[0].prompt_token_ids))
                pool.record_sampled(batch, np.array([5]))
        assert fast_pool.snapshot() == spec_pool.snapshot()


@pytest.mark.parametrize("backend_name", ["spec", "fast"])
def test_largest_vocabulary_ids_round_trip_through_int32(backend_name: str) -> None:
    top = MAX_VOCAB_SIZE - 1  # the largest id int32 storage must hold exactly
    config = WorkerConfig(1, 8, 8, MAX_VOCAB_SIZE, (KVCacheGroup(4, 8),))
    pool = (spec if backend_name == "spec" else fast).RequestStatePool(config)
    sched = SchedulerOutput(new_requests=(NewRequest("a", (top, 0, top), ((1,),)),), num_scheduled_tokens={"a": 3})
    pool.apply(sched)
    batch = pool.prepare(sched)
    ids = batch.input_ids.numpy() if hasattr(batch.input_ids, "numpy") else batch.input_ids
    assert ids.tolist() == [top, 0, top]
    pool.record_sampled(batch, np.array([top]))
    assert pool.snapshot()[0].token_ids == (top, 0, top, top)


def test_vocabulary_past_int32_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        WorkerConfig(1, 8, 8, MAX_VOCAB_SIZE + 1)
