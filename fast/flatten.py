"""Stage 4 on the host: flattening as spec/flatten.py, in NumPy over the pool's shared state.

CUDA tensors (and CPU tensors under the Triton interpreter) take fast.kernels.prepare, which computes
these arrays and the slot mappings in one launch. On plain CPU tensors the state IS host memory
(fast.state's shared mode), so the whole stage is NumPy index arithmetic writing into the output
buffers the pool then hands out as tensors: a handful of small torch ops costs several times the
NumPy equivalents on CPU (dispatch overhead), which is what the host-step target of the benchmarks measures.
"""

from __future__ import annotations

import numpy as np

from fast.writes import ranges


def flatten(
    index_mapping_np: np.ndarray,  # [num_reqs] int64, batch_idx -> req_state_idx
    num_scheduled_np: np.ndarray,  # [num_reqs] int64
    num_computed_np: np.ndarray,  # [R] req_state_idx -> num_computed_tokens
) -> tuple[np.ndarray, np.ndarray]:
    """(token_rows [num_tokens] int64 flat token index -> req_state_idx, positions [num_tokens] int64)."""
    computed = num_computed_np[index_mapping_np]  # [num_reqs]
    if num_scheduled_np.size and int(num_scheduled_np.max()) == 1:  # decode: token b is batch row b
        return index_mapping_np, computed
    batch_idx, within = ranges(num_scheduled_np)  # position = num_computed + index within the request
    return index_mapping_np[batch_idx], computed[batch_idx] + within


def gather_input_ids(
    token_ids_np: np.ndarray,  # [R, max_model_len] int64
    token_rows_np: np.ndarray,  # [num_tokens] int64
    positions_np: np.ndarray,  # [num_tokens] int64
    out: np.ndarray,  # [T] int64, T >= num_tokens: input ids, zero past num_tokens
) -> None:
    num_tokens = token_rows_np.shape[0]
    out[:num_tokens] = token_ids_np.ravel()[token_rows_np * token_ids_np.shape[1] + positions_np]
    out[num_tokens:] = 0
