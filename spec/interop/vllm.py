"""vLLM in slotmap's terms: its scheduler output converted, its flash-attention metadata named its way.

`from_vllm(out)` reads an object shaped like vLLM's `SchedulerOutput` (0.32's field names, mirrored by
the `Vllm*` dataclasses below; vLLM itself is never imported, any object with these attributes works)
and returns slotmap's `SchedulerOutput`. `copy_vllm(out)` copies what from_vllm reads into those
dataclasses (a record that the engine's later steps cannot change, and whose repr rebuilds it). Every
field from_vllm reads is mapped, checked, or refused with `VllmConversionError` naming the request and
the field; fields newer than 0.32's core read as their default where an older vLLM lacks them.

Mapped:
- new requests (`prompt_token_ids`, `block_ids`, `num_computed_tokens`); `prefill_token_ids` (model runner
  v2: every token the request holds) become the request's known tokens, after a check that they start
  with the prompt. With `known_token_ids`, a new request whose req_id slotmap's pool still holds is v2's
  resumption (v2 drops a preempted request and sends it again as new): it maps to a resumed cached request
  once its `prefill_token_ids` equal the tokens the pool holds (without them it is refused: a v1 "new"
  request with a held id is a streaming input update, which slotmap does not model);
- cached requests (`new_block_ids`, `num_computed_tokens`, `resumed_req_ids`);
- `scheduled_spec_decode_tokens` (empty lists dropped, as absent);
- `finished_req_ids`; with `known_token_ids`, ids the pool never held are dropped (vLLM lists requests
  aborted before they were ever scheduled, and its worker pops them with a default).
Checked (refused when they disagree):
- `total_num_scheduled_tokens` equals the sum of `num_scheduled_tokens`;
- with `known_token_ids`: `all_token_ids` (resumed or re-added requests: every token they hold) equal the
  pool's tokens; `new_token_ids` (pipeline parallelism only, else empty) equal the pool's tokens at
  num_computed .. num_computed + len; one entry per request of num_scheduled - drafts tokens even without;
- with `known_token_ids` and `num_prompt_tokens`: `num_output_tokens` equals the pool's tokens past the
  prompt. Fewer means vLLM's worker discards output tokens (a failed KV load), more means placeholders
  slotmap has no ids for: both refused;
- `new_block_ids_to_zero`: integers >= 1 (real blocks). Zeroing changes KV memory of blocks no token
  has written yet, never an input; the shadow checker also checks that no scheduled token reads KV from
  a zeroed block;
- `num_common_prefix_blocks`: one non-negative integer per group, or empty (0.32 always sends it empty:
  cascade attention is gone); the shadow checker checks a nonzero claim against the tables.
Refused:
- a new request without `prompt_token_ids`, with `prompt_embeds`, or with positions that are not
  token ids (`prompt_is_token_ids`): slotmap needs token ids;
- a nonzero `replay_start` (sliding-window bounded replay: the request holds no window KV below it, so
  its attention has a lower bound slotmap does not model);
- `kv_cache_block_copies` (copy-on-write of KV between blocks before the forward pass), named by the
  request whose blocks hold a copy's destination;
- non-empty `scheduled_encoder_inputs` (multimodal encoder outputs replace input embeddings);
- draft ids that are placeholders (-1: async scheduling, the worker fills its own drafts in), unless
  `drafts_on_device` says the pool takes the drafter's ids (spec/async_steps.py, rule 8): then a request's
  placeholders pass as they are, and a mix of ids and placeholders is still refused;
- columns of different lengths, a preempted request that is also scheduled, a resumed request not in
  `req_ids`.
`preempted_req_ids` needs no action: a preempted request keeps its row in slotmap until it resumes.
`skip` names requests to leave out of the conversion entirely (the shadow checker's requests it no
longer follows).

`flash_attn_metadata(batch, config, group)` names a group's arrays as vLLM's flash-attention backend
does; `vllm_compatible=True` applies the conventions that change values (docs/porting.md): the
block-table width rounded up so that width * block_size is a multiple of 128 tokens (unused entries
0, as in v1), slots padded with PAD_SLOT_ID up to max_num_batched_tokens, int64 index mapping and
logits indices (model runner v2), and, with a `V2RowPolicy`, v2's row numbering.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spec.errors import ScheduleError
from spec.interop.host import HostCounts, check_host_counts
from spec.interop.kinds import refuse_state_group
from spec.types import (
    BLOCK_ID_DTYPE,
    INDEX_DTYPE,
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    SLOT_DTYPE,
    BatchInputs,
    CachedRequest,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
    is_integral,
)

VLLM_TABLE_ALIGN_TOKENS = 128  # vLLM rounds the block-table width to a multiple of this many tokens
V2_INDEX_DTYPE = "int64"  # model runner v2's idx_mapping and logits_indices
VLLM_PLACEHOLDER_DRAFT = -1  # a draft id the scheduler does not know yet (async scheduling)


class VllmConversionError(ScheduleError):
    """A vLLM scheduler output that slotmap cannot express (or that contradicts slotmap's pool)."""


# ---- the shapes from_vllm reads (vLLM 0.32 field names) -------------------------------------------
@dataclass
class VllmNewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int
    prefill_token_ids: list[int] | None = None  # model runner v2: every token the request holds
    replay_start: int = 0  # sliding-window bounded replay: no window KV below this position
    prompt_embeds: tuple[int, ...] | None = None  # the embeddings' shape when the prompt is embeddings
    prompt_is_token_ids: list[bool] | None = None  # per prompt position: False where it is an embedding


@dataclass
class VllmCachedRequestData:
    """Columnar: entry i of every list belongs to req_ids[i]."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]  # per request: per group, or None (no new blocks)
    num_computed_tokens: list[int]
    all_token_ids: dict[str, list[int]]  # requests not scheduled in the previous step: every token they hold
    new_token_ids: list[list[int]] = field(default_factory=list)  # pipeline parallelism only: this step's tokens
    num_output_tokens: list[int] | None = None  # per request: output tokens (+ placeholders); None: not sent


@dataclass
class VllmSchedulerOutput:
    scheduled_new_reqs: list[VllmNewRequestData]
    scheduled_cached_reqs: VllmCachedRequestData
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None
    total_num_scheduled_tokens: int | None = None  # None: not sent
    new_block_ids_to_zero: list[int] | None = None  # blocks whose KV memory the worker zeros first
    kv_cache_block_copies: list[tuple[int, int]] | None = None  # (src_block_id, dst_block_id) KV copies
    num_common_prefix_blocks: list[int] = field(default_factory=list)  # per group (deprecated, empty)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)


_MISSING = object()


def _read(obj: object, name: str, where: str, default: Any = _MISSING) -> Any:
    if not hasattr(obj, name):
        if default is not _MISSING:
            return default
        raise VllmConversionError(None, f"{where}.{name}", f"missing on {type(obj).__name__}")
    return getattr(obj, name)


def _groups(block_ids: object, req_id: str | None, field_name: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(block_ids, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in block_ids):
        raise VllmConversionError(req_id, field_name, f"expected one list of block ids per group, got {block_ids!r}")
    return tuple(tuple(g) for g in block_ids)


def _ints(values: object, req_id: str | None, field_name: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise VllmConversionError(req_id, field_name, f"expected a list of integers, got {values!r}")
    out = list(values)
    for v in out:
        if not is_integral(v):
            raise VllmConversionError(req_id, field_name, f"{v!r} is not an integer")
    return [int(v) for v in out]


def _maybe_ints(values: object, req_id: str | None, field_name: str) -> list[int] | None:
    return None if values is None else _ints(values, req_id, field_name)


def copy_vllm(out: object) -> VllmSchedulerOutput:
    """What from_vllm reads of `out`, copied into this module's dataclasses (lists of Python ints)."""
    where = "SchedulerOutput"
    new = []
    for req in _read(out, "scheduled_new_reqs", where):
        req_id = _read(req, "req_id", "NewRequestData")
        embeds = _read(req, "prompt_embeds", "NewRequestData", None)
        is_ids = _read(req, "prompt_is_token_ids", "NewRequestData", None)
        new.append(
            VllmNewRequestData(
                req_id=req_id,
                prompt_token_ids=_maybe_ints(
                    _read(req, "prompt_token_ids", "NewRequestData"), req_id, "prompt_token_ids"
                ),
                block_ids=tuple(
                    list(g) for g in _groups(_read(req, "block_ids", "NewRequestData"), req_id, "block_ids")
                ),
                num_computed_tokens=_read(req, "num_computed_tokens", "NewRequestData"),
                prefill_token_ids=_maybe_ints(
                    _read(req, "prefill_token_ids", "NewRequestData", None), req_id, "prefill_token_ids"
                ),
                replay_start=_read(req, "replay_start", "NewRequestData", 0),
                prompt_embeds=None if embeds is None else tuple(int(d) for d in getattr(embeds, "shape", (0,))),
                prompt_is_token_ids=None if is_ids is None else [bool(b) for b in is_ids],
            )
        )
    cached = _read(out, "scheduled_cached_reqs", where)
    c_where = "CachedRequestData"
    block_column = _read(cached, "new_block_ids", c_where)
    outputs = _read(cached, "num_output_tokens", c_where, None)
    copied = VllmCachedRequestData(
        req_ids=list(_read(cached, "req_ids", c_where)),
        resumed_req_ids=set(_read(cached, "resumed_req_ids", c_where) or ()),
        new_block_ids=[
            None if b is None else tuple(list(g) for g in _groups(b, None, "new_block_ids")) for b in block_column
        ],
        num_computed_tokens=list(_read(cached, "num_computed_tokens", c_where)),
        all_token_ids={
            r: _ints(t, r, "all_token_ids") for r, t in (_read(cached, "all_token_ids", c_where) or {}).items()
        },
        new_token_ids=[_ints(t, None, "new_token_ids") for t in _read(cached, "new_token_ids", c_where, None) or ()],
        num_output_tokens=None if outputs is None else list(outputs),
    )
    copies = _read(out, "kv_cache_block_copies", where, None)
    drafts = _read(out, "scheduled_spec_decode_tokens", where) or {}
    preempted = _read(out, "preempted_req_ids", where)
    return VllmSchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=copied,
        num_scheduled_tokens=dict(_read(out, "num_scheduled_tokens", where)),
        scheduled_spec_decode_tokens={r: _ints(t, r, "scheduled_spec_decode_tokens") for r, t in drafts.items()},
        finished_req_ids=set(_read(out, "finished_req_ids", where)),
        preempted_req_ids=None if preempted is None else set(preempted),
        total_num_scheduled_tokens=_read(out, "total_num_scheduled_tokens", where, None),
        new_block_ids_to_zero=_maybe_ints(
            _read(out, "new_block_ids_to_zero", where, None), None, "new_block_ids_to_zero"
        ),
        kv_cache_block_copies=None if copies is None else [_block_copy(c) for c in copies],
        num_common_prefix_blocks=_ints(
            _read(out, "num_common_prefix_blocks", where, ()) or (), None, "num_common_prefix_blocks"
        ),
        scheduled_encoder_inputs={
            r: list(v) for r, v in (_read(out, "scheduled_encoder_inputs", where, None) or {}).items()
        },
    )


