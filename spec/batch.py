"""Stage 3, the batch: which state rows run this step, in which order.

batch_idx -> req_state_idx is `index_mapping`. The order is a stable sort by num_scheduled_tokens
ascending (decodes first), ties keeping the scheduler's order: in the articles' example B (1 token)
becomes batch row 0 and A (8 tokens) batch row 1, which is what query_start_loc = [0, 1, 9] says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from spec.types import INDEX_DTYPE


def batch_order(
    scheduled: Sequence[tuple[str, int]],  # (req_id, num_scheduled_tokens) in the scheduler's order
    row_of: Mapping[str, int],  # req_id -> req_state_idx
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """Returns (req_ids [num_reqs], index_mapping [num_reqs], num_scheduled_tokens [num_reqs])."""
    order = sorted(range(len(scheduled)), key=lambda i: scheduled[i][1])  # sorted() is stable
    req_ids = tuple(scheduled[i][0] for i in order)
    index_mapping = np.array([row_of[r] for r in req_ids], INDEX_DTYPE)  # batch_idx -> req_state_idx
    num_scheduled = np.array([scheduled[i][1] for i in order], INDEX_DTYPE)
    return req_ids, index_mapping, num_scheduled
