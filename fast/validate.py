"""Stage 2 on the host: the scheduler output read once, every check made in compiled passes over all requests.

spec.validate.plan_step is the definition: it walks requests in Python and names the exact error.
`plan_bulk_step` checks the same thirteen conditions, drafts included (spec/drafts.py), with a few NumPy
calls and Numba-compiled loops (fast/bulk_read.py reads the output, fast/bulk_checks.py checks it). It
never raises: where the output has a shape it does not model, or where a check fails, it returns the
`Fallback` (fast/fallback.py) that names why, and the pool then runs plan_step, which raises spec's error
in spec's order or accepts the step. Both give the same spec.state.StepPlan, so a step accepted here is
one plan_step accepts, with the same effect.

A model-kind feature (spec/feature.py) is planned here when it says so (`Feature.plans_in_bulk`): its part of
the plan is its `plan_in_bulk`'s (fast/feature.py), which checks the rules of any group it owns (mamba:
fast/mamba_bulk.py, cross-attention: fast/cross_bulk.py) and reads its fields of new requests where it says so
(`reads_fields_in_bulk`); a step whose new requests bring any other feature's fields goes to plan_step. Every
fast feature plans in bulk; a spec feature (a test's) that does not leaves every step to plan_step.

Under async scheduling a continuing request whose last drafts' verdict is unread may start anywhere from its
count less those drafts (rule 4): its window's reads, and with one block pool the ids it holds, are checked
from that lowest start, as spec's are; what it writes, at the count sent.

It relies on invariants of the pool state that plan_step and the commit establish:
- every committed table passed the block-id checks, so only appended ids need checking against it,
  unless a released entry (fast/released.py) lies in the step's live part;
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

import dataclasses
from collections.abc import Sequence

import numpy as np

from fast.bulk_checks import (
    NO_NEW,
    check_group,
    check_new_requests,
    check_progress,
    counts_in_budget,
    held_in_two_groups,
    lowest_starts,
    merge,
    written_twice,
)
from fast.bulk_read import (
    EMPTY,
    SEQUENCES,
    RowMemo,
    appended_ids,
    read_cached,
    read_drafts,
    rows_of_new,
    scheduler_index,
    whole_tables_given,
)
from fast.fallback import Fallback
from fast.feature import FastFeature
from fast.one_pool import HeldIds
from fast.records import new_plan
from spec.feature import Feature
from spec.model_kinds import known_features
from spec.state import PoolState, StepPlan
from spec.types import NewRequest, SchedulerOutput, WorkerConfig

MAX_WRITTEN_MAP = 1 << 26  # the largest pool whose check 13 keeps an id map (64 MiB of int8)
MAX_HELD_MAP = 1 << 22  # the largest one block pool whose check 9 keeps its marks (fast/one_pool.py, 5 bytes an id)


class PlannerMemory:
    """What the bulk planner keeps for one pool between steps: a scratch map over block ids, zero between calls
    (1 byte an id, most of it never touched; a pool past MAX_WRITTEN_MAP ids sorts instead), with one block pool
    the ids the last step's requests hold (fast/one_pool.py; past MAX_HELD_MAP ids, sorted each step), and the
    last step's continuing rows (fast/bulk_read.py RowMemo), told of every freed row by the pool's commit."""

    def __init__(self, config: WorkerConfig, features: Sequence[Feature] = ()) -> None:
        fast_features = [f for f in features if isinstance(f, FastFeature)]
        owned = frozenset().union(*(f.own_tables() for f in fast_features))
        # [G] the group's tables are checked by the tokens' positions (not a group a feature checks itself)
        self.by_position = tuple(g not in owned for g in range(len(config.kv_groups)))
        # the known features whose fields of new requests the pool's features read in bulk
        self.fields_read = frozenset(
            kind
            for kind in known_features()
            if any(isinstance(f, kind) and f.reads_fields_in_bulk for f in fast_features)
        )
        pooled = config.one_block_pool and len(config.kv_groups) > 1
        num_ids = max(group.num_blocks for group in config.kv_groups)
        self.held = HeldIds(config) if pooled and num_ids <= MAX_HELD_MAP else None
        # [max num_blocks] int8 ids a step writes (check 13)
        self.written = np.zeros(num_ids, np.int8) if num_ids <= MAX_WRITTEN_MAP else None
        self.rows = RowMemo(config.max_num_reqs)

    def accepted(self) -> None:
        """The plan the planner returned last is the step being committed."""
        if self.held is not None:
            self.held.accepted()

    def forget(self) -> None:
        """The step being committed (or refused) is not the planner's last plan."""
        if self.held is not None:
            self.held.forget()


