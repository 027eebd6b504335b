"""The request state pool: the worker's persistent state and the three calls of an engine step.

    pool.apply(sched)                  # validate, then update rows, tokens, tables, progress
    batch = pool.prepare(sched)        # BatchInputs for the model
    pool.record_sampled(batch, ids)    # append each finished row's sampled token

The three calls come in this order. An output is frozen when it is applied: prepare reads what apply
validated, so changing the output object afterwards cannot change the batch. record_sampled takes the
batch of the last prepare, once: a batch from an earlier step could name rows that changed owner since.
"""

from __future__ import annotations

import numpy as np

from spec.batch import batch_order
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError, UnknownRequestError
from spec.flatten import flatten
from spec.slots import gather_block_tables, slot_mapping
from spec.state import PoolState, StepPlan
from spec.types import (
    TOKEN_STORAGE_DTYPE,
    BatchInputs,
    PoolSnapshot,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
    is_integral,
)
from spec.validate import plan_step


class RequestStatePool:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.state = PoolState(config)
        # [R, max_model_len]; np.zeros maps untouched pages lazily, so memory follows the tokens held
        self.token_ids = np.zeros((config.max_num_reqs, config.max_model_len), TOKEN_STORAGE_DTYPE)
        self._applied: SchedulerOutput | None = None
        self._plan: StepPlan | None = None  # the applied output as validated: what prepare reads
        self._prepared: BatchInputs | None = None  # the batch record_sampled may take
        self._prepared_rows = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # its index_mapping and seq_lens

    def apply(self, sched: SchedulerOutput) -> None:
        plan = plan_step(self.state, sched)  # raises before anything below runs
        new = sched.new_requests
        self.state.commit(plan, [r.req_id for r in new], [len(p) for p in plan.prompts])
        for prompt, row in zip(plan.prompts, plan.new_rows, strict=True):
            self.token_ids[row, : len(prompt)] = prompt
        self._applied, self._plan, self._prepared = sched, plan, None

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        if self._plan is None or (sched is not self._applied and sched != self._applied):
            raise InconsistentSchedulerOutputError(None, "prepare", "not the last applied scheduler output")
        num_tokens = sum(n for _, n in self._plan.scheduled)
        padded = num_tokens if pad_to is None else pad_to
        if not is_integral(padded):
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to!r} is not an integer")
        if padded < num_tokens:
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to} < {num_tokens} scheduled tokens")
        padded = int(padded)
        req_ids, index_mapping, num_scheduled = batch_order(self._plan.scheduled, self.state.row_of)
        flat = flatten(index_mapping, num_scheduled, self.state.num_computed_tokens, self.token_ids, padded)
        groups = self.config.kv_groups
        self._prepared = BatchInputs(
            req_ids=req_ids,
            index_mapping=index_mapping,
            num_scheduled_tokens=num_scheduled,
            query_start_loc=flat.query_start_loc,
            positions=flat.positions,
            input_ids=flat.input_ids,
            seq_lens=flat.seq_lens,
            logits_indices=flat.logits_indices,
            block_tables=tuple(gather_block_tables(t, index_mapping) for t in self.state.block_tables),
            slot_mappings=tuple(
                slot_mapping(t, flat.token_rows, flat.positions, g.block_size)
                for t, g in zip(self.state.block_tables, groups, strict=True)
            ),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )
        self._prepared_rows = (index_mapping.astype(np.int64), flat.seq_lens.copy())
        return self._prepared

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: object) -> None:
        """Append sampled_token_ids[b] to row index_mapping[b] if the step reached its last known token.

        Rows still mid-prefill (seq_len < known tokens) discard their sample. The step's progress
        itself is not advanced here: the scheduler's num_computed_tokens is authoritative.
        """
        if not self._is_last_prepared(batch):
            detail = "not the batch of the last prepare (or recorded already)"
            raise InconsistentSchedulerOutputError(None, "batch", detail)
        sampled = np.asarray(sampled_token_ids).reshape(-1)
        if sampled.size and sampled.dtype.kind not in "iu":  # empty: np.asarray([]) is float, and harmless
            detail = f"dtype {sampled.dtype}: needs integer ids"
            raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
        if sampled.shape[0] != batch.num_reqs:
            raise InconsistentSchedulerOutputError(
                None, "sampled_token_ids", f"{sampled.shape[0]} ids for {batch.num_reqs} batch rows"
            )
        rows, seq_lens = self._prepared_rows  # as prepared: edits to the batch's arrays cannot redirect the ids
        takes = seq_lens == self.state.num_tokens[rows]  # [num_reqs]
        for b in np.flatnonzero(takes):
            req_id, token = batch.req_ids[b], int(sampled[b])
            if not 0 <= token < self.config.vocab_size:
                raise TokenIdError(req_id, "sampled_token_ids", f"{token} not in [0, {self.config.vocab_size})")
            if self.state.num_tokens[rows[b]] >= self.config.max_model_len:
                raise ModelLengthError(req_id, "sampled_token_ids", "no room past max_model_len")
        for b in np.flatnonzero(takes):
            row = rows[b]
            self.token_ids[row, self.state.num_tokens[row]] = sampled[b]
            self.state.num_tokens[row] += 1
        self._prepared = None

    def _is_last_prepared(self, batch: BatchInputs) -> bool:
        """The batch prepare returned last, or one with its requests, rows and lengths (a wrapper's copy)."""
        if self._prepared is None or batch is self._prepared:
            return batch is not None and batch is self._prepared
        rows, seq_lens = self._prepared_rows
        return (
            tuple(batch.req_ids) == self._prepared.req_ids
            and np.array_equal(np.asarray(batch.index_mapping), rows)
            and np.array_equal(np.asarray(batch.seq_lens), seq_lens)
        )

    def row_of(self, req_id: str) -> int:
        if req_id not in self.state.row_of:
            raise UnknownRequestError(req_id, "req_id", "request holds no row")
        return self.state.row_of[req_id]

    def snapshot(self) -> PoolSnapshot:
        return tuple(
            RowSnapshot(
                row=row,
                req_id=req_id,
                token_ids=tuple(self.token_ids[row, : self.state.num_tokens[row]].tolist()),
                num_computed_tokens=int(self.state.num_computed_tokens[row]),
                block_ids=tuple(
                    tuple(self.state.blocks(row, g).tolist()) for g in range(len(self.config.kv_groups))
                ),
            )
            for row, req_id in enumerate(self.state.req_ids)
            if req_id is not None
        )
