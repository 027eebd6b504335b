"""Stage 2, validation: turn a SchedulerOutput into a StepPlan, or reject it before anything changes.

Checks run in the order below, each over the whole output; the first failing one raises. Every
backend must use the same order, so that an output with several faults raises the same class.

 1. InconsistentSchedulerOutputError  self-contradictions (no pool state needed)
 2. UnknownRequestError               finished or cached request without a row
 3. DuplicateRequestError             new request whose req_id holds a row
 4. PoolFullError                     more live requests than rows
 5. TokenBudgetError                  more scheduled tokens than the budget
 6. TokenIdError                      prompt token outside the vocabulary
 7. ModelLengthError                  prompt or num_computed + num_scheduled > max_model_len
 8. UnknownTokenError                 num_computed + num_scheduled > known tokens
 9. BlockIdError                      id out of range, repeated in a table, null without a window
10. BlockTableOverflowError           more blocks than max_blocks_per_req
11. MissingBlockError                 a scheduled token past the last block
12. NullBlockError                    a token writes to or attends through the null block
13. DuplicateSlotError                two tokens of the step write one slot
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec.errors import (
    BlockIdError,
    BlockTableOverflowError,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    NullBlockError,
    PoolFullError,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
)
from spec.state import PoolState, StepPlan, TableUpdate
from spec.types import NULL_BLOCK_ID, CachedRequest, NewRequest, SchedulerOutput


@dataclass
class _Scheduled:
    """One scheduled request as it will stand after the step."""

    req_id: str
    known_tokens: int
    num_computed: int
    num_scheduled: int
    tables: list[np.ndarray]  # per group: the whole table after the step


def plan_step(state: PoolState, sched: SchedulerOutput) -> StepPlan:
    config = state.config
    num_groups = len(config.kv_groups)
    _check_consistency(sched, num_groups)

    for req_id in sorted(sched.finished_req_ids):
        if req_id not in state.row_of:
            raise UnknownRequestError(req_id, "finished_req_ids", "request holds no row")
    for cached in sched.cached_requests:
        if cached.req_id not in state.row_of:
            raise UnknownRequestError(cached.req_id, "cached_requests", "request holds no row")
    for new in sched.new_requests:
        if new.req_id in state.row_of:
            raise DuplicateRequestError(new.req_id, "new_requests", "req_id already holds a row")

    plan = StepPlan(freed_rows=sorted(state.row_of[r] for r in sched.finished_req_ids))
    free = sorted(set(state.free_rows()) | set(plan.freed_rows))
    for i, new in enumerate(sched.new_requests):
        if i >= len(free):
            raise PoolFullError(new.req_id, "new_requests", f"all {config.max_num_reqs} rows taken")
        plan.new_rows.append(free[i])  # lowest free row, in the order the requests are given

    total = 0
    for req_id, n in sched.num_scheduled_tokens.items():
        total += n
        if total > config.max_num_batched_tokens:
            raise TokenBudgetError(
                req_id, "num_scheduled_tokens", f"step total {total} > {config.max_num_batched_tokens}"
            )
    for new in sched.new_requests:
        bad = [t for t in new.prompt_token_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise TokenIdError(new.req_id, "prompt_token_ids", f"{bad[0]} not in [0, {config.vocab_size})")

    scheduled = _scheduled_requests(state, sched, plan)
    for new in sched.new_requests:
        if len(new.prompt_token_ids) > config.max_model_len:
            raise ModelLengthError(new.req_id, "prompt_token_ids", f"{len(new.prompt_token_ids)} tokens")
    for s in scheduled:
        if s.num_computed + s.num_scheduled > config.max_model_len:
            raise ModelLengthError(
                s.req_id, "num_scheduled_tokens", f"seq_len {s.num_computed + s.num_scheduled} > max_model_len"
            )
    for s in scheduled:
        if s.num_computed + s.num_scheduled > s.known_tokens:
            raise UnknownTokenError(
                s.req_id,
                "num_scheduled_tokens",
                f"positions up to {s.num_computed + s.num_scheduled - 1} but {s.known_tokens} tokens known",
            )
    for check in (_check_block_ids, _check_table_sizes, _check_blocks_present, _check_null_reads):
        for s in scheduled:
            for g in range(num_groups):
                check(state, s, g)
    _check_unique_slots(state, scheduled)

    for s, update_row in zip(scheduled, _rows(state, sched, plan), strict=True):
        plan.num_computed_tokens[update_row] = s.num_computed
    plan.table_updates = _table_updates(state, sched, plan)
    return plan


def _check_consistency(sched: SchedulerOutput, num_groups: int) -> None:
    def fail(req_id: str | None, field: str, detail: str) -> None:
        raise InconsistentSchedulerOutputError(req_id, field, detail)

    seen: set[str] = set()
    requests: tuple[NewRequest | CachedRequest, ...] = (*sched.new_requests, *sched.cached_requests)
    for req in requests:
        if req.req_id in seen:
            fail(req.req_id, "new_requests/cached_requests", "listed twice")
        seen.add(req.req_id)
        if req.req_id in sched.finished_req_ids:
            fail(req.req_id, "finished_req_ids", "finished and scheduled in the same step")
        if req.req_id not in sched.num_scheduled_tokens:
            fail(req.req_id, "num_scheduled_tokens", "listed but not scheduled")
        if req.num_computed_tokens < 0:
            fail(req.req_id, "num_computed_tokens", f"{req.num_computed_tokens} < 0")
    for req_id, n in sched.num_scheduled_tokens.items():
        if req_id not in seen:
            fail(req_id, "num_scheduled_tokens", "scheduled but neither new nor cached")
        if not isinstance(n, int | np.integer) or n < 1:
            fail(req_id, "num_scheduled_tokens", f"{n!r}: every scheduled request needs >= 1 token")
    for new in sched.new_requests:
        if len(new.block_ids) != num_groups:
            fail(new.req_id, "block_ids", f"{len(new.block_ids)} groups, config has {num_groups}")
    for cached in sched.cached_requests:
        if cached.new_block_ids is not None and len(cached.new_block_ids) != num_groups:
            fail(cached.req_id, "new_block_ids", f"{len(cached.new_block_ids)} groups, config has {num_groups}")


def _rows(state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> list[int]:
    """Rows of new then cached requests (the order of `_scheduled_requests`)."""
    return plan.new_rows + [state.row_of[c.req_id] for c in sched.cached_requests]


def _scheduled_requests(state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> list[_Scheduled]:
    out = []
    for new in sched.new_requests:
        tables = [np.asarray(ids, np.int64) for ids in new.block_ids]
        out.append(
            _Scheduled(
                new.req_id,
                len(new.prompt_token_ids),
                new.num_computed_tokens,
                sched.num_scheduled_tokens[new.req_id],
                tables,
            )
        )
    for cached in sched.cached_requests:
        row = state.row_of[cached.req_id]
        groups = range(len(state.config.kv_groups))
        added = cached.new_block_ids or tuple(() for _ in groups)
        tables = [
            np.concatenate([[] if cached.resumed else state.blocks(row, g), added[g]]).astype(np.int64)
            for g in groups
        ]
        known = int(state.num_tokens[row])
        out.append(
            _Scheduled(
                cached.req_id, known, cached.num_computed_tokens, sched.num_scheduled_tokens[cached.req_id], tables
            )
        )
    return out


def _check_block_ids(state: PoolState, s: _Scheduled, g: int) -> None:
    group, table = state.config.kv_groups[g], s.tables[g]
    bad = table[(table < 0) | (table >= group.num_blocks)]
    if bad.size:
        raise BlockIdError(s.req_id, f"block_ids[{g}]", f"{bad[0]} not in [0, {group.num_blocks})")
    real = table[table != NULL_BLOCK_ID]
    if real.size != np.unique(real).size:
        raise BlockIdError(s.req_id, f"block_ids[{g}]", "a block appears twice in one table")
    if group.sliding_window is None and real.size != table.size:
        raise BlockIdError(s.req_id, f"block_ids[{g}]", "null block in a group without a sliding window")


def _check_table_sizes(state: PoolState, s: _Scheduled, g: int) -> None:
    limit = state.config.max_blocks_per_req(g)
    if s.tables[g].size > limit:
        raise BlockTableOverflowError(s.req_id, f"block_ids[{g}]", f"{s.tables[g].size} blocks > {limit}")


def _check_blocks_present(state: PoolState, s: _Scheduled, g: int) -> None:
    block_size = state.config.kv_groups[g].block_size
    last_block = (s.num_computed + s.num_scheduled - 1) // block_size
    if last_block >= s.tables[g].size:
        raise MissingBlockError(
            s.req_id, f"block_ids[{g}]", f"position needs logical block {last_block}, table has {s.tables[g].size}"
        )


def _check_null_reads(state: PoolState, s: _Scheduled, g: int) -> None:
    group = state.config.kv_groups[g]
    window = group.sliding_window
    first_read = 0 if window is None else max(0, s.num_computed - window + 1)
    last = s.num_computed + s.num_scheduled - 1
    read = s.tables[g][first_read // group.block_size : last // group.block_size + 1]
    if (read == NULL_BLOCK_ID).any():
        raise NullBlockError(s.req_id, f"block_ids[{g}]", f"null block inside positions {first_read}..{last}")


def _check_unique_slots(state: PoolState, scheduled: list[_Scheduled]) -> None:
    for g, group in enumerate(state.config.kv_groups):
        owner: dict[int, str] = {}
        for s in scheduled:
            positions = np.arange(s.num_computed, s.num_computed + s.num_scheduled)
            slots = s.tables[g][positions // group.block_size] * group.block_size + positions % group.block_size
            for slot in slots.tolist():
                if slot in owner:
                    detail = f"slot {slot} also written by {owner[slot]!r}"
                    raise DuplicateSlotError(s.req_id, f"block_ids[{g}]", detail)
                owner[slot] = s.req_id


def _table_updates(state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> list[TableUpdate]:
    updates = []
    for new, row in zip(sched.new_requests, plan.new_rows, strict=True):
        updates += [TableUpdate(row, g, tuple(ids), True) for g, ids in enumerate(new.block_ids)]
    for cached in sched.cached_requests:
        row = state.row_of[cached.req_id]
        if cached.resumed or cached.new_block_ids:
            groups = cached.new_block_ids or tuple(() for _ in state.config.kv_groups)
            updates += [
                TableUpdate(row, g, tuple(ids), cached.resumed) for g, ids in enumerate(groups) if ids or cached.resumed
            ]
    return updates
