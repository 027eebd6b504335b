"""The bulk planner's reading of a scheduler output (fast/validate.py): each Python object read once.

The cached requests' fields in one pass (or not at all when they come as spec.types.CachedRequestColumns),
each prompt converted once (array('i'), which also refuses floats and values past int32 as spec's
`operator.index` reading does), the drafts in one pass. A reader returns None for anything it does not
read in bulk or that fails the check it makes on the way (the caller names the fallback); spec's plan_step
then decides the step.
"""

from __future__ import annotations

from array import array
from itertools import chain, compress
from typing import Any, cast

import numpy as np
from numba import njit

from spec.state import PoolState
from spec.types import PLACEHOLDER_TOKEN_ID, CachedRequest, CachedRequestColumns

SEQUENCES = (tuple, list)
EMPTY = np.zeros(0, np.int64)
EMPTY_MASK = np.zeros(0, np.bool_)  # [0] bool: no request flagged
NO_TOKENS = np.zeros(0, np.int32)


def scheduler_index(keys: list[str]) -> dict[str, int]:
    """req_id -> its index in the scheduler order."""
    return {r: i for i, r in enumerate(keys)}


def read_drafts(
    drafts: Any,  # sched.scheduled_spec_decode_tokens
    keys: list[str],  # [n] scheduler order, distinct str
    vocab_size: int,
    placeholders: bool = False,  # async scheduling: a request's drafts may all be PLACEHOLDER_TOKEN_ID (rule 8)
) -> tuple[np.ndarray | None, np.ndarray] | None:
    """Checks 1 and 6 of the drafts: (num_drafts [n] scheduler order or None when nobody drafts, draft ids int32)."""
    if type(drafts) is not dict:
        return None
    if not drafts:
        return None, NO_TOKENS
    draft_keys = list(drafts)
    joined = joined_ids(list(drafts.values()), "i")
    if joined is None:
        return None
    lengths, ids = joined
    if not ids.size:  # every request lists no drafts: a step without drafts
        return (None, NO_TOKENS) if set(draft_keys) <= set(keys) else None
    if draft_keys == keys[: len(draft_keys)]:  # the first requests draft, in the scheduler's order (vLLM's running
        at = np.arange(len(draft_keys), dtype=np.int64)  # requests come before the new ones; often all of them)
    else:
        index = scheduler_index(keys)
        try:
            at = np.fromiter(map(index.__getitem__, draft_keys), np.int64, len(draft_keys))  # unscheduled: KeyError
        except (KeyError, TypeError):
            return None
    num_drafts = np.zeros(len(keys), np.int64)  # [n] scheduler order
    ordered = np.empty_like(ids)  # [sum] the ids in the scheduler's order
    if not _drafts_in_order(at, lengths, ids, vocab_size, placeholders, num_drafts, ordered):
        return None
    return num_drafts, ordered


@njit(cache=True, nogil=True)
def ids_in_range(ids: np.ndarray, limit: int) -> bool:  # pragma: no cover - compiled
    """Check 6 of token ids [k]: each in [0, limit), in one vectorisable pass (NumPy's min and max are two calls)."""
    low, high = 0, 0
    for i in range(ids.shape[0]):
        low, high = min(low, ids[i]), max(high, ids[i])
    return low >= 0 and high < limit


@njit(cache=True, nogil=True)
def _drafts_in_order(  # pragma: no cover - compiled; tested through plan_bulk_step against plan_step
    at: np.ndarray,  # [m] int64 each listed request's index in the scheduler order (distinct: dict keys)
    lengths: np.ndarray,  # [m] int64 its drafts
    ids: np.ndarray,  # [sum(lengths)] int32 the drafts as listed
    vocab_size: int,
    placeholders: bool,  # a request's drafts may all be PLACEHOLDER_TOKEN_ID (async rule 8)
    num_drafts: np.ndarray,  # [n] int64 out (zeros in): drafts of each scheduled request
    ordered: np.ndarray,  # [sum(lengths)] int32 out: the drafts in the scheduler's order
) -> bool:
    """Check 6 of the draft ids (in the vocabulary, or all placeholders where allowed), and the drafts moved into
    the scheduler's order."""
    in_range = ids_in_range(ids, vocab_size)
    if not (in_range or placeholders):
        return False
    first = np.empty(at.shape[0], np.int64)  # [m] where each listed request's drafts begin in `ids`
    start = 0
    for i in range(at.shape[0]):
        num_drafts[at[i]] = lengths[i]
        first[i] = start
        if not in_range:  # each request's drafts: all ids of the vocabulary, or all placeholders
            own = ids[start : start + lengths[i]]
            if not ids_in_range(own, vocab_size) and not (own == PLACEHOLDER_TOKEN_ID).all():
                return False
        start += lengths[i]
    source = np.full(num_drafts.shape[0], -1, np.int64)  # [n] scheduler index -> listed index, -1: not listed
    for i in range(at.shape[0]):
        source[at[i]] = i
    out = 0
    for s in range(num_drafts.shape[0]):
        i = source[s]
        if i >= 0:
            for j in range(lengths[i]):
                ordered[out + j] = ids[first[i] + j]
            out += lengths[i]
    return True


