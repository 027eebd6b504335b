"""The shadow checker beside an engine loop written like vLLM v1's: silent when it is right, and it
names the step, request and field of a planted bug, with a reproduction that fails the same way.

tests/test_shadow_drafts.py: drafting steps in vLLM's form; tests/test_shadow_refusals.py: going on past a
refused step; tests/test_shadow_files.py: where reproductions are written."""

from __future__ import annotations

import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import spec
from conformance.scenario import Scenario, random_scenario, vllm_stress_scenario
from conformance.scheduler import ReferenceScheduler, as_vllm
from shadow.checker import ShadowChecker, ShadowMismatchError, ShadowRefusalError, replay
from shadow.inputs import to_numpy
from spec.errors import ScheduleError
from spec.interop import VllmCachedRequestData, VllmNewRequestData, VllmSchedulerOutput
from spec.types import NULL_BLOCK_ID, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from tests.v1_style_engine import V1StyleEngine

# a wrong claim planted in a real step's vLLM output: (the output, slotmap's, the scheduler) -> the planted output,
# or None to send it as it is
Plant = Callable[[VllmSchedulerOutput, SchedulerOutput, ReferenceScheduler], VllmSchedulerOutput | None]


def _run(
    scenario: Scenario, engine: V1StyleEngine, checker: ShadowChecker, plant: Plant | None = None
) -> ReferenceScheduler:
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    while not sched.done():
        out = sched.schedule()
        vllm_out = as_vllm(out, sched)
        arrays, order = engine.execute(vllm_out)
        planted = plant(vllm_out, out, sched) if plant is not None else None
        checker.check(vllm_out if planted is None else planted, arrays, order)
        takes = sched.sampling_req_ids(out)
        sampled = {r: int(rng.integers(scenario.config.vocab_size)) for r in takes}
        engine.record_sampled(sampled)
        checker.record_sampled(sampled)
        sched.update(out, sampled)
    return sched


@pytest.mark.parametrize("seed", range(4))
def test_a_correct_v1_style_engine_passes_every_step(seed: int, tmp_path: object) -> None:
    for scenario in (vllm_stress_scenario(seed), random_scenario(seed)):
        engine = V1StyleEngine(scenario.config)
        checker = ShadowChecker(scenario.config, repro_dir=str(tmp_path))
        sched = _run(scenario, engine, checker)
        assert sched.stats.steps == checker.step_index > 0


def test_the_correct_runs_cover_moves_preemption_and_resumption(tmp_path: object) -> None:
    """The runs above are only evidence if rows really moved, requests really came back, and each field of
    vLLM's output that the checker checks against spec's tables was sent with something to check."""
    swaps = resumptions = preemptions = 0
    sent = dict.fromkeys(("zeroed", "common_prefix", "preempted", "v2_resumed", "new_token_ids"), 0)

    def count(vllm_out: VllmSchedulerOutput, out: SchedulerOutput, sched: ReferenceScheduler) -> None:
        sent["zeroed"] += bool(vllm_out.new_block_ids_to_zero)
        sent["common_prefix"] += any(vllm_out.num_common_prefix_blocks) and len(out.num_scheduled_tokens) > 1
        sent["preempted"] += bool(vllm_out.preempted_req_ids)
        sent["v2_resumed"] += sum(r.resumed for r in out.cached_requests) * sched.knobs.model_runner_v2
        sent["new_token_ids"] += any(vllm_out.scheduled_cached_reqs.new_token_ids)

    for seed in range(4):
        scenario = vllm_stress_scenario(seed)
        engine = V1StyleEngine(scenario.config)
        sched = _run(scenario, engine, ShadowChecker(scenario.config, repro_dir=str(tmp_path)), count)
        swaps += engine.swaps
        resumptions += sched.stats.resumptions
        preemptions += sched.stats.preemptions
    assert swaps > 0 and resumptions > 0 and preemptions > 0, (swaps, resumptions, preemptions)
    assert all(sent.values()), sent


