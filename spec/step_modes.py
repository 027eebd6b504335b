"""When the host learns a step's samples: within the step (synchronous), or one step late (async scheduling).

The pool's mode, fixed when it is built (`WorkerConfig.async_scheduling`): spec/pool.py calls the mode at four
points and never asks which it is. `InStep` is the plain engine loop: record_sampled checks the ids and
appends them before the next step is scheduled. `Ahead` is spec/async_steps.py's model of a host that
schedules step N+1 before step N's samples are read: optimistic counts, pending tokens, faults reported late.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from spec.async_steps import (
    REPORTED_AFTER,
    LateFault,
    correct_counts,
    forget_unrecorded,
    pending_tokens,
    record_ahead,
    take_proposals,
)
from spec.drafts import check_accepted
from spec.types import TOKEN_STORAGE_DTYPE, SchedulerOutput, WorkerConfig

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan


class StepMode(Protocol):
    def before_apply(self, applied_steps: int) -> None:
        """Before validation: a fault due at this apply raises here."""

    def after_commit(self, state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> None:
        """After the commit: what the step's output tells of the last record."""

    def batch_fields(
        self,
        state: PoolState,
        index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
        query_start_loc: np.ndarray,  # [num_reqs + 1]
        num_scheduled: np.ndarray,  # [num_reqs]
    ) -> dict[str, Any]:
        """The BatchInputs fields the mode adds (none in step)."""
        ...

    def record(
        self,
        state: PoolState,
        token_ids: np.ndarray,  # [R, max_model_len] the pool's tokens, appended to here
        applied_steps: int,
        req_ids: tuple[str, ...],  # [n] batch order
        rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
        takes: np.ndarray,  # [n] bool: the row's step reached its last input token
        tokens: np.ndarray,  # [n, width] each row's accepted tokens, then placeholders
        counts: np.ndarray,  # [n] tokens before each row's first placeholder
        drafts: list[np.ndarray],  # [n] each batch row's drafts
        proposed: np.ndarray | None,  # [n, P] the drafter's ids for the next drafts (async only), or None
    ) -> None:
        """record_sampled's effect on the rows that take their samples."""

    def held_tokens(self, state: PoolState) -> np.ndarray:
        """[R] the tokens each row holds (what a snapshot shows)."""
        ...


class InStep:
    """Synchronous: the ids are checked as they are recorded, and the first fault raises with nothing appended."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    def before_apply(self, applied_steps: int) -> None:
        return

    def after_commit(self, state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> None:
        return

    def batch_fields(
        self, state: PoolState, index_mapping: np.ndarray, query_start_loc: np.ndarray, num_scheduled: np.ndarray
    ) -> dict[str, Any]:
        return {}

    def record(
        self,
        state: PoolState,
        token_ids: np.ndarray,
        applied_steps: int,
        req_ids: tuple[str, ...],
        rows: np.ndarray,
        takes: np.ndarray,
        tokens: np.ndarray,
        counts: np.ndarray,
        drafts: list[np.ndarray],
        proposed: np.ndarray | None,
    ) -> None:
        known = state.num_known_tokens[rows]  # [n] (proposed is None: the pool refuses it without async scheduling)
        for b in np.flatnonzero(takes):
            check_accepted(req_ids[b], tokens[b], int(counts[b]), drafts[b], int(known[b]), self.config)
        for b in np.flatnonzero(takes):
            row, n = rows[b], counts[b]
            token_ids[row, known[b] : known[b] + n] = tokens[b, :n]
            state.num_known_tokens[row] += n

    def held_tokens(self, state: PoolState) -> np.ndarray:
        return state.num_known_tokens


class Ahead:
    """Async scheduling (spec/async_steps.py): the host learns each record's values one step late."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.late_faults: list[LateFault] = []
        self.num_rejected = np.zeros(config.max_num_reqs, np.int64)  # [R] drafts the last record rejected
        self.proposals = np.zeros((config.max_num_reqs, 0), TOKEN_STORAGE_DTYPE)  # [R, P] the drafter's (rule 8)
        self.recorded = False  # the last step applied had its batch recorded: its samples may be pending (rule 3)

    def before_apply(self, applied_steps: int) -> None:
        if self.late_faults and self.late_faults[0].due <= applied_steps:
            raise self.late_faults.pop(0).error

    def after_commit(self, state: PoolState, sched: SchedulerOutput, plan: StepPlan) -> None:
        state.num_unverified_drafts[:] = 0  # the step after this one is scheduled knowing the verdicts
        forget_unrecorded(state, self.recorded)  # rule 3: pending tokens come from the batch run just before
        self.recorded = False
        correct_counts(state, sched, plan.freed_rows, self.num_rejected)  # rule 2
        if plan.num_drafts is not None:  # rule 8: placeholder drafts take their row's proposals
            take_proposals(plan.rows, plan.num_drafts, plan.draft_ids, self.proposals)

    def batch_fields(
        self, state: PoolState, index_mapping: np.ndarray, query_start_loc: np.ndarray, num_scheduled: np.ndarray
    ) -> dict[str, Any]:
        counts = (state.num_known_tokens[index_mapping], state.num_computed_tokens[index_mapping])
        indices, sources = pending_tokens(state.sampled_in[index_mapping], *counts, query_start_loc, num_scheduled)
        return {"pending_token_indices": indices, "pending_prev_batch_idx": sources}  # rule 3

    def record(
        self,
        state: PoolState,
        token_ids: np.ndarray,
        applied_steps: int,
        req_ids: tuple[str, ...],
        rows: np.ndarray,
        takes: np.ndarray,
        tokens: np.ndarray,
        counts: np.ndarray,
        drafts: list[np.ndarray],
        proposed: np.ndarray | None,
    ) -> None:
        """Rules 1, 6 and 8: the scheduler's counts now, the values' checks reported at a later apply."""
        if proposed is not None and proposed.shape[1] > self.proposals.shape[1]:
            grown = np.zeros((self.proposals.shape[0], proposed.shape[1]), TOKEN_STORAGE_DTYPE)
            grown[:, : self.proposals.shape[1]] = self.proposals
            self.proposals = grown
        self.num_rejected, fault = record_ahead(state, token_ids, req_ids, rows, takes, tokens, counts, drafts,
                                                proposed, self.proposals)  # fmt: skip
        self.recorded = True
        if fault is not None:
            self.late_faults.append(LateFault(fault, applied_steps + REPORTED_AFTER))

    def held_tokens(self, state: PoolState) -> np.ndarray:
        return state.num_known_tokens - self.num_rejected  # the scheduler's count less the rejections


def step_mode(config: WorkerConfig) -> StepMode:
    return Ahead(config) if config.async_scheduling else InStep(config)
