"""Mamba state indices (spec/mamba.py): each batch row's written state blocks and the block it reads, per group.

One program per batch row: the row's write column (seq_len - 1) // block_size, the 1 + num_speculative_blocks
entries from there (-1 past the row's drafts), and the entry its previous state sits in (-1 without one), at
num_accepted_tokens = num_computed - first past its base column. num_computed is seq_len - num_scheduled, the
device's count: under async scheduling corrected by the drafts the last record rejected, which the host does
not know yet (fast/async_steps.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel


def mamba_state_indices_triton(
    table: torch.Tensor,  # [R, width] int32, one mamba group's block table (a view of the flat device tables)
    index_mapping: torch.Tensor,  # [num_reqs] int32 batch_idx -> req_state_idx
    seq_lens: torch.Tensor,  # [num_reqs] int32, from the device's (corrected) num_computed
    num_scheduled: torch.Tensor,  # [num_reqs] int32
    reads: torch.Tensor,  # [>= 3, num_reqs] int64: read base position (-1: none) | first stored state | num_drafts
    block_size: int,
    num_speculative_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([num_reqs, 1 + S] int32 written blocks, [num_reqs] int32 read block, [num_reqs] int32 num_accepted_tokens)."""
    num_reqs = index_mapping.shape[0]
    columns = 1 + num_speculative_blocks
    written = torch.empty((num_reqs, columns), dtype=torch.int32, device=table.device)
    read = torch.empty(num_reqs, dtype=torch.int32, device=table.device)
    accepted = torch.empty(num_reqs, dtype=torch.int32, device=table.device)
    if num_reqs == 0:
        return written, read, accepted
    if table.stride(1) != 1 or reads.stride(1) != 1:
        raise ValueError("mamba_state_indices: the table and the reads must be contiguous along their last axis")
    _mamba_state_indices_kernel[(num_reqs,)](
        table, index_mapping, seq_lens, num_scheduled, reads, written, read, accepted,
        num_reqs, table.stride(0), block_size, columns,
        BLOCK_W=triton.next_power_of_2(columns),
    )  # fmt: skip
    return written, read, accepted


@kernel
def _mamba_state_indices_kernel(
    table_ptr,  # [R, width] int32 req_state_idx -> state block ids
    index_mapping_ptr,  # [num_reqs] int32 batch_idx -> req_state_idx
    seq_lens_ptr,  # [num_reqs] int32
    num_scheduled_ptr,  # [num_reqs] int32
    reads_ptr,  # [>= 3, num_reqs] int64: base position of the read (-1: none) | first stored state | num_drafts
    written_ptr,  # [num_reqs, columns] int32 out: the state blocks the row writes, -1 past its drafts
    read_ptr,  # [num_reqs] int32 out: the state block the row starts from, -1 without one
    accepted_ptr,  # [num_reqs] int32 out: num_accepted_tokens, num_computed - first
    num_reqs,
    table_stride,  # entries per table row
    block_size,
    columns,  # 1 + num_speculative_blocks
    BLOCK_W: tl.constexpr,  # next_power_of_2(columns)
):
    b = tl.program_id(0)
    row = tl.load(index_mapping_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    base = tl.load(reads_ptr + b)
    first = tl.load(reads_ptr + num_reqs + b)
    drafts = tl.load(reads_ptr + 2 * num_reqs + b)
    accepted = seq_len - tl.load(num_scheduled_ptr + b).to(tl.int64) - first  # the device's count, corrected
    tl.store(accepted_ptr + b, accepted.to(tl.int32))
    entries = table_ptr + row * table_stride
    write = (seq_len - 1) // block_size
    cols = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    used = cols <= drafts
    ids = tl.load(entries + write + cols, mask=used & (cols < columns), other=-1)
    tl.store(written_ptr + b * columns + cols, ids, mask=cols < columns)
    # base // block_size with base >= 0 only: a row without a prior state reads nothing
    column = tl.maximum(base, 0) // block_size + accepted - 1
    prev = tl.load(entries + column, mask=base >= 0, other=-1)
    tl.store(read_ptr + b, prev)
