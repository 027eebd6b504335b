"""from_vllm: vLLM-shaped scheduler outputs (objects with exactly vLLM 0.33's fields) become slotmap's.

The reference scheduler drives every kind of step; each output is sent through the vLLM shape and
back, and spec run on the converted outputs must end every step exactly where spec run on the
originals does. The shapes used here are this file's own dataclasses with exactly vLLM's field names,
so the converter cannot rely on spec.interop's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pytest

import spec
from conformance.driving import sampled_array
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from spec.interop import VllmConversionError, from_vllm
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    all_token_ids: dict[str, list[int]]


@dataclass
class VllmOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


def _lists(groups: tuple[tuple[int, ...], ...]) -> tuple[list[int], ...]:
    return tuple(list(g) for g in groups)


def as_vllm(out: SchedulerOutput, sched: ReferenceScheduler) -> VllmOutput:
    cached = out.cached_requests
    return VllmOutput(
        scheduled_new_reqs=[
            NewRequestData(r.req_id, list(r.prompt_token_ids), _lists(r.block_ids), r.num_computed_tokens)
            for r in out.new_requests
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.req_id for r in cached],
            resumed_req_ids={r.req_id for r in cached if r.resumed},
            new_block_ids=[None if r.new_block_ids is None else _lists(r.new_block_ids) for r in cached],
            num_computed_tokens=[r.num_computed_tokens for r in cached],
            all_token_ids={r.req_id: list(sched.requests[r.req_id].tokens) for r in cached if r.resumed},
        ),
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        # vLLM lists drafting requests only; an empty list per other request must read as "no drafts" too
        scheduled_spec_decode_tokens={
            r: list(out.scheduled_spec_decode_tokens.get(r, ())) for r in out.num_scheduled_tokens
        },
        finished_req_ids=set(out.finished_req_ids),
        preempted_req_ids=set(),
    )


def _stress(seed: int) -> tuple[WorkerConfig, ReferenceScheduler]:
    config = WorkerConfig(4, 48, 40, 97, (KVCacheGroup(4, 22), KVCacheGroup(3, 30, sliding_window=7)))
    knobs = SchedulerKnobs(max_chunk=9, abort_prob=0.05, shuffle_order=True, reuse_freed_first=True)
    workload = make_workload(seed, config, num_requests=8, max_arrival_step=6, num_prefixes=2, max_new_tokens=10)
    return config, ReferenceScheduler(config, workload, knobs, seed=seed)


def _schedulers() -> list[tuple[WorkerConfig, ReferenceScheduler]]:
    runs = [_stress(s) for s in range(4)]
    for seed in range(6):
        scenario = random_scenario(seed, spec_decode=seed % 2 == 1)  # half of them draft
        runs.append((scenario.config, ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed)))
    return runs


def test_every_kind_of_step_converts_and_runs_through_spec_identically() -> None:
    kinds = {"new": 0, "resumed": 0, "finished": 0, "prefix_hit": 0, "no_new_blocks": 0, "chunked": 0, "drafting": 0}
    for config, sched in _schedulers():
        direct, converted = spec.RequestStatePool(config), spec.RequestStatePool(config)
        rng = np.random.default_rng(0)
        while not sched.done():
            out = sched.schedule()
            known = {row.req_id: row.token_ids for row in converted.snapshot()}
            back = from_vllm(as_vllm(out, sched), known_token_ids=known)
            assert back == out  # field for field, num_scheduled_tokens' order included
            assert list(back.num_scheduled_tokens) == list(out.num_scheduled_tokens)
            kinds["new"] += len(out.new_requests)
            kinds["resumed"] += sum(r.resumed for r in out.cached_requests)
            kinds["finished"] += len(out.finished_req_ids)
            kinds["prefix_hit"] += sum(r.num_computed_tokens > 0 for r in out.new_requests)
            kinds["no_new_blocks"] += sum(r.new_block_ids is None for r in out.cached_requests)
            kinds["chunked"] += sum(n > 1 for n in out.num_scheduled_tokens.values()) > 0
            kinds["drafting"] += len(out.scheduled_spec_decode_tokens)
            pad_to = sched.pad_to(out)
            for pool, o in ((direct, out), (converted, back)):
                pool.apply(o)
            batch, batch_back = direct.prepare(out, pad_to), converted.prepare(back, pad_to)
            for f in dataclasses.fields(batch):
                want, got = getattr(batch, f.name), getattr(batch_back, f.name)
                if isinstance(want, tuple) and f.name != "req_ids":
                    assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True)), f.name
                else:
                    assert np.array_equal(want, got), f.name
            takes = sched.sampling_req_ids(out)
            target = {r: int(rng.integers(config.vocab_size)) for r in batch.req_ids}
            kept = sched.rejection_step(out, {r: target[r] for r in takes})  # drafts the target keeps
            ids = sampled_array([kept.get(r, target[r]) for r in batch.req_ids])
            direct.record_sampled(batch, ids)
            converted.record_sampled(batch_back, ids)
            sched.update(out, kept)
            assert direct.snapshot() == converted.snapshot()
    assert all(kinds.values()), kinds


def _minimal(**changes: object) -> VllmOutput:
    out = VllmOutput(
        scheduled_new_reqs=[NewRequestData("n", [1, 2, 3], ([5],), 0)],
        scheduled_cached_reqs=CachedRequestData(["c"], set(), [([6],)], [4], {}),
        num_scheduled_tokens={"n": 3, "c": 1},
    )
    return dataclasses.replace(out, **changes)  # type: ignore[arg-type]


def test_a_minimal_output_maps_field_for_field() -> None:
    assert from_vllm(_minimal(finished_req_ids={"f"})) == SchedulerOutput(
        new_requests=(NewRequest("n", (1, 2, 3), ((5,),), 0),),
        cached_requests=(CachedRequest("c", 4, ((6,),), resumed=False),),
        num_scheduled_tokens={"n": 3, "c": 1},
        finished_req_ids=frozenset({"f"}),
    )


@pytest.mark.parametrize(
    ("changes", "req_id", "field_name"),
    [
        ({"scheduled_new_reqs": [NewRequestData("n", None, ([5],), 0)]}, "n", "prompt_token_ids"),
        ({"preempted_req_ids": {"c"}}, "c", "preempted_req_ids"),
        (
            {"scheduled_cached_reqs": CachedRequestData(["c"], set(), [], [4], {})},
            None,
            "CachedRequestData.new_block_ids",
        ),
        ({"scheduled_cached_reqs": CachedRequestData(["c"], {"x"}, [None], [4], {})}, "x", "resumed_req_ids"),
        ({"scheduled_new_reqs": [NewRequestData("n", [1], [5], 0)]}, "n", "block_ids"),  # type: ignore[arg-type]
    ],
)
def test_what_cannot_be_mapped_is_refused_naming_request_and_field(
    changes: dict[str, object], req_id: str | None, field_name: str
) -> None:
    with pytest.raises(VllmConversionError) as caught:
        from_vllm(_minimal(**changes))
    assert (caught.value.req_id, caught.value.field) == (req_id, field_name)
    assert isinstance(caught.value, spec.ScheduleError)


def test_a_missing_field_is_named() -> None:
    @dataclass
    class Old:  # an output from a vLLM without preempted_req_ids
        scheduled_new_reqs: list[NewRequestData]
        scheduled_cached_reqs: CachedRequestData
        num_scheduled_tokens: dict[str, int]
        scheduled_spec_decode_tokens: dict[str, list[int]]
        finished_req_ids: set[str]

    full = _minimal()
    old = Old(full.scheduled_new_reqs, full.scheduled_cached_reqs, full.num_scheduled_tokens, {}, set())
    with pytest.raises(VllmConversionError, match="preempted_req_ids"):
        from_vllm(old)


def test_resumed_tokens_must_match_what_slotmap_holds() -> None:
    resumed = CachedRequestData(["c"], {"c"}, [([6, 7],)], [0], {"c": [1, 2, 3]})
    out = _minimal(scheduled_cached_reqs=resumed)
    assert from_vllm(out, known_token_ids={"c": (1, 2, 3)}).cached_requests[0].resumed
    with pytest.raises(VllmConversionError) as caught:
        from_vllm(out, known_token_ids={"c": (1, 2, 4)})
    assert (caught.value.req_id, caught.value.field) == ("c", "all_token_ids")
