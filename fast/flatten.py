"""Stage 4 on the host: flattening as spec/flatten.py, in NumPy over the pool's shared state.

CUDA tensors (and CPU tensors under the Triton interpreter) take fast.kernels.prepare, which computes
these arrays and the slot mappings in one launch. On plain CPU tensors the state IS host memory
(fast.state's shared mode), so the whole stage is NumPy index arithmetic writing into the buffers the
pool hands out as tensors: a handful of small torch ops costs several times the NumPy equivalents on
CPU (dispatch overhead).
"""

from __future__ import annotations

import numpy as np


def flatten(
    index_mapping_np: np.ndarray,  # [num_reqs] int64, batch_idx -> req_state_idx
    num_scheduled_np: np.ndarray,  # [num_reqs] int64
    cu_num_tokens_np: np.ndarray,  # [num_reqs] int64, query_start_loc[1:]
    num_computed_np: np.ndarray,  # [R] req_state_idx -> num_computed_tokens
    out: np.ndarray,  # [T] int64, T >= num_tokens: positions, 0 past num_tokens
) -> np.ndarray:  # [num_tokens] int64, flat token index -> req_state_idx
    num_tokens = int(cu_num_tokens_np[-1]) if num_scheduled_np.size else 0
    computed = num_computed_np[index_mapping_np]  # [num_reqs]
    out[num_tokens:] = 0
    if num_tokens == num_scheduled_np.size:  # decode: token b is batch row b
        out[:num_tokens] = computed
        return index_mapping_np
    # position = num_computed + (t - query_start_loc[b]) = t + (num_computed - query_start_loc[b])
    np.add(np.arange(num_tokens), np.repeat(computed - (cu_num_tokens_np - num_scheduled_np), num_scheduled_np),
           out=out[:num_tokens])  # fmt: skip
    return np.repeat(index_mapping_np, num_scheduled_np)


def gather_input_ids(
    token_ids_np: np.ndarray,  # [R, token capacity] int32
    token_rows_np: np.ndarray,  # [num_tokens] int64
    positions_np: np.ndarray,  # [num_tokens] int64
    out: np.ndarray,  # [T] int64, T >= num_tokens: input ids, zero past num_tokens
) -> None:
    num_tokens = token_rows_np.shape[0]
    out[:num_tokens] = token_ids_np.ravel()[token_rows_np * token_ids_np.shape[1] + positions_np]
    out[num_tokens:] = 0


def ranges(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges of the given lengths laid end to end: (range index, index within range) per element."""
    which = np.repeat(np.arange(lengths.shape[0]), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return which, within
