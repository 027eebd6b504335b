"""Stage 2 on the host: the scheduler output read once, every check made in compiled passes over all requests.

spec.validate.plan_step is the definition: it walks requests in Python and names the exact error.
`plan_bulk_step` checks the same thirteen conditions, drafts included (spec/drafts.py), with a few NumPy
calls and Numba-compiled loops. It never raises: it returns None when the output has a shape it does not
cover (a resumed request, NumPy scalars for counts, a block written by two requests, ...) or when any
check fails, and the pool then runs plan_step, which raises spec's error in spec's order or accepts the
step. Both return the same spec.state.StepPlan, so a step accepted here is one plan_step accepts, with
the same effect.

Each Python object of the output is read once: the cached requests' fields in one pass (or not at all
when they come as spec.types.CachedRequestColumns), each prompt converted once (array('i'), which also
refuses floats and values past int32 as spec's `operator.index` reading does), the drafts in one pass,
and what the checks read (rows, counts, the new tables) is what the commit and prepare use.

It relies on invariants of the pool state that plan_step and the commit establish:
- every committed table passed the block-id checks, so only appended ids need checking against it,
  unless a released entry (see last_released_entries) lies in the step's live part;
- entries past a row's block count are NULL_BLOCK_ID and appended ids are >= 1, so an appended id can
  be compared with the row's stored entries without masking;
- num_known_tokens[row] <= max_model_len, so a step without drafts that reads only known tokens
  (check 8) passes check 7; a drafting request's end is checked against max_model_len itself.
Check 13 (no slot written twice) is made per block: tokens of one request never share a slot (the
blocks it writes are live entries, which are distinct), so if no physical block is written by two
requests no slot is. A block written by two requests (legal when their offsets differ) goes to
plan_step's exact per-slot check.
"""

from __future__ import annotations

from array import array
from itertools import chain, islice
from typing import Any

import numpy as np
from numba import njit

from spec.state import PoolState, StepPlan, TableWrites, ranges
from spec.types import NULL_BLOCK_ID, CachedRequest, CachedRequestColumns, NewRequest, SchedulerOutput

_SEQUENCES = (tuple, list)
MAX_OWNER_MAP = 1 << 26  # the largest pool whose one-block-pool check keeps an id -> group map (64 MiB of int8)
_EMPTY = np.zeros(0, np.int64)
_NO_TOKENS = np.zeros(0, np.int32)


