"""Stage 2, validation: turn a SchedulerOutput into a StepPlan, or reject it before anything changes.

Checks run in the order below, each over the whole output; the first failing one raises. Every
backend must use the same order, so that an output with several faults raises the same class.

 1. InconsistentSchedulerOutputError  malformed (a field of the wrong type) or self-contradictory output,
                                      drafts of a request not scheduled or scheduled for fewer than 1 + k tokens,
                                      an M-RoPE table or delta that is malformed or on a model without M-RoPE,
                                      an encoder_len that is not an integer >= 0
 2. UnknownRequestError               finished or cached request without a row
 3. DuplicateRequestError             new request whose req_id holds a row
 4. PoolFullError                     more live requests than rows
 5. TokenBudgetError                  more scheduled tokens than the budget
 6. TokenIdError                      prompt token, then draft token, outside the vocabulary (async: drafts all
                                      PLACEHOLDER_TOKEN_ID are the drafter's, spec/async_steps.py rule 8)
 7. ModelLengthError                  prompt or num_computed + num_scheduled > max_model_len; encoder_len
                                      outside [1, max_encoder_len] with a cross group, or > 0 without one
 8. UnknownTokenError                 num_computed + num_scheduled > known tokens (+ k drafts), or a request
                                      with k drafts whose step does not end exactly at known + k; async:
                                      drafts sent after unverified ones, placeholders past the row's proposals,
                                      a resumption past its unread verdict (spec/async_steps.py)
 9. BlockIdError                      id out of range, repeated among the entries not released by a
                                      window, null without a window (a mamba table may hold nulls); with
                                      one block pool, an id held in two groups
10. BlockTableOverflowError           more blocks than max_blocks_per_req; more drafts than a mamba group's
                                      speculative blocks
11. MissingBlockError                 a scheduled token past the last block; a cross table shorter than
                                      its encoder's L tokens, or new cross blocks on a step not starting at 0;
                                      a mamba state the step reads never kept, or a mamba table short of it
                                      or of the last draft's state (spec/mamba.py)
12. NullBlockError                    a token writes to or attends through the null block; the null block
                                      as a mamba state read or written
13. DuplicateSlotError                two tokens of the step write one slot; two requests one state block

What each field accepts (the input policy, docs/semantics.md): req ids are `str`; counts are integers of
any integer type but not bools; ids (prompt tokens, block ids) are tuples or lists of integers (`operator.index`)
or 1-D integer arrays; `new_requests` and `cached_requests` are tuples or lists (or a CachedRequestColumns),
`num_scheduled_tokens` a mapping, `finished_req_ids` a set, frozenset, tuple or list of distinct ids,
`scheduled_spec_decode_tokens` a mapping from scheduled req ids to ids (spec/drafts.py: where drafts go).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence

import numpy as np

from spec.async_steps import (
    check_no_drafts_after_unverified,
    check_proposed_drafts,
    check_resumed_within_known,
    proposed_on_device,
)
from spec.errors import (
    BlockIdError,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    ModelLengthError,
    PoolFullError,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
)
from spec.feature import Feature, group_rules
from spec.group_rules import GroupRules
from spec.model_kinds import known_features
from spec.request import ScheduledRequest
from spec.state import PoolState, StepPlan, TableWrites
from spec.types import (
    TOKEN_STORAGE_DTYPE,
    CachedRequest,
    CachedRequestColumns,
    NewRequest,
    SchedulerOutput,
    is_integral,
)

_SEQUENCES = (tuple, list)
_ID_SETS = (frozenset, set, tuple, list)


def plan_step(state: PoolState, sched: SchedulerOutput, features: Sequence[Feature]) -> StepPlan:
    """The validated step, or the first check's error. `features`: the pool's (spec/feature.py), none for a plain
    decoder."""
    config = state.config
    num_groups = len(config.kv_groups)
    if isinstance(sched.cached_requests, CachedRequestColumns):
        _check_containers(sched)  # the columns agree in length, so they read as one request each
        sched = dataclasses.replace(sched, cached_requests=tuple(sched.cached_requests))  # read them once
    _check_consistency(sched, num_groups)
    for kind in known_features():  # check 1 for the fields a model kind adds to a request (spec/feature.py)
        kind.check_request_fields(sched.new_requests, config)

    for req_id in sorted(sched.finished_req_ids):
        if req_id not in state.row_of:
            raise UnknownRequestError(req_id, "finished_req_ids", "request holds no row")
    for cached in sched.cached_requests:
        if cached.req_id not in state.row_of:
            raise UnknownRequestError(cached.req_id, "cached_requests", "request holds no row")
    for new in sched.new_requests:
        if new.req_id in state.row_of:
            raise DuplicateRequestError(new.req_id, "new_requests", "req_id already holds a row")

    freed_rows = sorted(state.row_of[r] for r in sched.finished_req_ids)
    free = sorted(set(state.free_rows()) | set(freed_rows))
    new_rows: list[int] = []  # parallel to sched.new_requests
    for i, new in enumerate(sched.new_requests):
        if i >= len(free):
            raise PoolFullError(new.req_id, "new_requests", f"all {config.max_num_reqs} rows taken")
        new_rows.append(free[i])  # lowest free row, in the order the requests are given

    total = 0
    for req_id, n in sched.num_scheduled_tokens.items():
        total += n
        if total > config.max_num_batched_tokens:
            raise TokenBudgetError(
                req_id, "num_scheduled_tokens", f"step total {total} > {config.max_num_batched_tokens}"
            )
    prompts: list[np.ndarray] = []  # parallel to new_rows: the validated prompts
    for new in sched.new_requests:
        tokens = as_ids(new.prompt_token_ids)
        if tokens is None:
            raise TokenIdError(new.req_id, "prompt_token_ids", "not a tuple, list or 1-D array of integer ids")
        bad = tokens[(tokens < 0) | (tokens >= config.vocab_size)]
        if bad.size:
            raise TokenIdError(new.req_id, "prompt_token_ids", f"{bad[0]} not in [0, {config.vocab_size})")
        prompts.append(tokens.astype(TOKEN_STORAGE_DTYPE))  # the copy commit stores: later edits can't reach it
    drafts_of: dict[str, np.ndarray] = {}  # req_id -> its validated drafts (non-empty only)
    for req_id, value in sched.scheduled_spec_decode_tokens.items():
        drafts = as_ids(value)
        if drafts is None:
            raise TokenIdError(req_id, "scheduled_spec_decode_tokens", "not a tuple, list or 1-D array of integer ids")
        bad = drafts[(drafts < 0) | (drafts >= config.vocab_size)]
        if bad.size and not proposed_on_device(drafts, config):  # placeholders: the ids are the drafter's (rule 8)
            raise TokenIdError(req_id, "scheduled_spec_decode_tokens", f"{bad[0]} not in [0, {config.vocab_size})")
        if drafts.size:
            drafts_of[req_id] = drafts.astype(TOKEN_STORAGE_DTYPE)  # frozen here, as the prompts

    scheduled = _scheduled_requests(state, sched, drafts_of)
    for feature in features:  # what its checks and plan need of each request (spec/feature.py)
        feature.read(state, sched, scheduled)
    for new in sched.new_requests:
        if len(new.prompt_token_ids) > config.max_model_len:
            raise ModelLengthError(new.req_id, "prompt_token_ids", f"{len(new.prompt_token_ids)} tokens")
    for kind in known_features():
        kind.check_request_lengths(sched.new_requests, config)
    for s in scheduled:
        if s.num_computed + s.num_scheduled > config.max_model_len:
            raise ModelLengthError(
                s.req_id, "num_scheduled_tokens", f"seq_len {s.num_computed + s.num_scheduled} > max_model_len"
            )
    for s in scheduled:
        end = s.num_computed + s.num_scheduled
        if end > s.known_tokens + s.num_drafts:
            and_drafts = f" and {s.num_drafts} drafts" if s.num_drafts else ""
            detail = f"positions up to {end - 1} but {s.known_tokens} tokens known{and_drafts}"
            raise UnknownTokenError(s.req_id, "num_scheduled_tokens", detail)
        if s.num_drafts and end != s.known_tokens + s.num_drafts:  # drafts must follow the last known token
            detail = f"step ends at position {end - 1}: {s.num_drafts} drafts must follow the {s.known_tokens} known"
            raise UnknownTokenError(s.req_id, "scheduled_spec_decode_tokens", detail)
    # async scheduling's rules of check 8 (spec/async_steps.py): they pass at once where no record left unverified
    # drafts and no drafts are placeholders, as in a synchronous pool
    check_no_drafts_after_unverified(state, drafts_of)
    check_proposed_drafts(state, sched, drafts_of)
    check_resumed_within_known(state, sched)
    rules = group_rules(config, features)  # per group: its table rules (spec/group_rules.py), a feature's for its own
    for s in scheduled:
        for g, table_rules in enumerate(rules):
            table_rules.check_ids(state, s, g)
    if config.one_block_pool and num_groups > 1:  # check 9 across groups, once every table passed it alone
        _check_one_pool(state, scheduled, rules)
    for check in ("check_size", "check_present", "check_not_null"):  # checks 10, 11, 12
        for s in scheduled:
            for g, table_rules in enumerate(rules):
                getattr(table_rules, check)(state, s, g)
    _check_unique_slots(state, scheduled, rules)

    plan = _plan(state, sched, freed_rows, new_rows, prompts, drafts_of, scheduled)
    rows = np.array(new_rows, np.int64)
    parts = {f.name: part for f in features if (part := f.plan(state, sched, rows, plan)) is not None}
    return dataclasses.replace(plan, features=parts) if parts else plan


def _plan(
    state: PoolState,
    sched: SchedulerOutput,
    freed_rows: list[int],
    new_rows: list[int],  # parallel to sched.new_requests
    prompts: list[np.ndarray],  # parallel to new_rows
    drafts_of: dict[str, np.ndarray],  # req_id -> drafts (non-empty only)
    scheduled: list[ScheduledRequest],  # new then cached requests
) -> StepPlan:
    """The validated step as the arrays of a StepPlan: everything prepare reads of the output, frozen here."""
    row_of = dict(zip([s.req_id for s in scheduled], _rows(state, sched, new_rows), strict=True))
    by_id = {s.req_id: s for s in scheduled}
    req_ids = tuple(sched.num_scheduled_tokens)  # scheduler order
    no_tokens = np.zeros(0, TOKEN_STORAGE_DTYPE)
    drafts = [drafts_of.get(r, no_tokens) for r in req_ids]
    return StepPlan(
        freed_rows=np.array(freed_rows, np.int64),
        new_req_ids=tuple(r.req_id for r in sched.new_requests),
        new_rows=np.array(new_rows, np.int64),
        prompt_lens=np.array([p.size for p in prompts], np.int64),
        prompt_tokens=np.concatenate([no_tokens, *prompts]),
        tables=_table_writes(state, sched, new_rows, scheduled),
        req_ids=req_ids,
        rows=np.array([row_of[r] for r in req_ids], np.int64),
        num_scheduled=np.array([by_id[r].num_scheduled for r in req_ids], np.int64),
        num_computed=np.array([by_id[r].num_computed for r in req_ids], np.int64),
        num_drafts=np.array([d.size for d in drafts], np.int64) if drafts_of else None,
        draft_ids=np.concatenate([no_tokens, *drafts]),
    )


def _check_consistency(sched: SchedulerOutput, num_groups: int) -> None:
    def fail(req_id: str | None, field: str, detail: str) -> None:
        raise InconsistentSchedulerOutputError(req_id, field, detail)

    _check_containers(sched)
    seen: set[str] = set()
    requests: tuple[NewRequest | CachedRequest, ...] = (*sched.new_requests, *sched.cached_requests)
    for req in requests:
        if not isinstance(req.req_id, str):
            fail(None, "req_id", f"{req.req_id!r} is not a str")
        if req.req_id in seen:
            fail(req.req_id, "new_requests/cached_requests", "listed twice")
        seen.add(req.req_id)
        if req.req_id in sched.finished_req_ids:
            fail(req.req_id, "finished_req_ids", "finished and scheduled in the same step")
        if req.req_id not in sched.num_scheduled_tokens:
            fail(req.req_id, "num_scheduled_tokens", "listed but not scheduled")
        if not is_integral(req.num_computed_tokens) or req.num_computed_tokens < 0:
            fail(req.req_id, "num_computed_tokens", f"{req.num_computed_tokens!r}: needs an integer >= 0")
    for req_id, n in sched.num_scheduled_tokens.items():
        if not isinstance(req_id, str):
            fail(None, "num_scheduled_tokens", f"key {req_id!r} is not a str")
        if req_id not in seen:
            fail(req_id, "num_scheduled_tokens", "scheduled but neither new nor cached")
        if not is_integral(n) or n < 1:
            fail(req_id, "num_scheduled_tokens", f"{n!r}: every scheduled request needs an integer >= 1")
    for req_id, value in sched.scheduled_spec_decode_tokens.items():
        if not isinstance(req_id, str):
            fail(None, "scheduled_spec_decode_tokens", f"key {req_id!r} is not a str")
        if req_id not in sched.num_scheduled_tokens:
            fail(req_id, "scheduled_spec_decode_tokens", "drafts for a request that is not scheduled")
        drafts = as_ids(value)  # malformed ids are check 6's (TokenIdError), as a prompt's
        if drafts is not None and sched.num_scheduled_tokens[req_id] < 1 + drafts.size:
            detail = f"{drafts.size} drafts need 1 + {drafts.size} scheduled tokens (the last known token first)"
            fail(req_id, "scheduled_spec_decode_tokens", detail)
    for new in sched.new_requests:
        if not isinstance(new.block_ids, _SEQUENCES) or len(new.block_ids) != num_groups:
            fail(new.req_id, "block_ids", f"{_describe_groups(new.block_ids)}, config has {num_groups}")
    for cached in sched.cached_requests:
        if not isinstance(cached.resumed, bool):
            fail(cached.req_id, "resumed", f"{cached.resumed!r} is not a bool")
        blocks = cached.new_block_ids
        if blocks is not None and (not isinstance(blocks, _SEQUENCES) or len(blocks) != num_groups):
            fail(cached.req_id, "new_block_ids", f"{_describe_groups(blocks)}, config has {num_groups}")


def _check_containers(sched: SchedulerOutput) -> None:
    """The output's own fields: each of the type the policy names, so nothing below is read twice differently."""

    def fail(req_id: str | None, field: str, detail: str) -> None:
        raise InconsistentSchedulerOutputError(req_id, field, detail)

    if not isinstance(sched.new_requests, _SEQUENCES):
        fail(None, "new_requests", f"{type(sched.new_requests).__name__}: needs a tuple or list")
    if not isinstance(sched.cached_requests, (*_SEQUENCES, CachedRequestColumns)):
        fail(None, "cached_requests", f"{type(sched.cached_requests).__name__}: needs a tuple, list or columns")
    if not isinstance(sched.num_scheduled_tokens, Mapping):
        fail(None, "num_scheduled_tokens", f"{type(sched.num_scheduled_tokens).__name__}: needs a mapping")
    if not isinstance(sched.finished_req_ids, _ID_SETS):
        fail(None, "finished_req_ids", f"{type(sched.finished_req_ids).__name__}: needs a set, tuple or list")
    if not isinstance(sched.scheduled_spec_decode_tokens, Mapping):
        drafts = type(sched.scheduled_spec_decode_tokens).__name__
        fail(None, "scheduled_spec_decode_tokens", f"{drafts}: needs a mapping")
    if any(not isinstance(r, NewRequest) for r in sched.new_requests):
        fail(None, "new_requests", "holds something that is not a NewRequest")
    cached = sched.cached_requests
    if isinstance(cached, CachedRequestColumns):
        if not isinstance(cached.req_ids, _SEQUENCES):
            fail(None, "cached_requests.req_ids", f"{type(cached.req_ids).__name__}: needs a tuple or list")
        n = len(cached.req_ids)
        if cached.num_computed_tokens is None:  # unlike new_block_ids, no column means no counts, not "none"
            fail(None, "cached_requests.num_computed_tokens", f"needs {n} entries, one per req_id")
        columns = {"num_computed_tokens": cached.num_computed_tokens, "new_block_ids": cached.new_block_ids}
        for name, column in columns.items():
            if column is not None and (not hasattr(column, "__len__") or len(column) != n):
                fail(None, f"cached_requests.{name}", f"needs {n} entries, one per req_id")
        if not isinstance(cached.resumed_req_ids, frozenset | set):
            fail(None, "cached_requests.resumed_req_ids", "needs a set")
        # `in` over the ids, not a set of them: an unhashable id is check 1's to name, below
        unknown = sorted(repr(r) for r in cached.resumed_req_ids if r not in cached.req_ids)
        if unknown:
            fail(None, "cached_requests.resumed_req_ids", f"{unknown[0]} is not among the cached req_ids")
    elif any(not isinstance(r, CachedRequest) for r in cached):
        fail(None, "cached_requests", "holds something that is not a CachedRequest")
    finished = list(sched.finished_req_ids)
    for req_id in finished:
        if not isinstance(req_id, str):
            fail(None, "finished_req_ids", f"{req_id!r} is not a str")
    if len(set(finished)) != len(finished):
        repeated = next(r for r in finished if finished.count(r) > 1)
        fail(repeated, "finished_req_ids", "listed twice")


