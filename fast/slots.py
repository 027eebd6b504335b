"""Stage 5 on the host: slot mappings and gathered block tables, as spec/slots.py, in NumPy.

slot = block_table[row, position // block_size] * block_size + position % block_size, in int64.
On plain CPU tensors the tables are host memory shared with the pool's mirror (see fast/flatten.py
for why NumPy); CUDA and the interpreter take fast.kernels.prepare instead.
"""

from __future__ import annotations

import numpy as np

from spec.types import PAD_SLOT_ID, SLOT_DTYPE


def slot_mapping(
    block_table_np: np.ndarray,  # [R, max_blocks] int32, req_state_idx -> physical block ids
    token_rows_np: np.ndarray,  # [num_tokens] int64, flat token index -> req_state_idx
    positions_np: np.ndarray,  # [T] int64, flat token index -> position (T >= num_tokens)
    block_size: int,
    out: np.ndarray | None = None,  # [T] int64 to write into
) -> np.ndarray:  # [T] int64, PAD_SLOT_ID past num_tokens
    num_tokens = token_rows_np.shape[0]
    slots = np.empty(positions_np.shape[0], SLOT_DTYPE) if out is None else out
    logical_block, offset = np.divmod(positions_np[:num_tokens], block_size)
    physical_block = np.take(block_table_np.ravel(), token_rows_np * block_table_np.shape[1] + logical_block)
    np.multiply(physical_block, block_size, out=slots[:num_tokens], dtype=SLOT_DTYPE)  # int64: may pass 2**31
    slots[:num_tokens] += offset
    slots[num_tokens:] = PAD_SLOT_ID
    return slots


def gather_block_tables(
    block_table_np: np.ndarray,  # [R, max_blocks] int32
    index_mapping_np: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    out: np.ndarray | None = None,  # [num_reqs, max_blocks] int32 to write into
) -> np.ndarray:  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    # mode="clip" only so that NumPy writes into `out` directly (with the default mode it buffers the
    # whole result first, ~10x slower here); rows come from the pool's req_id -> row map, always in range
    return block_table_np.take(index_mapping_np, axis=0, out=out, mode="clip")