def _shared_blocks(tables: list[list[int]]) -> int:
    """How many leading entries the tables share, none of them null (the test's own count)."""
    n = 0
    while all(len(t) > n for t in tables) and len({t[n] for t in tables}) == 1 and tables[0][n] != NULL_BLOCK_ID:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(4))
def test_a_wrong_zero_list_or_common_prefix_claim_in_a_real_step_is_reported(seed: int) -> None:
    """Into the scheduler's own steps, in turn: a block a scheduled token reads added to new_block_ids_to_zero,
    and one more common-prefix block in a group than the scheduled requests' tables share. Each is reported at
    its step, with its field, and nothing else is."""
    scenario = vllm_stress_scenario(seed)
    planted: dict[int, str] = {}  # step -> the field planted there
    step = 0

    def plant(
        vllm_out: VllmSchedulerOutput, out: SchedulerOutput, sched: ReferenceScheduler
    ) -> VllmSchedulerOutput | None:
        nonlocal step
        step += 1
        computed = {r.req_id: r.num_computed_tokens for r in (*out.new_requests, *out.cached_requests)}
        tables = [sched.requests[r].pool_tables for r in out.num_scheduled_tokens]
        if step % 2 and len(tables) > 1:  # group 1 is windowed: its shared entries end where its window began
            g = step // 2 % 2
            claim = [0, 0]
            claim[g] = _shared_blocks([t[g] for t in tables]) + 1
            planted[step - 1] = "num_common_prefix_blocks"
            return replace(vllm_out, num_common_prefix_blocks=claim)
        read = [(r, n) for r, n in computed.items() if n > 0]  # group 0 (no window) reads every position < n
        if read and not step % 2:
            req_id, n = read[step % len(read)]
            block = sched.requests[req_id].pool_tables[0][(n - 1) // 4]
            planted[step - 1] = "new_block_ids_to_zero"
            return replace(vllm_out, new_block_ids_to_zero=[*(vllm_out.new_block_ids_to_zero or ()), block])
        return None

    checker = ShadowChecker(scenario.config, write_repro=False, on_mismatch="report")
    _run(scenario, V1StyleEngine(scenario.config), checker, plant)
    found = {report.step: report.field for report in checker.reports}
    assert found == planted and len(checker.reports) == len(planted)
    assert set(planted.values()) == {"num_common_prefix_blocks", "new_block_ids_to_zero"}


def test_a_planted_bug_is_caught_with_request_field_step_and_reproduction(tmp_path: object) -> None:
    scenario = vllm_stress_scenario(0)
    engine = V1StyleEngine(scenario.config, bug="swap_keeps_block_table")
    checker = ShadowChecker(scenario.config, repro_dir=str(tmp_path))
    with pytest.raises(ShadowMismatchError) as caught:
        _run(scenario, engine, checker)
    error = caught.value
    assert error.req_id in {r.req_id for r in scenario.workload.requests}
    assert error.field.startswith(("block_table[", "slot_mapping["))
    assert error.step == checker.step_index - 1 and engine.swaps > 0
    assert error.repro_path is not None and error.repro_path.exists()
    with pytest.raises(ShadowMismatchError) as replayed:
        runpy.run_path(str(error.repro_path))
    assert (replayed.value.step, replayed.value.req_id, replayed.value.field) == (error.step, error.req_id, error.field)


def _one_step(config: WorkerConfig) -> tuple[SchedulerOutput, dict[str, np.ndarray]]:
    """Two new requests; spec's batch order is b (2 tokens) then a (5 tokens). Arrays in the engine's
    order a, b, padded to 10 tokens with garbage, table width 8 with garbage past the blocks."""
    out = SchedulerOutput(
        new_requests=(NewRequest("a", (5, 6, 7, 8, 9), ((3, 4),)), NewRequest("b", (1, 2), ((7,),))),
        num_scheduled_tokens={"a": 5, "b": 2},
    )
    arrays = {
        "query_start_loc": np.array([0, 5, 7], np.int32),
        "positions": np.array([0, 1, 2, 3, 4, 0, 1, 99, 98, 97]),
        "input_ids": np.array([5, 6, 7, 8, 9, 1, 2, 55, 55, 55], np.int32),
        "seq_lens": np.array([5, 2], np.int32),
        "logits_indices": np.array([4, 6]),
        "block_table": np.array([[3, 4, 66, 66, 0, 0, 0, 0], [7, 77, 77, 0, 0, 0, 0, 0]], np.int32),
        "slot_mapping": np.array([12, 13, 14, 15, 16, 28, 29, -1, -1, -1]),
    }
    return out, arrays


CONFIG = WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 10),))


