"""Stage 2, bulk validation of the usual step: continuing requests (none resumed), new and finished ones.

spec.validate.plan_step is the definition (and names the exact error); it walks requests in Python.
`plan_bulk_step` checks the same conditions with NumPy over all requests at once. It never raises: it
returns None whenever the step has another shape (a resumed request, odd types) or any bulk check
fails, and the pool then calls plan_step, which either raises the error spec raises or accepts a step
this fast path did not cover. So a step accepted here is one plan_step accepts, with the same effect:
finished rows freed, each new request on the lowest free row in the order given, the same tables,
num_computed_tokens and tokens.

It relies on invariants of the pool state that plan_step and record_sampled establish:
- every committed table already passed the block-id checks (tables change only for scheduled requests,
  and those are checked whole), so only the appended ids need checking against them;
- entries past a row's block count hold NULL_BLOCK_ID (commit clears them, freed rows included), and
  appended ids are >= 1, so an appended id can be compared with the whole stored row;
- num_tokens[row] <= max_model_len (prompts are checked, record_sampled refuses past it), so
  seq_len <= num_tokens (check 8) already implies seq_len <= max_model_len (check 7).
A new request's table is checked whole, as plan_step does; check 13 (unique slots) runs over every
token of the step, new and cached.

A step accepted here also yields what prepare recomputes otherwise: every cached request's tokens' row,
position and slot per group, in the scheduler's order of cached requests (the whole batch when the
step has no new request).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from fast.writes import TABLE_OP_FIELDS, ranges
from spec.state import PoolState
from spec.types import NULL_BLOCK_ID, NewRequest, SchedulerOutput

# Above this many (appended id x table entry) comparisons, freshness of appended ids is checked by sorting.
_DIRECT_COMPARE_LIMIT = 1 << 16
_INT = {int}
_SEQUENCES = {tuple, list}  # containers whose len and iteration spec's walk also sees; others: plan_step decides


@dataclass(frozen=True)
class GroupAppends:
    rows: np.ndarray  # [k] int64, req_state_idx of each request appending to this group
    counts: np.ndarray  # [k] int64, its filled entries before the step
    lengths: np.ndarray  # [k] int64 (>= 1), ids it appends
    ids: np.ndarray  # [sum(lengths)] int64, the appended ids, request after request


@dataclass(frozen=True)
class BulkStepPlan:
    req_ids: list[str]  # [n] cached requests, scheduler order
    rows: np.ndarray  # [n] int64, req_state_idx of each cached request
    num_computed: np.ndarray  # [n] int64, num_computed_tokens after the step
    num_scheduled: np.ndarray  # [n] int64
    in_schedule_order: bool  # req_ids is also the order of sched.num_scheduled_tokens (the batch tie-break)
    uniform: bool  # every request schedules the same number of tokens (so the batch order is req_ids')
    token_rows: np.ndarray  # [num_tokens] int64, flat token index -> req_state_idx, requests in req_ids order
    positions: np.ndarray  # [num_tokens] int64
    slots: tuple[np.ndarray, ...]  # per group [num_tokens] int64, through the tables as they stand after the step
    appends: tuple[GroupAppends, ...]  # per group
    freed_rows: list[int]  # req_state_idx of the finished requests, ascending (spec's StepPlan.freed_rows)
    new_rows: list[int]  # [len(sched.new_requests)] req_state_idx each new request takes, in their order
    prompt_lens: np.ndarray  # [len(new_rows)] int64
    prompt_tokens: np.ndarray  # [sum(prompt_lens)] int, the new requests' prompts end to end

    @property
    def cached_only(self) -> bool:
        """The step schedules only the cached requests, so the token arrays above cover the whole batch."""
        return not self.new_rows

    def table_ops(self) -> tuple[np.ndarray, np.ndarray]:
        """The appends as fast.writes table ops ([n_t, 6] int64) and their data ([D] int64)."""
        ops, data = [], []
        data_len = 0
        for g, a in enumerate(self.appends):
            if a.rows.size:
                after = a.counts + a.lengths
                index = data_len + np.cumsum(a.lengths) - a.lengths
                ops.append(np.stack([a.rows, np.full_like(a.rows, g), a.counts, after, after, index], axis=1))
                data.append(a.ids)
                data_len += a.ids.size
        if not ops:
            return np.zeros((0, TABLE_OP_FIELDS), np.int64), np.zeros(0, np.int64)
        return np.concatenate(ops), np.concatenate(data)


def plan_bulk_step(
    state: PoolState,
    sched: SchedulerOutput,
    null_tails: list[np.ndarray | None] | None = None,  # per group [R] from last_null_entries, or None to scan
) -> BulkStepPlan | None:
    config = state.config
    new = sched.new_requests
    cached = sched.cached_requests
    scheduled = sched.num_scheduled_tokens
    finished = sched.finished_req_ids
    n, num_new = len(cached), len(new)
    if len(scheduled) != n + num_new or not scheduled:
        return None
    # separate comprehensions: at 256+ requests the Python attribute reads are a large share of the step
    req_ids = [c.req_id for c in cached]
    if [c.resumed for c in cached].count(False) != n:  # any resumed (or a non-bool flag): plan_step decides
        return None
    computed = [c.num_computed_tokens for c in cached]
    new_blocks = [c.new_block_ids for c in cached]
    keys = list(scheduled)
    in_order = not num_new and keys == req_ids  # dict keys are unique, so this also rules out repeated req_ids
    new_counts: list[int] = []
    if in_order:
        counts = [*scheduled.values()]
        req_ids = keys  # equal strings whose hashes the dict already computed: faster row lookups
    else:
        new_ids = [r.req_id for r in new]
        if set(map(type, req_ids + new_ids)) != {str}:
            return None
        every = {*req_ids, *new_ids}
        if len(every) != n + num_new or scheduled.keys() != every:
            return None
        counts = [scheduled[r] for r in req_ids]
        new_counts = [scheduled[r] for r in new_ids]
    new_computed = [r.num_computed_tokens for r in new]
    types = {*map(type, counts), *map(type, computed), *map(type, new_counts), *map(type, new_computed)}
    if not types <= _INT:  # numpy ints, bools, floats: spec's walk decides
        return None
    low = min(counts) if n else 1
    if low < 1 or (n and min(computed) < 0) or (num_new and (min(new_counts) < 1 or min(new_computed) < 0)):
        return None
    cached_tokens = sum(counts)
    if cached_tokens + sum(new_counts) > config.max_num_batched_tokens:
        return None
    freed_rows: list[int] = []
    new_rows: list[int] = []
    if finished or num_new:
        rows_of = _rows_of_new(state, sched, keys)
        if rows_of is None:
            return None
        freed_rows, new_rows = rows_of
    try:
        rows = np.fromiter(map(state.row_of.__getitem__, req_ids), np.int64, n)
        num_scheduled = np.fromiter(counts, np.int64, n)
        num_computed = np.fromiter(computed, np.int64, n)
    except (KeyError, OverflowError):
        return None
    seq_lens = num_computed + num_scheduled
    if (seq_lens > state.num_tokens[rows]).any():  # also covers max_model_len, see the module docstring
        return None
    appends = _appended_ids(new_blocks, len(config.kv_groups))
    if appends is None:
        return None
    new_slots: list[np.ndarray] | None = None
    prompt_lens = prompt_tokens = np.zeros(0, np.int64)
    if num_new:
        checked_new = _check_new_requests(state, new, new_counts, new_computed)
        if checked_new is None:
            return None
        new_slots, prompt_lens, prompt_tokens = checked_new

    uniform = bool(n) and low * n == cached_tokens
    if cached_tokens == n:  # decode: one token per request
        token_req = None
        token_rows, positions = rows, num_computed
    else:
        token_req, within = ranges(num_scheduled)
        token_rows, positions = rows[token_req], num_computed[token_req] + within
    last = seq_lens - 1  # [n] last position written
    slots = []
    group_appends = []
    for g in range(len(config.kv_groups)):
        tails = null_tails[g] if null_tails is not None else None
        checked = _check_group(state, g, rows, num_computed, last, token_req, token_rows, positions, appends[g], tails)
        if checked is None:
            return None
        written = checked[0] if new_slots is None else np.concatenate([new_slots[g], checked[0]])
        if _has_repeats(written):  # check 13 over every token of the step, new requests' included
            return None
        slots.append(checked[0])
        group_appends.append(checked[1])
    return BulkStepPlan(
        req_ids=req_ids,
        rows=rows,
        num_computed=num_computed,
        num_scheduled=num_scheduled,
        in_schedule_order=in_order,
        uniform=uniform,
        token_rows=token_rows,
        positions=positions,
        slots=tuple(slots),
        appends=tuple(group_appends),
        freed_rows=freed_rows,
        new_rows=new_rows,
        prompt_lens=prompt_lens,
        prompt_tokens=prompt_tokens,
    )


def _rows_of_new(state: PoolState, sched: SchedulerOutput, scheduled: list[str]) -> tuple[list[int], list[int]] | None:
    """Checks 1-4 for finished and new requests: (freed rows ascending, the row of each new request)."""
    finished = sched.finished_req_ids
    if not isinstance(finished, frozenset | set) or not finished.isdisjoint(scheduled):
        return None  # a list could repeat an id; finished and scheduled at once is spec's error
    row_of = state.row_of
    if not all(isinstance(r, str) and r in row_of for r in finished):
        return None
    if any(r.req_id in row_of for r in sched.new_requests):
        return None
    freed_rows = sorted(row_of[r] for r in finished)
    freed = set(freed_rows)
    # the lowest rows that are free once the finished requests leave, in the order the new requests come
    free = (row for row, req_id in enumerate(state.req_ids) if req_id is None or row in freed)
    new_rows = list(islice(free, len(sched.new_requests)))
    if len(new_rows) != len(sched.new_requests):
        return None
    return freed_rows, new_rows


def _check_new_requests(
    state: PoolState,
    new: tuple[NewRequest, ...],  # [k]
    counts: list[int],  # [k] num_scheduled_tokens, ints >= 1
    computed: list[int],  # [k] num_computed_tokens, ints >= 0
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray] | None:
    """Checks 6-12 for the new requests: (per group the slots [sum(counts)] their tokens write, prompt lengths
    [k], prompt tokens [sum(prompt lengths)])."""
    config = state.config
    k, num_groups = len(new), len(config.kv_groups)
    try:  # malformed prompts or tables (not sequences, huge, nested, not ints): plan_step decides
        prompts = [r.prompt_token_ids for r in new]
        tables = [r.block_ids for r in new]
        if not {*map(type, prompts), *map(type, tables)} <= _SEQUENCES:
            return None
        prompt_lens = np.fromiter(map(len, prompts), np.int64, k)
        tokens = np.array(list(chain.from_iterable(prompts)))
        if list(map(len, tables)).count(num_groups) != k:
            return None
    except (TypeError, ValueError, OverflowError):
        return None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size != int(prompt_lens.sum()):
        return None  # an empty step's tokens are float: plan_step decides
    if tokens.min() < 0 or tokens.max() >= config.vocab_size or prompt_lens.max() > config.max_model_len:
        return None
    num_scheduled = np.array(counts, np.int64)
    num_computed = np.array(computed, np.int64)
    last = num_computed + num_scheduled - 1  # [k] last position written
    if (last >= prompt_lens).any():
        return None
    token_req, within = ranges(num_scheduled)
    positions = num_computed[token_req] + within  # [num_new_tokens]
    slots = []
    for g, group in enumerate(config.kv_groups):
        entries = [table[g] for table in tables]
        if not set(map(type, entries)) <= _SEQUENCES:
            return None
        try:
            lengths = np.fromiter(map(len, entries), np.int64, k)
            ids = np.array(list(chain.from_iterable(entries)), np.int64)  # as spec's np.asarray(ids, np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
        if ids.ndim != 1 or ids.size != int(lengths.sum()) or not ids.size:
            return None
        if ids.min() < 0 or ids.max() >= group.num_blocks or lengths.max() > config.max_blocks_per_req(g):
            return None
        block_size = group.block_size
        if (last // block_size >= lengths).any():
            return None  # a missing block
        start = lengths.cumsum() - lengths  # [k] where each request's table begins in `ids`
        id_req = np.arange(k).repeat(lengths)  # [sum(lengths)]
        real = ids != NULL_BLOCK_ID
        if not real.all():
            if group.sliding_window is None:
                return None
            first = np.maximum(0, num_computed - group.sliding_window + 1) // block_size  # [k] first entry read
            which, entry = ranges(last // block_size - first + 1)
            if (ids[start[which] + first[which] + entry] == NULL_BLOCK_ID).any():
                return None
        if _has_repeats((id_req * group.num_blocks + ids)[real]):
            return None
        logical, offset = np.divmod(positions, block_size)
        written = ids[start[token_req] + logical] * block_size  # int64: may pass 2**31
        written += offset
        slots.append(written)
    return slots, prompt_lens, tokens


def last_null_entries(state: PoolState, g: int, rows: np.ndarray) -> np.ndarray:
    """[k] int64: for each row, the index of the last NULL_BLOCK_ID among its filled entries in group g, or -1.

    The pool keeps these for sliding-window groups (the only ones whose tables may hold the null block),
    so the null-read check of a decode step looks at one number per request instead of its window.
    """
    table = state.block_tables[g][rows]  # [k, width]
    width = table.shape[1]
    null = (table == NULL_BLOCK_ID) & (np.arange(width) < state.num_blocks[g, rows][:, None])
    return np.where(null.any(axis=1), width - 1 - np.argmax(null[:, ::-1], axis=1), -1).astype(np.int64)


def _appended_ids(
    new_blocks: list[tuple[tuple[int, ...], ...] | None],  # [n] per request per group, or None
    num_groups: int,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """Per group: (request index [k], lengths [k] >= 1, ids [sum]) of requests appending to it."""
    none = np.zeros(0, np.int64)
    if new_blocks.count(None) == len(new_blocks):
        return [(none, none, none)] * num_groups
    appending = [i for i, ids in enumerate(new_blocks) if ids is not None]
    per_request = [new_blocks[i] for i in appending]
    index = np.array(appending, np.int64)
    out = []
    try:  # malformed ids (not sequences, huge, nested): plan_step decides, and raises what spec raises
        if list(map(len, per_request)).count(num_groups) != len(per_request):  # type: ignore[arg-type]
            return None
        for entries in zip(*per_request, strict=True):  # one tuple of per-request ids per group
            lengths = np.fromiter(map(len, entries), np.int64, len(entries))
            ids = np.array(list(chain.from_iterable(entries)), np.int64)
            if ids.ndim != 1 or ids.size != int(lengths.sum()):
                return None
            has = lengths > 0
            out.append((index[has], lengths[has], ids))
    except (TypeError, ValueError, OverflowError):
        return None
    return out


def _check_group(
    state: PoolState,
    g: int,
    rows: np.ndarray,  # [n] req_state_idx
    num_computed: np.ndarray,  # [n]
    last: np.ndarray,  # [n] last position each request writes
    token_req: np.ndarray | None,  # [num_tokens] request index of each token; None: token i is request i's only
    token_rows: np.ndarray,  # [num_tokens] req_state_idx
    positions: np.ndarray,  # [num_tokens]
    appended: tuple[np.ndarray, np.ndarray, np.ndarray],  # request index [k], lengths [k], ids
    null_tails: np.ndarray | None,  # [R] last_null_entries of every row, or None
) -> tuple[np.ndarray, GroupAppends] | None:
    """Checks 9-12 for group g. Returns the group's slots [num_tokens] and its appends."""
    group = state.config.kv_groups[g]
    table = state.block_tables[g]
    block_size, width = group.block_size, table.shape[1]
    counts = state.num_blocks[g][rows]  # [n] filled entries before the step
    app_req, lengths, ids = appended
    logical, offset = np.divmod(positions, block_size)  # [num_tokens]
    last_block = logical if token_req is None else last // block_size  # [n]
    if ids.size:
        # out of range, a null placeholder (plan_step decides), past int32 (spec's int32 tables decide), or overflow
        if ids.min() <= NULL_BLOCK_ID or ids.max() >= min(group.num_blocks, 2**31):
            return None
        app_counts = counts[app_req]
        app_after = app_counts + lengths
        if app_after.max() > width:
            return None
        after = counts.copy()
        after[app_req] = app_after
        if (last_block >= after).any():
            return None  # a missing block
        app_rows = rows[app_req]
        if not _fresh(table, app_rows, app_counts, lengths, ids, group.num_blocks):
            return None
    else:
        if (last_block >= counts).any():
            return None  # a missing block
        app_rows = app_counts = app_req
    if group.sliding_window is not None and not _no_null_reads(
        table, rows, counts, num_computed, last, group.sliding_window, block_size, null_tails
    ):
        return None

    # every scheduled token's slot, through the table as it will stand after the step
    physical = table.ravel()[token_rows * width + logical]  # [num_tokens] int32; appended entries read as NULL
    if ids.size:
        start = lengths.cumsum() - lengths  # [k] where each appending request's ids begin in `ids`
        if token_req is None:  # decode: request i's one token is token i
            reads = logical[app_req]
            past = np.flatnonzero(reads >= app_counts)  # appending requests whose token lands in a new block
            physical[app_req[past]] = ids[start[past] + reads[past] - app_counts[past]]
        else:
            start_of = np.zeros(rows.size, np.int64)
            start_of[app_req] = start
            beyond = np.flatnonzero(logical >= counts[token_req])
            tok = token_req[beyond]
            physical[beyond] = ids[start_of[tok] + logical[beyond] - counts[tok]]
    slots = np.multiply(physical, block_size, dtype=np.int64)  # int64: may pass 2**31
    slots += offset
    return slots, GroupAppends(app_rows, app_counts, lengths, ids)


