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
        """After the commit: freed rows hold nothing; a replaced table is scanned whole, an append only where it
        can release: its own null ids, and the earlier entry of an id it hands back. A step costs its writes,
        not its rows' tables (a decode-256 step with a window group: ~16 appends of one id)."""
        if not self._any:
            return
        for g, tails in enumerate(self.tails):
            if tails is None:
                continue
            tails[plan.freed_rows] = -1
            writes = plan.tables[g]
            if writes.rows.size:
                _refresh(state.block_tables[g], state.num_blocks[g], writes.rows, writes.starts, writes.lengths,
                         writes.replaced, tails)  # fmt: skip


@njit(cache=True, nogil=True)
def _last_released(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [k] int64 req_state_idx
) -> np.ndarray:
    """[k] int64: each row's last released entry (null, or its id held again further on), or -1."""
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


@njit(cache=True, nogil=True)
def _refresh(  # pragma: no cover - compiled; tested through the pool against a plain scan of spec's tables
    table: np.ndarray,  # [R, width] int32, the group's table after the commit
    num_blocks: np.ndarray,  # [R] int64 filled entries per row, after the commit
    rows: np.ndarray,  # [k] int64 req_state_idx of the rows the step wrote
    starts: np.ndarray,  # [k] int64 first entry written (0 where replaced)
    lengths: np.ndarray,  # [k] int64 ids written
    replaced: np.ndarray,  # [k] bool whole table replaced
    tails: np.ndarray,  # [R] int64 in/out: last released entry per row, -1 for none
) -> None:
    whole = np.zeros(1, np.int64)  # [1] the one row _last_released rescans
    for k in range(rows.shape[0]):
        row = rows[k]
        if replaced[k]:
            whole[0] = row
            tails[row] = _last_released(table, num_blocks, whole)[0]
            continue
        for e in range(starts[k], starts[k] + lengths[k]):  # the appended entries: each can release one entry
            block = table[row, e]
            if block == 0:
                tails[row] = max(tails[row], e)
                continue
            for j in range(e - 1, -1, -1):  # the latest earlier entry holding the id is released now
                if table[row, j] == block:
                    tails[row] = max(tails[row], j)
                    break
