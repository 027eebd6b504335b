"""The reference scheduler's output as vLLM 0.32's scheduler sends it: the one converter every test speaking vLLM uses.

    out = sched.schedule()
    vllm_out = as_vllm(out, sched)  # between schedule() and update(): it reads what this step decided
    back = spec.interop.from_vllm(vllm_out, known_token_ids=..., num_prompt_tokens=...)  # == out

Every field of vLLM 0.32's `SchedulerOutput` that slotmap models (spec/interop/vllm.py's docstring) is filled
with the value vLLM's scheduler (vllm/v1/core/sched/scheduler.py) would send for the same decisions:
- `total_num_scheduled_tokens`; `scheduled_spec_decode_tokens` lists drafting requests only;
- `preempted_req_ids`: the requests this step preempted (`ReferenceScheduler.preempted_req_ids`);
- `finished_req_ids`: the output's, and requests aborted before they ever held a row (vLLM lists every
  request freed since the last step; its worker pops the ids it never held);
- `CachedRequestData.all_token_ids`: every token of each request the previous output did not schedule
  (resumed ones, and running ones the budget left out), as v1 sends them; `num_output_tokens`: the tokens
  past the prompt of every cached request;
- `new_block_ids_to_zero`: vLLM sends it only when its KV cache needs zeroing (a mamba layer, or a
  mixed-precision cache: knob `zero_new_blocks`; otherwise None) and then lists every block its managers
  allocated this step, prefix-cache hits not included, in attention groups only (its mamba manager records
  none). vLLM's block ids are one namespace across groups (one block pool): with `one_block_pool` every
  fresh id is listed; with a pool per group the list names no group, so zeroing id b zeros b in every
  group, and an id is listed only while no other group holds it. No token has written such a block: a
  step writes its fresh blocks, it never reads them;
- `num_common_prefix_blocks`: empty, as 0.32 sends it (cascade attention is gone); with knob
  `common_prefix_blocks`, per group the leading blocks every running request's table shares (live, not
  null), which is what vLLM computed before 0.32 from reference counts; 0 for mamba and cross-attention
  groups, whose blocks are per request;
- model runner v2 (knob `model_runner_v2`): every new request carries `prefill_token_ids` (all its tokens),
  a resumed request is sent again as a new one (prompt, prefill_token_ids, its whole table), after the
  new ones, and no `all_token_ids` (v2 keeps none);
- pipeline parallelism (knob `pipeline_parallel`): `new_token_ids`, each cached request's tokens from
  num_computed_tokens for its scheduled tokens less its drafts.
Not produced, refused with `VllmFormError` naming the request and field: async scheduling (vLLM sends
placeholder drafts and counts in-flight tokens it has no ids for), encoder inputs (`encoder_len`) and
M-RoPE tables (vLLM's output carries neither: its worker computes them from the multimodal features).
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.scheduler.request import SchedRequest
from conformance.scheduler.scheduler import ReferenceScheduler
from spec.interop import VllmCachedRequestData, VllmNewRequestData, VllmSchedulerOutput
from spec.types import NULL_BLOCK_ID, CachedRequest, NewRequest, SchedulerOutput


class VllmFormError(ValueError):
    """A scheduler output vLLM 0.32's scheduler could not have sent in this form."""

    def __init__(self, req_id: str | None, field: str, detail: str) -> None:
        self.req_id, self.field, self.detail = req_id, field, detail
        who = f"request {req_id!r}" if req_id is not None else "scheduler output"
        super().__init__(f"{who}: {field}: {detail}")