def _fresh(
    table: np.ndarray,  # [R, width] the group's committed table
    app_rows: np.ndarray,  # [k] req_state_idx
    counts: np.ndarray,  # [k] filled entries before the step
    lengths: np.ndarray,  # [k]
    ids: np.ndarray,  # [sum(lengths)] appended ids (all >= 1)
    num_blocks: int,
) -> bool:
    """Appended ids are new to their table: not among its entries, and not repeated within one request."""
    width = table.shape[1]
    if ids.size == app_rows.size:  # one id per request (a decode crossing a block boundary): no repeats within
        # unfilled entries are NULL and ids >= 1, so the whole stored row can be compared
        return not (table[app_rows] == ids[:, None]).any()
    id_req = np.arange(app_rows.size).repeat(lengths)  # [D] appending request of each id
    if ids.size * width <= _DIRECT_COMPARE_LIMIT:
        if (table[app_rows[id_req]] == ids[:, None]).any():
            return False
        return not _has_repeats(id_req * num_blocks + ids)
    existing = table[app_rows].astype(np.int64)  # [k, width]
    filled = np.arange(width) < counts[:, None]
    keys_existing = (np.arange(app_rows.size)[:, None] * num_blocks + existing)[filled & (existing != 0)]
    return not _has_repeats(np.concatenate([keys_existing, id_req * num_blocks + ids]))


