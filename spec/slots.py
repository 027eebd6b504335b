"""Stage 5, addresses: where each new token's KV is written and which blocks attention reads.

position -> (logical block, offset) = divmod(position, block_size)
(req_state_idx, logical block) -> physical block, through the row's block table
slot = physical block * block_size + offset   (int64: may exceed 2**31)
"""

from __future__ import annotations

import numpy as np

from spec.types import PAD_SLOT_ID, SLOT_DTYPE


def slot_mapping(
    block_table: np.ndarray,  # [R, max_blocks] req_state_idx -> physical block ids
    token_rows: np.ndarray,  # [num_tokens] flat token index -> req_state_idx
    positions: np.ndarray,  # [T] flat token index -> position
    block_size: int,
) -> np.ndarray:  # [T] int64
    num_tokens = token_rows.shape[0]
    real = positions[:num_tokens]
    logical_block, offset = np.divmod(real, block_size)
    physical_block = block_table[token_rows, logical_block].astype(SLOT_DTYPE)
    slots = np.full(positions.shape[0], PAD_SLOT_ID, SLOT_DTYPE)
    slots[:num_tokens] = physical_block * block_size + offset
    return slots


def gather_block_tables(
    block_table: np.ndarray,  # [R, max_blocks]
    index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
) -> np.ndarray:  # [num_reqs, max_blocks], batch_idx -> physical block ids
    return block_table[index_mapping]
