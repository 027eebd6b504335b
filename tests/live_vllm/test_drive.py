"""The reference scheduler drives vLLM's model runner v1 (vLLM's own scheduler bypassed), every step checked by the
shadow checker: preemption and resumption on the very next step, prefix hits, chunked prefill, drafts by prompt
lookup that the runner accepts and rejects, two KV groups with a sliding window; a bug planted inside the runner
and a crash of the runner itself, each named and reproduced in a fresh runner by the script the drive wrote."""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings

from conformance.scenario import vllm_stress_scenario
from conformance.scheduler import SchedulerKnobs
from conformance.vllm_drive import (
    RUNNER_GATES,
    DriveError,
    DrivePlan,
    EngineSpec,
    KnobGateError,
    build_llm,
    drive,
    shutdown,
)
from conformance.vllm_drive.strategies import drive_plans
from shadow.checker import ShadowMismatchError
from shadow.vllm_attach import model_runner_of
from tests.live_vllm.engine import MODELS

FEW_BLOCKS = 12  # the scheduler's pool: 11 blocks of 32 tokens for 8 requests of up to 256 tokens
DRAFTING = SchedulerKnobs(spec_tokens=3, max_chunk=40, reuse_freed_first=True)


@pytest.fixture(scope="module")
def llama() -> Iterator[Any]:
    llm = build_llm(EngineSpec(str(MODELS / "llama"), num_blocks=64, spec_tokens=3))
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def gemma2() -> Iterator[Any]:
    llm = build_llm(EngineSpec(str(MODELS / "gemma2"), num_blocks=64, spec_tokens=3))
    yield llm
    shutdown(llm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_llama_preempted_resumed_prefix_hits_chunks_drafts_every_step_checked(
    llama: Any, seed: int, tmp_path: Path
) -> None:
    knobs = replace(DRAFTING, drafts_on_admission=True, zero_new_blocks=True)
    report = drive(llama, DrivePlan(knobs, seed=seed, scheduler_blocks=FEW_BLOCKS), steps=150, repro_dir=tmp_path)
    print(report.summary())
    assert report.steps_checked == report.steps >= 150
    assert report.preemptions > 0 and report.next_step_resumptions > 0, report
    assert report.prefix_hits > 0 and report.chunked_prefills > 0, report
    assert report.drafts_accepted > 0 and report.drafts_rejected > 0, report
    assert report.all_drafts_accepted > 0 and report.no_draft_accepted > 0, report


@pytest.mark.parametrize("seed", [0, 1])
def test_gemma2_two_groups_window_releases_blocks_handed_back_every_step_checked(
    gemma2: Any, seed: int, tmp_path: Path
) -> None:
    knobs = replace(DRAFTING, null_lookahead=True, common_prefix_blocks=True)
    report = drive(gemma2, DrivePlan(knobs, seed=seed, scheduler_blocks=FEW_BLOCKS + 4), steps=150, repro_dir=tmp_path)
    print(report.summary())
    assert report.steps_checked == report.steps >= 150
    assert report.window_releases > 0 and report.window_reuses > 0, report
    assert report.null_lookaheads > 0 and report.preemptions > 0, report
    assert report.drafts_accepted > 0 and report.drafts_rejected > 0, report


@pytest.mark.parametrize("seed", [0, 1])
def test_the_vllm_stress_scenarios_drive_gemma2(gemma2: Any, seed: int) -> None:
    """A Scenario's knobs and workload, on the runner's config (its pool cut to the scenario's size); the knobs
    v1 cannot take (seed 1: model runner v2's form) reset and reported."""
    report = drive(gemma2, vllm_stress_scenario(seed), drop_gated=True)
    assert report.steps_checked == report.steps > 0 and report.rounds == 1
    assert set(report.dropped_knobs) == ({"model_runner_v2"} if seed % 2 else set())


def test_a_row_condense_moves_without_its_last_block_is_named_and_reproduced(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted in vLLM: BlockTable.move_row (condense() moving a request down into a freed row) copies one entry
    short, so the moved request's last table entry is the freed row's cleared 0: its next tokens would write the
    null block."""
    from vllm.v1.worker.block_table import BlockTable

    moved: list[str] = []

    def one_short(self: Any, src: int, tgt: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table.np[tgt, : n - 1] = self.block_table.np[src, : n - 1]
        self.block_table.np[src, :n] = 0
        self.num_blocks_per_row[tgt], self.num_blocks_per_row[src] = n, 0
        moved.append(f"{src}->{tgt}")

    monkeypatch.setattr(BlockTable, "move_row", one_short)
    with pytest.raises(DriveError) as caught:
        drive(llama, DrivePlan(DRAFTING, seed=0, scheduler_blocks=FEW_BLOCKS), steps=300, repro_dir=tmp_path)
    failure = caught.value
    print(failure)
    assert moved and failure.kind == "mismatch" and failure.req_id is not None
    assert failure.field == "slot_mapping[0]" and "got 0," in failure.detail  # its tokens written into block 0
    assert isinstance(failure.__cause__, ShadowMismatchError)
    assert failure.spec_repro_path is not None and failure.spec_repro_path.parent == tmp_path
    assert failure.repro_path is not None and failure.repro_path.parent == tmp_path
    with pytest.raises(ShadowMismatchError) as replayed:  # a fresh engine, the bug still planted
        runpy.run_path(str(failure.repro_path))
    assert (replayed.value.step, replayed.value.req_id, replayed.value.field) == (
        failure.step,
        failure.req_id,
        failure.field,
    )
    monkeypatch.undo()
    assert drive(llama, DrivePlan(DRAFTING, seed=0, scheduler_blocks=FEW_BLOCKS), steps=40).steps_checked >= 40


def test_drafts_to_the_end_crash_v1_and_the_script_crashes_a_fresh_runner(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate's reason, verified: with it lifted, vLLM's own assertion stops the runner, and the script
    replays the crash into a fresh one."""
    monkeypatch.delitem(RUNNER_GATES["v1"], "drafts_to_the_end")
    knobs = replace(DRAFTING, drafts_to_the_end=True)
    plan = DrivePlan(knobs, seed=0, scheduler_blocks=FEW_BLOCKS, max_new_tokens=200)
    with pytest.raises(DriveError) as caught:
        drive(llama, plan, steps=300, repro_dir=tmp_path)
    failure = caught.value
    print(failure)
    assert failure.kind == "crash" and failure.field == "AssertionError"
    assert "Sampled token IDs exceed the max model length" in failure.detail
    assert failure.runner_traceback is not None and "_bookkeeping_sync" in failure.runner_traceback
    assert failure.repro_path is not None
    with pytest.raises(AssertionError, match="Sampled token IDs exceed the max model length"):
        runpy.run_path(str(failure.repro_path))


def test_the_other_v1_gates_refuse_with_their_reason(llama: Any) -> None:
    asks: list[dict[str, Any]] = [{"drafts_to_the_end": True}, {"model_runner_v2": True}, {"pad_buckets": (8, 64)}]
    for setting in asks:
        with pytest.raises(KnobGateError) as refused:
            drive(llama, DrivePlan(replace(DRAFTING, **setting)), steps=1)
        (name,) = setting
        assert refused.value.gated == {name: RUNNER_GATES["v1"][name]}
    report = drive(llama, DrivePlan(replace(DRAFTING, pad_buckets=(8, 64))), steps=5, drop_gated=True)
    assert report.dropped_knobs == {"pad_buckets": RUNNER_GATES["v1"]["pad_buckets"]}
    with pytest.raises(KnobGateError, match="verifies at most 3"):
        drive(llama, DrivePlan(replace(DRAFTING, spec_tokens=4)), steps=1)


def test_v1_reads_v2s_resumption_form_as_a_streaming_update(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model_runner_v2 gate's reason, verified: a resumed request sent again as new diverges on v1."""
    monkeypatch.delitem(RUNNER_GATES["v1"], "model_runner_v2")
    knobs = replace(DRAFTING, model_runner_v2=True)
    with pytest.raises(DriveError) as caught:
        drive(llama, DrivePlan(knobs, seed=1, scheduler_blocks=FEW_BLOCKS), steps=300, repro_dir=tmp_path)
    assert caught.value.kind == "mismatch", caught.value


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=drive_plans("v1"))
def test_any_plan_drives_one_engine_every_step_checked(llama: Any, plan: DrivePlan) -> None:
    """One round each (a chunk of 1 token a step can make it long: at most 100 steps, then its requests are
    finished), each example a fresh scheduler and fresh request ids; the runner is empty after each."""
    from conformance.vllm_drive.runner_step import held_requests

    report = drive(llama, plan, steps=100, rounds=1)
    note(report.summary())
    assert report.steps_checked == report.steps > 0 and report.rounds == 1
    assert not held_requests(model_runner_of(llama))


def test_the_command_with_runner_v2_says_what_it_needs_here(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm.triton_utils import HAS_TRITON

    from conformance.vllm_drive.__main__ import main

    if HAS_TRITON:
        pytest.skip("this vLLM builds model runner v2: the command drives it (tests/live_vllm/test_mrv2.py's process)")
    assert main(["--runner", "v2", "--model", str(MODELS / "llama"), "--steps", "5"]) == 2
    assert "model runner v2 needs Triton" in capsys.readouterr().err


def test_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Last in this file: the command shuts its engine down, which tears down vLLM's distributed state in this
    process (conformance/vllm_drive/repro.py), so no engine of this module may run after it."""
    from conformance.vllm_drive.__main__ import main

    assert main(["--runner", "v1", "--model", str(MODELS / "llama"), "--steps", "60", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "model runner v1: " in out and "steps checked, all agreeing" in out
