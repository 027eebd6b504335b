"""The bulk planner's checks (fast/validate.py): spec's checks 7 to 13 as Numba-compiled passes over all requests.

Each returns False or None at the first failure without naming it: spec's plan_step, which the pool runs
then, raises the exact error. The invariants they rely on are listed in fast/validate.py's docstring.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fast.bulk_read import EMPTY, EMPTY_MASK, ids_in_range, joined_ids
from fast.records import record_maker
from spec.state import PoolState, StepPlan, TableWrites
from spec.types import NULL_BLOCK_ID, NewRequest


@njit(cache=True, nogil=True)
def live_from(num_computed: int, block_size: int, window: int) -> int:  # pragma: no cover - compiled
    """The first table entry a request still holds at a step from `num_computed` (window 0: none; spec's
    AttentionRules.live_from for a synchronous step)."""
    return 0 if window == 0 else max(0, num_computed - window + 1) // block_size


@njit(cache=True, nogil=True)
def lowest_starts(  # pragma: no cover - compiled
    rows: np.ndarray,  # [n] int64 req_state_idx of the cached requests
    num_computed: np.ndarray,  # [n] int64 as the scheduler sends them
    unverified: np.ndarray,  # [R] int64 drafts of each row whose verdict is unread (PoolState.num_unverified_drafts)
) -> np.ndarray:
    """[n] int64 the lowest position each cached request's step may start from once the verdicts are in (async
    rule 4, spec.async_steps.lowest_start): the count less the row's unverified drafts. A resumed count is not
    corrected, but a resumed request whose row has unverified drafts never reaches a commit from the bulk planner:
    the pool's async mode leaves it to plan_step (rule 7, fast.step_modes.Ahead.vouch)."""
    out = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        out[i] = max(0, num_computed[i] - unverified[rows[i]])
    return out


@njit(cache=True, nogil=True)
def counts_in_budget(num_scheduled: np.ndarray, budget: int) -> bool:  # pragma: no cover - compiled
    """Checks 1 and 5 of the counts [n]: each at least 1, their sum within max_num_batched_tokens (one compiled
    pass: NumPy's min and sum are two calls of a few microseconds each on a step of a few rows)."""
    total = 0
    for i in range(num_scheduled.shape[0]):
        if num_scheduled[i] < 1 or num_scheduled[i] > budget:  # one past the budget: no sum can overflow
            return False
        total += num_scheduled[i]
    return total <= budget


