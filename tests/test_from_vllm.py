"""from_vllm: vLLM-shaped scheduler outputs (objects with exactly vLLM 0.32's fields) become slotmap's.

The reference scheduler drives every kind of step; each output is sent through the vLLM shape
(conformance.scheduler.as_vllm) and back, and spec run on the converted outputs must end every step
exactly where spec run on the originals does. The other tests build this file's own dataclasses with
exactly vLLM's field names, and the scheduler's outputs are read in them too, so from_vllm cannot rely
on spec.interop's.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.driving import sampled_array
from conformance.scenario import random_scenario, vllm_stress_scenario
from conformance.scheduler import ReferenceScheduler, VllmFormError, as_vllm
from shadow.compare import batch_differences
from spec import interop
from spec.interop import (
    VllmCachedRequestData,
    VllmConversionError,
    VllmNewRequestData,
    VllmSchedulerOutput,
    copy_vllm,
    from_vllm,
)
from spec.types import CachedRequest, NewRequest, SchedulerOutput, WorkerConfig

SPEC = BackendHandle("spec", spec)


@dataclass
class NewRequestData:  # vllm/v1/core/sched/output.py, 0.32: every field, in its order
    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[object]
    sampling_params: object | None
    pooling_params: object | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: object | None
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    prefill_token_ids: list[int] | None = None
    replay_start: int = 0


def new_req(req_id: str, prompt: list[int] | None, blocks: Any, computed: int = 0, **more: Any) -> NewRequestData:
    return NewRequestData(req_id, prompt, [], None, None, blocks, computed, None, **more)


@dataclass
class CachedRequestData:  # 0.32, every field in its order
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


def cached_reqs(
    req_ids: list[str],
    resumed: set[str],
    new_block_ids: list[Any],
    computed: list[int],
    all_token_ids: dict[str, list[int]],
    num_output_tokens: list[int] | None = None,
    new_token_ids: list[list[int]] | None = None,
) -> CachedRequestData:
    outputs = [0] * len(req_ids) if num_output_tokens is None else num_output_tokens
    return CachedRequestData(req_ids, resumed, new_token_ids or [], all_token_ids, new_block_ids, computed, outputs)


class KVCacheBlockCopy(NamedTuple):  # vllm/v1/core/kv_cache_utils.py
    src_block_id: int
    dst_block_id: int


@dataclass
class VllmOutput:  # 0.32's SchedulerOutput: the fields a worker reads (connector metadata left out)
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    preempted_req_ids: set[str] | None = None
    num_invalid_spec_tokens: dict[str, int] | None = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[KVCacheBlockCopy] | None = None
    num_spec_tokens_to_schedule: int = 0
    num_common_prefix_blocks: list[int] = field(default_factory=list)


def in_these_shapes(out: VllmSchedulerOutput) -> VllmOutput:
    """The product converter's output copied, field by field, into this file's shapes (vLLM's every field)."""
    c = out.scheduled_cached_reqs
    return VllmOutput(
        scheduled_new_reqs=[
            new_req(
                r.req_id, r.prompt_token_ids, r.block_ids, r.num_computed_tokens, prefill_token_ids=r.prefill_token_ids
            )
            for r in out.scheduled_new_reqs
        ],
        scheduled_cached_reqs=CachedRequestData(
            c.req_ids,
            c.resumed_req_ids,
            c.new_token_ids,
            c.all_token_ids,
            c.new_block_ids,
            c.num_computed_tokens,
            c.num_output_tokens or [],
        ),
        num_scheduled_tokens=out.num_scheduled_tokens,
        total_num_scheduled_tokens=out.total_num_scheduled_tokens or 0,
        scheduled_spec_decode_tokens=out.scheduled_spec_decode_tokens,
        finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids,
        new_block_ids_to_zero=out.new_block_ids_to_zero,
        num_common_prefix_blocks=out.num_common_prefix_blocks,
    )


def _stress(seed: int) -> tuple[WorkerConfig, ReferenceScheduler]:
    scenario = vllm_stress_scenario(seed)  # the shadow tests' scenario: every vLLM field sent
    return scenario.config, ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=seed)


def _schedulers() -> list[tuple[WorkerConfig, ReferenceScheduler]]:
    runs = [_stress(s) for s in range(4)]
    for seed in range(6):
        scenario = random_scenario(seed, spec_decode=seed % 2 == 1)  # half of them draft
        runs.append((scenario.config, ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed)))
    return runs


