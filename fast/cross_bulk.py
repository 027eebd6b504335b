"""The cross-attention group's checks (spec/cross_attention.py) for fast's bulk planner, in one compiled pass.

The bulk planner (fast/validate.py) checks the cross group's tables as any group's for ids and width only
(checks 9 and 10: ids in range, not null, distinct; at most the group's width): the decoder's positions say
nothing of a table that holds the encoder's KV (FastFeature.own_tables). `plan_in_bulk` then adds what the
cross group asks:
- check 1 and 7 of the new requests' `encoder_len`: an int, 1 <= L <= max_encoder_len;
- check 11: every scheduled request's table covers its L encoder tokens, and a table new this step (a new or a
  resumed request's) is filled by an encoder that runs now, at position 0 (no prefix cache for encoder output);
- check 13: no cross block written by two requests. A request whose step starts at 0 writes its encoder's
  slots, from offset 0 of its first cdiv(L, bs) blocks, so two requests writing one block write its first slot
  both: a block written twice is a slot written twice, and the check is exact per block.
It returns the plan's part, each new request's L (spec's CrossAttention.plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from fast.bulk_checks import entries_after, entry_after, write_index, written_twice
from fast.bulk_read import EMPTY
from fast.fallback import Fallback
from spec.state import PoolState, StepPlan
from spec.types import NewRequest

if TYPE_CHECKING:
    from spec.cross_attention import CrossAttention


def plan_in_bulk(
    feature: CrossAttention,
    state: PoolState,
    new: tuple[NewRequest, ...] | list[NewRequest],  # [k] sched.new_requests
    new_rows: np.ndarray,  # [k] their req_state_idx
    plan: StepPlan,
    marks: np.ndarray | None,  # the bulk planner's scratch map over block ids (check 13), None for a huge pool
) -> np.ndarray | Fallback:
    """[k] int64 each new request's L, in `new` order; or the Fallback that leaves the step to plan_step."""
    lens_in = [r.encoder_len for r in new]
    if lens_in and set(map(type, lens_in)) != {int}:  # a bool, a NumPy integer: spec's is_integral decides
        return Fallback.FEATURE_RULES
    new_lens = np.fromiter(lens_in, np.int64, len(lens_in))
    g = feature.group
    block_size, w = state.config.kv_groups[g].block_size, plan.tables[g]
    written = np.empty(plan.rows.shape[0] * state.block_tables[g].shape[1], np.int64)  # [<= n * width]
    count = _check_cross(
        state.block_tables[g], state.num_blocks[g], feature.encoder_lens, plan.rows, plan.num_computed, new_rows,
        new_lens, state.config.max_encoder_len, w.rows, w.starts, w.lengths, w.ids, w.replaced, block_size, written,
    )  # fmt: skip
    if count < 0 or written_twice(EMPTY, written[:count], marks):
        return Fallback.FEATURE_RULES
    return new_lens


@njit(cache=True, nogil=True)
def _check_cross(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the cross group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row, before the step
    encoder_lens: np.ndarray,  # [R] int64 req_state_idx -> L of the row's request (0: a free row)
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    num_computed: np.ndarray,  # [n] int64 scheduler order
    new_rows: np.ndarray,  # [k] int64 req_state_idx of each new request
    new_lens: np.ndarray,  # [k] int64 its encoder_len
    max_encoder_len: int,
    write_rows: np.ndarray,  # [m] int64 req_state_idx of each of the group's table writes
    write_starts: np.ndarray,  # [m] int64 first entry written
    write_lengths: np.ndarray,  # [m] int64 ids written
    write_ids: np.ndarray,  # [sum(write_lengths)] int64
    replaced: np.ndarray,  # [m] bool the write replaces the whole table (a new or resumed request's)
    block_size: int,
    written: np.ndarray,  # [>= n * width] int64 out: the cross blocks the step's encoders write
) -> int:
    """Checks 7, 11 and the cross group's part of 13, on the tables after the step: the count of blocks written
    (into `written`), or -1 at the first failure."""
    lens = np.empty(table.shape[0], np.int64)  # [R] req_state_idx -> L after the step
    # [R] req_state_idx -> its cross blocks are new this step: a new request's, or a resumed one's (spec counts a
    # resumed request given the blocks its row holds as not new: plan_step takes that one, if it starts past 0)
    fresh = np.zeros(table.shape[0], np.bool_)
    for i in range(rows.shape[0]):
        lens[rows[i]] = encoder_lens[rows[i]]
    for k in range(new_rows.shape[0]):
        if new_lens[k] < 1 or new_lens[k] > max_encoder_len:
            return -1  # check 7 (and 1: a negative length)
        lens[new_rows[k]] = new_lens[k]
    for k in range(write_rows.shape[0]):
        fresh[write_rows[k]] = replaced[k]
    write_of, offset = write_index(table.shape[0], write_rows, write_lengths)
    w = 0
    for i in range(rows.shape[0]):
        row, k = rows[i], write_of[rows[i]]
        kept, total = entries_after(num_blocks[row], k, write_starts, write_lengths, replaced)
        needed = (lens[row] + block_size - 1) // block_size
        if total < needed:
            return -1  # the table does not cover the encoder's tokens
        if fresh[row] and num_computed[i] > 0:
            return -1  # new cross blocks, but the encoder does not run (it runs at position 0 only)
        if num_computed[i] == 0:
            for e in range(needed):
                written[w] = entry_after(table, row, e, kept, write_ids, offset[max(k, 0)])
                w += 1
    return w