def _block_copy(copy: object) -> tuple[int, int]:
    """vLLM's KVCacheBlockCopy(src_block_id, dst_block_id), or a (src, dst) pair."""
    if hasattr(copy, "src_block_id") and hasattr(copy, "dst_block_id"):
        pair = [copy.src_block_id, copy.dst_block_id]
    else:
        pair = list(copy) if isinstance(copy, (tuple, list)) else []
    if len(pair) != 2 or not all(is_integral(b) for b in pair):
        raise VllmConversionError(None, "kv_cache_block_copies", f"{copy!r} is not a (src, dst) block pair")
    return int(pair[0]), int(pair[1])


def from_vllm(
    out: object,
    known_token_ids: Mapping[str, Sequence[int]] | None = None,
    *,
    num_prompt_tokens: Mapping[str, int] | None = None,
    skip: Collection[str] = (),
    drafts_on_device: bool = False,
) -> SchedulerOutput:
    """slotmap's SchedulerOutput for a vLLM-shaped one (module docstring).

    `known_token_ids`: req_id -> the tokens slotmap's pool holds, for every request it holds (its keys are
    the held requests). `num_prompt_tokens`: req_id -> its prompt length, for the num_output_tokens check.
    """
    where = "SchedulerOutput"
    drafts = _read(out, "scheduled_spec_decode_tokens", where) or {}
    num_scheduled = {r: n for r, n in dict(_read(out, "num_scheduled_tokens", where)).items() if r not in skip}
    preempted = set(_read(out, "preempted_req_ids", where) or ())
    for req_id in preempted & set(num_scheduled):
        raise VllmConversionError(req_id, "preempted_req_ids", "preempted and scheduled in the same step")
    total = _read(out, "total_num_scheduled_tokens", where, None)
    if total is not None and not skip:
        counted = sum(dict(_read(out, "num_scheduled_tokens", where)).values())
        if total != counted:
            raise VllmConversionError(
                None, "total_num_scheduled_tokens", f"{total}, but num_scheduled_tokens sum to {counted}"
            )
    _refuse_worker_side_ops(out, skip)
    for req_id, tokens in drafts.items():
        ids = list(tokens)
        on_device = drafts_on_device and all(t == VLLM_PLACEHOLDER_DRAFT for t in ids)
        if req_id not in skip and VLLM_PLACEHOLDER_DRAFT in ids and not on_device:
            detail = "placeholder drafts (-1, async scheduling): slotmap needs the draft ids, or the drafter's"
            raise VllmConversionError(req_id, "scheduled_spec_decode_tokens", detail)

    new: list[NewRequest] = []
    resumed_new: list[CachedRequest] = []
    for req in _read(out, "scheduled_new_reqs", where):
        req_id = _read(req, "req_id", "NewRequestData")
        if req_id in skip:
            continue
        request = _new_request(req, req_id, known_token_ids)
        if isinstance(request, CachedRequest):
            resumed_new.append(request)
        else:
            new.append(request)

    cached = _cached_requests(_read(out, "scheduled_cached_reqs", where), known_token_ids, num_prompt_tokens,
                              num_scheduled, drafts, skip)  # fmt: skip
    finished = frozenset(_read(out, "finished_req_ids", where)) - set(skip)
    if known_token_ids is not None:  # ids the worker never held need no action (vLLM's worker pops them)
        finished = frozenset(r for r in finished if r in known_token_ids)
    return SchedulerOutput(
        new_requests=tuple(new),
        cached_requests=tuple(cached) + tuple(resumed_new),
        num_scheduled_tokens=num_scheduled,
        finished_req_ids=finished,
        scheduled_spec_decode_tokens={r: tuple(t) for r, t in drafts.items() if len(t) and r not in skip},
    )


