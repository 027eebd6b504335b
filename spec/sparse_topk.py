"""Sparse top-k attention's slot mapping: the cache slot of every key a query's indexer selected.

DeepSeek-V3.2's sparse attention (vLLM's sparse MLA backends) lets an indexer pick, per query token, at most
top_k earlier tokens of the query's own request; attention then reads only those. The indexer is the model's
job; this stage takes its output as `topk_indices` [T, top_k]: for flat token t, positions in t's request
(the same index space as `positions`), -1 for an unused entry. It returns, per entry, the physical slot of
that position in one KV group's cache, vLLM's per-token form (triton_convert_req_index_to_global_index with
req_id_per_token = each token's batch_idx):

    slot[t, j] = block_table[b, idx // bs] * bs + idx % bs      (idx = topk_indices[t, j], b = t's batch row)
    slot[t, j] = -1                                               where idx == -1

Entries keep their columns (no compaction: vLLM's COMPACT_TO_FRONT variant reorders them, but the selected
set is all any reader may depend on). Slots are int64 (SLOT_DTYPE), as every slot of the project: vLLM's
int32 output assumes num_blocks * block_size < 2**31.

With decode context parallelism (`cp`, spec/context_parallel.py) on a sharded group, the slot is the one in
rank cp.rank's cache and -1 where the position lives on another rank: the very transform that places the
KV when it is written (cp_slot_mapping, applied to the selected positions), so each rank's entries are its
local share of the selection. vLLM's kernel with DCP_SIZE > 1 computes the same. A replicated group, or no
`cp`, maps through the pool's own blocks.

Rules, checked before anything is computed, each raising its SparseIndexError subclass (a ValueError that
names the request, the flat token and the argument), in this order; within a rule the first offending
(token, entry) in row-major order is named:
  1. PaddingIndexError: a padded token (flat index >= batch.num_tokens) selects anything; its row must be
     all -1, and its slots are all -1.
  2. InvalidIndexError: an index < -1.
  3. FutureIndexError: an index past the query's own position (causality: a query at position p reads
     positions <= p, itself included, as spec.attention).
  4. WindowIndexError: on a sliding-window group, an index at or before p - window (the window reads
     positions > p - window). This also keeps every index off the table entries a window released for good
     (KVCacheGroup.first_live_entry), which may hold ids the request was handed again.
  5. ReleasedBlockIndexError: the index's table entry is the null block (a placeholder the request no longer
     holds a block for), or lies past the table.
  6. DuplicateIndexError: one position twice in a row. A top-k selection is a set, and vLLM's sparse kernels
     read each listed entry (a repeated one would weigh its key twice in the softmax): refused, not merged.
A real token whose row is all -1 selects nothing; its attention is the empty state (spec/sparse_attention.py).
The group must hold KV per position (an attention or mla group): a Mamba group has one state per request and
a cross-attention group the encoder's KV, which no decoder position indexes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.context_parallel import ContextParallel, cp_slot_mapping
from spec.kv_cache import dtype_name
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, SLOT_DTYPE, BatchInputs, KVCacheGroup, WorkerConfig, is_integral

# Group kinds whose cache holds KV per position of the request's own sequence: the ones a top-k index reads.
POSITION_KINDS = ("attention", "mla")
INDEX_DTYPES = ("int32", "int64")


class SparseIndexError(ValueError):
    """A top-k index no query may read. `req_id` (None for a padded token), `token` (flat token index) and
    `field` say where; nothing was computed."""

    def __init__(self, req_id: str | None, token: int, field: str, detail: str) -> None:
        self.req_id, self.token, self.field, self.detail = req_id, token, field, detail
        who = f"request {req_id!r}, token {token}" if req_id is not None else f"token {token}"
        super().__init__(f"{who}: {field}: {detail}")


class PaddingIndexError(SparseIndexError):
    """A padded token selects a key: its row must be all -1."""


class InvalidIndexError(SparseIndexError):
    """An index below -1 (or, for a slot, outside the cache)."""


class FutureIndexError(SparseIndexError):
    """An index past the query's own position."""


class WindowIndexError(SparseIndexError):
    """An index outside the group's sliding window."""


class ReleasedBlockIndexError(SparseIndexError):
    """An index on the null block (a block the request no longer holds) or past its table."""


class DuplicateIndexError(SparseIndexError):
    """One key listed twice in a query's row."""


SPARSE_INDEX_ERRORS: tuple[type[SparseIndexError], ...] = (
    PaddingIndexError,
    InvalidIndexError,
    FutureIndexError,
    WindowIndexError,
    ReleasedBlockIndexError,
    DuplicateIndexError,
)


def sparse_slot_mapping(
    batch: BatchInputs,
    config: WorkerConfig,
    topk_indices: np.ndarray,  # [T, top_k] flat token index -> positions in its request it reads, -1: none
    group: int = 0,
    *,
    cp: ContextParallel | None = None,
) -> np.ndarray:  # [T, top_k] int64: slot in (rank cp.rank's) cache of `group`; -1: none, or on another rank
    block_size, rank_cp = check_sparse_request(batch, config, topk_indices, group, cp)
    check_topk_indices(
        topk_indices, batch.req_ids, batch.num_tokens, batch.query_start_loc, batch.positions,
        batch.block_tables[group], config.kv_groups[group], group,
    )  # fmt: skip
    return _rank_slots(batch, topk_indices, group, block_size, rank_cp)