def plan_bulk_step(
    state: PoolState,
    sched: SchedulerOutput,
    released_tails: list[np.ndarray | None] | None = None,  # per group [R]: last_released_entries, or None: scan
    block_owner: np.ndarray | None = None,  # [num_blocks] int8 zeros, with one block pool: _held_in_two_groups'
) -> StepPlan | None:
    config = state.config
    # attention groups only: a cross group's rules (spec/cross_attention.py) and a mamba group's state reads
    # (spec/mamba.py), which plan_step freezes, are plan_step's alone
    if any(group.kind != "attention" for group in config.kv_groups):
        return None
    scheduled, new, finished = sched.num_scheduled_tokens, sched.new_requests, sched.finished_req_ids
    if type(scheduled) is not dict or type(new) not in _SEQUENCES or type(finished) not in (frozenset, set):
        return None
    cached = _read_cached(sched.cached_requests)
    if cached is None:
        return None
    cached_ids, computed_in, new_blocks = cached
    n, num_new = len(cached_ids), len(new)
    keys = list(scheduled)
    counts_in = list(scheduled.values())
    if len(keys) != n + num_new or not keys or set(map(type, keys)) != {str} or set(map(type, counts_in)) != {int}:
        return None
    num_scheduled = np.array(counts_in, np.int64)  # [n + k] scheduler order
    if num_scheduled.min() < 1 or num_scheduled.sum() > config.max_num_batched_tokens:
        return None
    if num_new and set(map(type, new)) != {NewRequest}:
        return None
    if num_new and any(r.encoder_len != 0 for r in new):  # an encoder on a decoder-only model: plan_step refuses it
        return None
    if num_new and any(
        r.mrope_positions is not None or type(r.mrope_position_delta) is not int or r.mrope_position_delta for r in new
    ):
        return None  # M-RoPE inputs (spec/mrope.py) are spec's plan_step's to check and freeze
    new_ids = [r.req_id for r in new] if num_new else []
    # the position of each cached and each new request among the scheduled ones
    if keys == cached_ids + new_ids:
        cached_at, new_at = slice(0, n), slice(n, n + num_new)
    elif keys == new_ids + cached_ids:
        new_at, cached_at = slice(0, num_new), slice(num_new, n + num_new)
    else:
        if len(set(keys)) != len(keys) or set(keys) != {*cached_ids, *new_ids}:
            return None
        index = _positions(keys)
        cached_at = np.fromiter(map(index.__getitem__, cached_ids), np.int64, n)  # type: ignore[assignment]
        new_at = np.fromiter(map(index.__getitem__, new_ids), np.int64, num_new)  # type: ignore[assignment]
    row_of = state.row_of
    try:
        rows = np.fromiter(map(row_of.__getitem__, cached_ids), np.int64, n)  # unknown request: KeyError
        num_computed = np.array(computed_in, np.int64) if n else _EMPTY  # [n]
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    if num_computed.ndim != 1:
        return None
    if finished or num_new:
        freed_new = _rows_of_new(state, finished, new_ids, keys)
        if freed_new is None:
            return None
        freed_rows, new_rows = freed_new
    else:
        freed_rows = new_rows = _EMPTY
    drafts = _read_drafts(sched.scheduled_spec_decode_tokens, keys, config.vocab_size)
    if drafts is None:
        return None
    num_drafts, draft_ids = drafts
    cached_drafts = _EMPTY if num_drafts is None else num_drafts[cached_at]
    last = np.empty(n, np.int64)  # [n] last position each cached request writes
    limits = (config.max_model_len, state.num_known_tokens)
    if not _check_progress(rows, num_computed, num_scheduled[cached_at], cached_drafts, *limits, last):
        return None
    appends = _appended_ids(new_blocks, n, len(config.kv_groups))
    if appends is None:
        return None
    new_drafts = None if num_drafts is None else num_drafts[new_at]
    prompts = _check_new_requests(state, new, num_scheduled[new_at], new_drafts) if num_new else _NO_NEW
    if prompts is None:
        return None
    new_computed, prompt_lens, prompt_tokens, new_writes, new_written = prompts

    tables = []
    for g in range(len(config.kv_groups)):
        tails = released_tails[g] if released_tails is not None else None
        checked = _check_group(state, g, rows, num_computed, last, appends[g], tails)
        if checked is None:
            return None
        appended, written = checked
        if num_new:
            written = np.concatenate([new_written[g], written])
        if _has_repeats(written, -1):  # a block written by two requests: plan_step checks per slot
            return None
        tables.append(_merge(new_rows, new_writes[g], appended) if num_new else appended)
    if not num_new and type(cached_at) is slice:  # the cached requests come in the scheduler's order
        sched_rows, sched_computed = rows, num_computed
    else:  # scheduler order from the cached and the new requests' parts
        sched_rows, sched_computed = np.empty(n + num_new, np.int64), np.empty(n + num_new, np.int64)
        sched_rows[cached_at], sched_rows[new_at] = rows, new_rows
        sched_computed[cached_at], sched_computed[new_at] = num_computed, new_computed
    plan = StepPlan(
        freed_rows=freed_rows,
        new_req_ids=tuple(new_ids),
        new_rows=new_rows,
        prompt_lens=prompt_lens,
        prompt_tokens=prompt_tokens,
        tables=tuple(tables),
        req_ids=tuple(keys),
        rows=sched_rows,
        num_scheduled=num_scheduled,
        num_computed=sched_computed,
        num_drafts=num_drafts,
        draft_ids=draft_ids,
    )
    if config.one_block_pool and len(config.kv_groups) > 1 and _held_in_two_groups(state, plan, block_owner):
        return None  # plan_step names the first such entry and its holder
    return plan