@njit(cache=True, nogil=True)
def check_progress(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
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


NO_NEW: tuple[np.ndarray, np.ndarray, np.ndarray, list[TableWrites], list[np.ndarray]] = (
    EMPTY,
    EMPTY,
    np.zeros(0, np.int32),
    [],
    [],
)
new_table_writes = record_maker(TableWrites)


def check_new_requests(
    state: PoolState,
    new: tuple[NewRequest, ...] | list[NewRequest],  # [k]
    num_scheduled: np.ndarray,  # [k] >= 1
    num_drafts: np.ndarray | None,  # [k] drafts of each, or None: nobody drafts
    by_position: tuple[bool, ...],  # [G] the group's tables are checked by the tokens' positions (PlannerMemory)
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[TableWrites], list[np.ndarray]] | None:
    """Checks 6-12 for the new requests (and 1 and 8 for their drafts). Returns their num_computed_tokens [k],
    prompt lengths [k], prompt tokens [sum] int32, per group their tables (as TableWrites, rows left to the
    caller) and the physical blocks their tokens write (none in a group not checked by position)."""
    config = state.config
    k, num_groups = len(new), len(config.kv_groups)
    computed_in = [r.num_computed_tokens for r in new]
    tables = [r.block_ids for r in new]
    if set(map(type, computed_in)) != {int} or set(map(type, tables)) - {tuple, list}:
        return None
    if list(map(len, tables)).count(num_groups) != k:
        return None
    joined = joined_ids([r.prompt_token_ids for r in new], "i", long=True)  # int32: past it is past any vocabulary
    if joined is None:
        return None
    prompt_lens, tokens = joined
    try:
        num_computed = np.array(computed_in, np.int64)
    except OverflowError:  # past int64: past max_model_len
        return None
    last = np.empty(k, np.int64)  # [k] last position written
    drafts = EMPTY if num_drafts is None else num_drafts
    if not _new_progress(prompt_lens, tokens, config.vocab_size, num_computed, num_scheduled, drafts,
                         config.max_model_len, last):  # fmt: skip
        return None
    writes, written = [], []
    for g, group in enumerate(config.kv_groups):
        joined = joined_ids([table[g] for table in tables], "q")
        if joined is None:
            return None
        lengths, ids = joined
        ok, out = _check_new_tables(
            lengths, ids, num_computed, last, group.num_blocks, config.max_blocks_per_req(g), group.block_size,
            group.sliding_window or 0, by_position[g],
        )  # fmt: skip
        if not ok:
            return None
        written.append(out)
        replaced = np.ones(k, bool)  # whole tables, written from entry 0
        writes.append(new_table_writes(rows=EMPTY, starts=np.zeros(k, np.int64), lengths=lengths, ids=ids,
                                       replaced=replaced))  # fmt: skip
    return num_computed, prompt_lens, tokens, writes, written


@njit(cache=True, nogil=True)
def _new_progress(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    prompt_lens: np.ndarray,  # [k] int64
    tokens: np.ndarray,  # [sum(prompt_lens)] int32 the prompts end to end
    vocab_size: int,
    num_computed: np.ndarray,  # [k] int64 as the scheduler says
    num_scheduled: np.ndarray,  # [k] int64 >= 1
    num_drafts: np.ndarray,  # [k] int64 drafts of each, or empty: nobody drafts
    max_model_len: int,
    last: np.ndarray,  # [k] int64 out: last position each writes
) -> bool:
    """Checks 6, 1, 7 and 8 of the new requests: prompt tokens in the vocabulary, prompts within max_model_len,
    num_computed >= 0, every position written a prompt token or one of the request's drafts, which follow its
    prompt (a drafting request's step ends at its last draft, within max_model_len, and holds at least its drafts
    and one token before them)."""
    if not ids_in_range(tokens, vocab_size):
        return False
    for i in range(prompt_lens.shape[0]):
        last[i] = num_computed[i] + num_scheduled[i] - 1
        k = num_drafts[i] if num_drafts.shape[0] else 0
        known_end = prompt_lens[i] + k  # past the last input token it may read
        if prompt_lens[i] > max_model_len or num_computed[i] < 0 or last[i] >= known_end:
            return False
        if k and (last[i] != known_end - 1 or last[i] >= max_model_len or num_scheduled[i] < 1 + k):
            return False
    return True


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
    by_position: bool,  # False: a feature's group checked by its own rules (ids and width only here, nothing written)
) -> tuple[bool, np.ndarray]:
    """Checks 9-12 for one group's new tables, one pass: (False at the first failure (plan_step names it), else True
    and [w] int64 the physical block of every (request, block) the step's tokens write)."""
    written = np.empty(_blocks_written(num_computed, last, block_size) if by_position else 0, np.int64)
    start, w = 0, 0
    for i in range(lengths.shape[0]):
        table = ids[start : start + lengths[i]]
        start += lengths[i]
        first, last_block = num_computed[i] // block_size, last[i] // block_size
        if not _table_holds(table, last_block, num_computed[i], num_blocks, max_blocks, block_size, window,
                            by_position):  # fmt: skip
            return False, written
        if not by_position:
            continue
        for e in range(first, last_block + 1):
            written[w] = table[e]
            w += 1
    return True, written


@njit(cache=True, nogil=True)
def _table_holds(  # pragma: no cover - compiled
    table: np.ndarray,  # [k] int64 a whole table the step gives a request (new, or resumed)
    last_block: int,  # the last: its last position // block_size
    lowest: int,  # the lowest position its step may start from (its window's reads are checked from there)
    id_limit: int,  # ids must be < this (num_blocks, and int32 for the tables)
    max_blocks: int,  # the group's width
    block_size: int,
    window: int,  # sliding window, 0 for none
    by_position: bool,  # False: a feature's group checked by its own rules (ids and width only here)
) -> bool:
    """Checks 9-12 of one whole table: width, every block its tokens need present, ids in range, the null block only
    in a window's released entries (never where a token reads or writes), no id twice among the live entries."""
    if table.shape[0] > max_blocks or (by_position and last_block >= table.shape[0]):
        return False  # too many blocks, or a missing one
    for block in table:
        if block < 0 or block >= id_limit or (block == 0 and window == 0):
            return False  # out of range, or the null block outside a sliding-window group
    read_from = live_from(lowest, block_size, window)
    if has_repeats(table[read_from:], NULL_BLOCK_ID):
        return False  # a block twice among the entries not released by the window
    if by_position:
        for e in range(read_from, last_block + 1):
            if table[e] == 0:
                return False  # a token would read or write through the null block
    return True