def _describe_groups(value: object) -> str:
    if isinstance(value, _SEQUENCES):
        return f"{len(value)} groups"
    return f"{type(value).__name__} instead of a tuple of per-group ids"


def as_ids(values: object) -> np.ndarray | None:
    """Ids as a 1-D integer array, or None if they are not ids.

    Accepted: a tuple or list whose every element is an integer as Python's `operator.index` reads it (int,
    bool, NumPy integer; never a float), or a 1-D NumPy array of an integer dtype. Values past int64 are
    not ids (no vocabulary or cache is that large).
    """
    if isinstance(values, np.ndarray):
        ok = values.ndim == 1 and (values.size == 0 or values.dtype.kind in "iu")
        return values if ok else None
    if not isinstance(values, _SEQUENCES):
        return None
    try:
        return np.array([operator.index(v) for v in values], np.int64)
    except (TypeError, OverflowError):
        return None


def _rows(state: PoolState, sched: SchedulerOutput, new_rows: list[int]) -> list[int]:
    """Rows of new then cached requests (the order of `_scheduled_requests`)."""
    return new_rows + [state.row_of[c.req_id] for c in sched.cached_requests]


def _scheduled_requests(
    state: PoolState, sched: SchedulerOutput, drafts_of: dict[str, np.ndarray]
) -> list[ScheduledRequest]:
    """Every scheduled request as it will stand after the step: the new ones in the order given, then the cached."""
    out = []
    for new in sched.new_requests:
        tables, malformed = _tables([], new.block_ids)
        out.append(
            ScheduledRequest(
                new.req_id,
                len(new.prompt_token_ids),
                int(new.num_computed_tokens),  # integers of any type (check 1): mixed NumPy types must not promote
                int(sched.num_scheduled_tokens[new.req_id]),
                _num_drafts(drafts_of, new.req_id),
                tables,
                is_new=True,
                resumed=False,
                malformed=malformed,
            )
        )
    for cached in sched.cached_requests:
        row = state.row_of[cached.req_id]
        groups = range(len(state.config.kv_groups))
        kept = [np.zeros(0, np.int64) if cached.resumed else state.blocks(row, g) for g in groups]
        tables, malformed = _tables(kept, cached.new_block_ids or tuple(() for _ in groups))
        out.append(
            ScheduledRequest(
                cached.req_id,
                int(state.num_known_tokens[row]),
                int(cached.num_computed_tokens),
                int(sched.num_scheduled_tokens[cached.req_id]),
                _num_drafts(drafts_of, cached.req_id),
                tables,
                is_new=False,
                resumed=bool(cached.resumed),
                malformed=malformed,
            )
        )
    return out


