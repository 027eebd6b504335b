"""A step spec refuses is reported as refused by spec, and with on_refusal="report" the checker goes on.

The refused request is dropped (spec stops following it until the engine finishes it), the rest of the
step and every later step are still compared, and each report's script replays to the same report.
"""

from __future__ import annotations

import numpy as np
import pytest

from shadow.checker import ShadowChecker, ShadowMismatchError, ShadowRefusalError
from spec.errors import BlockIdError, InconsistentSchedulerOutputError, ScheduleError, TokenBudgetError
from spec.interop import VllmCachedRequestData, VllmNewRequestData, VllmSchedulerOutput
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from tests.test_shadow import run_script

CONFIG = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 20),))


def _steps() -> list[tuple[SchedulerOutput, dict[str, np.ndarray], list[str], dict[str, int] | None]]:
    """b's block 99 is out of range (refused at step 0); a's slot at step 1 is wrong; b finishes at step 2."""
    return [
        (
            SchedulerOutput(
                new_requests=(NewRequest("a", (5, 6, 7, 8, 9), ((3, 4),)), NewRequest("b", (1, 2), ((99,),))),
                num_scheduled_tokens={"a": 5, "b": 2},
            ),
            {"positions": np.array([0, 1, 2, 3, 4, 0, 1]), "slot_mapping": np.array([12, 13, 14, 15, 16, 396, 397])},
            ["a", "b"],
            {"a": 11, "b": 12},
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("a", 5), CachedRequest("b", 2)), num_scheduled_tokens={"a": 1, "b": 1}
            ),
            {"input_ids": np.array([11, 12]), "slot_mapping": np.array([18, 398])},  # a's slot is 17
            ["a", "b"],
            {"a": 13, "b": 14},
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("a", 6),),
                num_scheduled_tokens={"a": 1},
                finished_req_ids=frozenset({"b"}),
            ),
            {"input_ids": np.array([13]), "slot_mapping": np.array([18])},
            ["a"],
            None,
        ),
    ]


def test_a_refused_request_is_dropped_and_the_rest_is_still_checked(tmp_path: object) -> None:
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path), on_refusal="report", on_mismatch="report")
    seen = []
    for sched, arrays, order, sampled in _steps():
        seen.append(checker.check(sched, arrays, order))
        if sampled is not None:
            seen[-1] += checker.record_sampled(sampled)
        seen[-1] = [(type(r).__name__, r.step, r.req_id, r.field) for r in seen[-1]]  # type: ignore[misc]
        if len(seen) == 2:
            assert checker.lost_req_ids == {"b"}
    assert seen == [
        [("ShadowRefusalError", 0, "b", "block_ids[0]")],
        [("ShadowMismatchError", 1, "a", "slot_mapping")],  # b is not compared: spec does not follow it
        [],  # b finished: nothing left to drop
    ]
    refusal, mismatch = checker.reports
    assert isinstance(refusal, ShadowRefusalError) and refusal.error == BlockIdError.__name__
    assert refusal.lost == {"b"} and "spec no longer follows ['b']" in str(refusal)
    assert checker.lost_req_ids == frozenset() and checker.view.count() == 1  # a alone holds a row
    for report in (refusal, mismatch):
        assert report.repro_path is not None
        ran = run_script(report.repro_path)
        assert ran.returncode == 1 and type(report).__name__ in ran.stderr, ran.stderr
        assert str(report).splitlines()[0] in ran.stderr


def test_with_raise_the_refusal_is_raised_and_spec_is_as_before(tmp_path: object) -> None:
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    sched, arrays, order, _ = _steps()[0]
    with pytest.raises(ShadowRefusalError) as caught:
        checker.check(sched, arrays, order)
    assert isinstance(caught.value, ScheduleError) and not isinstance(caught.value, ShadowMismatchError)
    assert isinstance(caught.value.__cause__, BlockIdError)
    assert checker.step_index == 0 and checker.view.count() == 0 and checker.reports == [caught.value]
    assert caught.value.repro_path is not None
    ran = run_script(caught.value.repro_path)
    assert ran.returncode == 1 and str(caught.value).splitlines()[0] in ran.stderr


def test_the_request_an_error_names_is_dropped_and_the_step_retried(tmp_path: object) -> None:
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path), on_refusal="report")
    prompt = tuple(range(20))
    big = SchedulerOutput(
        new_requests=(NewRequest("a", prompt, ((1, 2, 3, 4, 5),)), NewRequest("b", prompt, ((6, 7, 8, 9, 10),))),
        num_scheduled_tokens={"a": 20, "b": 20},
    )
    (refusal,) = checker.check(big, {"positions": np.arange(40) % 20}, ["a", "b"])
    assert isinstance(refusal, ShadowRefusalError) and refusal.error == TokenBudgetError.__name__
    assert refusal.req_id == "b" and refusal.lost == {"b"}  # without b, the step fits the budget: a is compared
    assert checker.view.holds("a") and not checker.view.holds("b")