def _held_in_two_groups(state: PoolState, plan: StepPlan, owner: np.ndarray | None) -> bool:
    """With one block pool: some id held by a scheduled request in one group is held in another group too.

    `owner` [num_blocks] int8, all zero: a scratch map id -> 1 + the group holding it, returned zeroed (a
    step marks its held ids and clears them again, so it costs the held entries, not the pool's size);
    None (a pool too large for one): the ids are sorted instead.
    """
    scratch = owner if owner is not None else np.zeros(0, np.int8)
    touched = np.empty(sum(plan.rows.shape[0] * t.shape[1] for t in state.block_tables), np.int64)
    count, clash, num_groups = 0, False, len(state.config.kv_groups)
    for g, group in enumerate(state.config.kv_groups):
        w = plan.tables[g]
        count, clash = _mark_held(
            state.block_tables[g], state.num_blocks[g], plan.rows, plan.num_computed, w.rows, w.starts, w.lengths,
            w.ids, w.replaced, group.block_size, group.sliding_window or 0, g, num_groups, scratch, touched, count,
        )  # fmt: skip
        if clash:
            break
    if owner is not None:
        _unmark(owner, touched, count)
        return clash
    ids, groups = np.divmod(touched[:count], num_groups)  # without a scratch map: (id, group) pairs
    order = np.lexsort((groups, ids))  # by id, then group: an id held in two groups has two groups side by side
    ids, groups = ids[order], groups[order]
    return bool(((ids[1:] == ids[:-1]) & (groups[1:] != groups[:-1])).any())


@njit(cache=True, nogil=True)
def _unmark(owner: np.ndarray, touched: np.ndarray, count: int) -> None:  # pragma: no cover - compiled
    """Zero the `count` ids of `touched` in `owner` again (_mark_held's marks)."""
    for i in range(count):
        owner[touched[i]] = 0


@njit(cache=True, nogil=True)
def _mark_held(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    num_computed: np.ndarray,  # [n] int64 scheduler order
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each table write
    write_starts: np.ndarray,  # [k] int64 first entry written
    write_lengths: np.ndarray,  # [k] int64 ids written
    write_ids: np.ndarray,  # [sum(write_lengths)] int64
    replaced: np.ndarray,  # [k] bool: the write replaces the whole table
    block_size: int,
    window: int,  # sliding window, 0 for none
    group: int,
    num_groups: int,
    owner: np.ndarray,  # [num_blocks] int8 id -> 1 + its holding group, 0: none yet; or empty: record pairs
    touched: np.ndarray,  # [n * sum of widths] int64 out: ids marked (with owner), else id * num_groups + group
    count: int,  # entries of `touched` already used
) -> tuple[int, bool]:
    """Group `group`'s held ids after the step (non-null, from each request's first live entry on): marked in
    `owner`, (count, True) at the first id another group holds; without `owner`, recorded as pairs."""
    write_of = np.full(table.shape[0], -1, np.int64)  # req_state_idx -> its write, or -1
    offset = np.zeros(write_rows.shape[0] + 1, np.int64)
    for k in range(write_rows.shape[0]):
        write_of[write_rows[k]] = k
        offset[k + 1] = offset[k] + write_lengths[k]
    for i in range(rows.shape[0]):
        row, k = rows[i], write_of[rows[i]]
        kept = num_blocks[row] if k < 0 else (0 if replaced[k] else write_starts[k])
        total = kept + (0 if k < 0 else write_lengths[k])
        lo = 0 if window == 0 else max(0, num_computed[i] - window + 1) // block_size
        for e in range(lo, total):
            block = table[row, e] if e < kept else write_ids[offset[k] + e - kept]
            if block == NULL_BLOCK_ID:
                continue
            if owner.shape[0] == 0:
                touched[count] = block * num_groups + group
                count += 1
            elif owner[block] == 0:
                owner[block] = group + 1
                touched[count] = block
                count += 1
            elif owner[block] != group + 1:
                return count, True
    return count, False


def _positions(keys: list[str]) -> dict[str, int]:
    """req_id -> its index in the scheduler order."""
    return {r: i for i, r in enumerate(keys)}


