"""Stage 1, the persistent state: which request holds which row, its progress and its block tables.

`PoolState` is everything except the token ids. It is what validation reads, so a backend that keeps
its tables on a device can keep a `PoolState` on the host as its mirror and share this code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec.types import BLOCK_ID_DTYPE, NULL_BLOCK_ID, WorkerConfig


@dataclass
class TableUpdate:
    row: int  # req_state_idx
    group: int
    block_ids: tuple[int, ...]
    replace: bool  # True: the table becomes block_ids; False: block_ids are appended


@dataclass
class StepPlan:
    """What a validated scheduler output does to the pool, in apply order."""

    freed_rows: list[int] = field(default_factory=list)
    new_rows: list[int] = field(default_factory=list)  # parallel to sched.new_requests
    table_updates: list[TableUpdate] = field(default_factory=list)
    num_computed_tokens: dict[int, int] = field(default_factory=dict)  # row -> value after the step
    prompts: list[np.ndarray] = field(default_factory=list)  # parallel to new_rows: validated prompt token ids
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # (req_id, num_scheduled), scheduler order
    drafts: dict[str, np.ndarray] = field(default_factory=dict)  # req_id -> validated draft ids (non-empty only)


class PoolState:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        rows = config.max_num_reqs
        self.req_ids: list[str | None] = [None] * rows  # req_state_idx -> req_id
        self.row_of: dict[str, int] = {}  # req_id -> req_state_idx
        self.num_tokens = np.zeros(rows, np.int64)  # [R] known tokens: prompt + sampled
        self.num_computed_tokens = np.zeros(rows, np.int64)  # [R]
        self.num_blocks = np.zeros((len(config.kv_groups), rows), np.int64)  # [G, R] filled entries
        self.block_tables = [  # per group: [R, max_blocks_per_req(g)], unused entries NULL_BLOCK_ID
            np.full((rows, config.max_blocks_per_req(g)), NULL_BLOCK_ID, BLOCK_ID_DTYPE)
            for g in range(len(config.kv_groups))
        ]

    def blocks(self, row: int, group: int) -> np.ndarray:
        return self.block_tables[group][row, : self.num_blocks[group, row]]

    def free_rows(self) -> list[int]:
        return [row for row, req_id in enumerate(self.req_ids) if req_id is None]

    def commit(self, plan: StepPlan, new_req_ids: list[str], prompt_lens: list[int]) -> None:
        """Apply a validated plan: finished rows are cleared, then new rows filled, then updates."""
        for row in plan.freed_rows:
            del self.row_of[self.req_ids[row]]  # type: ignore[arg-type]
            self.req_ids[row] = None
            self.num_tokens[row] = self.num_computed_tokens[row] = 0
            self.num_blocks[:, row] = 0
            for table in self.block_tables:
                table[row] = NULL_BLOCK_ID  # no stale ids survive into the next owner's row
        for row, req_id, prompt_len in zip(plan.new_rows, new_req_ids, prompt_lens, strict=True):
            self.req_ids[row] = req_id
            self.row_of[req_id] = row
            self.num_tokens[row] = prompt_len
        for update in plan.table_updates:
            table, row, g = self.block_tables[update.group], update.row, update.group
            if update.replace:
                table[row] = NULL_BLOCK_ID
                self.num_blocks[g, row] = 0
            start = self.num_blocks[g, row]
            table[row, start : start + len(update.block_ids)] = update.block_ids
            self.num_blocks[g, row] = start + len(update.block_ids)
        for row, value in plan.num_computed_tokens.items():
            self.num_computed_tokens[row] = value
