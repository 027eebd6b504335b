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


def _syncs_of_device_drafts(interpreted: bool, device: str = "cpu") -> dict[str, list[str]]:
    """Drafts proposed on the device (rule 8): two placeholder steps back to back, the second sent before the
    verdict on the first; the counted calls of each record and of each step."""
    config = dataclasses.replace(CONFIG, async_scheduling=True)
    with interpret(interpreted):
        pool = fast.RequestStatePool(config, device)
        first = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3), ((3,),)),), num_scheduled_tokens={"a": 3})
        pool.apply(first)
        batch = pool.prepare(first)
        with HostSyncCounter() as record:
            pool.record_sampled(batch, torch.tensor([7], device=device), torch.tensor([[5, 6]], device=device))
        with HostSyncCounter() as step:
            drafting = SchedulerOutput(cached_requests=(CachedRequest("a", 3),), num_scheduled_tokens={"a": 3},
                                       scheduled_spec_decode_tokens={"a": (-1, -1)})  # fmt: skip
            pool.apply(drafting)
            batch = pool.prepare(drafting)
        with HostSyncCounter() as record_drafts:
            pool.record_sampled(batch, torch.tensor([[5, 9, -1]], device=device), torch.tensor([[4, 8]], device=device))
        with HostSyncCounter() as step_ahead:  # counted 3 + 1 + 3 = 7 known, 6 in truth: sent at 6, run at 5
            ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"a": 3},
                                    scheduled_spec_decode_tokens={"a": (-1, -1)})  # fmt: skip
            pool.apply(ahead)
            batch = pool.prepare(ahead)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("default")  # the checks below read the device
    assert batch.positions.tolist() == [5, 6, 7] and batch.input_ids.tolist() == [9, 4, 8]
    return {"record": record.calls, "step": step.calls, "record_drafts": record_drafts.calls,
            "step_ahead": step_ahead.calls}  # fmt: skip


def test_drafts_proposed_on_the_device_wait_for_nothing() -> None:
    # the step ahead is the apply after the first record's next: it reads that record's copy, started at the record
    # (on CUDA behind an event, fast.runtime.HostCopy): written, known, faults, tokens and proposals, one view each
    counted = _syncs_of_device_drafts(interpreted=True)
    assert counted == {"record": [], "step": [], "record_drafts": [], "step_ahead": ["numpy"] * 5}


def test_in_host_mode_drafts_proposed_on_the_device_view_host_memory() -> None:
    # one NumPy view of the sampled ids and one of the proposals per record (the first also of the proposals'
    # buffer it makes), nothing in the steps
    views = ["numpy", "numpy"]
    assert _syncs_of_device_drafts(interpreted=False) == {"record": [*views, "numpy"], "step": [],
                                                          "record_drafts": views, "step_ahead": []}  # fmt: skip


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu-check runs it)")
def test_on_cuda_drafts_proposed_on_the_device_pass_sync_debug_mode_error() -> None:
    torch.cuda.set_sync_debug_mode("error")
    try:
        counted = _syncs_of_device_drafts(interpreted=False, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counted == {"record": [], "step": [], "record_drafts": [], "step_ahead": ["numpy"] * 5}


def test_a_hybrid_step_sent_ahead_of_its_verdict_waits_for_nothing() -> None:
    # Mamba under async (spec/mamba.py): the state read of the step after a drafting one comes from the device's
    # corrected count, so the Triton path (here under the interpreter) reads nothing back to compute it
    mamba = KVCacheGroup(4, 16, kind="mamba", num_speculative_blocks=2)
    config = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 16), mamba), async_scheduling=True)
    with interpret(True):
        pool = fast.RequestStatePool(config)
        first = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3), ((3, 4), (5, 6, 7, 8))),),
                                num_scheduled_tokens={"a": 3})  # fmt: skip
        pool.apply(first)
        pool.record_sampled(pool.prepare(first), torch.tensor([7]))
        drafting = SchedulerOutput(cached_requests=(CachedRequest("a", 3),), num_scheduled_tokens={"a": 3},
                                   scheduled_spec_decode_tokens={"a": (5, 6)})  # fmt: skip
        pool.apply(drafting)
        pool.record_sampled(pool.prepare(drafting), torch.tensor([[5, 9, -1]]))
        ahead = SchedulerOutput(cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"a": 1})
        pool.apply(ahead)  # reads the prefill's record, a step old (rule 6): the drafting record stays unread
        with HostSyncCounter() as step:
            batch = pool.prepare(ahead)
    assert step.calls == []
    assert batch.mamba_prev_state_indices[1].tolist() == [7]  # draft 5 kept: the state after position 4, entry 2
