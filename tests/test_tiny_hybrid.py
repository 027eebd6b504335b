"""The tiny hybrid model (slotmap/tiny, `ModelConfig.mamba`): attention plus a recurrent sublayer whose state lives
in the mamba group's state blocks. Its greedy output through the paged pipeline equals its dense recompute, so
every state index (spec/mamba.py) is right: a state read where it was written, none for a fresh row (also
in a row a finished request left, vLLM PR #37728), after a preemption, after accepted drafts, from a prefix hit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from conformance.backends import BackendHandle, load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from conformance.scheduler.drafter import Proposer
from slotmap.simulate.dense_check import check_request
from slotmap.tiny.drafting import NoisyOracle
from slotmap.tiny.engine import Engine, RequestRecord, drive
from slotmap.tiny.model import ModelConfig
from spec.types import (
    NULL_BLOCK_ID,
    BatchInputs,
    CachedRequest,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
)

GROUPS = (KVCacheGroup(4, 64), KVCacheGroup(8, 40, kind="mamba"))  # align mode: a state block per 8 tokens
CONFIG = WorkerConfig(4, 48, 32, 2048, GROUPS)
MODEL = ModelConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, head_dim=8, layer_groups=(0, 0), mamba=True)
A_PROMPT, B_PROMPT, C_PROMPT = (7, 300, 1999, 42, 5, 5, 810, 64, 11, 12), (901, 902, 903), (3, 1, 4, 1, 5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def hand_steps() -> list[SchedulerOutput]:
    """a's prompt in two chunks (the second crosses into a's second state block), b beside it; both decode; a
    finishes and c takes its row and its freed state block 20; b is preempted and resumed from 0 in block 23."""
    return [
        SchedulerOutput(new_requests=(NewRequest("a", A_PROMPT, ((1, 2), (20,))),), num_scheduled_tokens={"a": 6}),
        SchedulerOutput(new_requests=(NewRequest("b", B_PROMPT, ((4,), (22,))),),
                        cached_requests=(CachedRequest("a", 6, ((3,), (21,))),), num_scheduled_tokens={"b": 3, "a": 4}),
        SchedulerOutput(cached_requests=(CachedRequest("a", 10), CachedRequest("b", 3)),
                        num_scheduled_tokens={"a": 1, "b": 1}),
        SchedulerOutput(new_requests=(NewRequest("c", C_PROMPT, ((5, 6), (20,))),),
                        cached_requests=(CachedRequest("b", 4, ((9,), ())),), num_scheduled_tokens={"c": 5, "b": 1},
                        finished_req_ids=frozenset({"a"})),
        SchedulerOutput(cached_requests=(CachedRequest("b", 0, ((7, 8), (23,)), resumed=True), CachedRequest("c", 5)),
                        num_scheduled_tokens={"b": 6, "c": 1}),
        SchedulerOutput(cached_requests=(CachedRequest("b", 6), CachedRequest("c", 6)),
                        num_scheduled_tokens={"b": 1, "c": 1}),
    ]  # fmt: skip


def _run(engine: Engine, edit: Callable[[int, BatchInputs], None] | None = None) -> dict[str, RequestRecord]:
    real_prepare = engine.pool.prepare
    for i, out in enumerate(hand_steps()):

        def prepare(sched: SchedulerOutput, pad: int | None = None, i: int = i) -> BatchInputs:
            batch = real_prepare(sched, pad)
            if edit is not None:
                edit(i, batch)  # in place: record_sampled accepts only the batch prepare returned
            return batch

        engine.pool.prepare = prepare  # type: ignore[method-assign,assignment]
        engine.step(out)
    return {r.req_id: r for r in engine.finish(set(engine.requests))}


def test_hand_written_hybrid_steps_match_dense(backend: BackendHandle) -> None:
    engine = Engine(backend, CONFIG, MODEL)
    records = _run(engine)
    assert {r: len(rec.tokens) for r, rec in records.items()} == {"a": 12, "b": 8, "c": 8}
    for record in records.values():
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt)


def _row(batch: BatchInputs, req_id: str) -> int:
    return batch.req_ids.index(req_id)


@pytest.mark.parametrize(
    "bug",
    [
        "c reads the state a left in its block",  # the stale-state bug class of vLLM PR #37728
        "c reads the null block",  # vLLM PR #33937
        "b's resumed prefill reads its old state",
    ],
)
def test_the_dense_check_catches_a_wrong_state_read(bug: str) -> None:
    """Controls: each wrong read index, planted in spec's batch, must fail the dense check."""
    engine = Engine(load_backend("spec"), CONFIG, MODEL)

    def edit(step: int, batch: BatchInputs) -> None:
        read = batch.mamba_prev_state_indices[1]
        if step == 3 and bug.startswith("c reads the state"):
            read[_row(batch, "c")] = 20
        elif step == 3 and bug == "c reads the null block":
            read[_row(batch, "c")] = NULL_BLOCK_ID
        elif step == 4 and bug.startswith("b's resumed"):
            read[_row(batch, "b")] = 22

    records = _run(engine, edit)
    victim = "b" if bug.startswith("b") else "c"
    assert not check_request(engine.model, records[victim]).ok