def test_every_kind_of_step_converts_and_runs_through_spec_identically() -> None:
    """Through conformance.scheduler.as_vllm (and its output copied into this file's shapes), every field of
    vLLM's output that slotmap models is sent with something in it at least once."""
    kinds = {"new": 0, "resumed": 0, "finished": 0, "prefix_hit": 0, "no_new_blocks": 0, "chunked": 0, "drafting": 0}
    kinds |= dict.fromkeys(("preempted_req_ids", "new_block_ids_to_zero", "num_common_prefix_blocks",
                            "new_token_ids", "prefill_token_ids", "v2_resumed", "all_token_ids",
                            "num_output_tokens", "finished_never_held"), 0)  # fmt: skip
    for config, sched in _schedulers():
        direct, converted = spec.RequestStatePool(config), spec.RequestStatePool(config)
        rng = np.random.default_rng(0)
        prompts: dict[str, int] = {}
        while not sched.done():
            out = sched.schedule()
            known = {row.req_id: row.token_ids for row in converted.snapshot()}
            prompts.update({r.req_id: len(r.prompt_token_ids) for r in out.new_requests})
            sent = as_vllm(out, sched)
            back = from_vllm(sent, known_token_ids=known, num_prompt_tokens=prompts)
            assert back == out  # field for field, num_scheduled_tokens' order included
            assert from_vllm(in_these_shapes(sent), known_token_ids=known, num_prompt_tokens=prompts) == out
            assert list(back.num_scheduled_tokens) == list(out.num_scheduled_tokens)
            kinds["new"] += len(out.new_requests)
            kinds["resumed"] += sum(r.resumed for r in out.cached_requests)
            kinds["finished"] += len(out.finished_req_ids)
            kinds["prefix_hit"] += sum(r.num_computed_tokens > 0 for r in out.new_requests)
            kinds["no_new_blocks"] += sum(r.new_block_ids is None for r in out.cached_requests)
            kinds["chunked"] += sum(n > 1 for n in out.num_scheduled_tokens.values()) > 0
            kinds["drafting"] += len(out.scheduled_spec_decode_tokens)
            c = sent.scheduled_cached_reqs
            kinds["preempted_req_ids"] += len(sent.preempted_req_ids or ())
            kinds["new_block_ids_to_zero"] += bool(sent.new_block_ids_to_zero)
            kinds["num_common_prefix_blocks"] += (
                any(sent.num_common_prefix_blocks) and len(out.num_scheduled_tokens) > 1
            )
            kinds["new_token_ids"] += sum(len(t) > 0 for t in c.new_token_ids)
            kinds["prefill_token_ids"] += sum(r.prefill_token_ids is not None for r in sent.scheduled_new_reqs)
            kinds["v2_resumed"] += sum(r.req_id in known for r in sent.scheduled_new_reqs)
            kinds["all_token_ids"] += len(c.all_token_ids)
            kinds["num_output_tokens"] += sum(n > 0 for n in c.num_output_tokens or ())
            kinds["finished_never_held"] += len(sent.finished_req_ids - set(known))
            pad_to = sched.pad_to(out)
            for pool, o in ((direct, out), (converted, back)):
                pool.apply(o)
            batch, batch_back = direct.prepare(out, pad_to), converted.prepare(back, pad_to)
            problems = batch_differences(SPEC.batch_to_numpy(batch), SPEC.batch_to_numpy(batch_back))
            assert not problems, "\n".join(problems)
            takes = sched.sampling_req_ids(out)
            target = {r: int(rng.integers(config.vocab_size)) for r in batch.req_ids}
            kept = sched.rejection_step(out, {r: target[r] for r in takes})  # drafts the target keeps
            ids = sampled_array([kept.get(r, target[r]) for r in batch.req_ids])
            direct.record_sampled(batch, ids)
            converted.record_sampled(batch_back, ids)
            sched.update(out, kept)
            assert direct.snapshot() == converted.snapshot()
    assert all(kinds.values()), kinds


@pytest.mark.parametrize(
    ("draw", "field_name"),
    [
        ("encoder_decoder", "encoder_len"),
        ("multimodal", "mrope_positions"),
        ("async_scheduling", "config.async_scheduling"),
    ],
)
def test_what_vllms_output_cannot_carry_is_refused_by_as_vllm(draw: str, field_name: str) -> None:
    """Encoder inputs and M-RoPE tables are not in vLLM's scheduler output; its async form sends placeholders."""
    scenario = random_scenario(2, **{draw: True})  # seed 2 draws each of them
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, scenario.seed)
    with pytest.raises(VllmFormError) as caught:
        while not sched.done():
            out = sched.schedule()
            as_vllm(out, sched)
            sched.update(out, {r: 1 for r in sched.sampling_req_ids(out)})
    assert caught.value.field == field_name


