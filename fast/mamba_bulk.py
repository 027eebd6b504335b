"""A mamba group's checks 9 to 13 (spec/mamba.py) for fast's bulk planner, in compiled passes over the plan.

The bulk planner (fast/validate.py) checks every group's table as an attention group's first: ids in range
and distinct among the live entries (a mamba table's are all live), no null id appended, the blocks its
tokens' positions need present, no block two requests write. Those are spec's mamba rules 9 and 10 or
stricter: where they refuse a valid mamba step (a null entry, a state block shared for reading) the step goes
to spec's plan_step, which accepts it. `plan_in_bulk` then adds what only a mamba group asks: each request's
state read (check 11: the state it starts from was stored), its drafts within the speculative blocks (10),
no read or written state the null block (12), no state block written by two requests (13), and returns the
plan's `MambaSteps`, spec's values. Under async scheduling a step sent before the verdict on its row's last
drafts runs at any count from `lowest` (its count less those drafts) to the count sent: as spec/mamba.py, the
checks read every one of them (11: each count's state was stored; 12 and 13: every state read or written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from fast.bulk_checks import entries_after, entry_after, write_index, written_twice
from fast.bulk_read import EMPTY
from fast.fallback import Fallback
from spec.mamba import MAMBA, NO_STATE, MambaSteps
from spec.state import PoolState, StepPlan
from spec.types import NULL_BLOCK_ID

if TYPE_CHECKING:
    from spec.mamba import Mamba


def plan_in_bulk(feature: Mamba, state: PoolState, plan: StepPlan, marks: np.ndarray | None) -> MambaSteps | Fallback:
    """The plan's MambaSteps (scheduler order), or the Fallback that leaves the step to plan_step.

    `marks` is the bulk planner's scratch map over block ids (check 13), None for a pool too large for one."""
    config = feature.config
    n = plan.rows.shape[0]
    drafts = EMPTY if plan.num_drafts is None else plan.num_drafts
    bases, firsts = np.empty(n, np.int64), np.empty(n, np.int64)  # [n] scheduler order: spec's StateRead fields
    lowest = np.empty(n, np.int64)  # [n] scheduler order: StateRead.lowest
    new = plan.tables[0]  # every group's writes replace a new request's table (the bulk planner takes no resumed one)
    if not _reads(plan.rows, plan.num_computed, state.num_computed_tokens, state.num_unverified_drafts,
                  feature.rows.last_num_scheduled, feature.rows.last_num_drafts, new.rows, new.replaced,
                  feature.min_block, bases, firsts, lowest):  # fmt: skip
        return Fallback.FEATURE_RULES
    for g, group in enumerate(config.kv_groups):
        if group.kind != MAMBA:
            continue
        w = plan.tables[g]
        # [<= n (1 + spec) + the write columns the verdicts move] the state blocks the step may write
        moved = _spread(plan.num_computed, lowest, group.block_size)
        written = np.empty(n * (1 + group.num_speculative_blocks) + moved, np.int64)
        count = _check_states(
            state.block_tables[g], state.num_blocks[g], plan.rows, plan.num_computed, lowest, plan.num_scheduled,
            drafts, w.rows, w.starts, w.lengths, w.ids, w.replaced, group.block_size, group.num_speculative_blocks,
            bases, firsts, written,
        )  # fmt: skip
        if count < 0 or written_twice(EMPTY, written[:count], marks):
            return Fallback.FEATURE_RULES
    return MambaSteps(bases, firsts)


