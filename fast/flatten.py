"""Stage 4 in host mode: flattening as spec/flatten.py, compiled with Numba, over the pool's state.

CUDA tensors (and CPU tensors under the Triton interpreter) take fast.kernels.prepare, which computes
these arrays and the slot mappings in one launch. In host mode (CPU tensors without Triton) the state IS
host memory (fast/state.py), and this stage is one compiled loop over the batch writing into the
buffers the pool hands out as tensors: a step's dozen small NumPy calls cost more in dispatch than
the loop costs in work (docs/performance.md).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def flatten(  # pragma: no cover - compiled; tested through its results
    index_mapping: np.ndarray,  # [num_reqs] int64, batch_idx -> req_state_idx
    num_scheduled: np.ndarray,  # [num_reqs] int64
    num_computed: np.ndarray,  # [R] int64, req_state_idx -> num_computed_tokens
    token_ids: np.ndarray,  # [R, token capacity] int32
    out32: np.ndarray,  # [>= 5 n + 1] int32: index_mapping | num_scheduled | query_start_loc | seq_lens | logits
    positions: np.ndarray,  # [T] int64, 0 past num_tokens
    input_ids: np.ndarray,  # [T] int64, 0 past num_tokens
    token_rows: np.ndarray,  # [>= num_tokens] int64: flat token index -> req_state_idx
) -> int:  # num_tokens
    n = index_mapping.shape[0]
    out32[2 * n] = 0  # query_start_loc[0]
    t = 0
    for b in range(n):
        row = index_mapping[b]
        count = num_scheduled[b]
        computed = num_computed[row]
        out32[b] = row
        out32[n + b] = count
        out32[2 * n + 1 + b] = t + count
        out32[3 * n + 1 + b] = computed + count  # seq_len
        out32[4 * n + 1 + b] = t + count - 1  # logits index: the request's last token
        for i in range(count):
            position = computed + i
            positions[t] = position
            input_ids[t] = token_ids[row, position]
            token_rows[t] = row
            t += 1
    for pad in range(t, positions.shape[0]):
        positions[pad] = 0
        input_ids[pad] = 0
    return t
