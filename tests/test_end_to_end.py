"""End to end: the tiny decoder generating through a backend's paged pipeline equals a dense recompute.

Every logits row the paged run produces, and every greedy token, is checked against the same model run
densely in float64 over the request's whole sequence (prompt + generated), with the tolerance of
`slotmap.tiny.model.dense_logit_tolerance`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

import spec
from conformance.backends import BackendHandle, load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, Workload, make_workload
from slotmap.cli import app
from slotmap.simulate.dense_check import check_request
from slotmap.simulate.speculative import SpeculativeComparison, compare, plain_greedy_run, prefix_check
from slotmap.simulate.verify import SpecVerifier
from slotmap.tiny.drafting import NgramDrafter, NoisyOracle
from slotmap.tiny.engine import Engine, RequestRecord, drive
from slotmap.tiny.model import ModelConfig
from spec.types import BatchInputs, CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


GROUPS = (KVCacheGroup(block_size=4, num_blocks=64), KVCacheGroup(block_size=4, num_blocks=64, sliding_window=5))
HAND_CONFIG = WorkerConfig(
    max_num_reqs=4, max_model_len=64, max_num_batched_tokens=32, vocab_size=2048, kv_groups=GROUPS
)
PREFIX = (7, 300, 1999, 42, 5, 5, 810, 64)  # two full blocks, shared by "a" and "b"
A_PROMPT = (*PREFIX, 11, 12)
B_PROMPT = (*PREFIX, 901, 902, 903)


def hand_steps() -> list[tuple[SchedulerOutput, int | None]]:
    """Chunked prefill, padding, a prefix-cache hit sharing blocks in both groups (the window group with a
    null block for positions out of its window), preemption with recompute into a replaced table."""
    return [
        (
            SchedulerOutput(
                new_requests=(NewRequest("a", A_PROMPT, ((1, 2, 3), (11, 12, 13))),), num_scheduled_tokens={"a": 6}
            ),
            8,
        ),
        (SchedulerOutput(cached_requests=(CachedRequest("a", 6),), num_scheduled_tokens={"a": 4}), None),
        (
            SchedulerOutput(
                new_requests=(NewRequest("b", B_PROMPT, ((1, 2, 4), (0, 12, 14)), num_computed_tokens=8),),
                cached_requests=(CachedRequest("a", 10),),
                num_scheduled_tokens={"b": 3, "a": 1},
            ),
            8,
        ),
        (SchedulerOutput(cached_requests=(CachedRequest("b", 11),), num_scheduled_tokens={"b": 1}), None),
        (
            SchedulerOutput(
                cached_requests=(
                    CachedRequest("a", 0, ((5, 6, 7), (15, 16, 17)), resumed=True),
                    CachedRequest("b", 12, ((8,), (18,))),
                ),
                num_scheduled_tokens={"a": 12, "b": 1},
            ),
            16,
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("a", 12, ((9,), (19,))), CachedRequest("b", 13)),
                num_scheduled_tokens={"a": 1, "b": 1},
            ),
            4,
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("b", 14),),
                finished_req_ids=frozenset({"a"}),
                num_scheduled_tokens={"b": 1},
            ),
            None,
        ),
    ]


def run_hand_steps(backend: BackendHandle) -> tuple[Engine, list[RequestRecord]]:
    engine = Engine(backend, HAND_CONFIG, ModelConfig(vocab_size=HAND_CONFIG.vocab_size))
    done: list[RequestRecord] = []
    for out, pad_to in hand_steps():
        done += engine.finish(out.finished_req_ids)
        engine.step(out, pad_to)
    return engine, done + engine.finish(set(engine.requests))


def test_hand_written_steps_match_dense(backend: BackendHandle) -> None:
    engine, records = run_hand_steps(backend)
    by_id = {r.req_id: r for r in records}
    # a: 10-token prompt sampled at step 2, one decode, then recompute + sample, one decode.
    assert len(by_id["a"].tokens) == len(A_PROMPT) + 4
    assert len(by_id["b"].tokens) == len(B_PROMPT) + 5
    for record in records:
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt)


def test_dense_check_catches_a_wrong_position() -> None:
    """Control: shifting one request's RoPE positions by one must fail the check (so passing means something)."""
    spec_backend = load_backend("spec")
    engine = Engine(spec_backend, HAND_CONFIG, ModelConfig(vocab_size=HAND_CONFIG.vocab_size))
    steps = hand_steps()
    for out, pad_to in steps[:3]:
        engine.step(out, pad_to)
    out, pad_to = steps[3]
    real_prepare = engine.pool.prepare

    def shifted_prepare(sched: SchedulerOutput, pad: int | None = None) -> BatchInputs:
        batch = real_prepare(sched, pad)
        batch.positions[:] += 1  # in place: record_sampled accepts only the batch prepare returned
        return batch

    engine.pool.prepare = shifted_prepare  # type: ignore[method-assign,assignment]
    engine.step(out, pad_to)
    check = check_request(engine.model, engine.requests["b"])
    assert not check.ok
    assert check.max_error > 1000 * check.tolerance


