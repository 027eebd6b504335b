"""DCP slot transform: each token's slot in one rank's cache of a sharded group (PAD where not local).

Program b < num_reqs handles batch row b's tokens, BLOCK_TOKENS at a time; program num_reqs writes the
padding tail PAD_SLOT_ID (as vLLM's _compute_slot_mappings_kernel). The formulas are spec.context_parallel's.
Slots are int64: a slot can exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel
from spec.types import PAD_SLOT_ID

BLOCK_TOKENS = 128


def cp_slot_mapping_triton(
    out: torch.Tensor,  # [T] int64, written: flat token index -> slot in this rank's cache, or PAD_SLOT_ID
    positions: torch.Tensor,  # [T] int64 (or int32), contiguous
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32 (or int64), contiguous
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32 (or int64), batch_idx -> virtual block ids
    block_size: int,  # bs: tokens per physical block of a rank
    world_size: int,
    rank: int,
    interleave: int,
) -> None:
    num_reqs = block_table.shape[0]
    _cp_slot_mapping_kernel[(num_reqs + 1,)](
        out, positions, query_start_loc, block_table,
        block_table.stride(0), block_table.stride(1), num_reqs, positions.shape[0],
        block_size, world_size, rank, interleave, PAD_SLOT_ID,
        BLOCK_TOKENS=min(BLOCK_TOKENS, triton.next_power_of_2(max(positions.shape[0], 1))),
    )  # fmt: skip


@kernel
def _cp_slot_mapping_kernel(
    out_ptr,  # [T] int64
    positions_ptr,  # [T] flat token index -> position
    query_start_loc_ptr,  # [num_reqs + 1]
    block_table_ptr,  # [num_reqs, max_blocks] batch_idx -> virtual block ids
    table_stride_row,
    table_stride_col,
    num_reqs,
    num_tokens_padded,
    block_size,
    world_size,
    rank,
    interleave,
    pad_slot_id,
    BLOCK_TOKENS: tl.constexpr,
):
    b = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_TOKENS)
    if b == num_reqs:
        end = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(end, num_tokens_padded, BLOCK_TOKENS):
            t = start + tokens
            tl.store(out_ptr + t, tl.full([BLOCK_TOKENS], 0, tl.int64) + pad_slot_id, mask=t < num_tokens_padded)
    else:
        first = tl.load(query_start_loc_ptr + b)
        last = tl.load(query_start_loc_ptr + b + 1)
        virtual = block_size * world_size  # tokens per virtual block (the pool's block of this group)
        for start in range(first, last, BLOCK_TOKENS):
            t = start + tokens
            mask = t < last
            position = tl.load(positions_ptr + t, mask=mask, other=0).to(tl.int64)
            offset = position % virtual
            local = (offset // interleave) % world_size == rank
            block = tl.load(
                block_table_ptr + b * table_stride_row + (position // virtual) * table_stride_col,
                mask=mask & local, other=0,
            ).to(tl.int64)  # fmt: skip
            slot = block * block_size + (offset // (interleave * world_size)) * interleave + offset % interleave
            tl.store(out_ptr + t, tl.where(local, slot, pad_slot_id), mask=mask)
