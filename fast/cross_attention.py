"""Encoder-decoder cross-attention on torch tensors: spec/cross_attention.py's three cross fields of a batch.

They are computed on the host mirror, which holds every table prepare reads (fast/state.py), in a few
vectorised NumPy calls, and go to the device in one copy; the cross group's slot_mappings[g] becomes
PAD_SLOT_ID. The attention over the encoder's KV is fast/encoder_attention.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fast.runtime import upload
from spec.state import PoolState, ranges
from spec.types import INDEX_DTYPE, PAD_SLOT_ID, BatchInputs


def with_cross_inputs(
    batch: BatchInputs,
    state: PoolState,  # the host mirror
    group: int,
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx, the host's copy
    device: torch.device,
) -> BatchInputs:
    """spec.cross_attention.with_cross_inputs on the device: the three cross fields, slot_mappings[group] PAD."""
    block_size = state.config.kv_groups[group].block_size
    lens = state.encoder_lens[index_mapping]  # [num_reqs]
    scheduled = np.where(state.num_computed_tokens[index_mapping] == 0, lens, 0)  # [num_reqs] encoder runs
    which, within = ranges(scheduled)  # [sum(scheduled)] batch row, encoder position of each encoder token
    blocks = state.block_tables[group][index_mapping[which], within // block_size].astype(np.int64)
    slots = blocks * block_size + within % block_size  # [sum(scheduled)] int64
    n = lens.size
    packed = upload(np.concatenate([lens, scheduled, slots]).astype(np.int64), device)
    pad = torch.full((batch.num_tokens_padded,), PAD_SLOT_ID, dtype=torch.int64, device=device)
    slot_mappings = list(batch.slot_mappings)
    slot_mappings[group] = pad  # [T] decoder tokens write no cross KV
    return dataclasses.replace(
        batch,
        slot_mappings=tuple(slot_mappings),
        encoder_seq_lens=packed[:n].to(getattr(torch, INDEX_DTYPE)),
        scheduled_encoder_lens=packed[n : 2 * n].to(getattr(torch, INDEX_DTYPE)),
        cross_slot_mapping=packed[2 * n :],
    )
