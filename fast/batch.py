"""Stage 3 on the host: the batch order, as spec/batch.py, without a Python sort.

Everything here is known on the host (the scheduler output and the host mirror's req_id -> row map),
so the batch order costs no device round trip. A decode step is usually sorted already (every request
schedules one token), and then the order is the scheduler's as it stands, with no gathers at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter

import numpy as np

from spec.types import SchedulerOutput


def scheduled_rows(sched: SchedulerOutput, row_of: Mapping[str, int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """In the scheduler's order: (req_ids [n], rows [n] int64 req_state_idx, num_scheduled [n] int64)."""
    scheduled = sched.num_scheduled_tokens
    count = len(scheduled)
    ids = list(scheduled)
    num_scheduled = np.fromiter(scheduled.values(), np.int64, count)
    rows = np.fromiter(map(row_of.__getitem__, ids), np.int64, count)
    return ids, rows, num_scheduled


def batch_order(
    req_ids: list[str],  # [n] scheduler order
    rows_np: np.ndarray,  # [n] int64 req_state_idx, scheduler order
    num_scheduled_np: np.ndarray,  # [n] int64, scheduler order
    known_sorted: bool = False,  # the caller knows num_scheduled is non-decreasing
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, bool]:
    """(req_ids, index_mapping [n] int64, num_scheduled [n] int64) in batch order; True if that is the input order."""
    count = len(req_ids)
    if known_sorted or count < 2 or bool((num_scheduled_np[1:] >= num_scheduled_np[:-1]).all()):
        return tuple(req_ids), rows_np, num_scheduled_np, True
    order = np.argsort(num_scheduled_np, kind="stable")  # ties keep the scheduler's order, as spec's sorted()
    return tuple(itemgetter(*order)(req_ids)), rows_np[order], num_scheduled_np[order], False