def read_cached(cached: Any) -> tuple[list[str], Any, list[Any] | None, np.ndarray] | None:
    """(req_ids, num_computed_tokens, new_block_ids or None, resumed [n] bool or EMPTY_MASK when none) of the cached
    requests, or None for a form spec names or reads one by one."""
    if type(cached) is CachedRequestColumns:
        resumed_ids = cached.resumed_req_ids  # a set (an empty tuple is refused: spec's to name)
        if type(resumed_ids) not in (frozenset, set) or type(cached.req_ids) not in SEQUENCES:
            return None
        req_ids, computed, blocks = list(cached.req_ids), cached.num_computed_tokens, cached.new_block_ids
        if blocks is not None and type(blocks) not in SEQUENCES:  # an unsized column: spec names it
            return None
        if type(computed) in SEQUENCES:
            if set(map(type, computed)) - {int}:
                return None
        elif type(computed) is not np.ndarray or computed.dtype.kind not in "iu":
            return None
        if len(computed) != len(req_ids) or (blocks is not None and len(blocks) != len(req_ids)):
            return None
        resumed = EMPTY_MASK
        if resumed_ids:
            try:
                resumed = np.fromiter(map(resumed_ids.__contains__, req_ids), np.bool_, len(req_ids))
            except TypeError:  # an unhashable id: spec names it
                return None
            if int(resumed.sum()) != len(resumed_ids):  # a resumed id not among the cached ones: spec names it
                return None
        return req_ids, computed, None if blocks is None else list(blocks), resumed
    if type(cached) not in SEQUENCES:
        return None
    if not cached:
        return [], EMPTY, None, EMPTY_MASK
    if set(map(type, cached)) != {CachedRequest}:
        return None
    fields = [(c.req_id, c.num_computed_tokens, c.new_block_ids, c.resumed) for c in cached]
    ids, computed, blocks, flags = zip(*fields, strict=True)
    if set(map(id, flags)) - {id(False), id(True)} or set(map(type, computed)) != {int}:  # the bools, not 0 or 1
        return None
    return list(ids), computed, list(blocks), np.array(flags, np.bool_) if True in flags else EMPTY_MASK


def whole_tables_given(new_blocks: list[Any] | None, resumed: np.ndarray, num_groups: int) -> bool:
    """Every resumed request ([n] `resumed`) gives a table for each group, none empty: its ids replace its tables,
    where any other request's appended ids extend them (an empty one is spec's to judge)."""
    if new_blocks is None:
        return False
    try:
        return all(
            type(tables) in SEQUENCES and len(tables) == num_groups and all(len(t) for t in tables)
            for tables in compress(new_blocks, resumed)
        )
    except TypeError:  # an unsized table: spec names it
        return False


class RowMemo:
    """The continuing requests' rows of the last step the bulk planner read, kept while they hold them.

    A steady step continues the same requests as the last one, in the same order (a decode batch; the decodes of a
    mixed one, beside prompts that come and go): comparing the two id lists costs a fraction of a dict lookup per
    request. A request's row changes only when it leaves (a finished row, freed by a commit) and comes back, and a
    new request takes only a free row: so the pool's commit hands the memo the rows it frees, and the memo is
    forgotten when one of them is a remembered row. A remembered row is then always the row the pool holds.
    """

    def __init__(self, num_rows: int) -> None:
        self.req_ids: list[str] | None = None  # [n] the ids last read; None: nothing remembered
        self.rows: np.ndarray = EMPTY  # [n] int64 their req_state_idx, read-only (plans share it)
        self._held = np.zeros(num_rows, np.bool_)  # [R] req_state_idx -> among `rows`

    def rows_of(self, state: PoolState, req_ids: list[str]) -> np.ndarray:
        """[n] int64 the rows of `req_ids`; KeyError for a request that holds none."""
        if req_ids == self.req_ids:
            return self.rows
        rows = np.fromiter(map(state.row_of.__getitem__, req_ids), np.int64, len(req_ids))
        rows.flags.writeable = False
        self._held[self.rows] = False
        self._held[rows] = True
        self.req_ids, self.rows = req_ids, rows
        return rows

    def freed(self, rows: np.ndarray) -> None:
        """A commit freed `rows` [f] req_state_idx: a remembered request among them may come back elsewhere."""
        if self.req_ids is not None and _any_at(self._held, rows):
            self._held[self.rows] = False
            self.req_ids, self.rows = None, EMPTY