SCHED_CONFIG = WorkerConfig(
    max_num_reqs=6,
    max_model_len=48,
    max_num_batched_tokens=32,
    vocab_size=2048,
    kv_groups=(KVCacheGroup(block_size=4, num_blocks=24), KVCacheGroup(block_size=4, num_blocks=24, sliding_window=6)),
)
SCHED_MODEL = ModelConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, head_dim=8)
SCHED_KNOBS = SchedulerKnobs(max_chunk=8, pad_buckets=(8, 16, 32))


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: the hand-written steps cover it")
def test_reference_scheduler_run_matches_dense(backend: BackendHandle) -> None:
    """16 requests with shared prefixes through a pool too small for them all: every token of every request
    equals the dense recompute, and the run really chunked, padded, shared prefixes and preempted."""
    workload = make_workload(
        0,
        SCHED_CONFIG,
        num_requests=16,
        max_arrival_step=4,
        num_prefixes=2,
        shared_prefix_prob=0.7,
        max_prompt_len=24,
        max_new_tokens=10,
    )
    scheduler = ReferenceScheduler(SCHED_CONFIG, workload, knobs=SCHED_KNOBS, seed=0)
    engine = Engine(backend, SCHED_CONFIG, SCHED_MODEL)
    records: list[RequestRecord] = []
    drive(engine, scheduler, on_finished=records.append)
    records += engine.finish(set(engine.requests))

    stats = scheduler.stats
    assert stats.preemptions > 0 and stats.resumptions > 0
    assert stats.prefix_hit_tokens > 0
    assert stats.padded_steps > 0
    assert stats.window_releases > 0
    chunks = [entry for r in records for entry in r.logits if entry.sampled is None]  # mid-prefill rows
    assert chunks, "no prompt was prefilled in more than one step"
    assert sorted(r.req_id for r in records) == sorted(r.req_id for r in workload.requests)

    generated = 0
    for record in records:
        expected_prompt = next(w.prompt_token_ids for w in workload.requests if w.req_id == record.req_id)
        assert record.prompt == expected_prompt
        assert record.tokens == scheduler.requests[record.req_id].tokens  # what the scheduler was told
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt) >= 1
        generated += check.tokens_checked
    assert generated == sum(r.num_output for r in scheduler.requests.values())


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: a whole simulated workload is too long")
def test_simulate_command_verifies_and_plots(backend: BackendHandle, tmp_path: Path) -> None:
    plot = tmp_path / "run.png"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--backend",
            backend.name,
            "--requests",
            "12",
            "--seed",
            "1",
            "--verify-every",
            "2",
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "requests finished" in result.output and "all matched" in result.output
    assert plot.stat().st_size > 0


def test_verifier_flags_a_backend_that_drifts_from_spec() -> None:
    """Control: a backend whose attention output is 1e-4 (relative) off fails step verification."""
    drifting = BackendHandle(
        "drifting",
        SimpleNamespace(
            RequestStatePool=spec.RequestStatePool,
            write_kv=spec.write_kv,
            paged_attention=lambda *args, **kwargs: spec.paged_attention(*args, **kwargs) * np.float32(1.0001),
        ),
    )
    workload = make_workload(0, SCHED_CONFIG, num_requests=4, max_arrival_step=1, max_prompt_len=12, max_new_tokens=3)
    engine = Engine(drifting, SCHED_CONFIG, SCHED_MODEL)
    verifier = SpecVerifier(engine, every=1)
    drive(engine, ReferenceScheduler(SCHED_CONFIG, workload, knobs=SCHED_KNOBS), observer=verifier)
    assert verifier.steps_checked > 0
    assert not verifier.all_matched and "logits differ from spec" in verifier.mismatches[0]


