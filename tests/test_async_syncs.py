"""Async scheduling makes no host sync on the critical path (spec/async_steps.py, fast/async_steps.py).

fast.runtime.HostSyncCounter counts the torch calls that would wait for the device on CUDA; on CPU the same code
path runs (host mode, and the Triton interpreter), so these tests hold the CUDA path to zero without a GPU.
scripts/gpu-check asserts the same on CUDA with torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fast
from fast.runtime import HostSyncCounter, interpret
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

CONFIG = WorkerConfig(4, 64, 32, 100, (KVCacheGroup(16, 64),))


def _syncs_of_a_step(config: WorkerConfig, interpreted: bool) -> dict[str, list[str]]:
    """The counted calls of record_sampled, then of the next apply and prepare, for a prefill and a drafting step."""
    counted: dict[str, list[str]] = {}
    with interpret(interpreted):
        pool = fast.RequestStatePool(config)
        first = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3), ((3,),)),), num_scheduled_tokens={"a": 3})
        pool.apply(first)
        batch = pool.prepare(first)
        with HostSyncCounter() as record:
            pool.record_sampled(batch, torch.tensor([7]))
        drafting = SchedulerOutput(cached_requests=(CachedRequest("a", 3),), num_scheduled_tokens={"a": 3},
                                   scheduled_spec_decode_tokens={"a": (5, 6)})  # fmt: skip
        with HostSyncCounter() as step:
            pool.apply(drafting)
            batch = pool.prepare(drafting)
        with HostSyncCounter() as record_drafts:
            pool.record_sampled(batch, torch.tensor([[5, 9, -1]]))
    counted.update(record=record.calls, step=step.calls, record_drafts=record_drafts.calls)
    return counted


def test_async_record_sampled_and_the_next_step_wait_for_nothing() -> None:
    # the Triton path, CUDA's, here under the interpreter: launches only
    counted = _syncs_of_a_step(dataclasses.replace(CONFIG, async_scheduling=True), interpreted=True)
    assert counted == {"record": [], "step": [], "record_drafts": []}


def test_in_host_mode_the_async_record_only_views_host_memory() -> None:
    # host mode has no device: the compiled loop reads the CPU tensor of ids as a NumPy view, once per record
    counted = _syncs_of_a_step(dataclasses.replace(CONFIG, async_scheduling=True), interpreted=False)
    assert counted == {"record": ["numpy"], "step": [], "record_drafts": ["numpy"]}


@pytest.mark.parametrize("interpreted", [False, True], ids=["host-mode", "interpret"])
def test_the_counter_sees_the_synchronous_record_read_its_ids(interpreted: bool) -> None:
    # the control: without async scheduling record_sampled validates on the host, one read of the ids
    counted = _syncs_of_a_step(CONFIG, interpreted)
    assert counted["record"] and counted["record_drafts"]
    assert np.all([name in ("numpy", "cpu") for name in counted["record"]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check runs it)")
def test_on_cuda_the_async_step_passes_sync_debug_mode_error() -> None:
    config = dataclasses.replace(CONFIG, async_scheduling=True)
    pool = fast.RequestStatePool(config, device="cuda")
    first = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3), ((3,),)),), num_scheduled_tokens={"a": 3})
    pool.apply(first)
    batch = pool.prepare(first)
    sampled = torch.tensor([7], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.record_sampled(batch, sampled)
        decode = SchedulerOutput(cached_requests=(CachedRequest("a", 3),), num_scheduled_tokens={"a": 1})
        pool.apply(decode)
        pool.prepare(decode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