def test_as_vllm_reads_only_the_output_being_executed() -> None:
    _, sched = _stress(0)
    out = sched.schedule()
    sched.update(out, {r: 1 for r in sched.sampling_req_ids(out)})
    with pytest.raises(VllmFormError) as caught:
        as_vllm(out, sched)  # after update: the scheduler's step state belongs to the next output
    assert caught.value.field == "out"


def _minimal(**changes: object) -> VllmOutput:
    out = VllmOutput(
        scheduled_new_reqs=[new_req("n", [1, 2, 3], ([5],), 0)],
        scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}),
        num_scheduled_tokens={"n": 3, "c": 1},
        total_num_scheduled_tokens=4,
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
        ({"scheduled_new_reqs": [new_req("n", None, ([5],), 0)]}, "n", "prompt_token_ids"),
        ({"preempted_req_ids": {"c"}}, "c", "preempted_req_ids"),
        (
            {"scheduled_cached_reqs": cached_reqs(["c"], set(), [], [4], {})},
            None,
            "CachedRequestData.new_block_ids",
        ),
        ({"scheduled_cached_reqs": cached_reqs(["c"], {"x"}, [None], [4], {})}, "x", "resumed_req_ids"),
        ({"scheduled_new_reqs": [new_req("n", [1], [5], 0)]}, "n", "block_ids"),
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
    class Old:  # an output from a vLLM without preempted_req_ids (nor any 0.32 field)
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
    resumed = cached_reqs(["c"], {"c"}, [([6, 7],)], [0], {"c": [1, 2, 3]})
    out = _minimal(scheduled_cached_reqs=resumed)
    assert from_vllm(out, known_token_ids={"c": (1, 2, 3)}).cached_requests[0].resumed
    with pytest.raises(VllmConversionError) as caught:
        from_vllm(out, known_token_ids={"c": (1, 2, 4)})
    assert (caught.value.req_id, caught.value.field) == ("c", "all_token_ids")


# ---- vLLM 0.32's fields, one by one -------------------------------------------------------------------
def _refused(out: VllmOutput, req_id: str | None, field_name: str, **known: Any) -> VllmConversionError:
    with pytest.raises(VllmConversionError) as caught:
        from_vllm(out, **known)
    assert (caught.value.req_id, caught.value.field) == (req_id, field_name), caught.value
    return caught.value


def test_replay_start_is_refused_unless_zero() -> None:
    assert from_vllm(_minimal(scheduled_new_reqs=[new_req("n", [1, 2, 3], ([5],), replay_start=0)])).new_requests
    _refused(_minimal(scheduled_new_reqs=[new_req("n", [1, 2, 3], ([5],), replay_start=2)]), "n", "replay_start")


def test_prefill_token_ids_are_the_known_tokens_and_start_with_the_prompt() -> None:
    out = _minimal(scheduled_new_reqs=[new_req("n", [1, 2], ([5],), prefill_token_ids=[1, 2, 9])])
    assert from_vllm(out).new_requests[0].prompt_token_ids == (1, 2, 9)  # v2: prompt then outputs
    bad = _minimal(scheduled_new_reqs=[new_req("n", [1, 2], ([5],), prefill_token_ids=[1, 3, 9])])
    _refused(bad, "n", "prefill_token_ids")


def test_a_v2_resumption_becomes_a_resumed_request_and_a_v1_repeat_is_refused() -> None:
    """Model runner v2 drops a preempted request and sends it again as new, with every token it holds."""
    again = new_req("c", [1, 2], ([7, 8],), 0, prefill_token_ids=[1, 2, 3])
    out = _minimal(scheduled_new_reqs=[again], num_scheduled_tokens={"c": 3},
                   scheduled_cached_reqs=cached_reqs([], set(), [], [], {}), total_num_scheduled_tokens=3)  # fmt: skip
    back = from_vllm(out, known_token_ids={"c": (1, 2, 3)})
    assert back.new_requests == () and back.cached_requests == (CachedRequest("c", 0, ((7, 8),), resumed=True),)
    _refused(out, "c", "prefill_token_ids", known_token_ids={"c": (1, 2, 4)})
    repeat = dataclasses.replace(out, scheduled_new_reqs=[new_req("c", [1, 2], ([7, 8],), 0)])
    _refused(repeat, "c", "scheduled_new_reqs", known_token_ids={"c": (1, 2)})  # a streaming input update