def as_counts(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """[n] int64 of a column read_cached checked: Python ints through fromiter (no dtype discovery pass), an integer
    array as NumPy casts it."""
    if type(values) is np.ndarray:
        return np.array(values, np.int64)
    return np.fromiter(values, np.int64, len(values))


def plan_bulk_step(
    state: PoolState,
    sched: SchedulerOutput,
    features: Sequence[Feature] = (),  # the pool's model-kind features (spec.model_kinds.features_for)
    released_tails: list[np.ndarray | None] | None = None,  # per group [R]: fast/released.py's tails, or None: scan
    memory: PlannerMemory | None = None,  # the pool's: its commit tells the row memo which rows it frees
) -> StepPlan | Fallback:
    config = state.config
    memory = memory or PlannerMemory(config, features)
    if features and not all(f.plans_in_bulk for f in features):
        return Fallback.FEATURE
    scheduled, new, finished = sched.num_scheduled_tokens, sched.new_requests, sched.finished_req_ids
    if type(scheduled) is not dict or type(new) not in SEQUENCES or type(finished) not in (frozenset, set):
        return Fallback.CONTAINERS
    num_new = len(new)
    if num_new and set(map(type, new)) != {NewRequest}:
        return Fallback.CONTAINERS
    # every known feature's fields, configured or not (one on a model without the feature is check 1's to refuse),
    # but those the pool's features read themselves
    if num_new and any(kind.fields_given(new) for kind in known_features() if kind not in memory.fields_read):
        return Fallback.FEATURE_FIELDS
    cached = read_cached(sched.cached_requests)
    if cached is None:
        return Fallback.CACHED_REQUESTS
    cached_ids, computed_in, new_blocks, resumed = cached  # resumed: [n] bool, or EMPTY_MASK when none is
    n = len(cached_ids)
    # a resumed request's ids replace its tables (checked as a new request's)
    if resumed.size and not whole_tables_given(new_blocks, resumed, len(config.kv_groups)):
        return Fallback.CACHED_REQUESTS
    keys = list(scheduled)
    counts_in = list(scheduled.values())
    if not keys or set(map(type, keys)) != {str} or set(map(type, counts_in)) != {int}:
        return Fallback.REQUEST_KEYS
    if len(keys) != n + num_new:
        return Fallback.REQUEST_SET
    # [n + k] scheduler order; Python ints (checked above) need no dtype discovery: fromiter is 2/3 of array()'s time
    try:
        num_scheduled = np.fromiter(counts_in, np.int64, len(counts_in))
    except OverflowError:  # past int64: past any budget
        return Fallback.BUDGET
    if not counts_in_budget(num_scheduled, config.max_num_batched_tokens):
        return Fallback.BUDGET
    new_ids = [r.req_id for r in new] if num_new else []
    # the position of each cached and each new request among the scheduled ones
    try:
        cached_first = keys == cached_ids + new_ids
        new_first = not cached_first and keys == new_ids + cached_ids
    except (ValueError, TypeError):  # an id whose comparison is no bool (an array): check 1's to name
        return Fallback.REQUEST_SET
    if cached_first:
        cached_at, new_at = slice(0, n), slice(n, n + num_new)
    elif new_first:
        new_at, cached_at = slice(0, num_new), slice(num_new, n + num_new)
    else:
        if set(map(type, cached_ids + new_ids)) - {str}:  # (an unhashable id would not even make a set)
            return Fallback.REQUEST_SET
        if len(set(keys)) != len(keys) or set(keys) != {*cached_ids, *new_ids}:
            return Fallback.REQUEST_SET
        index = scheduler_index(keys)
        cached_at = np.fromiter(map(index.__getitem__, cached_ids), np.int64, n)  # type: ignore[assignment]
        new_at = np.fromiter(map(index.__getitem__, new_ids), np.int64, num_new)  # type: ignore[assignment]
    try:  # unknown request: KeyError
        rows = memory.rows.rows_of(state, cached_ids)  # [n] req_state_idx
        num_computed = as_counts(computed_in) if n else EMPTY  # [n]
    except (KeyError, TypeError, ValueError, OverflowError):
        return Fallback.UNKNOWN_REQUEST
    if num_computed.ndim != 1:
        return Fallback.UNKNOWN_REQUEST
    if finished or num_new:
        freed_new = rows_of_new(state, finished, new_ids, scheduled)
        if freed_new is None:
            return Fallback.ROWS
        freed_rows, new_rows = freed_new
    else:
        freed_rows = new_rows = EMPTY
    drafts = read_drafts(sched.scheduled_spec_decode_tokens, keys, config.vocab_size, config.async_scheduling)
    if drafts is None:
        return Fallback.DRAFTS
    num_drafts, draft_ids = drafts
    cached_drafts = EMPTY if num_drafts is None else num_drafts[cached_at]
    # [n] the lowest position each cached request's step may start from: under async scheduling its count less the
    # drafts whose verdict is unread (rule 4: its window's reads are checked from there)
    lowest = lowest_starts(rows, num_computed, state.num_unverified_drafts) if config.async_scheduling else num_computed
    last = np.empty(n, np.int64)  # [n] last position each cached request writes
    limits = (config.max_model_len, state.num_known_tokens)
    if not check_progress(rows, num_computed, num_scheduled[cached_at], cached_drafts, *limits, last):
        return Fallback.PROGRESS
    appends = appended_ids(new_blocks, n, len(config.kv_groups))
    if appends is None:
        return Fallback.BLOCK_IDS
    new_drafts = None if num_drafts is None else num_drafts[new_at]
    prompts = (
        check_new_requests(state, new, num_scheduled[new_at], new_drafts, memory.by_position) if num_new else NO_NEW
    )
    if prompts is None:
        return Fallback.NEW_REQUESTS
    new_computed, prompt_lens, prompt_tokens, new_writes, new_written = prompts

    tables = []
    for g in range(len(config.kv_groups)):
        tails = released_tails[g] if released_tails is not None else None
        checked = check_group(
            state, g, rows, num_computed, lowest, last, appends[g], tails, memory.by_position[g], resumed
        )
        if checked is None:
            return Fallback.TABLES
        appended, written = checked
        if written_twice(new_written[g] if num_new else EMPTY, written, memory.written):
            return Fallback.SHARED_BLOCK  # a block written by two requests: plan_step checks per slot
        tables.append(merge(new_rows, new_writes[g], appended) if num_new else appended)
    if not num_new and type(cached_at) is slice:  # the cached requests come in the scheduler's order
        sched_rows, sched_computed, sched_lowest = rows, num_computed, lowest
    else:  # scheduler order from the cached and the new requests' parts (a new request's count is exact)
        sched_rows, sched_computed = np.empty(n + num_new, np.int64), np.empty(n + num_new, np.int64)
        sched_rows[cached_at], sched_rows[new_at] = rows, new_rows
        sched_computed[cached_at], sched_computed[new_at] = num_computed, new_computed
        sched_lowest = sched_computed
        if lowest is not num_computed:
            sched_lowest = sched_computed.copy()
            sched_lowest[cached_at] = lowest
    plan = new_plan(
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
    if config.one_block_pool and len(config.kv_groups) > 1:
        held = memory.held
        clash = held.clashes if held is not None else held_in_two_groups
        if clash(state, plan, sched_lowest):
            return Fallback.ONE_POOL  # plan_step names the first such entry and its holder
    if not features:
        return plan
    parts = {}
    for f in features:  # a fast feature checks its own groups' rules here (spec's features, in tests: their plan)
        if isinstance(f, FastFeature):
            part = f.plan_in_bulk(state, sched, new_rows, plan, memory.written)
        else:
            part = f.plan(state, sched, new_rows, plan)
        if isinstance(part, Fallback):
            return part
        if part is not None:
            parts[f.name] = part
    return dataclasses.replace(plan, features=parts) if parts else plan
