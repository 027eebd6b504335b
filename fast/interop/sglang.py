"""SGLang's layout on device tensors: spec/interop/sglang.py's contract, without host syncs.

req_to_token is built for all the batch's rows at once over a [num_reqs, max_model_len] grid of
positions (masked past each seq_len and under null blocks), then written to their pool rows.
"""

from __future__ import annotations

import torch

from spec.interop.sglang import SGLangLayout
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, BatchInputs, WorkerConfig


def sglang_layout(batch: BatchInputs, config: WorkerConfig, group: int = 0) -> SGLangLayout:
    block_size = config.kv_groups[group].block_size
    rows: torch.Tensor = batch.index_mapping.long()  # [num_reqs]
    seq_lens: torch.Tensor = batch.seq_lens.long()  # [num_reqs]
    num_scheduled = batch.num_scheduled_tokens.long()  # [num_reqs]
    table = batch.block_tables[group].long()  # [num_reqs, max_blocks]
    device = rows.device
    positions = torch.arange(config.max_model_len, device=device)  # [L]
    blocks = table[:, positions // block_size]  # [num_reqs, L]
    slots = blocks * block_size + positions % block_size  # [num_reqs, L]
    held = (positions[None, :] < seq_lens[:, None]) & (blocks != NULL_BLOCK_ID)  # [num_reqs, L]
    shape = (config.max_num_reqs, config.max_model_len)
    req_to_token = torch.full(shape, PAD_SLOT_ID, dtype=torch.int64, device=device)  # [R, L]
    req_to_token[rows] = torch.where(held, slots, PAD_SLOT_ID)
    slot_mapping = batch.slot_mappings[group]  # [T]
    return SGLangLayout(
        req_to_token=req_to_token,
        req_pool_indices=rows,
        out_cache_loc=slot_mapping[: batch.num_tokens].long(),
        seq_lens=seq_lens,
        extend_prefix_lens=(seq_lens - num_scheduled).to(torch.int32),
        extend_seq_lens=num_scheduled.to(torch.int32),
    )