def test_prompt_embeddings_are_refused() -> None:
    _refused(
        _minimal(scheduled_new_reqs=[new_req("n", [0, 0, 0], ([5],), prompt_embeds=object())]), "n", "prompt_embeds"
    )
    mixed = new_req("n", [1, 0, 3], ([5],), prompt_is_token_ids=[True, False, True])
    _refused(_minimal(scheduled_new_reqs=[mixed]), "n", "prompt_is_token_ids")


def test_num_output_tokens_must_equal_the_tokens_past_the_prompt() -> None:
    """vLLM's worker truncates its outputs to num_output_tokens (after a failed KV load): slotmap never drops tokens."""
    known = {"known_token_ids": {"c": (1, 2, 3, 4, 9)}, "num_prompt_tokens": {"c": 4}}
    ok = _minimal(scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}, num_output_tokens=[1]))
    assert from_vllm(ok, **known).cached_requests[0].req_id == "c"
    fewer = _minimal(scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}, num_output_tokens=[0]))
    assert "discard" in _refused(fewer, "c", "num_output_tokens", **known).detail
    more = _minimal(scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}, num_output_tokens=[2]))
    _refused(more, "c", "num_output_tokens", **known)
    short = _minimal(scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}, num_output_tokens=[]))
    _refused(short, None, "CachedRequestData.num_output_tokens")


def test_new_token_ids_are_checked_against_the_tokens_held() -> None:
    """Pipeline parallelism's non-last ranks get this step's tokens; slotmap already holds them."""
    known = {"known_token_ids": {"c": (1, 2, 3, 4, 9)}}

    def with_tokens(tokens: list[int]) -> VllmOutput:
        return _minimal(scheduled_cached_reqs=cached_reqs(["c"], set(), [([6],)], [4], {}, new_token_ids=[tokens]))

    assert from_vllm(with_tokens([9]), **known).cached_requests[0].num_computed_tokens == 4
    _refused(with_tokens([8]), "c", "new_token_ids", **known)
    _refused(with_tokens([9, 9]), "c", "new_token_ids")  # 1 token scheduled: one token sent


def test_total_num_scheduled_tokens_is_the_sum() -> None:
    assert from_vllm(_minimal(total_num_scheduled_tokens=4)).total_num_scheduled_tokens == 4
    _refused(_minimal(total_num_scheduled_tokens=5), None, "total_num_scheduled_tokens")


def test_block_copies_are_refused_naming_the_request_that_receives_the_copy() -> None:
    assert from_vllm(_minimal(kv_cache_block_copies=[])).num_scheduled_tokens == {"n": 3, "c": 1}
    _refused(_minimal(kv_cache_block_copies=[KVCacheBlockCopy(2, 6)]), "c", "kv_cache_block_copies")
    _refused(_minimal(kv_cache_block_copies=[KVCacheBlockCopy(2, 9)]), None, "kv_cache_block_copies")


def test_blocks_to_zero_and_common_prefix_counts_must_be_well_formed() -> None:
    assert from_vllm(_minimal(new_block_ids_to_zero=[5, 6], num_common_prefix_blocks=[0])).new_requests
    _refused(_minimal(new_block_ids_to_zero=[0]), None, "new_block_ids_to_zero")
    _refused(_minimal(num_common_prefix_blocks=[-1]), None, "num_common_prefix_blocks")


def test_an_empty_draft_list_reads_as_no_drafts() -> None:
    """vLLM lists drafting requests only (as conformance.scheduler.as_vllm does); an empty list is no drafts."""
    assert from_vllm(_minimal(scheduled_spec_decode_tokens={"c": [], "n": []})) == from_vllm(_minimal())


def test_placeholder_drafts_and_encoder_inputs_are_refused() -> None:
    _refused(_minimal(scheduled_spec_decode_tokens={"c": [-1, -1]}), "c", "scheduled_spec_decode_tokens")
    with pytest.raises(VllmConversionError, match="placeholder drafts"):  # a mix, even with a drafter on the device
        from_vllm(_minimal(scheduled_spec_decode_tokens={"c": [5, -1]}), drafts_on_device=True)
    placeholders = from_vllm(_minimal(scheduled_spec_decode_tokens={"c": [-1, -1]}), drafts_on_device=True)
    assert placeholders.scheduled_spec_decode_tokens == {"c": (-1, -1)}  # the pool takes the drafter's ids
    _refused(_minimal(scheduled_encoder_inputs={"n": [0]}), "n", "scheduled_encoder_inputs")
    assert from_vllm(_minimal(scheduled_encoder_inputs={"n": []})).new_requests


