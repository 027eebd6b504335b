"""The reference scheduler's output in vLLM's own classes, ready for a model runner's `execute_model`.

    vllm_out = to_vllm(as_vllm(out, sched), sampling)   # vllm.v1.core.sched.output.SchedulerOutput

`as_vllm` (conformance/scheduler/vllm_form.py) already holds every value vLLM 0.32's scheduler would send, in
spec-side dataclasses; this copies them into vLLM's `SchedulerOutput`, `NewRequestData` and
`CachedRequestData` (fresh lists: the runner extends a request's block-id lists in place on later steps) and
adds what only a real runner reads: each new request's `SamplingParams` (greedy, from `sampling`), and the
fields slotmap does not model, empty (no multimodal features, encoder inputs, LoRA or connectors).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spec.interop.vllm import VllmSchedulerOutput


def greedy_params(max_tokens: int) -> Any:
    """What a drive's request samples with: greedy, `max_tokens` (the runner never stops a request itself)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def to_vllm(form: VllmSchedulerOutput, max_tokens: Mapping[str, int]) -> Any:
    """vLLM's SchedulerOutput of `form`; `max_tokens[req_id]` for each new request's greedy SamplingParams."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = [
        NewRequestData(
            req_id=r.req_id,
            prompt_token_ids=None if r.prompt_token_ids is None else list(r.prompt_token_ids),
            mm_features=[],
            sampling_params=greedy_params(max_tokens[r.req_id]),
            pooling_params=None,
            block_ids=tuple(list(g) for g in r.block_ids),
            num_computed_tokens=r.num_computed_tokens,
            lora_request=None,
            prefill_token_ids=None if r.prefill_token_ids is None else list(r.prefill_token_ids),
        )
        for r in form.scheduled_new_reqs
    ]
    c = form.scheduled_cached_reqs
    cached = CachedRequestData(
        req_ids=list(c.req_ids),
        resumed_req_ids=set(c.resumed_req_ids),
        new_token_ids=[list(t) for t in c.new_token_ids],
        all_token_ids={r: list(t) for r, t in c.all_token_ids.items()},
        new_block_ids=[None if b is None else tuple(list(g) for g in b) for b in c.new_block_ids],
        num_computed_tokens=list(c.num_computed_tokens),
        num_output_tokens=list(c.num_output_tokens or [0] * len(c.req_ids)),
    )
    total = form.total_num_scheduled_tokens
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(form.num_scheduled_tokens),
        total_num_scheduled_tokens=sum(form.num_scheduled_tokens.values()) if total is None else total,
        scheduled_spec_decode_tokens={r: list(t) for r, t in form.scheduled_spec_decode_tokens.items()},
        scheduled_encoder_inputs={},
        finished_req_ids=set(form.finished_req_ids),
        free_encoder_mm_hashes=[],
        preempted_req_ids=None if form.preempted_req_ids is None else set(form.preempted_req_ids),
        new_block_ids_to_zero=None if form.new_block_ids_to_zero is None else list(form.new_block_ids_to_zero),
        num_common_prefix_blocks=list(form.num_common_prefix_blocks),
    )


def finishing(req_ids: set[str]) -> VllmSchedulerOutput:
    """A step that schedules nothing and finishes `req_ids` (the runner frees their rows and state)."""
    from spec.interop.vllm import VllmCachedRequestData

    empty = VllmCachedRequestData(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[],
                                  all_token_ids={}, num_output_tokens=[])  # fmt: skip
    return VllmSchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=empty, num_scheduled_tokens={},
                               finished_req_ids=set(req_ids), preempted_req_ids=set(),
                               total_num_scheduled_tokens=0)  # fmt: skip
