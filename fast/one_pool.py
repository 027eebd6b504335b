"""Check 9 across groups with one block pool (spec/validate.py's _check_one_pool), kept from step to step.

spec's check marks every id each scheduled request holds after the step (its table's non-null entries from
the first live one on) and refuses an id held in two groups. Made afresh each step that costs the blocks held,
which grow with the context (host workload decode-256-pool2, docs/performance.md). `HeldIds` keeps the marks of
the last committed step, with a count per id (requests
share a block within a group), and a step changes only what moved: entries a window released, rows that
left or joined the batch (whole tables replaced: new and resumed requests), appended ids. A clash needs an
id that is new to the marks (two old ones were checked together last step), so the additions are the ones
tested, after every removal (an id a window released may go to another group in the same step).

The marks describe the committed state. The pool tells `accepted` after a plan this check passed is the one
committed, and `forget` when anything else may change the tables (a step planned by spec's plan_step, a
refused step): the next check then marks every held id again.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fast.bulk_checks import entries_after, entry_after, live_from, write_index
from spec.state import PoolState, StepPlan
from spec.types import NULL_BLOCK_ID, WorkerConfig


class HeldIds:
    """The ids the last committed step's scheduled requests hold, per group, as marks over the pool's ids."""

    def __init__(self, config: WorkerConfig) -> None:
        num_ids, num_rows, num_groups = config.kv_groups[0].num_blocks, config.max_num_reqs, len(config.kv_groups)
        self.owner = np.zeros(num_ids, np.int8)  # [num_blocks] id -> 1 + the group holding it, 0: held by none
        self.count = np.zeros(num_ids, np.int32)  # [num_blocks] id -> marked entries holding it
        self.marked = np.zeros(num_rows, np.bool_)  # [R] req_state_idx -> its entries are marked
        self.first = np.zeros((num_groups, num_rows), np.int64)  # [G, R] first marked entry of each marked row
        self.end = np.zeros((num_groups, num_rows), np.int64)  # [G, R] past its last marked entry
        self._scheduled = np.zeros(num_rows, np.bool_)  # [R] scratch: this step's rows, False between checks
        self._first, self._end = list(self.first), list(self.end)  # per group: its row of each
        # per group: (g, block size, sliding window or 0)
        self._groups = [(g, group.block_size, group.sliding_window or 0) for g, group in enumerate(config.kv_groups)]
        self._valid = False  # the marks are those of the committed state
        self.remade = 0  # checks that marked every held id afresh (the first, and each after a step planned elsewhere)
        self._pending = False  # a check changed the marks for a plan not yet accepted

    def clashes(self, state: PoolState, plan: StepPlan, lowest: np.ndarray) -> bool:
        """Some id a scheduled request holds after the step is held in another group too (plan_step names it).
        `lowest` [n] (scheduler order): the lowest position each request's step may start from (async rule 4)."""
        if self._pending or not self._valid:  # marks of a step that was not committed, or none yet
            self.remade += 1
            self.owner.fill(0)
            self.count.fill(0)
            self.marked.fill(False)
        self._valid, self._pending = False, True  # until the step is accepted: no marks to trust if it is not
        rows, last_group = plan.rows, len(self._groups) - 1
        for g, block_size, window in self._groups:  # every removal first: a released id may be another group's now
            w = plan.tables[g]
            _unmark_moved(
                state.block_tables[g], self.marked, self._scheduled, g == 0, self._first[g], self._end[g], rows,
                lowest, w.rows, w.replaced, block_size, window, self.owner, self.count,
            )  # fmt: skip
        for g, block_size, window in self._groups:
            w = plan.tables[g]
            if _mark_new(
                state.block_tables[g], state.num_blocks[g], self.marked, self._scheduled, g == last_group,
                self._first[g], self._end[g], rows, lowest, w.rows, w.starts, w.lengths, w.ids, w.replaced,
                block_size, window, g + 1, self.owner, self.count,
            ):  # fmt: skip
                return True  # the marks are half made: made afresh next time
        return False

    def accepted(self) -> None:
        """The plan of the last check is the step committed: its marks are the state's."""
        if self._pending:
            self._valid, self._pending = True, False

    def forget(self) -> None:
        """The tables may change in a way no check marked."""
        self._valid = self._pending = False


@njit(cache=True, nogil=True)
def _unmark(  # pragma: no cover - compiled
    table: np.ndarray, row: int, lo: int, hi: int, owner: np.ndarray, count: np.ndarray
) -> None:
    """The marks of row's entries [lo, hi) removed."""
    for e in range(lo, hi):
        block = table[row, e]
        if block != NULL_BLOCK_ID:
            count[block] -= 1
            if count[block] == 0:
                owner[block] = 0