def _num_drafts(drafts_of: dict[str, np.ndarray], req_id: str) -> int:
    drafts = drafts_of.get(req_id)
    return 0 if drafts is None else int(drafts.size)


def _tables(kept: list[np.ndarray], given: tuple[tuple[int, ...], ...]) -> tuple[list[np.ndarray], list[int]]:
    """Per group: kept entries followed by the given ids, and the groups whose given ids are not integers."""
    tables, malformed = [], []
    for g, ids in enumerate(given):
        added = as_ids(ids)
        if added is None:
            malformed.append(g)
            added = np.zeros(0, np.int64)
        before = kept[g] if kept else np.zeros(0, np.int64)
        tables.append(np.concatenate([before.astype(np.int64), added.astype(np.int64)]))
    return tables, malformed


def _check_one_pool(state: PoolState, scheduled: list[ScheduledRequest], rules: tuple[GroupRules, ...]) -> None:
    """9, with one block pool (WorkerConfig.one_block_pool): an id held in one group is held in no other.

    Requests may share a block within a group (a prefix-cache hit); across groups one id would be two
    layers' KV in one piece of memory. Only the scheduled requests' held entries are known to be held: an
    unscheduled row may be a preempted request whose blocks went back to the pool. Scanned request by
    request (new, then cached, as given) and group by group, the first entry whose id some earlier entry
    holds in another group is named, with that earlier holder.
    """
    holder: dict[int, tuple[int, str]] = {}  # block id -> (group, req_id) of its first held entry
    for s in scheduled:
        for g in range(len(state.config.kv_groups)):
            for block in rules[g].held_ids(state, s, g).tolist():
                first = holder.setdefault(block, (g, s.req_id))
                if first[0] != g:
                    detail = f"block {block} is held in group {first[0]} by {first[1]!r} too (one block pool)"
                    raise BlockIdError(s.req_id, f"block_ids[{g}]", detail)


