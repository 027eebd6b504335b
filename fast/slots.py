"""Stage 5 on CPU tensors: slot mappings and gathered block tables, as spec/slots.py, without a kernel.

slot = block_table[row, position // block_size] * block_size + position % block_size, in int64.
The table reads are torch gathers of the device tables; the arithmetic around them is host NumPy
(see fast/flatten.py for why).
"""

from __future__ import annotations

import numpy as np
import torch

from spec.types import PAD_SLOT_ID, SLOT_DTYPE


def slot_mapping(
    block_table: torch.Tensor,  # [R, max_blocks] int32 on the CPU, req_state_idx -> physical block ids
    token_rows_np: np.ndarray,  # [num_tokens] int64, flat token index -> req_state_idx
    positions_np: np.ndarray,  # [T] int64, flat token index -> position
    block_size: int,
) -> torch.Tensor:  # [T] int64
    num_tokens = token_rows_np.shape[0]
    logical_block, offset = np.divmod(positions_np[:num_tokens], block_size)
    entries = torch.from_numpy(token_rows_np * block_table.shape[1] + logical_block)
    physical_block = block_table.view(-1).index_select(0, entries).numpy()  # [num_tokens] int32
    slots = np.full(positions_np.shape[0], PAD_SLOT_ID, SLOT_DTYPE)
    slots[:num_tokens] = physical_block.astype(SLOT_DTYPE) * block_size + offset
    return torch.from_numpy(slots)


def gather_block_tables(
    block_table: torch.Tensor,  # [R, max_blocks] int32
    index_mapping_np: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
) -> torch.Tensor:  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    return block_table.index_select(0, torch.from_numpy(index_mapping_np.astype(np.int64)))