def check_group(
    state: PoolState,
    g: int,
    rows: np.ndarray,  # [n] req_state_idx of the cached requests
    num_computed: np.ndarray,  # [n]
    lowest: np.ndarray,  # [n] the lowest position each may start from (lowest_starts; num_computed when synchronous)
    last: np.ndarray,  # [n] last position each writes
    appended: tuple[np.ndarray, np.ndarray, np.ndarray],  # request index [a], lengths [a], ids
    released_tails: np.ndarray | None,  # [R] last released entry of every row, or None
    by_position: bool = True,  # False: a feature's group checked by its own rules (ids and width only here)
    resumed: np.ndarray = EMPTY_MASK,  # [n] bool back from preemption (their ids replace their tables); empty: none
) -> tuple[TableWrites, np.ndarray] | None:
    """Checks 9-12 for group g's cached requests: their appends, and the physical blocks their tokens write. The
    window's reads (9, 12) are checked from `lowest`, the writes (13) at `num_computed` (async rule 4)."""
    group = state.config.kv_groups[g]
    app_req, lengths, ids = appended
    app_counts = np.empty(app_req.size, np.int64)  # [a] filled entries of each appending row before the step
    written = np.empty(_blocks_written(num_computed, last, group.block_size) if by_position else 0, np.int64)
    ok = _check_cached_group(
        state.block_tables[g], state.num_blocks[g], rows, num_computed, lowest, last, app_req, lengths, ids,
        min(group.num_blocks, 2**31), group.block_size, group.sliding_window or 0,
        _NO_TAILS if released_tails is None else released_tails, by_position, resumed, app_counts, written,
    )  # fmt: skip
    if not ok:
        return None
    replaced = resumed[app_req] if resumed.size else np.zeros(app_req.size, bool)
    return new_table_writes(rows=rows[app_req], starts=app_counts, lengths=lengths, ids=ids, replaced=replaced), written