@njit(cache=True, nogil=True)
def _reads(  # pragma: no cover - compiled; tested through the pool against spec
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    num_computed: np.ndarray,  # [n] int64 scheduler order, as sent (async: the scheduler's optimistic count)
    row_computed: np.ndarray,  # [R] int64 the pool's num_computed_tokens before the step
    unverified: np.ndarray,  # [R] int64 drafts of each row whose verdict is unread (async; zeros otherwise)
    last_num_scheduled: np.ndarray,  # [R] int64 each row's last step's tokens (spec.mamba.MambaRows)
    last_num_drafts: np.ndarray,  # [R] int64 its drafts
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each of a group's table writes
    replaced: np.ndarray,  # [k] bool the write replaces the whole table: a new request's row (fresh)
    min_block: int,  # the smallest mamba block size
    bases: np.ndarray,  # [n] int64 out: spec.mamba.StateRead.base
    firsts: np.ndarray,  # [n] int64 out: StateRead.first
    lowest: np.ndarray,  # [n] int64 out: StateRead.lowest, the lowest count a verdict may give the step
) -> bool:
    """spec.mamba.state_read for every request, and its check 11 on the stored state: a fresh row reads a
    prefix-cache hit (its count is exact), a continuing one a state its last step stored, for every count from
    its lowest (spec.async_steps.lowest_start) to the one sent."""
    fresh = np.zeros(row_computed.shape[0], np.bool_)  # [R] req_state_idx -> its table is new this step
    for k in range(write_rows.shape[0]):
        fresh[write_rows[k]] = replaced[k]
    for i in range(rows.shape[0]):
        c = num_computed[i]
        if fresh[rows[i]]:
            if c % min_block != 0:  # a cached state covers whole blocks only
                return False
            bases[i] = firsts[i] = c - 1
            lowest[i] = c
            continue
        row = rows[i]
        lowest[i] = max(0, c - unverified[row])
        last_seq_len = row_computed[row] + last_num_scheduled[row]
        first_stored = last_seq_len - 1 - last_num_drafts[row]
        if not (lowest[i] - first_stored >= 1 and c - first_stored <= 1 + last_num_drafts[row]):
            return False  # the state after some count's position c - 1 was never stored
        bases[i], firsts[i] = last_seq_len - 1, first_stored
    return True


@njit(cache=True, nogil=True)
def _spread(num_computed: np.ndarray, lowest: np.ndarray, block_size: int) -> int:  # pragma: no cover - compiled
    """The write columns a step's verdicts may add below the one at the count sent, over all requests."""
    total = 0
    for i in range(num_computed.shape[0]):
        if num_computed[i] > lowest[i]:
            total += (num_computed[i] - lowest[i]) // block_size + 1
    return total


@njit(cache=True, nogil=True)
def _check_states(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row, before the step
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    num_computed: np.ndarray,  # [n] int64 scheduler order, as sent
    lowest: np.ndarray,  # [n] int64 scheduler order: the lowest count a verdict may give the step (_reads)
    num_scheduled: np.ndarray,  # [n] int64 scheduler order
    num_drafts: np.ndarray,  # [n] int64 scheduler order, or empty: nobody drafts
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each table write
    write_starts: np.ndarray,  # [k] int64 first entry written
    write_lengths: np.ndarray,  # [k] int64 ids written
    write_ids: np.ndarray,  # [sum(write_lengths)] int64
    replaced: np.ndarray,  # [k] bool the write replaces the whole table
    block_size: int,
    speculative_blocks: int,  # the group's num_speculative_blocks
    bases: np.ndarray,  # [n] int64 each request's read base (_reads)
    firsts: np.ndarray,  # [n] int64 the position whose state the base column holds
    written: np.ndarray,  # [>= n (1 + speculative_blocks)] int64 out: the state blocks the step writes
) -> int:
    """Checks 10 (drafts within the speculative blocks), 11 (the table reaches the read column and the last
    written one), 12 (no state read or written is the null block) for one mamba group, on the tables after the
    step, for every count from `lowest` to the one sent: the count of state blocks written (into `written`), or -1
    at the first failure."""
    write_of, offset = write_index(table.shape[0], write_rows, write_lengths)
    w = 0
    for i in range(rows.shape[0]):
        row, k = rows[i], write_of[rows[i]]
        kept, total = entries_after(num_blocks[row], k, write_starts, write_lengths, replaced)
        start = offset[max(k, 0)]  # where its write's ids begin
        drafts = num_drafts[i] if num_drafts.shape[0] else 0
        if drafts > speculative_blocks:
            return -1
        c = num_computed[i]
        read = NO_STATE if bases[i] < 0 else bases[i] // block_size + c - firsts[i] - 1  # the highest count's
        write = (c + num_scheduled[i] - 1) // block_size  # the state after the row's last non-draft token
        if max(read, write + drafts) >= total:
            return -1
        # the read columns: a continuing row's last step wrote them (checked non-null then; tables only grow), a new
        # request's table passed the attention checks, which refuse a null entry: kept for when they allow one
        if read != NO_STATE:
            for e in range(read - (c - lowest[i]), read + 1):
                if entry_after(table, row, e, kept, write_ids, start) == NULL_BLOCK_ID:
                    return -1
        for e in range((lowest[i] + num_scheduled[i] - 1) // block_size, write + drafts + 1):
            block = entry_after(table, row, e, kept, write_ids, start)
            if block == NULL_BLOCK_ID:
                return -1
            written[w] = block
            w += 1
    return w
