"""Stage 2, bulk validation of the common step: only continuing requests, none resumed, none new or finished.

spec.validate.plan_step is the definition (and names the exact error); it walks requests in Python.
`plan_cached_step` checks the same conditions for the common decode step with NumPy over all requests
at once. It never raises: it returns None whenever the step has another shape or any bulk check
fails, and the pool then calls plan_step, which either raises the error spec raises or accepts a step
this fast path did not cover. So a step accepted here is one plan_step accepts, with the same effect.

It relies on an invariant that plan_step establishes: every committed table already passed the
block-id checks (tables change only for scheduled requests, and those are checked whole), so only
the appended ids need checking against them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fast.writes import ranges
from spec.state import PoolState
from spec.types import NULL_BLOCK_ID, SchedulerOutput


@dataclass(frozen=True)
class CachedStepPlan:
    rows: np.ndarray  # [n] int64, req_state_idx of each cached request (scheduler order)
    num_computed: np.ndarray  # [n] int64, num_computed_tokens after the step
    table_ops: np.ndarray  # [n_t, 6] int64: row, group, lo, hi, count, data index (fast.writes layout)
    data: np.ndarray  # [D] int64, the appended block ids


def plan_cached_step(state: PoolState, sched: SchedulerOutput) -> CachedStepPlan | None:
    if sched.new_requests or sched.finished_req_ids:
        return None
    config = state.config
    cached = sched.cached_requests
    scheduled = sched.num_scheduled_tokens
    n = len(cached)
    # one pass over the request objects: at 256+ requests the Python attribute reads are a large share
    fields = [(c.req_id, c.num_computed_tokens, c.new_block_ids, c.resumed) for c in cached]
    req_ids, computed, new_blocks, resumed = zip(*fields, strict=True) if fields else ((), (), (), ())
    if any(resumed) or len(scheduled) != n or len(set(req_ids)) != n or scheduled.keys() != set(req_ids):
        return None
    num_computed = np.array(computed)
    num_scheduled = np.array(list(map(scheduled.__getitem__, req_ids)))  # non-integer values fall back below
    if n and (num_computed.dtype.kind not in "iu" or num_scheduled.dtype.kind not in "iu"):
        return None
    num_computed, num_scheduled = num_computed.astype(np.int64), num_scheduled.astype(np.int64)
    try:
        rows = np.fromiter(map(state.row_of.__getitem__, req_ids), np.int64, n)
    except KeyError:
        return None
    seq_lens = num_computed + num_scheduled
    if n and (
        num_computed.min() < 0
        or num_scheduled.min() < 1
        or num_scheduled.sum() > config.max_num_batched_tokens
        or seq_lens.max() > config.max_model_len
        or (seq_lens > state.num_tokens[rows]).any()
    ):
        return None
    appending = [i for i, ids in enumerate(new_blocks) if ids is not None]
    if any(len(new_blocks[i]) != len(config.kv_groups) for i in appending):
        return None

    ops: list[np.ndarray] = []
    data: list[np.ndarray] = []
    data_len = 0
    for g in range(len(config.kv_groups)):
        group_ops = _check_group(state, g, rows, num_computed, num_scheduled, new_blocks, appending)
        if group_ops is None:
            return None
        op_rows, counts_before, ids, lengths = group_ops
        if lengths.size:
            data_index = data_len + np.cumsum(lengths) - lengths
            counts = counts_before + lengths
            group = np.full_like(op_rows, g)
            ops.append(np.stack([op_rows, group, counts_before, counts, counts, data_index], axis=1))
            data.append(ids)
            data_len += int(ids.size)
    table_ops = np.concatenate(ops) if ops else np.zeros((0, 6), np.int64)
    return CachedStepPlan(rows, num_computed, table_ops, np.concatenate(data) if data else np.zeros(0, np.int64))


def _check_group(
    state: PoolState,
    g: int,
    rows: np.ndarray,  # [n] req_state_idx
    num_computed: np.ndarray,  # [n]
    num_scheduled: np.ndarray,  # [n]
    new_blocks: tuple[tuple[tuple[int, ...], ...] | None, ...],  # [n], per request per group
    appending: list[int],  # requests whose new_block_ids is not None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Checks 9-13 for group g. Returns (rows, counts before, appended ids, lengths) of appending requests."""
    group = state.config.kv_groups[g]
    table = state.block_tables[g]
    block_size, width = group.block_size, table.shape[1]
    counts = state.num_blocks[g, rows]  # [n] filled entries before the step

    appended = [np.asarray(new_blocks[i][g], np.int64).reshape(-1) for i in appending]  # type: ignore[index]
    lengths_app = np.array([a.size for a in appended], np.int64)
    has = lengths_app > 0
    app_req = np.array(appending, np.int64)[has]  # request index of each appending request
    lengths_app = lengths_app[has]
    ids = np.concatenate(appended) if appended else np.zeros(0, np.int64)
    lengths = np.zeros(rows.size, np.int64)
    lengths[app_req] = lengths_app
    after = counts + lengths  # [n] entries after the step
    if ids.size:
        # out of range, a null placeholder (plan_step decides), past int32 (spec's int32 tables decide), or overflow
        if ids.min() <= NULL_BLOCK_ID or ids.max() >= min(group.num_blocks, 2**31) or after.max() > width:
            return None
        # appended ids must be new to their table: keys (appending request, block id), unique overall
        existing = table[rows[app_req]].astype(np.int64)  # [k, width]
        filled = np.arange(width) < counts[app_req, None]
        keys_existing = (np.arange(app_req.size)[:, None] * group.num_blocks + existing)[filled & (existing != 0)]
        keys_new = np.repeat(np.arange(app_req.size), lengths_app) * group.num_blocks + ids
        if _has_repeats(np.concatenate([keys_existing, keys_new])):
            return None

    last = num_computed + num_scheduled - 1  # [n] last position written
    if ((last // block_size) >= after).any():
        return None  # a missing block
    if group.sliding_window is not None:  # without a window, committed tables hold no null block
        # only the entries read this step, and of those only committed ones (appended ids are >= 1)
        lo = np.maximum(0, num_computed - group.sliding_window + 1) // block_size
        hi = np.minimum(last // block_size, counts - 1)  # inclusive
        which, within = ranges(np.maximum(hi - lo + 1, 0))
        if (table[rows[which], lo[which] + within] == NULL_BLOCK_ID).any():
            return None

    # every scheduled token's slot, through the table as it will stand after the step
    token_req, within = ranges(num_scheduled)
    positions = num_computed[token_req] + within
    logical = positions // block_size
    physical = table[rows[token_req], logical].astype(np.int64)
    if ids.size:
        start = np.cumsum(lengths) - lengths  # [n] where each request's appended ids begin in `ids`
        beyond = logical >= counts[token_req]
        physical[beyond] = ids[(start[token_req] + logical - counts[token_req])[beyond]]
    if _has_repeats(physical * block_size + positions % block_size):
        return None
    return rows[app_req], counts[app_req], ids, lengths_app


def _has_repeats(values: np.ndarray) -> bool:
    """Sorting beats np.unique's hashing by ~10x at these sizes (thousands of int64)."""
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())