class _ShiftedInputIds(spec.RequestStatePool):
    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        batch = super().prepare(sched, pad_to)
        return dataclasses.replace(batch, input_ids=(np.asarray(batch.input_ids) + 1) % SCHED_CONFIG.vocab_size)


def test_verifier_names_the_batch_field_that_differs_from_spec() -> None:
    """Control: a backend whose prepare shifts every input id is reported field by field, with the entries."""
    shifted = BackendHandle("shifted", SimpleNamespace(
        RequestStatePool=_ShiftedInputIds, write_kv=spec.write_kv, paged_attention=spec.paged_attention,
    ))  # fmt: skip
    workload = make_workload(0, SCHED_CONFIG, num_requests=2, max_arrival_step=1, max_prompt_len=12, max_new_tokens=2)
    engine = Engine(shifted, SCHED_CONFIG, SCHED_MODEL)
    verifier = SpecVerifier(engine, every=1)
    drive(engine, ReferenceScheduler(SCHED_CONFIG, workload, knobs=SCHED_KNOBS), observer=verifier)
    first = verifier.mismatches[0]
    assert first.startswith("step 1: BatchInputs differs from spec's: input_ids: ") and "entries differ" in first


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: the conformance suite drives its drafts")
@pytest.mark.parametrize("drafter", ["noisy oracle", "n-gram"])
def test_speculative_decoding_generates_the_plain_greedy_tokens(backend: BackendHandle, drafter: str) -> None:
    """Drafts verified greedily: after every step each request's tokens are a prefix of what the plain run
    generates, at the end they are equal, and every logits row kept matches the dense recompute."""
    workload = make_workload(
        5,
        SCHED_CONFIG,
        num_requests=10,
        max_arrival_step=3,
        num_prefixes=2,
        max_prompt_len=16,
        max_new_tokens=20,
        stop_token_prob=0.0,
    )
    if drafter == "n-gram":  # prompts that repeat themselves, so that the lookup finds something to propose
        workload = Workload(
            tuple(
                dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids[:4] * 4, max_new_tokens=12)
                for r in workload.requests
            )
        )
    plain, plain_steps = plain_greedy_run(backend, SCHED_CONFIG, workload, SCHED_KNOBS, 0, SCHED_MODEL)

    knobs = dataclasses.replace(SCHED_KNOBS, spec_tokens=3)
    oracle = NoisyOracle((r.tokens for r in plain.values()), 3, SCHED_CONFIG.vocab_size, seed=1)
    proposer = oracle if drafter == "noisy oracle" else NgramDrafter(3)
    scheduler = ReferenceScheduler(SCHED_CONFIG, workload, knobs=knobs, seed=0, proposer=proposer)
    engine = Engine(backend, SCHED_CONFIG, SCHED_MODEL)
    comparison = SpeculativeComparison(spec_tokens=3)
    records: list[RequestRecord] = []
    steps = drive(engine, scheduler, on_step=prefix_check(comparison, plain, engine), on_finished=records.append)
    records += engine.finish(set(engine.requests))
    compare(comparison, workload, plain, records)

    assert comparison.identical, comparison.differences
    assert comparison.requests_compared == len(workload.requests)
    for record in records:
        assert record.tokens == plain[record.req_id].tokens
        check = check_request(engine.model, record)
        assert check.ok, check.failures
    stats = scheduler.stats
    assert stats.drafts_scheduled > 0
    if drafter == "noisy oracle":  # right often enough to save steps, wrong often enough to roll back
        assert 0 < stats.drafts_accepted < stats.drafts_scheduled
        assert stats.all_drafts_accepted > 0 and stats.no_draft_accepted > 0
        assert stats.drafts_crossing_blocks > 0
        assert steps < plain_steps


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: a whole simulated workload is too long")
def test_simulate_with_spec_tokens_reports_acceptance_and_equality(backend: BackendHandle) -> None:
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--backend",
            backend.name,
            "--requests",
            "8",
            "--seed",
            "1",
            "--verify-every",
            "2",
            "--spec-tokens",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "acceptance" in result.output and "all identical" in result.output
