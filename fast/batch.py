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
    if _in_order(num_scheduled_np):
        return None, rows_np, num_scheduled_np
    order = np.argsort(num_scheduled_np, kind="stable")  # ties keep the scheduler's order, as spec's sorted()
    return order, rows_np[order], num_scheduled_np[order]


@njit(cache=True, nogil=True)
def _in_order(num_scheduled: np.ndarray) -> bool:  # pragma: no cover - compiled; tested against spec's order
    """The counts [n] are already ascending, so the scheduler's order is the batch order: one call where NumPy's
    sortedness test alone took three (a bool back: an array returned from compiled code costs a boxing)."""
    for i in range(1, num_scheduled.shape[0]):  # noqa: SIM110 - a loop Numba compiles (no generators)
        if num_scheduled[i] < num_scheduled[i - 1]:
            return False
    return True