def _read_drafts(
    drafts: Any,  # sched.scheduled_spec_decode_tokens
    keys: list[str],  # [n] scheduler order, distinct str
    vocab_size: int,
) -> tuple[np.ndarray | None, np.ndarray] | None:
    """Checks 1 and 6 of the drafts: (num_drafts [n] scheduler order or None when nobody drafts, draft ids int32)."""
    if type(drafts) is not dict:
        return None
    if not drafts:
        return None, _NO_TOKENS
    draft_keys = list(drafts)
    joined = _joined_ids(list(drafts.values()), "i")
    if joined is None:
        return None
    lengths, ids = joined
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        return None
    if not ids.size:  # every request lists no drafts: a step without drafts
        return (None, _NO_TOKENS) if set(draft_keys) <= set(keys) else None
    num_drafts = np.zeros(len(keys), np.int64)  # [n] scheduler order
    if draft_keys == keys:  # every scheduled request drafts, in the scheduler's order
        num_drafts[:] = lengths
        return num_drafts, ids
    index = _positions(keys)
    try:
        at = np.fromiter(map(index.__getitem__, draft_keys), np.int64, len(draft_keys))  # not scheduled: KeyError
    except (KeyError, TypeError):
        return None
    num_drafts[at] = lengths
    if (at[1:] > at[:-1]).all():  # listed in the scheduler's order: the ids are too
        return num_drafts, ids
    order = np.argsort(at)  # the listed requests in the scheduler's order
    starts = np.cumsum(lengths) - lengths
    which, within = ranges(lengths[order])
    return num_drafts, ids[starts[order][which] + within]


def _read_cached(cached: Any) -> tuple[list[str], Any, list[Any] | None] | None:
    """(req_ids, num_computed_tokens, new_block_ids or None) of the cached requests, or None if any is resumed."""
    if type(cached) is CachedRequestColumns:
        resumed_ids = cached.resumed_req_ids  # spec's to judge unless an empty set (an empty tuple is refused)
        if resumed_ids or type(resumed_ids) not in (frozenset, set) or type(cached.req_ids) not in _SEQUENCES:
            return None
        req_ids, computed, blocks = list(cached.req_ids), cached.num_computed_tokens, cached.new_block_ids
        if type(computed) in _SEQUENCES:
            if set(map(type, computed)) - {int}:
                return None
        elif type(computed) is not np.ndarray or computed.dtype.kind not in "iu":
            return None
        if len(computed) != len(req_ids) or (blocks is not None and len(blocks) != len(req_ids)):
            return None
        return req_ids, computed, None if blocks is None else list(blocks)
    if type(cached) not in _SEQUENCES:
        return None
    if not cached:
        return [], _EMPTY, None
    if set(map(type, cached)) != {CachedRequest}:
        return None
    fields = [(c.req_id, c.num_computed_tokens, c.new_block_ids, c.resumed) for c in cached]
    ids, computed, blocks, resumed = zip(*fields, strict=True)
    if set(map(id, resumed)) != {id(False)} or set(map(type, computed)) != {int}:  # False itself, not 0
        return None
    return list(ids), computed, list(blocks)


def _rows_of_new(
    state: PoolState, finished: frozenset[str] | set[str], new_ids: list[str], scheduled: list[str]
) -> tuple[np.ndarray, np.ndarray] | None:
    """Checks 1-4 for finished and new requests: (freed rows ascending, the row of each new request)."""
    row_of = state.row_of
    if finished and (not finished.isdisjoint(scheduled) or not all(type(r) is str and r in row_of for r in finished)):
        return None
    if any(r in row_of for r in new_ids):
        return None
    freed = sorted(row_of[r] for r in finished)
    freed_set = set(freed)
    # the lowest rows free once the finished requests leave, in the order the new requests come
    free = (row for row, req_id in enumerate(state.req_ids) if req_id is None or row in freed_set)
    new_rows = list(islice(free, len(new_ids)))
    if len(new_rows) != len(new_ids):
        return None
    return np.array(freed, np.int64), np.array(new_rows, np.int64)


_NO_NEW: tuple[np.ndarray, np.ndarray, np.ndarray, list[TableWrites], list[np.ndarray]] = (
    _EMPTY,
    _EMPTY,
    np.zeros(0, np.int32),
    [],
    [],
)