def check_sparse_request(
    batch: BatchInputs, config: WorkerConfig, topk_indices: Any, group: Any, cp: ContextParallel | None
) -> tuple[int, ContextParallel]:
    """Shapes, dtypes and the group (NumPy arrays and torch tensors alike); returns the block size of the cache
    the slots address and the split its slots follow (one rank for a replicated group or without `cp`)."""
    if not is_integral(group) or not 0 <= group < len(config.kv_groups):
        raise ValueError(f"sparse_slot_mapping: group must be in [0, {len(config.kv_groups)}), got {group!r}")
    kind = config.kv_groups[group].kind
    if kind not in POSITION_KINDS:
        raise ValueError(f"sparse_slot_mapping: group {group} is a {kind} group; top-k indices read {POSITION_KINDS}")
    if topk_indices.ndim != 2 or topk_indices.shape[0] != batch.num_tokens_padded:
        raise ValueError(
            f"sparse_slot_mapping: topk_indices {tuple(topk_indices.shape)} must be "
            f"[num_tokens_padded={batch.num_tokens_padded}, top_k]"
        )
    if dtype_name(topk_indices.dtype) not in INDEX_DTYPES:
        raise ValueError(f"sparse_slot_mapping: topk_indices must be int32 or int64, got {topk_indices.dtype}")
    if cp is not None and not isinstance(cp, ContextParallel):
        raise ValueError(f"sparse_slot_mapping: cp must be a ContextParallel or None, got {cp!r}")
    if cp is None or not cp.is_sharded(group):
        return config.kv_groups[group].block_size, ContextParallel(1, 0)
    cp.check_config(config)
    return cp.block_size(config, group), cp


def check_topk_indices(
    topk_indices: np.ndarray,  # [T, top_k] flat token index -> positions in its request, -1: none
    req_ids: tuple[str, ...],  # [num_reqs] batch_idx -> req_id
    num_tokens: int,  # real tokens; the rest of the T rows are padding
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    positions: np.ndarray,  # [T] flat token index -> position
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> block ids of the group (the pool's blocks)
    kv_group: KVCacheGroup,
    group: int,
) -> None:
    """Rules 1-6 of the module docstring on NumPy arrays: the first violation raises its error."""
    topk = np.asarray(topk_indices, np.int64)  # [T, top_k]
    qsl = np.asarray(query_start_loc, np.int64)  # [num_reqs + 1]
    row = np.searchsorted(qsl[1:], np.arange(topk.shape[0]), side="right")  # [T] flat token -> batch_idx
    real = (np.arange(topk.shape[0]) < num_tokens)[:, None]  # [T, 1]
    pos = np.asarray(positions, np.int64)[:, None]  # [T, 1]
    selected = real & (topk >= 0)  # [T, top_k]
    field = "topk_indices"

    def refuse(error: type[SparseIndexError], bad: np.ndarray, detail: str) -> None:
        if bad.any():
            t, j = (int(i) for i in np.argwhere(bad)[0])
            req = req_ids[row[t]] if t < num_tokens else None
            raise error(req, t, f"{field}[{t}, {j}]", detail.format(idx=int(topk[t, j]), p=int(pos[t, 0])))

    refuse(PaddingIndexError, ~real & (topk != -1), "= {idx} on a padded token, whose row must be all -1")
    refuse(InvalidIndexError, real & (topk < -1), "= {idx}: an index is a position >= 0, or -1 for none")
    refuse(FutureIndexError, selected & (topk > pos), "= {idx} lies past the query's position {p} (causal)")
    window = kv_group.sliding_window
    if window is not None:
        refuse(WindowIndexError, selected & (topk <= pos - window),
               f"= {{idx}} lies outside group {group}'s sliding window {window} of position {{p}}")  # fmt: skip
    table = np.asarray(block_table, np.int64)  # [num_reqs, max_blocks] batch_idx -> block ids
    entry = np.where(selected, topk, 0) // kv_group.block_size  # [T, top_k]
    past = selected & (entry >= table.shape[1])
    refuse(ReleasedBlockIndexError, past, f"= {{idx}} lies past the request's {table.shape[1]}-entry block table")
    rows = np.minimum(row, max(table.shape[0] - 1, 0))[:, None]
    blocks = table[rows, np.minimum(entry, table.shape[1] - 1)] if table.size else np.zeros_like(topk)
    refuse(ReleasedBlockIndexError, selected & (blocks == NULL_BLOCK_ID),
           f"= {{idx}} lies on the null block (group {group}): the request holds no block there")  # fmt: skip
    refuse(DuplicateIndexError, real & repeated_entries(topk), "= {idx} is listed twice in the row")


def repeated_entries(values: np.ndarray) -> np.ndarray:  # [T, top_k] bool
    """Where a row lists a value >= 0 that an earlier column of the same row already lists."""
    order = np.argsort(values, axis=1, kind="stable")  # equal values keep their column order
    ranked = np.take_along_axis(values, order, axis=1)
    repeat = np.zeros(values.shape, dtype=bool)
    repeat[:, 1:] = (ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)
    later = np.zeros(values.shape, dtype=bool)
    np.put_along_axis(later, order, repeat, axis=1)
    return later


def _rank_slots(
    batch: BatchInputs, topk_indices: np.ndarray, group: int, block_size: int, cp: ContextParallel
) -> np.ndarray:  # [T, top_k] int64
    """The KV write's own transform (cp_slot_mapping) on the selected positions, one flat "token" per entry:
    entry (t, j) is flat index t * top_k + j, so batch row b's entries are query_start_loc * top_k."""
    topk = np.asarray(topk_indices, np.int64)
    width = topk.shape[1]
    flat = np.where(topk >= 0, topk, 0).reshape(-1)  # [T * top_k] a position for every entry; -1 restored below
    bounds = np.asarray(batch.query_start_loc, np.int64) * width  # [num_reqs + 1]
    table = batch.block_tables[group]
    slots = cp_slot_mapping(flat, bounds, table, block_size, cp).reshape(topk.shape)
    return np.where(topk >= 0, slots, PAD_SLOT_ID).astype(SLOT_DTYPE)
