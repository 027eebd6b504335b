"""Stage 3 on the host: the batch order, as spec/batch.py, from the applied plan's arrays.

Everything here is known on the host (the plan holds each scheduled request's row and token count in
the scheduler's order), so the batch order costs no device round trip. A decode step is already
sorted (every request schedules one token), and then the scheduler's order is the batch order as is.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def batch_order(
    rows_np: np.ndarray,  # [n] int64 req_state_idx, scheduler order
    num_scheduled_np: np.ndarray,  # [n] int64, scheduler order
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(order [n] or None if the scheduler's order already is the batch order, index_mapping [n], num_scheduled [n])."""
    order = _order(num_scheduled_np)
    if order.shape[0] == 0:
        return None, rows_np, num_scheduled_np
    return order, rows_np[order], num_scheduled_np[order]


@njit(cache=True, nogil=True)
def _order(num_scheduled: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled; tested against spec's order
    """[n] the stable order by token count (ties keep the scheduler's order, as spec's sorted()), or empty when the
    counts are already in order: one call where NumPy's sortedness test alone took three."""
    for i in range(1, num_scheduled.shape[0]):
        if num_scheduled[i] < num_scheduled[i - 1]:
            return np.argsort(num_scheduled, kind="mergesort")
    return np.zeros(0, np.int64)
