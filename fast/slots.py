"""Stage 5 on the host: slot mappings and gathered block tables, as spec/slots.py, compiled with Numba.

slot = block_table[row, position // block_size] * block_size + position % block_size, in int64. A request's
tokens are a run of consecutive positions, so the loop divides once per run and per block crossing, not per
token (the two integer divisions per token were most of a long prefill's time).
On plain CPU tensors the tables are host memory shared with the pool's mirror (see fast/flatten.py
for why a compiled loop); CUDA and the interpreter take fast.kernels.prepare instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from spec.types import PAD_SLOT_ID


@njit(cache=True, nogil=True)
def slot_mapping(  # pragma: no cover - compiled; tested through its results
    block_table: np.ndarray,  # [R, max_blocks] int32, req_state_idx -> physical block ids
    token_rows: np.ndarray,  # [num_tokens] int64, flat token index -> req_state_idx
    positions: np.ndarray,  # [T] int64, flat token index -> position (T >= num_tokens)
    block_size: int,
    out: np.ndarray,  # [T] int64: the slots, PAD_SLOT_ID past num_tokens
) -> None:
    num_tokens = token_rows.shape[0]
    row, block, offset, end = -1, np.int64(0), np.int64(0), np.int64(-1)
    for t in range(num_tokens):
        position = positions[t]
        if token_rows[t] != row or position != end:  # a new run of consecutive positions: divide once
            row = token_rows[t]
            offset = position % block_size
            block = np.int64(block_table[row, position // block_size]) * block_size  # int64: slots pass 2**31
        elif offset == block_size:  # the run crosses into the next logical block
            offset = np.int64(0)
            block = np.int64(block_table[row, position // block_size]) * block_size
        out[t] = block + offset
        offset += 1
        end = position + 1
    for pad in range(num_tokens, out.shape[0]):
        out[pad] = PAD_SLOT_ID


@njit(cache=True, nogil=True)
def tables_and_slots(  # pragma: no cover - compiled; tested through its results
    flat_tables: np.ndarray,  # [R * total_width] int32, every group's [R, width] table (fast.state.table_layout)
    num_rows: int,  # R
    offsets: np.ndarray,  # [G] int64 each group's table offset, in rows' widths
    widths: np.ndarray,  # [G] int64 each group's width (max_blocks_per_req)
    block_sizes: np.ndarray,  # [G] int64
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    token_rows: np.ndarray,  # [num_tokens] int64 flat token index -> req_state_idx
    positions: np.ndarray,  # [T] int64
    tables_out: np.ndarray,  # [num_reqs * total_width] int32 out: each group's [num_reqs, width] table, in layout order
    slots_out: np.ndarray,  # [G * T] int64 out: each group's slot mapping
) -> None:
    """Every group's gathered block table and slot mapping in one call (a call per group and stage cost more in
    dispatch than a decode step's copies)."""
    n, t = index_mapping.shape[0], positions.shape[0]
    for g in range(offsets.shape[0]):
        off, width = offsets[g], widths[g]
        table = flat_tables[num_rows * off : num_rows * (off + width)].reshape(num_rows, width)
        out = tables_out[n * off : n * (off + width)].reshape(n, width)
        for b in range(n):
            out[b, :] = table[index_mapping[b], :]
        slot_mapping(table, token_rows, positions, block_sizes[g], slots_out[g * t : (g + 1) * t])