def test_an_output_that_cannot_be_read_drops_the_whole_batch(tmp_path: object) -> None:
    class Broken:  # no num_scheduled_tokens, nor anything else
        scheduled_new_reqs: tuple[object, ...] = ()

    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path), on_refusal="report")
    (refusal,) = checker.check(Broken(), {}, ["a", "b"])
    assert isinstance(refusal, ShadowRefusalError) and refusal.req_id is None and refusal.lost == {"a", "b"}
    checker.record_sampled({})
    assert refusal.repro_path is not None
    ran = run_script(refusal.repro_path)
    assert ran.returncode == 1 and str(refusal).splitlines()[0] in ran.stderr, ran.stderr


def _drafting() -> list[tuple[SchedulerOutput, dict[str, np.ndarray], list[str], dict[str, list[int]] | None]]:
    """a drafts (20, 21) at step 1 and the engine 'accepts' 9, 9: no sampler keeps a draft it rejected."""
    return [
        (
            SchedulerOutput(
                new_requests=(NewRequest("a", (1, 2, 3), ((1,),)), NewRequest("b", (4, 5), ((2,),))),
                num_scheduled_tokens={"a": 3, "b": 2},
            ),
            {"positions": np.array([0, 1, 2, 0, 1])},
            ["a", "b"],
            {"a": [7], "b": [6]},
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("a", 3, ((3,),)), CachedRequest("b", 2)),
                num_scheduled_tokens={"a": 3, "b": 1},
                scheduled_spec_decode_tokens={"a": (20, 21)},
            ),
            {"positions": np.array([3, 4, 5, 2]), "draft_token_ids": np.array([20, 21])},
            ["a", "b"],
            {"a": [9, 9], "b": [8]},
        ),
        (
            SchedulerOutput(
                cached_requests=(CachedRequest("a", 4), CachedRequest("b", 3)), num_scheduled_tokens={"a": 1, "b": 1}
            ),
            {"input_ids": np.array([55, 8])},  # a: whatever the engine holds, spec no longer follows it
            ["a", "b"],
            None,
        ),
    ]


def test_refused_accepted_tokens_drop_that_request_and_record_the_others(tmp_path: object) -> None:
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path), on_refusal="report")
    reports = []
    for sched, arrays, order, sampled in _drafting():
        reports += checker.check(sched, arrays, order)
        if sampled is not None:
            reports += checker.record_sampled(sampled)
    (refusal,) = reports
    assert isinstance(refusal, ShadowRefusalError) and (refusal.step, refusal.req_id) == (1, "a")
    assert (refusal.field, refusal.error) == ("sampled_token_ids", InconsistentSchedulerOutputError.__name__)
    assert checker.lost_req_ids == {"a"} and not checker.view.holds("a")  # its row freed at step 2
    assert checker.view.tokens("b", 0, checker.view.num_tokens("b")).tolist() == [4, 5, 6, 8]
    assert refusal.repro_path is not None
    ran = run_script(refusal.repro_path)
    assert ran.returncode == 1 and str(refusal).splitlines()[0] in ran.stderr


def test_with_raise_refused_tokens_are_not_recorded(tmp_path: object) -> None:
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path))
    (s0, a0, o0, t0), (s1, a1, o1, t1), _ = _drafting()
    checker.check(s0, a0, o0)
    checker.record_sampled(t0)
    checker.check(s1, a1, o1)
    with pytest.raises(ShadowRefusalError, match="step 1: refused by spec: request 'a': sampled_token_ids"):
        checker.record_sampled(t1)
    assert checker.view.num_tokens("a") == 4 and checker.view.num_tokens("b") == 3  # nothing of step 1


def test_a_vllm_field_slotmap_does_not_model_drops_its_request(tmp_path: object) -> None:
    """A nonzero replay_start is refused by the converter; the other request of the step is still compared."""
    out = VllmSchedulerOutput(
        scheduled_new_reqs=[
            VllmNewRequestData("a", [5, 6, 7], ([3],), 0),
            VllmNewRequestData("w", [1, 2, 3, 4], ([4],), 0, replay_start=2),
        ],
        scheduled_cached_reqs=VllmCachedRequestData([], set(), [], [], {}),
        num_scheduled_tokens={"a": 3, "w": 4},
        total_num_scheduled_tokens=7,
    )
    checker = ShadowChecker(CONFIG, repro_dir=str(tmp_path), on_refusal="report", on_mismatch="report")
    wrong = {"positions": np.array([0, 1, 1, 0, 1, 2, 3])}  # a's third position is 2
    refusal, mismatch = checker.check(out, wrong, ["a", "w"])
    assert isinstance(refusal, ShadowRefusalError) and (refusal.req_id, refusal.field) == ("w", "replay_start")
    assert isinstance(mismatch, ShadowMismatchError) and (mismatch.req_id, mismatch.field) == ("a", "positions")
    for report in (refusal, mismatch):
        assert report.repro_path is not None
        ran = run_script(report.repro_path)
        assert ran.returncode == 1 and str(report).splitlines()[0] in ran.stderr, ran.stderr


def test_the_options_are_checked() -> None:
    with pytest.raises(ValueError, match="on_refusal: one of"):
        ShadowChecker(CONFIG, on_refusal="ignore")
    with pytest.raises(ValueError, match="on_mismatch: one of"):
        ShadowChecker(CONFIG, on_mismatch="skip")