def test_finished_requests_the_pool_never_held_need_no_action() -> None:
    out = _minimal(finished_req_ids={"f", "never-scheduled"})
    assert from_vllm(out, known_token_ids={"f": (1,), "c": (1, 2, 3, 4)}).finished_req_ids == frozenset({"f"})
    assert from_vllm(out).finished_req_ids == frozenset({"f", "never-scheduled"})  # without the pool: as sent


def test_skipped_requests_are_left_out_entirely() -> None:
    bad = _minimal(scheduled_new_reqs=[new_req("n", [1, 2, 3], ([5],), replay_start=2)], finished_req_ids={"n"})
    back = from_vllm(bad, skip={"n"})
    assert back.new_requests == () and set(back.num_scheduled_tokens) == {"c"} and back.finished_req_ids == frozenset()


def test_a_copy_holds_every_field_read_and_rebuilds_from_its_repr() -> None:
    out = _minimal(kv_cache_block_copies=[], new_block_ids_to_zero=[5], num_common_prefix_blocks=[0],
                   scheduled_new_reqs=[new_req("n", [1, 2, 3], ([5],), prefill_token_ids=[1, 2, 3])])  # fmt: skip
    copied = copy_vllm(out)
    assert from_vllm(copied) == from_vllm(out)
    assert copied.kv_cache_block_copies == [] and copied.new_block_ids_to_zero == [5]
    assert copied.scheduled_cached_reqs.num_output_tokens == [0]
    rebuilt = eval(repr(copied), vars(interop))  # as the reproduction script rebuilds it
    assert rebuilt == copied
    out.scheduled_new_reqs[0].block_ids[0].append(99)  # the engine changes its lists later: the copy does not
    assert copied.scheduled_new_reqs[0].block_ids == ([5],)


# ---- against the installed vLLM (scripts/setup-vllm) ------------------------------------------------
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
# SchedulerOutput / NewRequestData fields that do not shape the worker's inputs, and why from_vllm leaves them
NOT_INPUTS = {
    "free_encoder_mm_hashes": "the encoder cache's bookkeeping",
    "scheduled_encoder_input_stats": "statistics",
    "has_structured_output_requests": "the sampler's grammar masks",
    "pending_structured_output_tokens": "the sampler's grammar masks",
    "num_invalid_spec_tokens": "the scheduler's acceptance statistics",
    "kv_connector_metadata": "KV transfer between engines",
    "has_sync_kv_loads": "KV transfer between engines",
    "aux_output_connector_metadata": "auxiliary outputs",
    "ec_connector_metadata": "encoder-cache transfer",
    "ec_manager_metadata": "encoder-cache transfer",
    "kv_connector_block_state": "scheduler-local, always None at the worker",
    "num_spec_tokens_to_schedule": "the scheduler's draft count for its next step",
    "mm_features": "multimodal: refused through scheduled_encoder_inputs",
    "sampling_params": "the sampler",
    "pooling_params": "pooling models' outputs",
    "lora_request": "weights, not inputs",
}
FIELDS_OF_VLLM = """
import dataclasses, json
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
print(json.dumps({c.__name__: [f.name for f in dataclasses.fields(c)]
                  for c in (NewRequestData, CachedRequestData, SchedulerOutput)}))
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (scripts/setup-vllm makes .venv-vllm)")
def test_every_field_of_the_installed_vllm_is_read_or_named_as_no_input() -> None:
    """A vLLM that adds a field to its scheduler output fails here until from_vllm handles it or says why not."""
    ran = subprocess.run([str(VLLM_PYTHON), "-c", FIELDS_OF_VLLM], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    real = json.loads(ran.stdout.splitlines()[-1])
    assert real["NewRequestData"] == [f.name for f in dataclasses.fields(NewRequestData)]
    assert real["CachedRequestData"] == [f.name for f in dataclasses.fields(CachedRequestData)]
    read = {
        f.name for c in (VllmSchedulerOutput, VllmNewRequestData, VllmCachedRequestData) for f in dataclasses.fields(c)
    }
    for name in (*real["SchedulerOutput"], *real["NewRequestData"], *real["CachedRequestData"]):
        assert name in read or name in NOT_INPUTS, f"vLLM's {name} is neither read by from_vllm nor named here"