def _no_null_reads(
    table: np.ndarray,  # [R, width]
    rows: np.ndarray,  # [n]
    counts: np.ndarray,  # [n] filled entries before the step
    num_computed: np.ndarray,  # [n]
    last: np.ndarray,  # [n]
    window: int,
    block_size: int,
    null_tails: np.ndarray | None,  # [R] last null entry per row, or None
) -> bool:
    """No committed entry read this step is null (appended ids are >= 1): check 12 for a windowed group."""
    lo = np.maximum(0, num_computed - window + 1) // block_size  # [n] first entry read
    if null_tails is not None:
        suspects = np.flatnonzero(null_tails[rows] >= lo)  # the others hold no null from lo on
        if not suspects.size:
            return True
        rows, counts, lo, last = rows[suspects], counts[suspects], lo[suspects], last[suspects]
    hi = np.minimum(last // block_size, counts - 1)  # inclusive
    which, within = ranges(np.maximum(hi - lo + 1, 0))
    return not (table[rows[which], lo[which] + within] == NULL_BLOCK_ID).any()


def _has_repeats(values: np.ndarray) -> bool:
    """Sorting beats np.unique's hashing by ~10x at these sizes (thousands of int64)."""
    ordered = values.copy()
    ordered.sort()
    return bool((ordered[1:] == ordered[:-1]).any())