def _new_request(
    req: object, req_id: str, known_token_ids: Mapping[str, Sequence[int]] | None
) -> NewRequest | CachedRequest:
    """A new request, or (model runner v2) the resumption of one the pool holds (a resumed CachedRequest)."""
    where = "NewRequestData"
    prompt = _read(req, "prompt_token_ids", where)
    if prompt is None:
        raise VllmConversionError(req_id, "prompt_token_ids", "None (prompt embeddings): slotmap needs token ids")
    if _read(req, "prompt_embeds", where, None) is not None:
        raise VllmConversionError(req_id, "prompt_embeds", "prompt embeddings: slotmap needs token ids")
    is_ids = _read(req, "prompt_is_token_ids", where, None)
    if is_ids is not None and not all(is_ids):
        raise VllmConversionError(req_id, "prompt_is_token_ids", "some positions are embeddings, not token ids")
    replay_start = _read(req, "replay_start", where, 0)
    if replay_start:
        detail = f"{replay_start}: bounded sliding-window replay (no window KV below it) is not modeled"
        raise VllmConversionError(req_id, "replay_start", detail)
    tokens = tuple(prompt)
    prefill = _read(req, "prefill_token_ids", where, None)
    if prefill is not None:
        if tuple(prefill[: len(tokens)]) != tokens:
            raise VllmConversionError(req_id, "prefill_token_ids", "does not start with prompt_token_ids")
        tokens = tuple(prefill)
    blocks = _groups(_read(req, "block_ids", where), req_id, "block_ids")
    computed = _read(req, "num_computed_tokens", where)
    if known_token_ids is not None and req_id in known_token_ids:
        if prefill is None:
            detail = "a new request whose id holds a row: a streaming input update, which slotmap does not model"
            raise VllmConversionError(req_id, "scheduled_new_reqs", detail)
        held = tuple(known_token_ids[req_id])
        if tokens != held:
            detail = f"{len(tokens)} tokens differ from the {len(held)} slotmap's pool holds"
            raise VllmConversionError(req_id, "prefill_token_ids", detail)
        return CachedRequest(req_id, computed, blocks, resumed=True)
    return NewRequest(req_id, tokens, blocks, computed)


