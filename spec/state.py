"""Stage 1, the persistent state: which request holds which row, its progress and its block tables.

`PoolState` is everything except the token ids. It is what validation reads, so a backend that keeps
its tables on a device can keep a `PoolState` on the host as its mirror and share this code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spec.types import BLOCK_ID_DTYPE, NULL_BLOCK_ID, WorkerConfig


@dataclass(frozen=True)
class TableWrites:
    """One KV group's table changes: each listed row gets `ids` written from entry `starts` on."""

    rows: np.ndarray  # [k] int64 req_state_idx
    starts: np.ndarray  # [k] int64 first entry written: the row's filled entries (an append), 0 where replaced
    lengths: np.ndarray  # [k] int64 ids written (0 for a table replaced by an empty one)
    ids: np.ndarray  # [sum(lengths)] int64, row after row
    replaced: np.ndarray  # [k] bool: the whole table is replaced (a new or resumed request)


@dataclass(frozen=True)
class StepPlan:
    """What a validated scheduler output does to the pool, in apply order, and the batch it schedules.

    Everything prepare and record_sampled read of the output is frozen here, as arrays: changing the
    output object after apply cannot change the step. Two index spaces meet in it: `new_*` follow
    `sched.new_requests`; `req_ids`, `rows`, `num_scheduled`, `num_computed` and `num_drafts` follow the
    scheduler order (the order of `sched.num_scheduled_tokens`, docs/index-spaces.md).
    """

    freed_rows: np.ndarray  # [f] int64 req_state_idx of the finished requests, ascending
    new_req_ids: tuple[str, ...]  # [k] the new requests, in the order given
    new_rows: np.ndarray  # [k] int64 new request -> the req_state_idx it takes
    prompt_lens: np.ndarray  # [k] int64
    prompt_tokens: np.ndarray  # [sum(prompt_lens)] int32 (TOKEN_STORAGE_DTYPE), the prompts end to end
    tables: tuple[TableWrites, ...]  # per KV group
    req_ids: tuple[str, ...]  # [n] scheduler order: every scheduled request
    rows: np.ndarray  # [n] int64 scheduler order -> req_state_idx
    num_scheduled: np.ndarray  # [n] int64 scheduler order
    num_computed: np.ndarray  # [n] int64 scheduler order: num_computed_tokens as the step sets it
    num_drafts: np.ndarray | None  # [n] int64 scheduler order: drafts of each request; None: nobody drafts
    draft_ids: np.ndarray  # [sum(num_drafts)] int32, scheduler order
    # feature name -> its part of the step (spec/feature.py, Feature.plan), for the config's features that keep one
    features: dict[str, Any] = field(default_factory=dict)

    def drafts_of(self) -> dict[str, np.ndarray]:
        """req_id -> its draft ids, for the requests that draft (spec/drafts.py)."""
        if self.num_drafts is None:
            return {}
        ends = np.cumsum(self.num_drafts).tolist()
        counts = self.num_drafts.tolist()
        return {r: self.draft_ids[end - k : end] for r, k, end in zip(self.req_ids, counts, ends, strict=True) if k}


def ranges(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges of the given lengths laid end to end: (range index, index within range) of every element."""
    which = np.repeat(np.arange(lengths.shape[0]), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return which, within


class PoolState:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        rows = config.max_num_reqs
        self.req_ids: list[str | None] = [None] * rows  # req_state_idx -> req_id
        self.row_of: dict[str, int] = {}  # req_id -> req_state_idx
        self.num_known_tokens = np.zeros(rows, np.int64)  # [R] known tokens: prompt + sampled (accepted)
        self.num_computed_tokens = np.zeros(rows, np.int64)  # [R]
        # [R] the request's prompt length, set when it is added: a row is prefilling while num_computed is below it
        # (spec/classify.py); 0 for a free row
        self.prompt_lens = np.zeros(rows, np.int64)
        self.num_blocks = np.zeros((len(config.kv_groups), rows), np.int64)  # [G, R] filled entries
        # What a host scheduling ahead knows of the last record_sampled without its values (spec/async_steps.py):
        self.sampled_in = np.full(rows, -1, np.int64)  # [R] batch_idx of the last recorded batch the row sampled in
        self.num_unverified_drafts = np.zeros(rows, np.int64)  # [R] drafts of that row whose verdict is unread
        # [R] drafts the drafter proposed at the row's last record (async rule 8); every record sets its batch rows',
        # so a new owner's first record replaces its predecessor's, and validation gives a new or resumed one none
        self.num_proposed = np.zeros(rows, np.int64)
        self.block_tables = [  # per group: [R, max_blocks_per_req(g)], unused entries NULL_BLOCK_ID
            np.full((rows, config.max_blocks_per_req(g)), NULL_BLOCK_ID, BLOCK_ID_DTYPE)
            for g in range(len(config.kv_groups))
        ]

    def blocks(self, row: int, group: int) -> np.ndarray:
        return self.block_tables[group][row, : self.num_blocks[group, row]]

    def free_rows(self) -> list[int]:
        return [row for row, req_id in enumerate(self.req_ids) if req_id is None]

    def commit(self, plan: StepPlan) -> None:
        """Apply a validated plan: finished rows are cleared, then new rows filled, then tables and progress.

        Both backends' pools commit here (fast to its host mirror, which on plain CPU is its device state).
        Arrays are written in place, never rebound: fast's device tensors may view them.
        """
        freed = plan.freed_rows
        for row in freed.tolist():
            del self.row_of[self.req_ids[row]]
            self.req_ids[row] = None
        if freed.size:
            self.num_known_tokens[freed] = 0
            self.num_computed_tokens[freed] = 0
            self.prompt_lens[freed] = 0
            self.num_blocks[:, freed] = 0
            self.sampled_in[freed] = -1  # a new owner of the row has no pending token
            for table in self.block_tables:
                table[freed] = NULL_BLOCK_ID  # no stale ids survive into the next owner's row
        if plan.new_rows.size:
            for row, req_id in zip(plan.new_rows.tolist(), plan.new_req_ids, strict=True):
                self.req_ids[row] = req_id
                self.row_of[req_id] = row
            self.num_known_tokens[plan.new_rows] = plan.prompt_lens
            self.prompt_lens[plan.new_rows] = plan.prompt_lens
        for g, writes in enumerate(plan.tables):
            if writes.rows.size:
                self.write_table(g, writes)
        self.num_computed_tokens[plan.rows] = plan.num_computed

    def write_table(self, g: int, writes: TableWrites) -> None:
        """One group's table changes: replaced tables cleared, then every row's ids from its start on.

        The one step of the commit whose cost grows with the step's appends: a backend may override it
        with a compiled loop of the same effect (fast.state.HostMirror).
        """
        table = self.block_tables[g]
        table[writes.rows[writes.replaced]] = NULL_BLOCK_ID
        which, within = ranges(writes.lengths)  # [sum(lengths)] each id's row, its place after the row's start
        table[writes.rows[which], writes.starts[which] + within] = writes.ids
        self.num_blocks[g, writes.rows] = writes.starts + writes.lengths