@njit(cache=True, nogil=True)
def _unmark_moved(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the group's committed table (the marked entries' ids)
    marked: np.ndarray,  # [R] bool rows whose entries are marked
    scheduled: np.ndarray,  # [R] bool this step's rows (scratch, all False between checks)
    first_group: bool,  # the first call of a check: it marks this step's rows in `scheduled`
    first: np.ndarray,  # [R] int64 first marked entry per row (this group)
    end: np.ndarray,  # [R] int64 past the last marked entry per row
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    lowest: np.ndarray,  # [n] int64 scheduler order: the lowest position each step may start from
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each table write
    replaced: np.ndarray,  # [k] bool the write replaces the whole table
    block_size: int,
    window: int,  # 0: none
    owner: np.ndarray,  # [num_blocks] int8 in/out
    count: np.ndarray,  # [num_blocks] int32 in/out
) -> None:
    """The marks the step removes in one group: a marked row's entries when it leaves the batch or its table is
    replaced (its first and end set to 0: marked again whole); a staying row's entries below its new first live
    entry (_mark_new then marks its entries from there that [first, end) lacks)."""
    if first_group:
        for i in range(rows.shape[0]):
            scheduled[rows[i]] = True
    for row in range(marked.shape[0]):
        if marked[row] and not scheduled[row]:
            _unmark(table, row, first[row], end[row], owner, count)
    for k in range(write_rows.shape[0]):
        row = write_rows[k]
        if replaced[k] and marked[row]:
            _unmark(table, row, first[row], end[row], owner, count)
            first[row] = end[row] = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if not marked[row] or first[row] == end[row] == 0:  # joining, or replaced just now: _mark_new marks it all
            continue
        lo = live_from(lowest[i], block_size, window)
        if lo < first[row]:  # an earlier start than the marks' (a count gone back): marked again from lo
            _unmark(table, row, first[row], end[row], owner, count)
            first[row] = end[row] = 0
        elif lo > first[row]:
            _unmark(table, row, first[row], min(lo, end[row]), owner, count)


@njit(cache=True, nogil=True)
def _mark_new(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row, before the step
    marked: np.ndarray,  # [R] bool rows marked before the step; after the last group's call, this step's rows
    scheduled: np.ndarray,  # [R] bool this step's rows: all False again after a clash or the last group's call
    last_group: bool,
    first: np.ndarray,  # [R] int64 in/out first marked entry per row (this group)
    end: np.ndarray,  # [R] int64 in/out past the last marked entry
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    lowest: np.ndarray,  # [n] int64 scheduler order: the lowest position each step may start from
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each table write
    write_starts: np.ndarray,  # [k] int64 first entry written
    write_lengths: np.ndarray,  # [k] int64 ids written
    write_ids: np.ndarray,  # [sum(write_lengths)] int64
    replaced: np.ndarray,  # [k] bool the write replaces the whole table
    block_size: int,
    window: int,  # 0: none
    mark: int,  # 1 + the group
    owner: np.ndarray,  # [num_blocks] int8 in/out
    count: np.ndarray,  # [num_blocks] int32 in/out
) -> bool:
    """The ids each scheduled row holds after the step and its marks lack, marked; True at the first id another
    group holds."""
    write_of, offset = write_index(table.shape[0], write_rows, write_lengths)
    for i in range(rows.shape[0]):
        row, k = rows[i], write_of[rows[i]]
        kept, total = entries_after(num_blocks[row], k, write_starts, write_lengths, replaced)
        lo = live_from(lowest[i], block_size, window)
        # a staying row's entries [lo, end) are marked already (_unmark_moved removed those below lo): its
        # appended ones follow; any other row is marked from lo on
        start = max(lo, end[row]) if marked[row] and first[row] != end[row] else lo
        for e in range(start, total):
            block = entry_after(table, row, e, kept, write_ids, offset[max(k, 0)])
            if block == NULL_BLOCK_ID:
                continue
            if owner[block] != 0 and owner[block] != mark:
                for j in range(rows.shape[0]):
                    scheduled[rows[j]] = False
                return True
            owner[block] = mark
            count[block] += 1
        first[row], end[row] = lo, max(lo, total)
    if last_group:  # only this step's rows are marked now (_unmark_moved cleared the others' marks)
        marked[:] = False
        for i in range(rows.shape[0]):
            marked[rows[i]] = True
            scheduled[rows[i]] = False
    return False