def _cached_requests(
    data: object,
    known_token_ids: Mapping[str, Sequence[int]] | None,
    num_prompt_tokens: Mapping[str, int] | None,
    num_scheduled: Mapping[str, int],
    drafts: Mapping[str, Sequence[int]],
    skip: Collection[str],
) -> list[CachedRequest]:
    where = "CachedRequestData"
    req_ids = list(_read(data, "req_ids", where))
    columns = {name: list(_read(data, name, where)) for name in ("new_block_ids", "num_computed_tokens")}
    outputs = _read(data, "num_output_tokens", where, None)
    if outputs is not None:
        columns["num_output_tokens"] = list(outputs)
    pp_tokens = list(_read(data, "new_token_ids", where, None) or ())
    if pp_tokens:  # empty unless pipeline parallelism
        columns["new_token_ids"] = pp_tokens
    for name, column in columns.items():
        if len(column) != len(req_ids):
            raise VllmConversionError(None, f"{where}.{name}", f"{len(column)} entries for {len(req_ids)} req_ids")
    resumed = set(_read(data, "resumed_req_ids", where) or ())
    for req_id in resumed - set(req_ids):
        raise VllmConversionError(req_id, "resumed_req_ids", "resumed but not in CachedRequestData.req_ids")
    all_token_ids = dict(_read(data, "all_token_ids", where) or {})
    prompts = num_prompt_tokens if num_prompt_tokens is not None else {}
    cached = []
    for i, req_id in enumerate(req_ids):
        if req_id in skip:
            continue
        computed = columns["num_computed_tokens"][i]
        # the pool's tokens, read only where a check needs them: len() for most requests, never every token
        held = None if known_token_ids is None or req_id not in known_token_ids else known_token_ids[req_id]
        if held is not None and req_id in all_token_ids and tuple(all_token_ids[req_id]) != tuple(held):
            detail = f"{len(all_token_ids[req_id])} tokens differ from the {len(held)} slotmap's pool holds"
            raise VllmConversionError(req_id, "all_token_ids", detail)
        if "new_token_ids" in columns:
            _check_pp_tokens(req_id, list(columns["new_token_ids"][i]), computed, held, num_scheduled, drafts)
        if "num_output_tokens" in columns and held is not None and req_id in prompts:
            want = len(held) - prompts[req_id]
            got = columns["num_output_tokens"][i]
            if got != want:
                why = "vLLM's worker would discard output tokens" if got < want else "more than slotmap holds"
                detail = f"{got}, slotmap's pool holds {want} past the prompt ({why})"
                raise VllmConversionError(req_id, "num_output_tokens", detail)
        blocks = columns["new_block_ids"][i]
        groups = None if blocks is None else _groups(blocks, req_id, "new_block_ids")
        cached.append(CachedRequest(req_id, computed, groups, resumed=req_id in resumed))
    return cached


