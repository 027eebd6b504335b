"""vLLM in slotmap's terms: its scheduler output converted, its flash-attention metadata named its way.

`from_vllm(out)` reads an object shaped like vLLM's `SchedulerOutput` (the 0.33 field names, mirrored
by the `Vllm*` dataclasses below; vLLM itself is never imported, any object with these attributes
works) and returns slotmap's `SchedulerOutput`. What it cannot map raises `VllmConversionError`
naming the request and the field:
- a new request without `prompt_token_ids` (prompt embeddings), columns of different lengths, a
  preempted request that is also scheduled, a resumed request not in `req_ids`;
- with `known_token_ids` (req_id -> the tokens slotmap's pool holds, e.g. from a snapshot), an entry of
  `all_token_ids` that disagrees with them: vLLM re-sends a resumed request's tokens because its worker
  dropped the request at preemption, while slotmap's pool kept the row and its tokens.
`preempted_req_ids` needs no action: a preempted request keeps its row in slotmap until it resumes.
`scheduled_spec_decode_tokens` carries over as is (a request's drafts; empty lists dropped, as absent).

`flash_attn_metadata(batch, config, group)` names a group's arrays as vLLM's flash-attention backend
does; `vllm_compatible=True` applies the conventions that change values (docs/porting.md): the
block-table width rounded up so that width * block_size is a multiple of 128 tokens (unused entries
0, as in v1), slots padded with PAD_SLOT_ID up to max_num_batched_tokens, int64 index mapping and
logits indices (model runner v2), and, with a `V2RowPolicy`, v2's row numbering.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spec.errors import ScheduleError
from spec.interop.host import HostCounts, check_host_counts
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
)

VLLM_TABLE_ALIGN_TOKENS = 128  # vLLM rounds the block-table width to a multiple of this many tokens
V2_INDEX_DTYPE = "int64"  # model runner v2's idx_mapping and logits_indices


class VllmConversionError(ScheduleError):
    """A vLLM scheduler output that slotmap cannot express (or that contradicts slotmap's pool)."""


# ---- the shapes from_vllm reads (vLLM 0.33 field names) -------------------------------------------
@dataclass
class VllmNewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int


@dataclass
class VllmCachedRequestData:
    """Columnar: entry i of every list belongs to req_ids[i]."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]  # per request: per group, or None (no new blocks)
    num_computed_tokens: list[int]
    all_token_ids: dict[str, list[int]]  # resumed requests: every token they hold


@dataclass
class VllmSchedulerOutput:
    scheduled_new_reqs: list[VllmNewRequestData]
    scheduled_cached_reqs: VllmCachedRequestData
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


def _read(obj: object, name: str, where: str) -> Any:
    if not hasattr(obj, name):
        raise VllmConversionError(None, f"{where}.{name}", f"missing on {type(obj).__name__}")
    return getattr(obj, name)


def _groups(block_ids: object, req_id: str, field_name: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(block_ids, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in block_ids):
        raise VllmConversionError(req_id, field_name, f"expected one list of block ids per group, got {block_ids!r}")
    return tuple(tuple(g) for g in block_ids)


def from_vllm(out: object, known_token_ids: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
    """slotmap's SchedulerOutput for a vLLM-shaped one (module docstring)."""
    drafts = _read(out, "scheduled_spec_decode_tokens", "SchedulerOutput") or {}
    num_scheduled = dict(_read(out, "num_scheduled_tokens", "SchedulerOutput"))
    preempted = set(_read(out, "preempted_req_ids", "SchedulerOutput") or ())
    for req_id in preempted & set(num_scheduled):
        raise VllmConversionError(req_id, "preempted_req_ids", "preempted and scheduled in the same step")

    new = []
    for req in _read(out, "scheduled_new_reqs", "SchedulerOutput"):
        req_id = _read(req, "req_id", "NewRequestData")
        prompt = _read(req, "prompt_token_ids", "NewRequestData")
        if prompt is None:
            raise VllmConversionError(req_id, "prompt_token_ids", "None (prompt embeddings): slotmap needs token ids")
        blocks = _groups(_read(req, "block_ids", "NewRequestData"), req_id, "block_ids")
        new.append(NewRequest(req_id, tuple(prompt), blocks, _read(req, "num_computed_tokens", "NewRequestData")))

    cached_data = _read(out, "scheduled_cached_reqs", "SchedulerOutput")
    req_ids = list(_read(cached_data, "req_ids", "CachedRequestData"))
    columns = {
        name: list(_read(cached_data, name, "CachedRequestData")) for name in ("new_block_ids", "num_computed_tokens")
    }
    for name, column in columns.items():
        if len(column) != len(req_ids):
            detail = f"{len(column)} entries for {len(req_ids)} req_ids"
            raise VllmConversionError(None, f"CachedRequestData.{name}", detail)
    resumed = set(_read(cached_data, "resumed_req_ids", "CachedRequestData") or ())
    for req_id in resumed - set(req_ids):
        raise VllmConversionError(req_id, "resumed_req_ids", "resumed but not in CachedRequestData.req_ids")
    all_token_ids = dict(_read(cached_data, "all_token_ids", "CachedRequestData") or {})
    if known_token_ids is not None:
        for req_id, tokens in all_token_ids.items():
            known = tuple(known_token_ids.get(req_id, ()))
            if tuple(tokens) != known:
                raise VllmConversionError(
                    req_id, "all_token_ids", f"{len(tokens)} tokens differ from the {len(known)} slotmap's pool holds"
                )
    cached = []
    for req_id, blocks, computed in zip(req_ids, columns["new_block_ids"], columns["num_computed_tokens"], strict=True):
        groups = None if blocks is None else _groups(blocks, req_id, "new_block_ids")
        cached.append(CachedRequest(req_id, computed, groups, resumed=req_id in resumed))

    return SchedulerOutput(
        new_requests=tuple(new),
        cached_requests=tuple(cached),
        num_scheduled_tokens=num_scheduled,
        finished_req_ids=frozenset(_read(out, "finished_req_ids", "SchedulerOutput")),
        scheduled_spec_decode_tokens={r: tuple(tokens) for r, tokens in drafts.items() if len(tokens)},
    )


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