def as_vllm(out: SchedulerOutput, sched: ReferenceScheduler) -> VllmSchedulerOutput:
    """`out`, the output `sched` is executing, in vLLM 0.32's form (module docstring)."""
    if out is not sched.last_output:
        raise VllmFormError(None, "out", "not the output the scheduler is executing (call between schedule and update)")
    knobs, config = sched.knobs, sched.config
    if config.async_scheduling:
        raise VllmFormError(None, "config.async_scheduling", "vLLM's async form (placeholder drafts) is not produced")
    for new in out.new_requests:
        if new.encoder_len or new.mrope_positions is not None:
            field = "encoder_len" if new.encoder_len else "mrope_positions"
            raise VllmFormError(new.req_id, field, "vLLM's scheduler output carries no encoder or M-RoPE inputs")
    v2 = knobs.model_runner_v2
    resumed = [r for r in out.cached_requests if r.resumed]
    running = [r for r in out.cached_requests if not r.resumed]
    new_reqs = [_new_request(r, v2) for r in out.new_requests]
    cached = list(out.cached_requests)
    if v2:  # v2 dropped a preempted request's state: it comes back as new, after the new ones
        new_reqs += [_resumed_as_new(r, sched.requests[r.req_id]) for r in resumed]
        cached = running
    requests = [sched.requests[r.req_id] for r in cached]
    unscheduled = [
        (r.req_id, q) for r, q in zip(cached, requests, strict=True) if r.req_id not in sched.previously_scheduled
    ]
    data = VllmCachedRequestData(
        req_ids=[r.req_id for r in cached],
        resumed_req_ids={r.req_id for r in cached if r.resumed},
        new_block_ids=[None if r.new_block_ids is None else _lists(r.new_block_ids) for r in cached],
        num_computed_tokens=[r.num_computed_tokens for r in cached],
        all_token_ids={} if v2 else {req_id: list(q.tokens) for req_id, q in unscheduled},
        new_token_ids=_pp_tokens(out, cached, requests) if knobs.pipeline_parallel else [],
        num_output_tokens=[q.num_output for q in requests],
    )
    return VllmSchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=data,
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        scheduled_spec_decode_tokens={r: list(t) for r, t in out.scheduled_spec_decode_tokens.items() if t},
        finished_req_ids=set(out.finished_req_ids | sched.finished_unheld),
        preempted_req_ids=set(sched.preempted_req_ids),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        new_block_ids_to_zero=blocks_to_zero(sched),
        num_common_prefix_blocks=common_prefix_blocks(sched) if knobs.common_prefix_blocks else [],
    )


def blocks_to_zero(sched: ReferenceScheduler) -> list[int] | None:
    """vLLM's new_block_ids_to_zero for the step `sched` is executing (module docstring), or None."""
    groups = sched.groups
    if not (sched.knobs.zero_new_blocks or any(g.kind == "mamba" for g in groups)):
        return None  # vLLM's uniform-precision caches without mamba layers skip zeroing
    ids: list[int] = []
    for g, fresh in enumerate(sched.fresh_blocks):
        if groups[g].kind == "mamba":
            continue
        if sched.config.one_block_pool:  # vLLM's own form: a fresh id is this group's alone
            ids += fresh
            continue
        others = [a for h, a in enumerate(sched.allocators) if h != g]
        ids += [b for b in fresh if all(a.is_free(b) for a in others)]
    return ids or None  # vLLM sends None for an empty list too


def common_prefix_blocks(sched: ReferenceScheduler) -> list[int]:
    """Per group, the leading blocks every running request holds in common (0 for per-request groups)."""
    counts = []
    for g, group in enumerate(sched.groups):
        if group.kind not in ("attention", "mla") or not sched.running:  # mla: vLLM's FullAttentionManager's
            counts.append(0)
            continue
        n = 0
        for column in zip(*(r.blocks[g] for r in sched.running), strict=False):  # stops at the shortest table
            if column[0] == NULL_BLOCK_ID or any(b != column[0] for b in column):
                break
            n += 1
        counts.append(n)
    return counts


def _new_request(r: NewRequest, v2: bool) -> VllmNewRequestData:
    prompt = list(r.prompt_token_ids)
    return VllmNewRequestData(r.req_id, prompt, _lists(r.block_ids), r.num_computed_tokens,
                              prefill_token_ids=list(prompt) if v2 else None)  # fmt: skip


def _resumed_as_new(r: CachedRequest, req: SchedRequest) -> VllmNewRequestData:
    if r.new_block_ids is None:
        raise VllmFormError(r.req_id, "new_block_ids", "a resumed request without its table")
    return VllmNewRequestData(r.req_id, list(req.spec.prompt_token_ids), _lists(r.new_block_ids),
                              r.num_computed_tokens, prefill_token_ids=list(req.tokens))  # fmt: skip


def _pp_tokens(
    out: SchedulerOutput, cached: Sequence[CachedRequest], requests: Sequence[SchedRequest]
) -> list[list[int]]:
    """new_token_ids: each cached request's known tokens this step computes (its drafts are sent apart)."""
    tokens = []
    for r, req in zip(cached, requests, strict=True):
        n = out.num_scheduled_tokens[r.req_id] - len(out.scheduled_spec_decode_tokens.get(r.req_id, ()))
        tokens.append(list(req.tokens[r.num_computed_tokens : r.num_computed_tokens + n]))
    return tokens


def _lists(groups: tuple[tuple[int, ...], ...]) -> tuple[list[int], ...]:
    return tuple(list(g) for g in groups)