def _check_pp_tokens(
    req_id: str,
    tokens: list[int],
    computed: int,
    held: Sequence[int] | None,
    num_scheduled: Mapping[str, int],
    drafts: Mapping[str, Sequence[int]],
) -> None:
    """new_token_ids[i]: the request's tokens at num_computed .. (pipeline parallelism's non-last ranks)."""
    want = num_scheduled.get(req_id, 0) - len(drafts.get(req_id, ()))
    if len(tokens) != want:
        detail = f"{len(tokens)} tokens, the step schedules {want} known ones"
        raise VllmConversionError(req_id, "new_token_ids", detail)
    if held is not None and tuple(tokens) != tuple(held[computed : computed + len(tokens)]):
        detail = f"differ from slotmap's tokens at positions {computed}..{computed + len(tokens) - 1}"
        raise VllmConversionError(req_id, "new_token_ids", detail)


def _refuse_worker_side_ops(out: object, skip: Collection[str]) -> None:
    """Fields that make the worker do more than build inputs: checked, or refused where slotmap has no model."""
    where = "SchedulerOutput"
    for block in _read(out, "new_block_ids_to_zero", where, None) or ():
        if not is_integral(block) or block < 1:
            raise VllmConversionError(None, "new_block_ids_to_zero", f"{block!r} is not a real block id (>= 1)")
    for count in _read(out, "num_common_prefix_blocks", where, None) or ():
        if not is_integral(count) or count < 0:
            raise VllmConversionError(None, "num_common_prefix_blocks", f"{count!r} is not a block count")
    copies = [_block_copy(c) for c in _read(out, "kv_cache_block_copies", where, None) or ()]
    if copies:
        owner = _owner_of(out, {dst for _, dst in copies})
        if owner not in skip:
            shown = ", ".join(f"{s}->{d}" for s, d in copies[:4]) + (" ..." if len(copies) > 4 else "")
            detail = f"{len(copies)} copies ({shown}): copying KV between blocks is not modeled"
            raise VllmConversionError(owner, "kv_cache_block_copies", detail)
    for req_id, inputs in (_read(out, "scheduled_encoder_inputs", where, None) or {}).items():
        if inputs and req_id not in skip:
            raise VllmConversionError(req_id, "scheduled_encoder_inputs", "encoder inputs (multimodal) are not modeled")


