"""Stage 3 on the host: the batch order, as spec/batch.py, from the applied plan's arrays.

Everything here is known on the host (the plan holds each scheduled request's row and token count in
the scheduler's order), so the batch order costs no device round trip. A decode step is already
sorted (every request schedules one token), and then the scheduler's order is the batch order as is.
"""

from __future__ import annotations

import numpy as np


def batch_order(
    rows_np: np.ndarray,  # [n] int64 req_state_idx, scheduler order
    num_scheduled_np: np.ndarray,  # [n] int64, scheduler order
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(order [n] or None if the scheduler's order already is the batch order, index_mapping [n], num_scheduled [n])."""
    if rows_np.size < 2 or bool((num_scheduled_np[1:] >= num_scheduled_np[:-1]).all()):
        return None, rows_np, num_scheduled_np
    order = np.argsort(num_scheduled_np, kind="stable")  # ties keep the scheduler's order, as spec's sorted()
    return order, rows_np[order], num_scheduled_np[order]