def test_engine_order_padding_and_table_tails_are_the_engines_own(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    checker.check(out, arrays, ["a", "b"])
    checker.record_sampled({"a": 11, "b": 12})
    assert {r.req_id: r.token_ids for r in checker.pool.snapshot()} == {"a": (5, 6, 7, 8, 9, 11), "b": (1, 2, 12)}


def test_spec_batch_is_readable_only_between_check_and_record(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    assert checker.batch is None
    checker.check(out, arrays, ["a", "b"])
    batch = checker.batch
    assert batch is not None and batch.req_ids == ("b", "a")  # spec's order, not the engine's a, b
    # by hand, block size 4: b's block 7 -> slots 28, 29; a's blocks 3, 4 -> 12..16
    assert batch.slot_mappings[0][: batch.num_tokens].tolist() == [28, 29, 12, 13, 14, 15, 16]
    checker.record_sampled({"a": 11, "b": 12})
    assert checker.batch is None


@pytest.mark.parametrize(
    ("field", "index", "value", "req_id"),
    [
        ("input_ids", 6, 3, "b"),
        ("positions", 2, 7, "a"),
        ("seq_lens", 0, 4, "a"),
        ("logits_indices", 1, 5, "b"),
        ("block_table", (0, 1), 5, "a"),
        ("slot_mapping", 5, 27, "b"),
        ("slot_mapping", 8, 40, None),  # a padding token that would write KV
        ("slot_mapping", 7, 40, None),  # the first padding token
        ("query_start_loc", 1, 4, "b"),  # spec's batch order is b first: its count is compared first
    ],
)
def test_each_field_divergence_is_named(
    field: str, index: int | tuple[int, int], value: int, req_id: str | None, tmp_path: object
) -> None:
    out, arrays = _one_step(CONFIG)
    arrays[field][index] = value
    with pytest.raises(ShadowMismatchError) as caught:
        ShadowChecker(CONFIG, repro_dir=str(tmp_path)).check(out, arrays, ["a", "b"])
    assert (caught.value.step, caught.value.req_id, caught.value.field) == (0, req_id, field)


def test_misuse_is_refused(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    with pytest.raises(ValueError, match="unknown field 'slots'"):
        ShadowChecker(CONFIG, repro_dir=str(tmp_path)).check(out, {"slots": arrays["slot_mapping"]}, ["a", "b"])
    with pytest.raises(ShadowMismatchError) as caught:
        ShadowChecker(CONFIG, repro_dir=str(tmp_path)).check(out, arrays, ["a"])
    assert (caught.value.req_id, caught.value.field) == ("b", "req_ids")
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    checker.check(out, arrays, ["a", "b"])
    with pytest.raises(ValueError, match="request 'c' is not in this step's batch"):
        checker.record_sampled({"a": 1, "b": 2, "c": 3})
    with pytest.raises(ShadowRefusalError, match="refused by spec: request 'b': sampled_token_ids: no token"):
        checker.record_sampled({"a": 1})  # b reached its last token: it samples


def test_a_refused_output_raises_as_a_refusal_and_is_not_recorded(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    bad = SchedulerOutput(new_requests=out.new_requests, num_scheduled_tokens={"a": 5})  # b is new but not scheduled
    with pytest.raises(ShadowRefusalError) as caught:
        checker.check(bad, arrays, ["a"])
    refusal = caught.value
    assert isinstance(refusal, ScheduleError) and not isinstance(refusal, ShadowMismatchError)
    assert str(refusal).startswith("step 0: refused by spec: ") and "fault" not in str(refusal)
    assert (refusal.step, refusal.error, refusal.lost) == (0, "InconsistentSchedulerOutputError", frozenset())
    assert checker.step_index == 0 and checker.view.count() == 0  # spec's pool is as before the step
    checker.check(out, arrays, ["a", "b"])  # the checker carries on from the state before the bad output
    assert checker.step_index == 1


def test_every_difference_of_a_step_is_listed_when_asked(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    arrays["input_ids"][6] = 3  # b
    arrays["positions"][2] = 7  # a
    arrays["slot_mapping"][8] = 40  # padding
    with pytest.raises(ShadowMismatchError) as caught:
        ShadowChecker(CONFIG, repro_dir=str(tmp_path), every_difference=True).check(out, arrays, ["a", "b"])
    found = [(r, f) for r, f, _ in caught.value.differences]
    assert found == [("b", "input_ids"), ("a", "positions"), (None, "slot_mapping")]  # spec's order, then padding
    assert (caught.value.req_id, caught.value.field) == found[0]
    assert str(caught.value).count("\n  and ") == 2


def test_a_copy_is_recorded_not_a_view_of_the_engines_buffer() -> None:
    buffer = torch.arange(6)
    copied = to_numpy(buffer)
    buffer[0] = 99  # the engine's next step writes its buffer again
    assert copied[0] == 0 and not np.shares_memory(copied, buffer.numpy())


def _run_torch(scenario: Scenario, checker: ShadowChecker) -> None:
    """The v1-style loop, its arrays handed over as CPU torch tensors over the engine's reused buffers."""
    engine = V1StyleEngine(scenario.config)
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    while not sched.done():
        out = sched.schedule()
        vllm_out = as_vllm(out, sched)
        arrays, order = engine.execute(vllm_out)
        checker.check(vllm_out, {k: torch.from_numpy(v) for k, v in arrays.items()}, order)
        sampled = {r: int(rng.integers(scenario.config.vocab_size)) for r in sched.sampling_req_ids(out)}
        engine.record_sampled(sampled)
        checker.record_sampled(sampled)
        sched.update(out, sampled)


@pytest.mark.parametrize("seed", range(2))
def test_the_record_of_an_engine_that_reuses_its_buffers_replays(seed: int, tmp_path: object) -> None:
    """Every recorded step must hold what that step saw: replaying the record passes where the run passed."""
    scenario = vllm_stress_scenario(seed)
    checker = ShadowChecker(scenario.config, repro_dir=str(tmp_path))
    _run_torch(scenario, checker)
    assert checker.step_index > 5 and not checker.reports
    replayed = replay(scenario.config, checker.steps)  # raises at the first report, if any
    assert replayed.step_index == checker.step_index and not replayed.reports


def test_the_checker_never_snapshots_the_pool(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its cost per step follows the step: it reads spec's pool per request, never every token held."""

    def refuse(self: object) -> None:
        raise AssertionError("snapshot() called: it copies every token the pool holds")

    monkeypatch.setattr(spec.RequestStatePool, "snapshot", refuse)
    scenario = vllm_stress_scenario(1)
    checker = ShadowChecker(scenario.config, repro_dir=str(tmp_path))
    sched = _run(scenario, V1StyleEngine(scenario.config), checker)
    assert sched.stats.resumptions > 0 and checker.step_index == sched.stats.steps


def test_the_reproduction_fails_the_same_way_in_a_fresh_interpreter(tmp_path: Path) -> None:
    scenario = vllm_stress_scenario(0)
    checker = ShadowChecker(scenario.config, repro_dir=tmp_path)
    with pytest.raises(ShadowMismatchError) as caught:
        _run(scenario, V1StyleEngine(scenario.config, bug="swap_keeps_block_table"), checker)
    error = caught.value
    assert error.repro_path is not None and error.repro_path.parent == tmp_path
    ran = run_script(error.repro_path)
    assert ran.returncode == 1 and "ShadowMismatchError" in ran.stderr
    assert f"step {error.step}: request {error.req_id!r}: {error.field}: {error.detail}" in ran.stderr


ROOT = Path(__file__).resolve().parents[1]


def run_script(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`python <path>` from the repository root, as the report says to run it."""
    return subprocess.run([sys.executable, *flags, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip


def _vllm_step(req_id: str, prompt: list[int], blocks: list[int], **fields: object) -> VllmSchedulerOutput:
    return VllmSchedulerOutput(
        scheduled_new_reqs=[VllmNewRequestData(req_id, prompt, (blocks,), 0)],
        scheduled_cached_reqs=VllmCachedRequestData([], set(), [], [], {}),
        num_scheduled_tokens={req_id: len(prompt)},
        **fields,  # type: ignore[arg-type]
    )


def test_a_zeroed_block_that_holds_kv_a_token_reads_is_named(tmp_path: object) -> None:
    config = WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 10),))
    checker = ShadowChecker(config, repro_dir=str(tmp_path), on_mismatch="report")
    assert checker.check(_vllm_step("a", [1, 2, 3, 4, 5], [3, 4], new_block_ids_to_zero=[3, 4]), {}, ["a"]) == []
    checker.record_sampled({"a": 6})
    decode = VllmSchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=VllmCachedRequestData(["a"], set(), [None], [5], {}),
        num_scheduled_tokens={"a": 1},
        new_block_ids_to_zero=[4],  # block 4 holds position 4, which the decode at position 5 reads
    )
    (report,) = checker.check(decode, {}, ["a"])
    assert isinstance(report, ShadowMismatchError) and (report.req_id, report.field) == ("a", "new_block_ids_to_zero")


def test_a_common_prefix_claim_is_checked_against_the_tables(tmp_path: object) -> None:
    config = WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 10),))
    shared = VllmSchedulerOutput(
        scheduled_new_reqs=[
            VllmNewRequestData("a", [1, 2, 3, 4, 5], ([3, 4],), 4),
            VllmNewRequestData("b", [1, 2, 3, 4, 6], ([3, 5],), 4),
        ],
        scheduled_cached_reqs=VllmCachedRequestData([], set(), [], [], {}),
        num_scheduled_tokens={"a": 1, "b": 1},
        num_common_prefix_blocks=[1],
    )
    assert ShadowChecker(config, repro_dir=str(tmp_path)).check(shared, {}, ["a", "b"]) == []
    with pytest.raises(ShadowMismatchError) as caught:
        ShadowChecker(config, repro_dir=str(tmp_path)).check(
            replace(shared, num_common_prefix_blocks=[2]), {}, ["a", "b"]
        )
    assert caught.value.field == "num_common_prefix_blocks" and caught.value.req_id in {"a", "b"}
    full = VllmSchedulerOutput(  # every entry of the table's width is a block: a claim past the width is wrong too
        scheduled_new_reqs=[VllmNewRequestData("a", list(range(1, 15)), ([3, 4, 5, 6],), 0)],
        scheduled_cached_reqs=VllmCachedRequestData([], set(), [], [], {}),
        num_scheduled_tokens={"a": 14},
        num_common_prefix_blocks=[4],
    )
    assert ShadowChecker(config, repro_dir=str(tmp_path)).check(full, {}, ["a"]) == []
    with pytest.raises(ShadowMismatchError) as caught:
        ShadowChecker(config, repro_dir=str(tmp_path)).check(replace(full, num_common_prefix_blocks=[5]), {}, ["a"])
    assert (caught.value.req_id, caught.value.field) == ("a", "num_common_prefix_blocks")