def _owner_of(out: object, blocks: set[int]) -> str | None:
    """The first request of the step handed one of `blocks` (None if none is)."""
    for req in _read(out, "scheduled_new_reqs", "SchedulerOutput"):
        if any(b in blocks for g in _read(req, "block_ids", "NewRequestData") for b in g):
            return str(_read(req, "req_id", "NewRequestData"))
    cached = _read(out, "scheduled_cached_reqs", "SchedulerOutput")
    for req_id, groups in zip(
        _read(cached, "req_ids", "CachedRequestData"), _read(cached, "new_block_ids", "CachedRequestData"), strict=False
    ):
        if groups is not None and any(b in blocks for g in groups for b in g):
            return str(req_id)
    return None


# ---- conventions ----------------------------------------------------------------------------------
def vllm_table_width(config: WorkerConfig, group: int) -> int:
    """vLLM's block-table width: max_blocks_per_req rounded up to a multiple of 128 tokens."""
    block_size = config.kv_groups[group].block_size
    step = VLLM_TABLE_ALIGN_TOKENS // math.gcd(VLLM_TABLE_ALIGN_TOKENS, block_size)  # blocks per aligned unit
    return -(-config.max_blocks_per_req(group) // step) * step


class V2RowPolicy:
    """Model runner v2's rows: the most recently freed row is handed out first (a stack of free rows).

    Fed every scheduler output in order (`apply`), it numbers rows as v2 would. Rows freed in one
    output are pushed in ascending row order, so the highest of them is reused first (v2 frees in
    set order; the tie needs a rule and this is ours). Row 0 is handed out first on a fresh pool.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.free = list(range(max_num_reqs - 1, -1, -1))  # stack: pop() gives the next row
        self.row_of: dict[str, int] = {}  # req_id -> v2's req_state_idx

    def apply(self, sched: SchedulerOutput) -> None:
        for row in sorted(self.row_of.pop(r) for r in sched.finished_req_ids if r in self.row_of):
            self.free.append(row)
        for req in sched.new_requests:
            if not self.free:
                raise VllmConversionError(req.req_id, "new_requests", "no free row")
            self.row_of[req.req_id] = self.free.pop()

    def index_mapping(self, req_ids: Iterable[str]) -> np.ndarray:  # [num_reqs] int64 batch_idx -> v2 row
        return np.array([self.row_of[r] for r in req_ids], V2_INDEX_DTYPE)


@dataclass(frozen=True)
class FlashAttnMetadata:
    """One KV cache group's metadata under vLLM's names (FlashAttentionMetadata / flash_attn_varlen_func).

    Arrays are NumPy from spec.interop, torch tensors on the batch's device from fast.interop.
    """

    num_actual_tokens: int  # real tokens; arrays below may be padded past it
    cu_seqlens_q: Any  # [num_reqs + 1] int32, query_start_loc
    seq_lens: Any  # [num_reqs] int32 (seqused_k)
    max_query_len: int  # max_seqlen_q
    max_seq_len: int  # max_seqlen_k
    block_table: Any  # [num_reqs, width] int32, width = vllm_table_width if vllm_compatible
    slot_mapping: Any  # [T'] int64, T' = max(T, max_num_batched_tokens) if vllm_compatible else T
    idx_mapping: Any  # [num_reqs] batch_idx -> req_state_idx (int64 and v2's rows if vllm_compatible)
    logits_indices: Any  # [num_reqs] (int64 if vllm_compatible)


def flash_attn_metadata(
    batch: BatchInputs,
    config: WorkerConfig,
    group: int = 0,
    *,
    vllm_compatible: bool = False,
    row_policy: V2RowPolicy | None = None,
    host: HostCounts | None = None,
) -> FlashAttnMetadata:
    refuse_state_group(config, group, "flash_attn_metadata")
    num_scheduled = np.asarray(batch.num_scheduled_tokens, np.int64)  # [num_reqs]
    seq_lens = np.asarray(batch.seq_lens)  # [num_reqs]
    check_host_counts(host, num_scheduled, seq_lens.astype(np.int64))
    table = np.asarray(batch.block_tables[group])  # [num_reqs, max_blocks]
    slots = np.asarray(batch.slot_mappings[group])  # [T]
    idx_mapping, logits_indices = np.asarray(batch.index_mapping), np.asarray(batch.logits_indices)
    if vllm_compatible:
        wide = np.full((table.shape[0], vllm_table_width(config, group)), NULL_BLOCK_ID, BLOCK_ID_DTYPE)
        wide[:, : table.shape[1]] = table
        table = wide
        padded = np.full(max(len(slots), config.max_num_batched_tokens), PAD_SLOT_ID, SLOT_DTYPE)
        padded[: len(slots)] = slots
        slots = padded
        if row_policy is not None:
            idx_mapping = row_policy.index_mapping(batch.req_ids)
        idx_mapping, logits_indices = idx_mapping.astype(V2_INDEX_DTYPE), logits_indices.astype(V2_INDEX_DTYPE)
    elif row_policy is not None:
        raise ValueError("row_policy: only with vllm_compatible=True")
    return FlashAttnMetadata(
        num_actual_tokens=batch.num_tokens,
        cu_seqlens_q=np.asarray(batch.query_start_loc).astype(INDEX_DTYPE),
        seq_lens=seq_lens.astype(INDEX_DTYPE),
        max_query_len=int(num_scheduled.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        block_table=table,
        slot_mapping=slots,
        idx_mapping=idx_mapping,
        logits_indices=logits_indices,
    )
