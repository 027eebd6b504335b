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
    num_blocks: np.ndarray,  # [G, R] int64 filled entries per row (every entry past them is NULL_BLOCK_ID)
    versions: np.ndarray,  # [G, R] int64 each row's table version (fast.state.HostMirror.table_versions)
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    token_rows: np.ndarray,  # [num_tokens] int64 flat token index -> req_state_idx
    positions: np.ndarray,  # [T] int64
    tables_out: np.ndarray,  # [num_reqs * total_width] int32 out: each group's [num_reqs, width] table, in layout order
    held: np.ndarray,  # [G * num_reqs, 3] int64 in/out: per out row the req_state_idx, version and filled count it
    #                    holds from the last call into the same buffer; req_state_idx -1: unknown contents
    slots_out: np.ndarray,  # [G * T] int64 out: each group's slot mapping
) -> None:
    """Every group's gathered block table and slot mapping in one call (a call per group and stage cost more in
    dispatch than a decode step's copies).

    The out rows are reused from call to call, so an out row that already holds its row's table at the current
    version is left as it is: a steady decode batch copies only the tables that changed since the last step (the
    rows that appended a block), where a whole-width copy per step was most of its prepare. A row that is copied
    takes its filled entries, and only the part past them that the out row held non-null before is cleared.
    """
    n, t = index_mapping.shape[0], positions.shape[0]
    for g in range(offsets.shape[0]):
        off, width = offsets[g], widths[g]
        table = flat_tables[num_rows * off : num_rows * (off + width)].reshape(num_rows, width)
        out = tables_out[n * off : n * (off + width)].reshape(n, width)
        for b in range(n):
            row, k = index_mapping[b], g * n + b
            if held[k, 0] == row and held[k, 1] == versions[g, row]:
                continue
            count = num_blocks[g, row]
            out[b, :count] = table[row, :count]
            out[b, count : width if held[k, 0] < 0 else max(count, held[k, 2])] = 0
            held[k, 0], held[k, 1], held[k, 2] = row, versions[g, row], count
        slot_mapping(table, token_rows, positions, block_sizes[g], slots_out[g * t : (g + 1) * t])
