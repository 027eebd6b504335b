"""The request state pool: the worker's persistent state and the three calls of an engine step.

    pool.apply(sched)                  # validate, then update rows, tokens, tables, progress
    batch = pool.prepare(sched)        # BatchInputs for the model
    pool.record_sampled(batch, ids)    # append each finished row's sampled (or accepted) tokens

The three calls come in this order. An output is frozen when it is applied: prepare reads what apply
validated, so changing the output object afterwards cannot change the batch. record_sampled takes the
batch of the last prepare, once: a batch from an earlier step could name rows that changed owner since.
Speculative decoding (drafts in the batch, accepted tokens, rollback) is described in spec/drafts.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import numpy as np

from spec.batch import batch_order
from spec.classify import classify, step_decode_query_len
from spec.drafts import DraftLogits, accepted_rows, draft_logits, draft_token_indices, proposed_ids
from spec.errors import InconsistentSchedulerOutputError, UnknownRequestError
from spec.feature import Feature, find, group_rules
from spec.flatten import flatten
from spec.graphs import CapturedGraphs, dispatch
from spec.model_kinds import features_for
from spec.padding import pad_request_rows
from spec.slots import gather_block_tables
from spec.state import PoolState, StepPlan
from spec.step_modes import step_mode
from spec.types import (
    INDEX_DTYPE,
    TOKEN_STORAGE_DTYPE,
    BatchInputs,
    PoolSnapshot,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
    is_integral,
)
from spec.validate import plan_step

F = TypeVar("F", bound=Feature)


class RequestStatePool:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.state = PoolState(config)
        self.features = features_for(config)  # the model kind's (spec/feature.py): none for a plain decoder
        self._group_rules = group_rules(config, self.features)  # per KV group: its table rules, its slots
        # [R, max_model_len]; np.zeros maps untouched pages lazily, so memory follows the tokens held
        self.token_ids = np.zeros((config.max_num_reqs, config.max_model_len), TOKEN_STORAGE_DTYPE)
        self._applied: SchedulerOutput | None = None
        self._plan: StepPlan | None = None  # the applied output as validated: what prepare reads
        self._prepared: BatchInputs | None = None  # the batch record_sampled may take
        self._prepared_rows = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # its index_mapping and seq_lens
        self._prepared_drafts: list[np.ndarray] = []  # [num_reqs] its drafts per batch row
        self._applied_steps = 0  # outputs applied so far: the clock async scheduling's late faults are due by
        self.mode = step_mode(config)  # when the host learns the samples: in step, or a step late (async)

    def apply(self, sched: SchedulerOutput) -> None:
        self.mode.before_apply(self._applied_steps)  # async: a fault due now raises (spec/step_modes.py)
        plan = plan_step(self.state, sched, self.features)  # raises before anything below runs
        self.state.commit(plan)
        for feature in self.features:
            feature.commit(self.state, plan)
        self._applied_steps += 1
        self.mode.after_commit(self.state, sched, plan)
        starts = np.cumsum(plan.prompt_lens) - plan.prompt_lens  # [k] where each prompt begins in prompt_tokens
        for row, start, length in zip(plan.new_rows, starts, plan.prompt_lens, strict=True):
            self.token_ids[row, :length] = plan.prompt_tokens[start : start + length]
        self._applied, self._plan, self._prepared = sched, plan, None

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        """The step's batch. `pad_to` pads its tokens to a count (a DP peer's, spec/dummy.py); `graphs` instead
        picks the captured graph it runs (spec/graphs.py) and pads tokens and request rows for it (spec/padding.py)."""
        plan = check_last_applied(sched, self._applied, self._plan)
        check_graphs_choice(pad_to, graphs)
        num_tokens = int(plan.num_scheduled.sum())
        scheduled = list(zip(plan.req_ids, plan.num_scheduled.tolist(), strict=True))  # scheduler order
        req_ids, index_mapping, num_scheduled = batch_order(scheduled, self.state.row_of)
        no_drafts = np.zeros(0, TOKEN_STORAGE_DTYPE)
        drafts_of = plan.drafts_of()
        drafts = [drafts_of.get(r, no_drafts) for r in req_ids]  # [num_reqs] per batch row
        num_drafts = np.array([d.size for d in drafts], INDEX_DTYPE)  # [num_reqs]
        state = self.state
        decode_query_len = step_decode_query_len(num_drafts) if graphs is None else graphs.uniform_decode_query_len
        classes = classify(  # by progress (spec/classify.py): decides the graph below
            num_scheduled, state.num_computed_tokens[index_mapping], state.prompt_lens[index_mapping], decode_query_len
        )
        descriptor = None if graphs is None else dispatch(graphs, num_tokens, len(req_ids), classes)
        padded = padded_tokens(pad_to, num_tokens) if descriptor is None else descriptor.num_tokens
        flat = flatten(index_mapping, num_scheduled, self.state.num_computed_tokens, self.token_ids, padded)
        draft_ids = np.concatenate([no_drafts, *drafts])  # [num_drafts] batch order
        sampler = draft_logits(flat.query_start_loc, num_drafts, draft_ids) if drafts_of else None
        if sampler is not None:  # the draft positions lie past the known tokens: their ids are the drafts
            flat.input_ids[draft_token_indices(flat.query_start_loc, num_drafts)] = sampler.draft_token_ids
        groups = self.config.kv_groups
        batch = BatchInputs(
            req_ids=req_ids,
            index_mapping=index_mapping,
            num_scheduled_tokens=num_scheduled,
            query_start_loc=flat.query_start_loc,
            positions=flat.positions,
            input_ids=flat.input_ids,
            seq_lens=flat.seq_lens,
            logits_indices=flat.logits_indices if sampler is None else sampler.logits_indices,
            block_tables=tuple(gather_block_tables(t, index_mapping) for t in self.state.block_tables),
            slot_mappings=tuple(  # a feature's group (spec/feature.py) may hold no token's KV: its rules say
                rules.token_slots(t, flat.token_rows, flat.positions, g.block_size)
                for t, g, rules in zip(self.state.block_tables, groups, self._group_rules, strict=True)
            ),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            row_classes=classes,
            **({} if sampler is None else _sampler_fields(sampler)),
            **self.mode.batch_fields(self.state, index_mapping, flat.query_start_loc, num_scheduled),
        )
        if self.features:  # the model kind's records of the batch (spec/feature.py)
            at = {r: i for i, r in enumerate(plan.req_ids)}
            order = np.array([at[r] for r in req_ids], np.int64)  # [num_reqs] batch_idx -> scheduler index
            records = tuple(f.prepare(self.state, plan, batch, order) for f in self.features)
            batch = dataclasses.replace(batch, features=records)
        if graphs is not None and descriptor is not None:  # the request rows the graph replays (spec/padding.py)
            batch = pad_request_rows(batch, descriptor, graphs.profile, self.features)
        self._prepared = batch
        self._prepared_rows = (index_mapping.astype(np.int64), flat.seq_lens.copy())
        self._prepared_drafts = drafts
        return self._prepared

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: object, next_draft_ids: object = None) -> None:
        """Append each batch row's sampled tokens to its row if the step reached the row's last known token.

        `sampled_token_ids` is `[num_reqs]` (one token per row) or `[num_reqs, width]` padded with
        PLACEHOLDER_TOKEN_ID (the accepted tokens of a step with drafts, spec/drafts.py). Rows still
        mid-prefill (seq_len < known tokens) discard theirs. Each taking row, in batch order, is checked:
        1 .. 1 + k tokens with no gap, every id in the vocabulary, all but the last equal to its drafts,
        room below max_model_len; the first fault raises and nothing is appended. The step's progress itself
        is not advanced here: the scheduler's num_computed_tokens is authoritative (and rolls back past
        rejected drafts).

        `next_draft_ids` (async scheduling only) is the drafter's output, `[num_reqs, P]` integer ids: each taking
        row's proposals for the drafts of its next step, which the scheduler sends as placeholders
        (spec/async_steps.py, rule 8).
        """
        if not self._is_last_prepared(batch):
            detail = "not the batch of the last prepare (or recorded already)"
            raise InconsistentSchedulerOutputError(None, "batch", detail)
        sampled = np.asarray(sampled_token_ids)
        if sampled.size and sampled.dtype.kind not in "iu":  # empty: np.asarray([]) is float, and harmless
            detail = f"dtype {sampled.dtype}: needs integer ids"
            raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
        tokens, counts = accepted_rows(sampled, batch.num_reqs)  # [num_reqs, width], [num_reqs]
        proposed = proposed_ids(next_draft_ids, batch.num_reqs, self.config)  # [num_reqs, P] or None
        rows, seq_lens = self._prepared_rows  # as prepared: edits to the batch's arrays cannot redirect the ids
        drafts = self._prepared_drafts
        known = self.state.num_known_tokens[rows]  # [num_reqs]
        takes = seq_lens == known + [d.size for d in drafts]  # [num_reqs] the step reached its last input token
        self.mode.record(self.state, self.token_ids, self._applied_steps, batch.req_ids, rows, takes, tokens, counts,
                         drafts, proposed)  # fmt: skip
        self._prepared = None

    def _is_last_prepared(self, batch: BatchInputs) -> bool:
        """The batch prepare returned last, or one with its requests, rows and lengths (a wrapper's copy)."""
        if self._prepared is None or batch is self._prepared:
            return batch is not None and batch is self._prepared
        rows, seq_lens = self._prepared_rows
        return (
            tuple(batch.req_ids) == self._prepared.req_ids
            and np.array_equal(np.asarray(batch.index_mapping)[: len(rows)], rows)  # past them: padded rows
            and np.array_equal(np.asarray(batch.seq_lens)[: len(rows)], seq_lens)
            # an earlier step's batch of the same rows and lengths (a decode after a one-draft step) is told apart
            # by its padding: the graph it was prepared for, and its padded token count
            and batch.descriptor == self._prepared.descriptor
            and batch.num_tokens_padded == self._prepared.num_tokens_padded
        )

    def feature(self, kind: type[F]) -> F | None:
        """The pool's instance of a feature class (spec/feature.py), or None where its config lacks the feature."""
        return find(self.features, kind)

    def row_of(self, req_id: str) -> int:
        if req_id not in self.state.row_of:
            raise UnknownRequestError(req_id, "req_id", "request holds no row")
        return self.state.row_of[req_id]

    def snapshot(self) -> PoolSnapshot:
        held = self.mode.held_tokens(self.state)  # [R]
        return tuple(
            RowSnapshot(
                row=row,
                req_id=req_id,
                token_ids=tuple(self.token_ids[row, : held[row]].tolist()),
                num_computed_tokens=int(self.state.num_computed_tokens[row]),
                block_ids=tuple(tuple(self.state.blocks(row, g).tolist()) for g in range(len(self.config.kv_groups))),
            )
            for row, req_id in enumerate(self.state.req_ids)
            if req_id is not None
        )


def _sampler_fields(sampler: DraftLogits) -> dict[str, Any]:
    return {
        "num_draft_tokens": sampler.num_draft_tokens,
        "cu_num_draft_tokens": sampler.cu_num_draft_tokens,
        "draft_token_ids": sampler.draft_token_ids,
        "target_logits_indices": sampler.target_logits_indices,
        "bonus_logits_indices": sampler.bonus_logits_indices,
    }


def check_last_applied(sched: SchedulerOutput, applied: SchedulerOutput | None, plan: StepPlan | None) -> StepPlan:
    """The plan of the step to prepare: `sched` must be the output applied last (the same object, or equal)."""
    if plan is None or (sched is not applied and sched != applied):
        raise InconsistentSchedulerOutputError(None, "prepare", "not the last applied scheduler output")
    return plan


def check_graphs_choice(pad_to: int | None, graphs: object) -> None:
    """pad_to and graphs are two answers to one question (how far to pad): at most one is given."""
    if pad_to is not None and graphs is not None:
        raise InconsistentSchedulerOutputError(None, "graphs", "pad_to and graphs are exclusive: give one")
    if graphs is not None and not isinstance(graphs, CapturedGraphs):
        raise InconsistentSchedulerOutputError(None, "graphs", f"{type(graphs).__name__}: needs a CapturedGraphs")


def padded_tokens(pad_to: int | None, num_tokens: int) -> int:
    """The batch's padded token count: the step's tokens, or pad_to, an integer at least that many."""
    if pad_to is None:
        return num_tokens
    if not is_integral(pad_to):
        raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to!r} is not an integer")
    if pad_to < num_tokens:
        raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to} < {num_tokens} scheduled tokens")
    return int(pad_to)
