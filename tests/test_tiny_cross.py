"""The tiny encoder-decoder (slotmap/tiny, `ModelConfig.cross_attention`): its greedy output through the paged
pipeline equals its dense recompute, so every cross-attention mapping (spec/cross_attention.py) is right."""

from __future__ import annotations

import dataclasses
import random

import pytest

from conformance.backends import BackendHandle, load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from slotmap.simulate.dense_check import check_request
from slotmap.tiny.engine import Engine, RequestRecord, drive
from slotmap.tiny.model import ModelConfig
from spec.types import BatchInputs, CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

GROUPS = (KVCacheGroup(4, 64), KVCacheGroup(4, 64, kind="cross_attention"))
CONFIG = WorkerConfig(4, 48, 32, 2048, GROUPS, max_encoder_len=12)
MODEL = ModelConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, head_dim=8, layer_groups=(0, 0),
                    cross_attention=True)  # fmt: skip
A_PROMPT, B_PROMPT = (7, 300, 1999, 42, 5, 5, 810, 64, 11, 12), (901, 902, 903)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def hand_steps() -> list[SchedulerOutput]:
    """a's prompt in two chunks (its encoder runs on the first), b beside a's decode, then a preempted and
    resumed from 0 with new blocks, its encoder running again."""
    return [
        SchedulerOutput(new_requests=(NewRequest("a", A_PROMPT, ((1, 2, 3), (20, 21)), encoder_len=7),),
                        num_scheduled_tokens={"a": 6}),
        SchedulerOutput(new_requests=(NewRequest("b", B_PROMPT, ((4,), (22, 23, 24)), encoder_len=12),),
                        cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"b": 3, "a": 4}),
        SchedulerOutput(cached_requests=(CachedRequest("a", 10), CachedRequest("b", 3, ((5,), ()))),
                        num_scheduled_tokens={"a": 1, "b": 1}),
        SchedulerOutput(cached_requests=(CachedRequest("a", 0, ((6, 7, 8), (25, 26)), resumed=True),
                                         CachedRequest("b", 4)), num_scheduled_tokens={"a": 12, "b": 1}),
        SchedulerOutput(cached_requests=(CachedRequest("a", 12, ((9,), ())), CachedRequest("b", 5)),
                        num_scheduled_tokens={"a": 1, "b": 1}),
    ]  # fmt: skip


def test_hand_written_encoder_decoder_steps_match_dense(backend: BackendHandle) -> None:
    engine = Engine(backend, CONFIG, MODEL)
    for out in hand_steps():
        engine.step(out)
    records = engine.finish(set(engine.requests))
    assert {r.req_id: len(r.tokens) for r in records} == {"a": len(A_PROMPT) + 4, "b": len(B_PROMPT) + 4}
    for record in records:
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt)


def test_the_dense_check_catches_cross_slots_written_one_slot_off() -> None:
    """Control: writing b's encoder KV one slot off must fail the check (so passing means something)."""
    engine = Engine(load_backend("spec"), CONFIG, MODEL)
    steps = hand_steps()
    engine.step(steps[0])
    real_prepare = engine.pool.prepare

    def shifted(sched: SchedulerOutput, pad: int | None = None) -> BatchInputs:
        batch = real_prepare(sched, pad)
        batch.cross_slot_mapping[:] += 1  # in place: record_sampled accepts only the batch prepare returned
        return batch

    engine.pool.prepare = shifted  # type: ignore[method-assign,assignment]
    engine.step(steps[1])
    engine.pool.prepare = real_prepare  # type: ignore[method-assign]
    engine.step(steps[2])
    check = check_request(engine.model, engine.requests["b"])
    assert not check.ok


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: the hand-written steps cover it")
def test_reference_scheduler_encoder_decoder_run_matches_dense(backend: BackendHandle) -> None:
    """12 encoder-decoder requests through a pool too small for them all: every token equals the dense
    recompute, and the run chunked prompts and preempted, so encoders ran again after a resume."""
    config = dataclasses.replace(CONFIG, kv_groups=(KVCacheGroup(4, 20), KVCacheGroup(4, 16, kind="cross_attention")))
    workload = make_workload(1, config, num_requests=12, max_arrival_step=3, max_prompt_len=20, max_new_tokens=8)
    rng = random.Random(1)
    requests = tuple(dataclasses.replace(r, encoder_len=rng.randint(1, 12)) for r in workload.requests)
    workload = dataclasses.replace(workload, requests=requests)
    scheduler = ReferenceScheduler(config, workload, knobs=SchedulerKnobs(max_chunk=8, pad_buckets=(8, 16)), seed=1)
    engine = Engine(backend, config, MODEL)
    records: list[RequestRecord] = []
    drive(engine, scheduler, on_finished=records.append)
    records += engine.finish(set(engine.requests))
    assert scheduler.stats.encoder_writes > len(requests) - 1 and scheduler.stats.encoder_rewrites > 0
    assert sorted(r.req_id for r in records) == sorted(r.req_id for r in requests)
    for record in records:
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt) >= 1