def _check_new_requests(
    state: PoolState,
    new: tuple[NewRequest, ...] | list[NewRequest],  # [k]
    num_scheduled: np.ndarray,  # [k] >= 1
    num_drafts: np.ndarray | None,  # [k] drafts of each, or None: nobody drafts
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[TableWrites], list[np.ndarray]] | None:
    """Checks 6-12 for the new requests (and 1 and 8 for their drafts). Returns their num_computed_tokens [k],
    prompt lengths [k], prompt tokens [sum] int32, per group their tables (as TableWrites, rows left to the
    caller) and the physical blocks their tokens write."""
    config = state.config
    k, num_groups = len(new), len(config.kv_groups)
    fields = [(r.prompt_token_ids, r.block_ids, r.num_computed_tokens) for r in new]
    prompts, tables, computed_in = zip(*fields, strict=True)
    if set(map(type, computed_in)) != {int} or set(map(type, tables)) - {tuple, list}:
        return None
    joined = _joined_ids(prompts, "i", long=True)  # int32 storage: past int32 is past any vocabulary
    if joined is None:
        return None
    prompt_lens, tokens = joined
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        return None
    if prompt_lens.max() > config.max_model_len or list(map(len, tables)).count(num_groups) != k:
        return None
    num_computed = np.array(computed_in, np.int64)
    last = num_computed + num_scheduled - 1  # [k] last position written
    if num_drafts is None:
        known_end = prompt_lens  # [k] past the last input token each may read
    else:  # a drafting request's step ends at its last draft, and holds its last known token first
        known_end = prompt_lens + num_drafts
        drafting = num_drafts > 0
        misplaced = (last != known_end - 1) | (last >= config.max_model_len) | (num_scheduled < 1 + num_drafts)
        if (drafting & misplaced).any():
            return None
    if num_computed.min() < 0 or (last >= known_end).any():
        return None
    writes, written = [], []
    for g, group in enumerate(config.kv_groups):
        joined = _joined_ids([table[g] for table in tables], "q")
        if joined is None:
            return None
        lengths, ids = joined
        out = np.empty(_blocks_written(num_computed, last, group.block_size), np.int64)
        ok = _check_new_tables(
            lengths, ids, num_computed, last, group.num_blocks, config.max_blocks_per_req(g), group.block_size,
            group.sliding_window or 0, out,
        )  # fmt: skip
        if not ok:
            return None
        written.append(out)
        writes.append(TableWrites(_EMPTY, np.zeros(k, np.int64), lengths, ids, np.ones(k, bool)))
    return num_computed, prompt_lens, tokens, writes, written


