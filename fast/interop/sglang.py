"""SGLang's layout on device tensors: spec/interop/sglang.py's contract, without host syncs.

req_to_token is built for all the batch's rows at once over a [num_reqs, max_encoder_len + max_model_len]
grid of columns (the decoder's position of a column is the column minus the row's encoder length; masked
past each seq_len and under null blocks, and, for an encoder-decoder model, the encoder's slots in front),
then written to their pool rows.
"""

from __future__ import annotations

import torch

from spec.cross_attention import cross_group
from spec.interop.kinds import refuse_state_group
from spec.interop.sglang import SGLangLayout
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, BatchInputs, WorkerConfig


def sglang_layout(batch: BatchInputs, config: WorkerConfig, group: int = 0) -> SGLangLayout:
    cross = cross_group(config)
    if group == cross:
        raise ValueError(f"sglang_layout: group {group} is the cross group; its KV leads every decoder group's rows")
    refuse_state_group(config, group, "sglang_layout")
    block_size = config.kv_groups[group].block_size
    rows: torch.Tensor = batch.index_mapping.long()  # [num_reqs]
    seq_lens: torch.Tensor = batch.seq_lens.long()  # [num_reqs]
    num_scheduled = batch.num_scheduled_tokens.long()  # [num_reqs]
    table = batch.block_tables[group].long()  # [num_reqs, max_blocks]
    device = rows.device
    encoder_lens = torch.zeros_like(rows) if cross is None else batch.encoder_seq_lens.long()  # [num_reqs]
    columns = torch.arange(config.max_encoder_len + config.max_model_len, device=device)  # [W]
    positions = columns[None, :] - encoder_lens[:, None]  # [num_reqs, W] the decoder position of each column
    clamped = positions.clamp(0, config.max_model_len - 1)
    blocks = table.gather(1, clamped // block_size)  # [num_reqs, W]
    slots = blocks * block_size + clamped % block_size  # [num_reqs, W]
    held = (positions >= 0) & (positions < seq_lens[:, None]) & (blocks != NULL_BLOCK_ID)  # [num_reqs, W]
    filled = torch.where(held, slots, PAD_SLOT_ID)  # [num_reqs, W]
    if cross is not None:  # the encoder's slots lead the row
        cross_size = config.kv_groups[cross].block_size
        encoder_column = columns.clamp(max=config.max_encoder_len - 1)  # [W]
        cross_blocks = batch.block_tables[cross].long()[:, encoder_column // cross_size]  # [num_reqs, W]
        encoder = columns[None, :] < encoder_lens[:, None]  # [num_reqs, W]
        filled = torch.where(encoder, cross_blocks * cross_size + encoder_column % cross_size, filled)
    shape = (config.max_num_reqs, columns.numel())
    req_to_token = torch.full(shape, PAD_SLOT_ID, dtype=torch.int64, device=device)  # [R, W]
    req_to_token[rows] = filled
    slot_mapping = batch.slot_mappings[group]  # [T]
    encoder_fields = {}
    if cross is not None:
        encoder_fields = {
            "encoder_lens": encoder_lens,
            "encoder_cached": batch.scheduled_encoder_lens == 0,
            "encoder_out_cache_loc": batch.cross_slot_mapping.long(),
        }
    return SGLangLayout(
        req_to_token=req_to_token,
        req_pool_indices=rows,
        out_cache_loc=slot_mapping[: batch.num_tokens].long(),
        seq_lens=seq_lens,
        extend_prefix_lens=(seq_lens - num_scheduled).to(torch.int32),
        extend_seq_lens=num_scheduled.to(torch.int32),
        last_loc=filled.gather(1, (encoder_lens + seq_lens - 1)[:, None]).squeeze(1),
        **encoder_fields,
    )
