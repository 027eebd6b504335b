"""The shadow checker beside an engine loop written like vLLM v1's: silent when it is right, and it
names the step, request and field of a planted bug, with a reproduction that fails the same way."""

from __future__ import annotations

import runpy

import numpy as np
import pytest

from conformance.scenario import Scenario, random_scenario
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from conformance.shadow import ShadowChecker, ShadowMismatchError
from spec.errors import ScheduleError
from spec.types import KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from tests.v1_style_engine import V1StyleEngine, to_vllm


def _scenario(seed: int) -> Scenario:
    """Few blocks (preemption and resumption), a windowed group, prefixes, chunked prefill, aborts."""
    config = WorkerConfig(4, 48, 40, 97, (KVCacheGroup(4, 22), KVCacheGroup(3, 30, sliding_window=7)))
    knobs = SchedulerKnobs(max_chunk=9, abort_prob=0.05, shuffle_order=True, reuse_freed_first=True)
    workload = make_workload(seed, config, num_requests=8, max_arrival_step=6, num_prefixes=2, max_new_tokens=10)
    return Scenario(config, workload, knobs, None, seed)


def _run(scenario: Scenario, engine: V1StyleEngine, checker: ShadowChecker) -> ReferenceScheduler:
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    while not sched.done():
        out = sched.schedule()
        vllm_out = to_vllm(out, sched)
        arrays, order = engine.execute(vllm_out)
        checker.check(vllm_out, arrays, order)
        takes = sched.sampling_req_ids(out)
        sampled = {r: int(rng.integers(scenario.config.vocab_size)) for r in takes}
        engine.record_sampled(sampled)
        checker.record_sampled(sampled)
        sched.update(out, sampled)
    return sched


@pytest.mark.parametrize("seed", range(4))
def test_a_correct_v1_style_engine_passes_every_step(seed: int, tmp_path: object) -> None:
    for scenario in (_scenario(seed), random_scenario(seed)):
        engine = V1StyleEngine(scenario.config)
        checker = ShadowChecker(scenario.config, repro_dir=str(tmp_path))
        sched = _run(scenario, engine, checker)
        assert sched.stats.steps == checker.step_index > 0


def test_the_correct_runs_cover_moves_preemption_and_resumption(tmp_path: object) -> None:
    """The runs above are only evidence if rows really moved and requests really came back."""
    swaps = resumptions = preemptions = 0
    for seed in range(4):
        engine = V1StyleEngine(_scenario(seed).config)
        sched = _run(_scenario(seed), engine, ShadowChecker(_scenario(seed).config, repro_dir=str(tmp_path)))
        swaps += engine.swaps
        resumptions += sched.stats.resumptions
        preemptions += sched.stats.preemptions
    assert swaps > 0 and resumptions > 0 and preemptions > 0, (swaps, resumptions, preemptions)


def test_a_planted_bug_is_caught_with_request_field_step_and_reproduction(tmp_path: object) -> None:
    scenario = _scenario(0)
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
    with pytest.raises(ValueError, match="request 'b' reached its last token"):
        checker.record_sampled({"a": 1})


def test_an_invalid_scheduler_output_is_the_schedulers_error_and_is_not_recorded(tmp_path: object) -> None:
    out, arrays = _one_step(CONFIG)
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    bad = SchedulerOutput(new_requests=out.new_requests, num_scheduled_tokens={"a": 5})  # b is new but not scheduled
    with pytest.raises(ScheduleError):
        checker.check(bad, arrays, ["a"])
    assert checker.step_index == 0
    checker.check(out, arrays, ["a", "b"])  # the checker carries on from the state before the bad output
    assert checker.step_index == 1