@njit(cache=True, nogil=True)
def _check_new_tables(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    lengths: np.ndarray,  # [k] int64 entries of each new request's table
    ids: np.ndarray,  # [sum(lengths)] int64 the tables, request after request
    num_computed: np.ndarray,  # [k] int64
    last: np.ndarray,  # [k] int64 last position each writes
    num_blocks: int,
    max_blocks: int,  # max_blocks_per_req of the group
    block_size: int,
    window: int,  # sliding window, 0 for none
    written: np.ndarray,  # [w] int64 out: the physical block of every (request, block) the step writes
) -> bool:
    """Checks 9-12 for one group's new tables, one pass; False at the first failure (plan_step names it)."""
    start, w = 0, 0
    for i in range(lengths.shape[0]):
        table = ids[start : start + lengths[i]]
        start += lengths[i]
        if table.shape[0] > max_blocks or last[i] // block_size >= table.shape[0]:
            return False  # too many blocks, or a missing one
        for block in table:
            if block < 0 or block >= num_blocks or (block == 0 and window == 0):
                return False  # out of range, or the null block outside a sliding-window group
        read_from = 0 if window == 0 else max(0, num_computed[i] - window + 1) // block_size
        for e in range(read_from, last[i] // block_size + 1):
            if table[e] == 0:
                return False  # a token would read or write through the null block
        if _has_repeats(table[read_from:], NULL_BLOCK_ID):
            return False  # a block twice among the entries not released by the window
        for e in range(num_computed[i] // block_size, last[i] // block_size + 1):
            written[w] = table[e]
            w += 1
    return True


def _ids(values: Any, typecode: str) -> np.ndarray | None:
    """spec.validate.as_ids without a per-element Python loop: array() takes exactly what operator.index takes.

    typecode "i" gives int32 (token ids: past int32 is past any vocabulary), "q" int64 (block ids). An
    array whose values do not fit is left to plan_step, which names the bad value.
    """
    dtype = np.int32 if typecode == "i" else np.int64
    if type(values) in _SEQUENCES:
        try:
            return np.frombuffer(array(typecode, values), dtype)
        except (TypeError, OverflowError):
            return None
    if type(values) is not np.ndarray or values.ndim != 1:
        return None
    if not values.size:
        return np.zeros(0, dtype)
    info = np.iinfo(dtype)
    if values.dtype.kind not in "iu" or values.min() < info.min or values.max() > info.max:
        return None
    return values.astype(dtype, copy=False)


def _appended_ids(
    new_blocks: list[Any] | None,  # [n] per request: per group ids, or None
    n: int,
    num_groups: int,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """Per group: (request index [a], lengths [a] >= 1, ids [sum]) of the cached requests appending to it."""
    if new_blocks is None or new_blocks.count(None) == n:
        return [(_EMPTY, _EMPTY, _EMPTY)] * num_groups
    appending = [i for i, ids in enumerate(new_blocks) if ids is not None]
    per_request = [new_blocks[i] for i in appending]
    if set(map(type, per_request)) - {tuple, list} or list(map(len, per_request)).count(num_groups) != len(appending):
        return None
    index = np.array(appending, np.int64)
    out = []
    for entries in zip(*per_request, strict=True):  # one tuple of per-request ids per group
        joined = _joined_ids(entries, "q")
        if joined is None:
            return None
        lengths, ids = joined
        has = lengths > 0
        out.append((index[has], lengths[has], ids))
    return out


def _joined_ids(
    entries: tuple[Any, ...] | list[Any], typecode: str, long: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Several requests' ids end to end: (lengths [k], ids [sum]).

    Short sequences (appended block ids) convert in one pass over all of them; `long` ones (prompts) one
    array() each, which reads a list or tuple several times faster than through an iterator.
    """
    if not long and not set(map(type, entries)) - {tuple, list}:
        lengths = np.fromiter(map(len, entries), np.int64, len(entries))
        dtype = np.int32 if typecode == "i" else np.int64
        try:
            ids = np.frombuffer(array(typecode, chain.from_iterable(entries)), dtype)
        except (TypeError, OverflowError):
            return None
        return lengths, ids
    converted = [_ids(e, typecode) for e in entries]
    if any(c is None for c in converted):
        return None
    lengths = np.fromiter(map(len, converted), np.int64, len(converted))  # type: ignore[arg-type]
    return lengths, np.concatenate(converted)  # type: ignore[arg-type]


def _check_group(
    state: PoolState,
    g: int,
    rows: np.ndarray,  # [n] req_state_idx of the cached requests
    num_computed: np.ndarray,  # [n]
    last: np.ndarray,  # [n] last position each writes
    appended: tuple[np.ndarray, np.ndarray, np.ndarray],  # request index [a], lengths [a], ids
    released_tails: np.ndarray | None,  # [R] last released entry of every row, or None
) -> tuple[TableWrites, np.ndarray] | None:
    """Checks 9-12 for group g's cached requests: their appends, and the physical blocks their tokens write."""
    group = state.config.kv_groups[g]
    app_req, lengths, ids = appended
    app_counts = np.empty(app_req.size, np.int64)  # [a] filled entries of each appending row before the step
    written = np.empty(_blocks_written(num_computed, last, group.block_size), np.int64)
    ok = _check_cached_group(
        state.block_tables[g], state.num_blocks[g], rows, num_computed, last, app_req, lengths, ids,
        min(group.num_blocks, 2**31), group.block_size, group.sliding_window or 0,
        _NO_TAILS if released_tails is None else released_tails, app_counts, written,
    )  # fmt: skip
    if not ok:
        return None
    return TableWrites(rows[app_req], app_counts, lengths, ids, np.zeros(app_req.size, bool)), written


_NO_TAILS = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _check_progress(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    rows: np.ndarray,  # [n] int64 req_state_idx
    num_computed: np.ndarray,  # [n] int64 as the scheduler says
    num_scheduled: np.ndarray,  # [n] int64
    num_drafts: np.ndarray,  # [n] int64 drafts of each request, or empty: nobody drafts
    max_model_len: int,
    num_known: np.ndarray,  # [R] int64 known tokens per row
    last: np.ndarray,  # [n] int64 out: last position each writes
) -> bool:
    """Checks 1, 7 and 8 of the cached requests: num_computed >= 0, every position written a known token
    (which bounds it by max_model_len) or one of the request's drafts, which follow its last known token."""
    for i in range(rows.shape[0]):
        last[i] = num_computed[i] + num_scheduled[i] - 1
        k = num_drafts[i] if num_drafts.shape[0] else 0
        if num_computed[i] < 0 or last[i] >= num_known[rows[i]] + k:
            return False
        if k and (last[i] != num_known[rows[i]] + k - 1 or last[i] >= max_model_len or num_scheduled[i] < 1 + k):
            return False
    return True


@njit(cache=True, nogil=True)
def _blocks_written(num_computed: np.ndarray, last: np.ndarray, block_size: int) -> int:  # pragma: no cover
    """(request, block) pairs a step's tokens write: each request writes blocks first .. last // block_size."""
    total = 0
    for i in range(last.shape[0]):
        total += last[i] // block_size - num_computed[i] // block_size + 1
    return total


@njit(cache=True, nogil=True)
def _check_cached_group(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [n] int64 req_state_idx
    num_computed: np.ndarray,  # [n] int64
    last: np.ndarray,  # [n] int64 last position each request writes
    app_req: np.ndarray,  # [a] int64 request index of each appending request
    lengths: np.ndarray,  # [a] int64 ids each appends (>= 1)
    ids: np.ndarray,  # [sum(lengths)] int64 appended ids, request after request
    id_limit: int,  # appended ids must be < this (num_blocks, and int32 for the tables)
    block_size: int,
    window: int,  # sliding window, 0 for none
    released_tails: np.ndarray,  # [R] last released entry per row (last_released_entries), or empty: scan
    app_counts: np.ndarray,  # [a] int64 out: each appending row's filled entries before the step
    written: np.ndarray,  # [w] int64 out: the physical block of every (request, block) the step writes
) -> bool:
    """Checks 9-12 for one group's cached requests, one pass; False at the first failure (plan_step names it)."""
    n, width = rows.shape[0], table.shape[1]
    start_of = np.full(n, -1, np.int64)  # where request i's appended ids begin in `ids` (-1: it appends none)
    added = np.zeros(n, np.int64)
    at = 0
    for k in range(app_req.shape[0]):
        start_of[app_req[k]] = at
        added[app_req[k]] = lengths[k]
        app_counts[k] = num_blocks[rows[app_req[k]]]
        at += lengths[k]
    w = 0
    for i in range(n):
        row = rows[i]
        count = num_blocks[row]
        first, last_block = num_computed[i] // block_size, last[i] // block_size
        if count + added[i] > width or last_block >= count + added[i]:
            return False  # too many blocks for the table, or a missing block
        lo = 0 if window == 0 else max(0, num_computed[i] - window + 1) // block_size  # first live entry
        for j in range(added[i]):  # appended ids: in range, new among the live entries, not repeated
            block = ids[start_of[i] + j]
            if block <= 0 or block >= id_limit:
                return False  # out of range, or a null placeholder (plan_step decides those)
            for e in range(lo, count):
                if table[row, e] == block:
                    return False
            for e in range(j):
                if ids[start_of[i] + e] == block:
                    return False
        # a released entry (null, or an id handed to the row again) at or past lo: the committed live
        # entries may read the null block or repeat an id, so look at them all (appended ids are >= 1)
        if window > 0 and (released_tails.shape[0] == 0 or released_tails[row] >= lo):
            for e in range(lo, min(last_block, count - 1) + 1):
                if table[row, e] == 0:
                    return False
            if _has_repeats(table[row, lo:count], NULL_BLOCK_ID):
                return False
        for block_index in range(first, last_block + 1):
            if block_index < count:
                written[w] = table[row, block_index]
            else:
                written[w] = ids[start_of[i] + block_index - count]
            w += 1
    return True


def _merge(new_rows: np.ndarray, new: TableWrites, cached: TableWrites) -> TableWrites:
    """The new requests' table writes (rows filled in) followed by the cached requests' appends."""
    return TableWrites(
        rows=np.concatenate([new_rows, cached.rows]),
        starts=np.concatenate([new.starts, cached.starts]),
        lengths=np.concatenate([new.lengths, cached.lengths]),
        ids=np.concatenate([new.ids, cached.ids]),
        replaced=np.concatenate([new.replaced, cached.replaced]),
    )


@njit(cache=True, nogil=True)
def _has_repeats(values: np.ndarray, may_repeat: int) -> bool:  # pragma: no cover - compiled
    """Some value other than `may_repeat` appears twice among `values` [k]."""
    ordered = np.sort(values)
    for i in range(1, ordered.shape[0]):  # noqa: SIM110 - a loop Numba compiles (no generators)
        if ordered[i] == ordered[i - 1] and ordered[i] != may_repeat:
            return True
    return False
