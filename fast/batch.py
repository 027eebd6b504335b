"""Stage 3 on the host: the batch order, as spec/batch.py, without a Python sort.

Everything here is known on the host (the scheduler output and the host mirror's req_id -> row map),
so the batch order costs no device round trip. The arrays it returns are what prepare uploads.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import itemgetter

import numpy as np

from spec.types import SchedulerOutput


def batch_order(sched: SchedulerOutput, row_of: Mapping[str, int]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """Returns (req_ids [num_reqs], index_mapping_np [num_reqs] int32, num_scheduled_np [num_reqs] int32)."""
    scheduled = sched.num_scheduled_tokens
    count = len(scheduled)
    ids = list(scheduled)
    num_scheduled = np.fromiter(scheduled.values(), np.int64, count)
    rows = np.fromiter(map(row_of.__getitem__, ids), np.int64, count)
    order = np.argsort(num_scheduled, kind="stable")  # ties keep the scheduler's order, as spec's sorted()
    req_ids = tuple(itemgetter(*order)(ids)) if count > 1 else tuple(ids)
    return req_ids, rows[order].astype(np.int32), num_scheduled[order].astype(np.int32)
