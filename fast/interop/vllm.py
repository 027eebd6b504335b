"""vLLM's names on device tensors: spec/interop/vllm.py's flash_attn_metadata, without host syncs.

from_vllm, V2RowPolicy and vllm_table_width are host code and are spec's own (re-exported by
fast.interop). max_query_len and max_seq_len are Python ints: they come from `host`
(spec.interop.host_counts); without it they are read back from the device (one sync).
"""

from __future__ import annotations

import torch

from spec.interop.host import HostCounts
from spec.interop.kinds import refuse_state_group
from spec.interop.vllm import FlashAttnMetadata, V2RowPolicy, vllm_table_width
from spec.types import PAD_SLOT_ID, BatchInputs, WorkerConfig


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
    num_scheduled: torch.Tensor = batch.num_scheduled_tokens  # [num_reqs]
    seq_lens: torch.Tensor = batch.seq_lens  # [num_reqs] int32
    table: torch.Tensor = batch.block_tables[group]  # [num_reqs, max_blocks]
    slots: torch.Tensor = batch.slot_mappings[group]  # [T]
    idx_mapping: torch.Tensor = batch.index_mapping  # [num_reqs]
    logits_indices: torch.Tensor = batch.logits_indices  # [num_reqs]
    if host is not None:
        max_query_len = int(host.num_scheduled_np.max(initial=0))
        max_seq_len = int(host.seq_lens_np.max(initial=0))
    else:  # the one host sync, only when the caller has no host counts
        max_query_len = int(num_scheduled.max().item()) if num_scheduled.numel() else 0
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if vllm_compatible:
        wide = torch.zeros(table.shape[0], vllm_table_width(config, group), dtype=table.dtype, device=table.device)
        wide[:, : table.shape[1]] = table
        table = wide
        padded = torch.full(
            (max(slots.shape[0], config.max_num_batched_tokens),), PAD_SLOT_ID, dtype=slots.dtype, device=slots.device
        )
        padded[: slots.shape[0]] = slots
        slots = padded
        if row_policy is not None:  # host rows -> device: a copy to the device, never a wait on it
            rows_np = row_policy.index_mapping(batch.req_ids)
            idx_mapping = torch.as_tensor(rows_np, device=idx_mapping.device)
        idx_mapping, logits_indices = idx_mapping.to(torch.int64), logits_indices.to(torch.int64)
    elif row_policy is not None:
        raise ValueError("row_policy: only with vllm_compatible=True")
    return FlashAttnMetadata(
        num_actual_tokens=batch.num_tokens,
        cu_seqlens_q=batch.query_start_loc,
        seq_lens=seq_lens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_table=table,
        slot_mapping=slots,
        idx_mapping=idx_mapping,
        logits_indices=logits_indices,
    )
