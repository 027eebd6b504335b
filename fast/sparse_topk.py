"""Sparse top-k attention's slot mapping on torch tensors: spec.sparse_topk's function, same contract and errors.

The rules are checked as one vectorised torch mask over [T, top_k] (one device->host read of whether any entry
breaks one); only when one does are the arrays copied to the host, where spec.sparse_topk.check_topk_indices
names the first violation, so both backends raise the same error with the same message. The slots come from
fast.context_parallel.cp_slot_mapping applied to the selected positions, one flat entry per (token, column):
the Triton kernel that places written KV on CUDA (and on CPU under the Triton interpreter), vectorised torch
ops otherwise. That call reads its positions' range on the host once more.
"""

from __future__ import annotations

import torch

from fast import context_parallel as fast_cp
from spec.context_parallel import ContextParallel
from spec.sparse_topk import check_sparse_request, check_topk_indices
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, BatchInputs, KVCacheGroup, WorkerConfig


def sparse_slot_mapping(
    batch: BatchInputs,
    config: WorkerConfig,
    topk_indices: torch.Tensor,  # [T, top_k] flat token index -> positions in its request it reads, -1: none
    group: int = 0,
    *,
    cp: ContextParallel | None = None,
) -> torch.Tensor:  # [T, top_k] int64: slot in (rank cp.rank's) cache of `group`; -1: none, or on another rank
    block_size, rank_cp = check_sparse_request(batch, config, topk_indices, group, cp)
    table = batch.block_tables[group]  # [num_reqs, max_blocks] batch_idx -> block ids
    devices = {t.device for t in (topk_indices, batch.positions, batch.query_start_loc, table)}
    if len(devices) != 1:
        raise ValueError(f"sparse_slot_mapping: tensors on several devices: {sorted(str(d) for d in devices)}")
    kv_group = config.kv_groups[group]
    topk = topk_indices.to(torch.int64)
    if bool(_violations(batch, kv_group, topk, table).any()):  # the one host read of the checks
        check_topk_indices(
            topk_indices.cpu().numpy(), batch.req_ids, batch.num_tokens, batch.query_start_loc.cpu().numpy(),
            batch.positions.cpu().numpy(), table.cpu().numpy(), kv_group, group,
        )  # fmt: skip
        raise RuntimeError("fast.sparse_slot_mapping: its check found a violation spec's did not (a bug)")
    width = topk.shape[1]
    flat = torch.where(topk >= 0, topk, 0).reshape(-1)  # [T * top_k] a position per entry; -1 restored below
    bounds = batch.query_start_loc.to(torch.int64) * width  # [num_reqs + 1] batch row b's entries
    slots = fast_cp.cp_slot_mapping(flat, bounds, table, block_size, rank_cp).view(topk.shape)
    return torch.where(topk >= 0, slots, PAD_SLOT_ID)


def _violations(
    batch: BatchInputs,
    kv_group: KVCacheGroup,
    topk: torch.Tensor,  # [T, top_k] int64
    table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> block ids
) -> torch.Tensor:  # [T, top_k] bool: the entries spec.sparse_topk's rules refuse, all rules at once
    num_rows, device = topk.shape[0], topk.device
    flat = torch.arange(num_rows, device=device)
    real = (flat < batch.num_tokens)[:, None]  # [T, 1]
    pos = batch.positions.to(torch.int64)[:, None]  # [T, 1]
    selected = real & (topk >= 0)
    bad = (~real & (topk != -1)) | (real & (topk < -1)) | (selected & (topk > pos))
    if kv_group.sliding_window is not None:
        bad |= selected & (topk <= pos - kv_group.sliding_window)
    num_reqs, width = table.shape
    entry = torch.where(selected, topk, 0) // kv_group.block_size  # [T, top_k]
    bad |= selected & (entry >= width)
    if num_reqs and width:
        row = torch.searchsorted(batch.query_start_loc[1:].contiguous(), flat, right=True).clamp(max=num_reqs - 1)
        blocks = table[row[:, None], entry.clamp(max=width - 1)]  # [T, top_k]
        bad |= selected & (blocks == NULL_BLOCK_ID)
    if topk.shape[1] > 1:
        ranked = torch.sort(topk, dim=1).values  # a repeat anywhere in a row is adjacent once sorted
        repeat = (ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)  # [T, top_k - 1]
        bad[:, 1:] |= real & repeat  # the column is arbitrary: only whether the row has one matters here
    return bad
