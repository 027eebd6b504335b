"""A state cache of fast's validator: per row of each sliding-window group, its last released table entry.

Released entries are the ones no step may read: NULL_BLOCK_ID placeholders, and an entry whose id the
row holds again further on (vLLM hands a released block back to the same request, docs/semantics.md).
Only sliding-window groups' tables may hold either, so only they keep a tail. With it, the checks of a
decode step (fast/validate.py) look at one number per request instead of its window: below the step's
first live entry a released entry is harmless.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from spec.state import PoolState, StepPlan
from spec.types import WorkerConfig


class ReleasedTails:
    def __init__(self, config: WorkerConfig) -> None:
        self.tails: list[np.ndarray | None] = [  # per group: [R] int64 last released entry of each row, or -1
            np.full(config.max_num_reqs, -1, np.int64) if g.sliding_window is not None else None
            for g in config.kv_groups
        ]
        self._any = any(t is not None for t in self.tails)

    def refresh(self, state: PoolState, plan: StepPlan) -> None:
        """After the commit: rows whose tables changed get new tails (an append may hand back a released id)."""
        if not self._any:
            return
        for g, tails in enumerate(self.tails):
            if tails is None:
                continue
            rows = np.union1d(plan.tables[g].rows, plan.freed_rows)
            if rows.size:
                tails[rows] = last_released_entries(state, g, rows)


def last_released_entries(state: PoolState, g: int, rows: np.ndarray) -> np.ndarray:
    """[k] int64: for each row, its last filled entry in group g that a window released, or -1.

    Released entries are the ones no step may read: NULL_BLOCK_ID placeholders, and an entry whose id
    the row holds again further on (vLLM hands a released block back to the same request). The pool keeps
    these for sliding-window groups (the only ones whose tables may hold either), so the checks of a
    decode step look at one number per request instead of its window: below the step's first live
    entry a released entry is harmless.
    """
    return _last_released(state.block_tables[g], state.num_blocks[g], rows.astype(np.int64))


@njit(cache=True, nogil=True)
def _last_released(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [k] int64 req_state_idx
) -> np.ndarray:
    out = np.full(rows.shape[0], -1, np.int64)  # [k]
    for i in range(rows.shape[0]):
        filled = table[rows[i], : num_blocks[rows[i]]]
        order = np.argsort(filled, kind="mergesort")  # equal ids adjacent, earlier entries first
        for j in range(order.shape[0]):
            e = order[j]
            again = j + 1 < order.shape[0] and filled[order[j + 1]] == filled[e]
            if (filled[e] == 0 or again) and e > out[i]:
                out[i] = e
    return out