_NO_TAILS = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _check_cached_group(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [n] int64 req_state_idx
    num_computed: np.ndarray,  # [n] int64
    lowest: np.ndarray,  # [n] int64 the lowest position each may start from: its window's reads are checked from there
    last: np.ndarray,  # [n] int64 last position each request writes
    app_req: np.ndarray,  # [a] int64 request index of each appending request
    lengths: np.ndarray,  # [a] int64 ids each appends (>= 1)
    ids: np.ndarray,  # [sum(lengths)] int64 appended ids, request after request
    id_limit: int,  # appended ids must be < this (num_blocks, and int32 for the tables)
    block_size: int,
    window: int,  # sliding window, 0 for none
    released_tails: np.ndarray,  # [R] last released entry per row (fast/released.py), or empty: scan
    by_position: bool,  # False: a feature's group checked by its own rules (ids and width only here, nothing written)
    resumed: np.ndarray,  # [n] bool the request is back from preemption: its ids replace its table; empty: none is
    app_counts: np.ndarray,  # [a] int64 out: each appending row's filled entries kept (0 for a resumed request)
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
        app_counts[k] = 0 if resumed.shape[0] and resumed[app_req[k]] else num_blocks[rows[app_req[k]]]
        at += lengths[k]
    w = 0
    for i in range(n):
        row = rows[i]
        first, last_block = num_computed[i] // block_size, last[i] // block_size
        if resumed.shape[0] and resumed[i]:  # a whole new table, as a new request's
            own = ids[start_of[i] : start_of[i] + added[i]]
            if not _table_holds(own, last_block, lowest[i], id_limit, width, block_size, window, by_position):
                return False
            if by_position:
                for block_index in range(first, last_block + 1):
                    written[w] = own[block_index]
                    w += 1
            continue
        count = num_blocks[row]
        if count + added[i] > width or (by_position and last_block >= count + added[i]):
            return False  # too many blocks for the table, or a missing block
        lo = live_from(lowest[i], block_size, window)
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
            if has_repeats(table[row, lo:count], NULL_BLOCK_ID):
                return False
        if not by_position:
            continue
        for block_index in range(first, last_block + 1):
            if block_index < count:
                written[w] = table[row, block_index]
            else:
                written[w] = ids[start_of[i] + block_index - count]
            w += 1
    return True


@njit(cache=True, nogil=True)
def _blocks_written(num_computed: np.ndarray, last: np.ndarray, block_size: int) -> int:  # pragma: no cover
    """(request, block) pairs a step's tokens write: each request writes blocks first .. last // block_size."""
    total = 0
    for i in range(last.shape[0]):
        total += last[i] // block_size - num_computed[i] // block_size + 1
    return total


def merge(new_rows: np.ndarray, new: TableWrites, cached: TableWrites) -> TableWrites:
    """The new requests' table writes (rows filled in) followed by the cached requests' (appends, resumed tables)."""
    if not cached.rows.size:  # nobody appends (every prefill-only step): the new requests' writes as they are
        return new_table_writes(rows=new_rows, starts=new.starts, lengths=new.lengths, ids=new.ids,
                                replaced=new.replaced)  # fmt: skip
    rows, starts, lengths, ids, replaced = _joined_writes(new_rows, new.lengths, new.ids, cached.rows, cached.starts,
                                                          cached.lengths, cached.ids, cached.replaced)  # fmt: skip
    return new_table_writes(rows=rows, starts=starts, lengths=lengths, ids=ids, replaced=replaced)


@njit(cache=True, nogil=True)
def _joined_writes(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    new_rows: np.ndarray,  # [k] int64 req_state_idx of the new requests: their whole tables, from entry 0
    new_lengths: np.ndarray,  # [k] int64
    new_ids: np.ndarray,  # [sum(new_lengths)] int64
    rows: np.ndarray,  # [a] int64 req_state_idx of the cached requests that write (append, or resumed: replace)
    starts: np.ndarray,  # [a] int64 their filled entries kept (0 for a resumed request)
    lengths: np.ndarray,  # [a] int64
    ids: np.ndarray,  # [sum(lengths)] int64
    cached_replaced: np.ndarray,  # [a] bool the request is resumed: its ids replace its table
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """TableWrites' five arrays for the new tables then the cached requests' writes: one call where five
    concatenations were five."""
    k, a = new_rows.shape[0], rows.shape[0]
    out_rows, out_starts, out_lengths = np.empty(k + a, np.int64), np.zeros(k + a, np.int64), np.empty(k + a, np.int64)
    out_ids, replaced = np.empty(new_ids.shape[0] + ids.shape[0], np.int64), np.zeros(k + a, np.bool_)
    out_rows[:k], out_rows[k:] = new_rows, rows
    out_starts[k:] = starts
    out_lengths[:k], out_lengths[k:] = new_lengths, lengths
    out_ids[: new_ids.shape[0]], out_ids[new_ids.shape[0] :] = new_ids, ids
    replaced[:k], replaced[k:] = True, cached_replaced
    return out_rows, out_starts, out_lengths, out_ids, replaced


@njit(cache=True, nogil=True)
def has_repeats(values: np.ndarray, may_repeat: int) -> bool:  # pragma: no cover - compiled
    """Some value other than `may_repeat` appears twice among `values` [k]."""
    ordered = np.sort(values)
    for i in range(1, ordered.shape[0]):  # noqa: SIM110 - a loop Numba compiles (no generators)
        if ordered[i] == ordered[i - 1] and ordered[i] != may_repeat:
            return True
    return False


def written_twice(
    first: np.ndarray,  # [a] int64 physical blocks the step writes (the new requests'), each in [1, num_blocks)
    second: np.ndarray,  # [b] int64 the others (the continuing requests')
    marks: np.ndarray | None,  # [>= num_blocks] int8 zeros, returned zeroed; None: sort instead (a huge pool)
) -> bool:
    """Some block appears twice among `first` and `second` together (written by two requests: check 13 per slot).
    With a scratch map it costs the blocks written, without a sort or a join of the two lists."""
    if marks is None:
        return has_repeats(np.concatenate([first, second]), -1)
    return _marked_twice(first, second, marks)


@njit(cache=True, nogil=True)
def _marked_twice(first: np.ndarray, second: np.ndarray, marks: np.ndarray) -> bool:  # pragma: no cover - compiled
    clash, marked_first, marked_second = False, first.shape[0], second.shape[0]
    for i in range(first.shape[0]):
        if marks[first[i]]:
            clash, marked_first, marked_second = True, i, 0
            break
        marks[first[i]] = 1
    if not clash:
        for i in range(second.shape[0]):
            if marks[second[i]]:
                clash, marked_second = True, i
                break
            marks[second[i]] = 1
    for i in range(marked_first):
        marks[first[i]] = 0
    for i in range(marked_second):
        marks[second[i]] = 0
    return clash


@njit(cache=True, nogil=True)
def write_index(  # pragma: no cover - compiled
    num_rows: int,  # R
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each of a group's table writes (TableWrites.rows)
    write_lengths: np.ndarray,  # [k] int64 ids each writes
) -> tuple[np.ndarray, np.ndarray]:
    """A group's table writes by row: (write_of [R] req_state_idx -> its write or -1, offset [k + 1] where each
    write's ids start among the writes' ids)."""
    write_of = np.full(num_rows, -1, np.int64)
    offset = np.zeros(write_rows.shape[0] + 1, np.int64)
    for k in range(write_rows.shape[0]):
        write_of[write_rows[k]] = k
        offset[k + 1] = offset[k] + write_lengths[k]
    return write_of, offset


@njit(cache=True, nogil=True)
def entries_after(  # pragma: no cover - compiled
    filled: int,  # the row's filled entries before the step
    k: int,  # its write (write_index), or -1
    write_starts: np.ndarray,  # [k] int64 first entry each write writes
    write_lengths: np.ndarray,  # [k] int64 ids each writes
    replaced: np.ndarray,  # [k] bool the write replaces the whole table
) -> tuple[int, int]:
    """(kept, total) of a row's table after the step: the entries kept from the committed table (all of them
    without a write, none where replaced, those before an append), then all its entries."""
    if k < 0:
        return filled, filled
    kept = 0 if replaced[k] else write_starts[k]
    return kept, kept + write_lengths[k]


@njit(cache=True, nogil=True)
def entry_after(  # pragma: no cover - compiled
    table: np.ndarray, row: int, e: int, kept: int, write_ids: np.ndarray, start: int
) -> int:
    """Entry e of the row's table after the step: the committed table's below `kept`, else the ids of the row's
    write, which begin at `start` among the writes' ids."""
    return table[row, e] if e < kept else write_ids[start + e - kept]


def held_in_two_groups(state: PoolState, plan: StepPlan, lowest: np.ndarray) -> bool:
    """With one block pool, for a pool too large for fast/one_pool.py's marks: some id held by a scheduled request in
    one group is held in another group too, by sorting the (id, group) pairs of every held entry. `lowest` [n]
    (scheduler order) is the lowest position each request's step may start from (async rule 4)."""
    num_groups = len(state.config.kv_groups)
    touched = np.empty(sum(plan.rows.shape[0] * t.shape[1] for t in state.block_tables), np.int64)
    count = 0
    for g, group in enumerate(state.config.kv_groups):
        w = plan.tables[g]
        count = _held_pairs(
            state.block_tables[g], state.num_blocks[g], plan.rows, lowest, w.rows, w.starts, w.lengths,
            w.ids, w.replaced, group.block_size, group.sliding_window or 0, g, num_groups, touched, count,
        )  # fmt: skip
    ids, groups = np.divmod(touched[:count], num_groups)
    order = np.lexsort((groups, ids))  # by id, then group: an id held in two groups has two groups side by side
    ids, groups = ids[order], groups[order]
    return bool(((ids[1:] == ids[:-1]) & (groups[1:] != groups[:-1])).any())


@njit(cache=True, nogil=True)
def _held_pairs(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    table: np.ndarray,  # [R, width] int32, the group's committed table
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    lowest: np.ndarray,  # [n] int64 scheduler order: the lowest position each step may start from
    write_rows: np.ndarray,  # [k] int64 req_state_idx of each table write
    write_starts: np.ndarray,  # [k] int64 first entry written
    write_lengths: np.ndarray,  # [k] int64 ids written
    write_ids: np.ndarray,  # [sum(write_lengths)] int64
    replaced: np.ndarray,  # [k] bool: the write replaces the whole table
    block_size: int,
    window: int,  # sliding window, 0 for none
    group: int,
    num_groups: int,
    touched: np.ndarray,  # [n * sum of widths] int64 out: id * num_groups + group of each held entry
    count: int,  # entries of `touched` already used
) -> int:
    """Group `group`'s held ids after the step (non-null, from each request's first live entry on), recorded as
    (id, group) pairs from `count` on; the new count."""
    write_of, offset = write_index(table.shape[0], write_rows, write_lengths)
    for i in range(rows.shape[0]):
        row, k = rows[i], write_of[rows[i]]
        kept, total = entries_after(num_blocks[row], k, write_starts, write_lengths, replaced)
        lo = live_from(lowest[i], block_size, window)
        for e in range(lo, total):
            block = entry_after(table, row, e, kept, write_ids, offset[max(k, 0)])
            if block != NULL_BLOCK_ID:
                touched[count] = block * num_groups + group
                count += 1
    return count
