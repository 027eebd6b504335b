"""M-RoPE positions under Triton: each token's three position rows (spec/mrope.py's rule) in one launch.

Program b < num_reqs handles batch row b's tokens, BLOCK_TOKENS at a time: a token at position p below
its row's table length reads column p of the row's table, any other gets p + delta on all three rows.
Program num_reqs writes the padding tail 0. Reads the positions prepare already wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel

BLOCK_TOKENS = 128


def mrope_positions_triton(
    out: torch.Tensor,  # [3, T] int64, written: row j, flat token index -> M-RoPE position
    positions: torch.Tensor,  # [T] int64 flat token index -> position in its request (0 for padding), contiguous
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, contiguous
    index_mapping: torch.Tensor,  # [num_reqs] int32 batch_idx -> req_state_idx
    lengths_deltas: torch.Tensor,  # [2, num_reqs] int64 batch_idx -> table length | mrope_position_delta
    tables: torch.Tensor,  # [R, 3, capacity] int64 req_state_idx -> its position table
) -> None:
    num_reqs = index_mapping.shape[0]
    padded = positions.shape[0]
    if tuple(out.shape) != (3, padded) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"mrope positions: out must be contiguous [3, {padded}] int64, got {tuple(out.shape)}")
    if tuple(lengths_deltas.shape) != (2, num_reqs) or lengths_deltas.dtype != torch.int64:
        raise ValueError(f"mrope positions: lengths_deltas must be [2, {num_reqs}] int64")
    _mrope_positions_kernel[(num_reqs + 1,)](
        out, positions, query_start_loc, index_mapping, lengths_deltas, tables,
        tables.stride(0), tables.stride(1), num_reqs, padded,
        BLOCK_TOKENS=min(BLOCK_TOKENS, triton.next_power_of_2(max(padded, 1))),
    )  # fmt: skip


@kernel
def _mrope_positions_kernel(
    out_ptr,  # [3, T] int64, row j at out_ptr + j * T
    positions_ptr,  # [T] int64 flat token index -> position
    query_start_loc_ptr,  # [num_reqs + 1] int32
    index_mapping_ptr,  # [num_reqs] int32 batch_idx -> req_state_idx
    lengths_deltas_ptr,  # [2, num_reqs] int64 batch_idx -> table length | delta
    tables_ptr,  # [R, 3, capacity] int64 req_state_idx -> table
    table_stride_row,  # elements between two rows' tables
    table_stride_dim,  # elements between a table's temporal, height and width rows
    num_reqs,
    num_tokens_padded,
    BLOCK_TOKENS: tl.constexpr,
):
    b = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_TOKENS)
    if b == num_reqs:
        end = tl.load(query_start_loc_ptr + num_reqs)
        zero = tl.full([BLOCK_TOKENS], 0, tl.int64)
        for start in range(end, num_tokens_padded, BLOCK_TOKENS):
            t = start + tokens
            mask = t < num_tokens_padded
            for j in tl.static_range(3):
                tl.store(out_ptr + j * num_tokens_padded + t, zero, mask=mask)
    else:
        first = tl.load(query_start_loc_ptr + b)
        last = tl.load(query_start_loc_ptr + b + 1)
        row = tl.load(index_mapping_ptr + b).to(tl.int64)
        length = tl.load(lengths_deltas_ptr + b)
        delta = tl.load(lengths_deltas_ptr + num_reqs + b)
        for start in range(first, last, BLOCK_TOKENS):
            t = start + tokens
            mask = t < last
            position = tl.load(positions_ptr + t, mask=mask, other=0).to(tl.int64)
            in_table = mask & (position < length)
            for j in tl.static_range(3):
                column = tl.load(
                    tables_ptr + row * table_stride_row + j * table_stride_dim + position, mask=in_table, other=0
                )
                tl.store(out_ptr + j * num_tokens_padded + t, tl.where(in_table, column, position + delta), mask=mask)