@njit(cache=True, nogil=True)
def _any_at(flags: np.ndarray, at: np.ndarray) -> bool:  # pragma: no cover - compiled
    """flags[at].any() for a few indices [f], without the gathered copy."""
    for i in range(at.shape[0]):  # noqa: SIM110 - a loop Numba compiles (no generators)
        if flags[at[i]]:
            return True
    return False


def rows_of_new(
    state: PoolState,
    finished: frozenset[str] | set[str],
    new_ids: list[str],
    scheduled: dict[str, int],  # sched.num_scheduled_tokens
) -> tuple[np.ndarray, np.ndarray] | None:
    """Checks 1-4 for finished and new requests: (freed rows ascending, the row of each new request)."""
    row_of = state.row_of
    freed: list[int] = []
    if finished:  # each a known request (a str: other keys are plan_step's to name) that is not scheduled again
        if set(map(type, finished)) != {str} or any(map(scheduled.__contains__, finished)):
            return None
        found = list(map(row_of.get, finished))
        if None in found:
            return None
        freed = sorted(cast(list[int], found))  # no None left
    if not row_of.keys().isdisjoint(new_ids):
        return None
    # the lowest rows free once the finished requests leave, in the order the new requests come: the k lowest of the
    # finished rows and the k lowest empty ones (list.index finds each at C speed, where a Python scan of the rows
    # before them cost a mixed step of 256 running requests more than the rest of this function)
    k, req_ids, start = len(new_ids), state.req_ids, 0
    empty: list[int] = []
    while len(empty) < k:
        try:
            start = req_ids.index(None, start) + 1
        except ValueError:
            break
        empty.append(start - 1)
    new_rows = sorted(freed + empty)[:k] if freed else empty
    if len(new_rows) != k:
        return None
    return np.array(freed, np.int64), np.array(new_rows, np.int64)


def _ids(values: Any, typecode: str) -> np.ndarray | None:
    """spec.validate.as_ids without a per-element Python loop: array() takes exactly what operator.index takes.

    typecode "i" gives int32 (token ids: past int32 is past any vocabulary), "q" int64 (block ids). An
    array whose values do not fit is left to plan_step, which names the bad value.
    """
    dtype = np.int32 if typecode == "i" else np.int64
    if type(values) in SEQUENCES:
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


def appended_ids(
    new_blocks: list[Any] | None,  # [n] per request: per group ids, or None
    n: int,
    num_groups: int,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """Per group: (request index [a], lengths [a] >= 1, ids [sum]) of the cached requests appending to it."""
    if new_blocks is None:
        return [(EMPTY, EMPTY, EMPTY)] * num_groups
    # the requests whose entry is truthy (compress: a C loop where a comprehension over n cost more than the rest);
    # a falsy entry other than None (an empty tuple) is no group's ids, and an entry whose truth or equality with
    # None raises (an array) is not a tuple: both are left to plan_step, which names them
    try:
        num_none = new_blocks.count(None)
        if num_none == n:
            return [(EMPTY, EMPTY, EMPTY)] * num_groups
        appending = list(compress(range(n), new_blocks))
    except (ValueError, TypeError):
        return None
    if len(appending) + num_none != n:
        return None
    per_request = [new_blocks[i] for i in appending]
    if set(map(type, per_request)) - {tuple, list} or list(map(len, per_request)).count(num_groups) != len(appending):
        return None
    index = np.array(appending, np.int64)
    out = []
    for entries in zip(*per_request, strict=True):  # one tuple of per-request ids per group
        joined = joined_ids(entries, "q")
        if joined is None:
            return None
        lengths, ids = joined
        if all(entries):  # every appending request appends to this group (tuples or lists, checked by joined_ids)
            out.append((index, lengths, ids))
            continue
        has = lengths > 0
        out.append((index[has], lengths[has], ids))
    return out


def joined_ids(
    entries: tuple[Any, ...] | list[Any], typecode: str, long: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Several requests' ids end to end: (lengths [k], ids [sum]).

    Lists and tuples go into one array through `fromlist`, which sizes itself from a list where array() and
    extend() over an iterator grow element by element: short sequences (appended block ids, drafts) chained into
    one list first, `long` ones (prompts) one call each (a tuple copied into a list), with no concatenation after.
    Anything else (arrays) one `_ids` each.
    """
    if not set(map(type, entries)) - {tuple, list}:
        lengths = np.fromiter(map(len, entries), np.int64, len(entries))
        joined = array(typecode)
        try:
            if long:
                for e in entries:
                    joined.fromlist(e if type(e) is list else list(e))
            else:
                joined.fromlist(list(chain.from_iterable(entries)))
        except (TypeError, OverflowError):
            return None
        return lengths, np.frombuffer(joined, np.int32 if typecode == "i" else np.int64)
    converted = [_ids(e, typecode) for e in entries]
    if any(c is None for c in converted):
        return None
    lengths = np.fromiter(map(len, converted), np.int64, len(converted))  # type: ignore[arg-type]
    return lengths, np.concatenate(converted)  # type: ignore[arg-type]
