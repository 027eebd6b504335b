"""The launch budget: apply is one Triton launch, prepare one (for all KV groups together).

Launches are counted by wrapping fast.runtime.Kernel.__getitem__ (every fast kernel is launched as
`kernel[grid](...)`), with the kernels run through Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import fast
from conformance.backends import fast_handle
from fast.runtime import HAVE_TRITON, Kernel, interpret
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")

CONFIG = WorkerConfig(
    max_num_reqs=4,
    max_model_len=48,
    max_num_batched_tokens=64,
    vocab_size=100,
    kv_groups=(KVCacheGroup(4, 64), KVCacheGroup(8, 32), KVCacheGroup(16, 16, sliding_window=8)),
)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()
    original = Kernel.__getitem__

    def counting(self: Kernel, grid: Any) -> Any:
        counts[self.fn.__name__] += 1
        return original(self, grid)

    monkeypatch.setattr(Kernel, "__getitem__", counting)
    with interpret(True):
        yield counts


def _steps() -> list[SchedulerOutput]:
    first = SchedulerOutput(
        new_requests=(
            NewRequest("a", tuple(range(10)), ((1, 2, 3), (1, 2), (1,))),
            NewRequest("b", tuple(range(20, 26)), ((4, 5), (3,), (2,))),
        ),
        num_scheduled_tokens={"a": 10, "b": 6},
    )
    second = SchedulerOutput(  # b finishes; a decodes into a new block of group 0; c arrives
        new_requests=(NewRequest("c", (7, 8, 9), ((6,), (4,), (3,))),),
        cached_requests=(CachedRequest("a", 10, ((), (), ())),),
        num_scheduled_tokens={"a": 1, "c": 3},
        finished_req_ids=frozenset({"b"}),
    )
    third = SchedulerOutput(  # the common decode step: the bulk-validated path
        cached_requests=(CachedRequest("a", 11, ((7,), (), ())), CachedRequest("c", 3)),
        num_scheduled_tokens={"c": 1, "a": 1},
    )
    return [first, second, third]


@pytest.mark.interpret
@pytest.mark.parametrize("pad_to", [None, 32])
def test_apply_and_prepare_are_one_launch_each(launches: Counter[str], pad_to: int | None) -> None:
    """docs/architecture.md's launch counts: 1 per apply (every step here changes state), 1 per prepare."""
    pool = fast.RequestStatePool(CONFIG)
    for sched in _steps():
        launches.clear()
        pool.apply(sched)
        assert launches == Counter({"_apply_writes_kernel": 1}), launches
        launches.clear()
        batch = pool.prepare(sched, pad_to)
        assert launches == Counter({"_prepare_kernel": 1}), launches
        launches.clear()
        pool.record_sampled(batch, np.ones(batch.num_reqs, np.int64))
        assert sum(launches.values()) == 0, launches  # a plain indexed write, no kernel


@pytest.mark.interpret
def test_counter_sees_kernel_launches(launches: Counter[str]) -> None:
    """The wrapper really intercepts launches (else the budget test above could pass vacuously)."""
    pool = fast.RequestStatePool(CONFIG)
    sched = _steps()[0]
    pool.apply(sched)
    pool.prepare(sched)
    assert launches == Counter({"_apply_writes_kernel": 1, "_prepare_kernel": 1})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no host sync can be observed on CPU)")
def test_prepare_never_waits_for_the_device() -> None:
    pool = fast.RequestStatePool(CONFIG, device="cuda")
    for sched in _steps():
        pool.apply(sched)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any device->host synchronisation now raises
        try:
            batch = pool.prepare(sched, pad_to=32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        pool.record_sampled(batch, torch.ones(batch.num_reqs, dtype=torch.int64, device="cuda"))


@pytest.mark.interpret
def test_pool_keeps_the_kernel_mode_it_was_built_in(launches: Counter[str]) -> None:
    """The mode is fixed at construction: a later `interpret(...)` block neither adds nor removes kernels."""
    kernels = fast.RequestStatePool(CONFIG)  # built inside the fixture's interpret(True)
    with interpret(False):
        host = fast.RequestStatePool(CONFIG)
        sched = _steps()[0]
        kernels.apply(sched)
        kernels.prepare(sched)
    assert launches == Counter({"_apply_writes_kernel": 1, "_prepare_kernel": 1})
    launches.clear()
    host.apply(sched)  # back inside interpret(True)
    host.prepare(sched)
    assert sum(launches.values()) == 0, launches
    assert not kernels.host_mode and host.host_mode


@pytest.mark.interpret
@pytest.mark.parametrize("enabled", [True, False])
def test_backend_handle_builds_pools_in_its_mode(launches: Counter[str], enabled: bool) -> None:
    """fast-interpret's pools run the kernels, fast's run none (host mode), whatever mode the caller is in."""
    with interpret(not enabled):
        pool = fast_handle(enabled).make_pool(CONFIG)
        sched = _steps()[0]
        pool.apply(sched)
        pool.prepare(sched)
    kernels = enabled or torch.cuda.is_available()
    assert launches == (Counter({"_apply_writes_kernel": 1, "_prepare_kernel": 1}) if kernels else Counter())


@pytest.mark.interpret
def test_a_model_with_mrope_adds_one_launch_to_prepare(launches: Counter[str]) -> None:
    """docs/architecture.md: M-RoPE positions (fast/kernels/mrope.py) are one more launch per prepare, none in apply."""
    config = WorkerConfig(4, 48, 64, 100, (KVCacheGroup(4, 64),), uses_mrope=True)
    table = ((0, 1, 2, 2, 2, 2), (0, 1, 2, 2, 3, 3), (0, 1, 2, 3, 2, 3))
    pool = fast.RequestStatePool(config)
    image = NewRequest("img", tuple(range(6)), ((1, 2),), mrope_positions=table, mrope_position_delta=-2)
    steps = [
        SchedulerOutput(
            new_requests=(image, NewRequest("txt", (5, 6), ((3,),))), num_scheduled_tokens={"img": 4, "txt": 2}
        ),
        SchedulerOutput(
            cached_requests=(CachedRequest("img", 4), CachedRequest("txt", 2)),
            num_scheduled_tokens={"img": 2, "txt": 1},
        ),
    ]
    for sched in steps:
        launches.clear()
        pool.apply(sched)
        assert launches == Counter({"_apply_writes_kernel": 1}), launches
        launches.clear()
        batch = pool.prepare(sched)
        assert launches == Counter({"_prepare_kernel": 1, "_mrope_positions_kernel": 1}), launches
        pool.record_sampled(batch, np.ones(batch.num_reqs, np.int64))
