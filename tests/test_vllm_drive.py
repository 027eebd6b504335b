"""conformance.vllm_drive without vLLM: the prompt-lookup proposer, the knob gates, the drive's workloads and
plans, and the reproduction script's text (the live drive is tests/live_vllm/test_drive.py)."""

from __future__ import annotations

import runpy
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import given, settings

from conformance.scheduler import SchedulerKnobs, Workload, WorkloadRequest
from conformance.vllm_drive import FORCED, RUNNER_GATES, DrivePlan, EngineSpec, KnobGateError, NgramProposer, gated
from conformance.vllm_drive.gates import for_runner
from conformance.vllm_drive.repro import write
from conformance.vllm_drive.strategies import drive_plans
from conformance.vllm_drive.vllm_output import finishing
from conformance.vllm_drive.workload import lookup_workload
from spec.types import KVCacheGroup, WorkerConfig

GEMMA2_LIKE = WorkerConfig(8, 256, 64, 512, (KVCacheGroup(32, 64, 64), KVCacheGroup(32, 64)), one_block_pool=True)


def test_prompt_lookup_proposes_what_followed_the_longest_earlier_match() -> None:
    lookup = NgramProposer(3)
    assert lookup.propose([7, 8, 9, 5, 7, 8], room=10) == [9, 5, 7]  # [7, 8] occurred before: 9, 5, 7 followed
    assert lookup.propose([7, 8, 9, 5, 7, 8], room=2) == [9, 5]
    assert lookup.propose([1, 2, 3, 4], room=10) == []  # no earlier occurrence of any suffix
    assert lookup.propose([4, 4, 4], room=10) == [4]  # the latest match runs into the suffix: as much as there is
    assert NgramProposer(0).propose([4, 4, 4, 4], room=5) == []
    assert NgramProposer(2, min_n=2).propose([1, 5, 2, 5], room=5) == []  # 1-grams are not enough


def test_each_runner_refuses_its_gated_knobs_with_the_reason_or_resets_them_when_asked() -> None:
    knobs = SchedulerKnobs(spec_tokens=2, drafts_to_the_end=True, pad_buckets=(8,), zero_new_blocks=True)
    assert gated("v1", knobs) == {k: RUNNER_GATES["v1"][k] for k in ("pad_buckets", "drafts_to_the_end")}
    with pytest.raises(KnobGateError, match="drafts_to_the_end: v1's _bookkeeping_sync asserts"):
        for_runner("v1", knobs)
    taken, dropped = for_runner("v2", knobs, drop_gated=True)
    assert set(dropped) == {"pad_buckets", "drafts_to_the_end", "zero_new_blocks"}
    assert taken == SchedulerKnobs(spec_tokens=2, model_runner_v2=True)  # v2's form forced on
    workload = Workload((WorkloadRequest("a", 0, (1, 2), 1, encoder_len=4),))
    assert "workload.encoder_len" in gated("v1", SchedulerKnobs(), workload=workload)
    assert "config.async_scheduling" in gated("v2", SchedulerKnobs(), replace(GEMMA2_LIKE, async_scheduling=True))
    names = {f.name for f in fields(SchedulerKnobs)}
    for runner, gates in RUNNER_GATES.items():  # every gate names a knob or a config/workload feature, with a reason
        assert all((k in names or "." in k) and reason for k, reason in gates.items()), runner
        assert not set(gates) & set(FORCED[runner])


@settings(max_examples=30, deadline=None)
@given(plan=drive_plans("v2"))
def test_the_plans_never_draw_a_gated_knob(plan: DrivePlan) -> None:
    assert gated("v2", plan.knobs) == {} and plan.knobs.model_runner_v2


def test_a_drive_workload_fits_the_runner_repeats_itself_and_tags_its_ids() -> None:
    workload = lookup_workload(5, GEMMA2_LIKE, tag="d9", num_requests=12, max_new_tokens=40)
    assert [r.req_id for r in workload.requests] == [f"d9-{i}" for i in range(12)]
    for r in workload.requests:
        assert max(r.prompt_token_ids) < GEMMA2_LIKE.vocab_size
        assert len(r.prompt_token_ids) + r.max_new_tokens <= GEMMA2_LIKE.max_model_len
    lookup = NgramProposer(3)
    assert sum(bool(lookup.propose(r.prompt_token_ids, 3)) for r in workload.requests) >= 6  # lookups find drafts


def test_a_plan_cuts_the_scheduler_pool_within_the_runners() -> None:
    assert DrivePlan(scheduler_blocks=3).scheduler_config(GEMMA2_LIKE).kv_groups[1].num_blocks == 3
    assert DrivePlan().scheduler_config(GEMMA2_LIKE) == GEMMA2_LIKE
    for blocks in (2, 65):  # a block per group besides the null block, and no more than the runner has
        with pytest.raises(ValueError, match=r"scheduler_blocks: 3 \.\. 64"):
            DrivePlan(scheduler_blocks=blocks).scheduler_config(GEMMA2_LIKE)
    assert DrivePlan(seed=4).round_seed(0) == 4 and DrivePlan(seed=4).round_seed(1) != DrivePlan(seed=5).round_seed(0)


def test_the_reproduction_script_holds_the_engine_and_every_output(tmp_path: Path) -> None:
    engine = EngineSpec("tests/live_vllm/models/llama", num_blocks=12, spec_tokens=3)
    steps = [finishing({"a"}), finishing(set())]
    path = write(engine, {"a": 4}, steps, "crash at step 1: batch: AssertionError: ...", tmp_path)
    assert path.parent == tmp_path and path.name == "drive_repro_step1.py"
    assert "crash at step 1" in path.read_text()
    held = runpy.run_path(str(path), run_name="not_main")  # read, not replayed
    assert (held["engine"], held["max_tokens"], held["steps"]) == (engine, {"a": 4}, steps)


def test_importing_the_drive_package_imports_no_vllm() -> None:
    code = ("import sys, conformance.vllm_drive, conformance.vllm_drive.__main__, conformance.vllm_drive.strategies; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