def test_the_dense_check_catches_a_state_written_to_the_wrong_block() -> None:
    engine = Engine(load_backend("spec"), CONFIG, MODEL)

    def edit(step: int, batch: BatchInputs) -> None:
        if step == 1:  # a's state after its prompt written to b's block: a's decode reads stale state
            batch.mamba_state_indices[1][_row(batch, "a"), 0] = 22

    assert not check_request(engine.model, _run(engine, edit)["a"]).ok


def _scheduler_run(
    backend: BackendHandle, knobs: SchedulerKnobs, proposer: Proposer | None = None
) -> tuple[ReferenceScheduler, dict[str, RequestRecord]]:
    """8 requests, most sharing a prefix, through a pool whose mamba group holds 10 state blocks."""
    mamba = KVCacheGroup(8, 10, kind="mamba", num_speculative_blocks=knobs.spec_tokens)
    config = dataclasses.replace(CONFIG, kv_groups=(KVCacheGroup(4, 30), mamba))
    workload = make_workload(3, config, num_requests=8, max_arrival_step=6, max_prompt_len=24, max_new_tokens=8,
                             num_prefixes=1, shared_prefix_prob=0.8)  # fmt: skip
    scheduler = ReferenceScheduler(config, workload, knobs=knobs, seed=2, proposer=proposer)
    engine = Engine(backend, config, MODEL)
    records: list[RequestRecord] = []
    drive(engine, scheduler, on_finished=records.append)
    records += engine.finish(set(engine.requests))
    assert sorted(r.req_id for r in records) == sorted(r.req_id for r in workload.requests)
    for record in records:
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt) >= 1
    return scheduler, {r.req_id: r for r in records}


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: the hand-written steps cover it")
def test_reference_scheduler_hybrid_run_with_prefix_caching_matches_dense(backend: BackendHandle) -> None:
    """Shared prefixes in align mode: hits start from the state cached at a block end; the pool is small enough
    that requests are preempted and resumed."""
    scheduler, _ = _scheduler_run(backend, SchedulerKnobs(max_chunk=8, enable_prefix_caching=True))
    assert scheduler.stats.prefix_hit_tokens > 0 and scheduler.stats.preemptions > 0


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: the hand-written steps cover it")
def test_reference_scheduler_hybrid_run_with_drafts_matches_dense(backend: BackendHandle) -> None:
    """Drafts whose states go to the speculative blocks; the next step reads the state of the last accepted one."""
    _, plain = _scheduler_run(backend, SchedulerKnobs(max_chunk=8))
    oracle = NoisyOracle((r.tokens for r in plain.values()), 2, CONFIG.vocab_size, seed=1)
    scheduler, drafted = _scheduler_run(backend, SchedulerKnobs(max_chunk=8, spec_tokens=2), oracle)
    assert {r: d.tokens for r, d in drafted.items()} == {r: p.tokens for r, p in plain.items()}
    stats = scheduler.stats
    assert 0 < stats.drafts_accepted < stats.drafts_scheduled and stats.no_draft_accepted > 0


def test_a_hybrid_model_needs_a_mamba_group() -> None:
    with pytest.raises(ValueError, match="mamba group"):
        Engine(load_backend("spec"), WorkerConfig(4, 48, 32, 2048, (KVCacheGroup(4, 64),)), MODEL)