def _check_unique_slots(state: PoolState, scheduled: list[ScheduledRequest], rules: tuple[GroupRules, ...]) -> None:
    """13: per group, what the step writes (a slot per token; a feature's group, its own keys), written once."""
    for g, table_rules in enumerate(rules):
        written = [table_rules.written(state, s, g) for s in scheduled]  # per request, in step order
        slots = np.concatenate(written) if written else np.zeros(0, np.int64)  # [num_tokens] in step order
        writer = np.repeat(np.arange(len(scheduled)), [w.size for w in written])  # [num_tokens] request index
        order = np.argsort(slots, kind="stable")  # equal slots end up adjacent, earlier tokens first
        again = order[1:][slots[order[1:]] == slots[order[:-1]]]  # tokens writing a slot an earlier token wrote
        if again.size:
            token = int(again.min())  # the first such token in step order
            first = int(np.flatnonzero(slots == slots[token])[0])
            detail = f"slot {slots[token]} also written by {scheduled[writer[first]].req_id!r}"
            raise DuplicateSlotError(scheduled[writer[token]].req_id, f"block_ids[{g}]", detail)


def _table_writes(
    state: PoolState, sched: SchedulerOutput, new_rows: list[int], scheduled: list[ScheduledRequest]
) -> tuple[TableWrites, ...]:
    """Per group, from the validated tables: new and resumed requests replace theirs, the others append their ids."""
    replaces = [True] * len(sched.new_requests) + [c.resumed for c in sched.cached_requests]
    rows = _rows(state, sched, new_rows)
    out = []
    for g in range(len(state.config.kv_groups)):
        writes: list[tuple[int, int, np.ndarray, bool]] = []  # (row, first entry written, ids, replaced)
        for s, row, replace in zip(scheduled, rows, replaces, strict=True):
            start = 0 if replace else int(state.num_blocks[g, row])
            added = s.tables[g][start:]
            if replace or added.size:
                writes.append((row, start, added, replace))
        out.append(
            TableWrites(
                rows=np.array([w[0] for w in writes], np.int64),
                starts=np.array([w[1] for w in writes], np.int64),
                lengths=np.array([w[2].size for w in writes], np.int64),
                ids=np.concatenate([np.zeros(0, np.int64), *(w[2] for w in writes)]),
                replaced=np.array([w[3] for w in writes], bool),
            )
        )
    return tuple(out)
