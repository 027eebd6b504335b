"""Encoder-decoder cross-attention: the encoder's KV in a group of its own, where it is written, and who reads it.

A KV cache group of kind "cross_attention" (vLLM's CrossAttentionSpec) holds each request's encoder output
KV: `encoder_len` tokens (L), in the request's blocks of that group, allocated when it is admitted. The
decoder's own groups are unchanged; the cross group differs in three ways:

- Written once. A request's encoder output is written on the step that starts at position 0 (its first
  step; vLLM's builder skips every request with num_computed_tokens > 0). Its slots are
      block_ids[:cdiv(L, bs)] * bs + arange(bs), flattened and cut to L,
  concatenated over the rows whose encoder runs, in batch order: `BatchInputs.cross_slot_mapping`, with
  `scheduled_encoder_lens` giving each row's count (0 where its encoder does not run). vLLM's cross group
  puts these in its metadata's slot_mapping; here slot_mappings[g] stays [T] for every group, and for the
  cross group it is all PAD_SLOT_ID: the decoder's tokens write no KV there.
- Read whole. Every decoder token of the request attends to all L encoder keys, without a causal mask
  (spec/encoder_attention.py); `encoder_seq_lens` [num_reqs] is each row's L, as vLLM's, and the cross
  group's block_tables[g] row is the request's cross blocks.
- Not cached. There is no prefix cache for encoder output: a request whose cross blocks are new this step
  (a new request, or a resumed one whose new_block_ids give it other cross blocks than its row holds) must
  start at position 0, so that its encoder runs again and fills them. vLLM frees a preempted request's
  blocks, the encoder's too, and reschedules its encoder input with the recomputed prefill: it resumes at 0.

Running the encoder is the model's job: slotmap says where its output goes and what reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spec.errors import InconsistentSchedulerOutputError, MissingBlockError, ModelLengthError
from spec.feature import Feature
from spec.group_rules import GroupRules, NoTokenKV
from spec.request import ScheduledRequest
from spec.types import (
    INDEX_DTYPE,
    SLOT_DTYPE,
    BatchInputs,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
    feature_record,
    is_integral,
)

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan

CROSS_ATTENTION = "cross_attention"


def cross_group(config: WorkerConfig) -> int | None:
    """The index of the config's cross_attention group, or None for a decoder-only model."""
    return next((g for g, group in enumerate(config.kv_groups) if group.kind == CROSS_ATTENTION), None)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def encoder_slots(blocks: np.ndarray, encoder_len: int, block_size: int) -> np.ndarray:  # [L] int64
    """One request's encoder tokens' slots: its first cdiv(L, bs) cross blocks, each block's offsets, cut to L."""
    needed = blocks[: cdiv(encoder_len, block_size)].astype(SLOT_DTYPE)  # [cdiv(L, bs)] physical blocks
    return (needed[:, None] * block_size + np.arange(block_size)).reshape(-1)[:encoder_len]


@feature_record
@dataclass(frozen=True)
class CrossInputs:
    """Cross-attention's record of a batch (BatchInputs.features)."""

    encoder_seq_lens: Any  # [num_reqs] int32 batch_idx -> L
    scheduled_encoder_lens: Any  # [num_reqs] int32 batch_idx -> L where its encoder runs this step, else 0
    cross_slot_mapping: Any  # [sum(scheduled_encoder_lens)] int64, batch order


def cross_inputs(
    block_table: np.ndarray,  # [R, max_blocks] the cross group's table, req_state_idx -> physical block ids
    index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    encoder_lens: np.ndarray,  # [R] req_state_idx -> L
    num_computed: np.ndarray,  # [R] req_state_idx -> the step's first position
    block_size: int,
) -> CrossInputs:
    lens = encoder_lens[index_mapping]  # [num_reqs] batch order
    runs = (lens > 0) & (num_computed[index_mapping] == 0)  # [num_reqs] the step starts at 0: the encoder runs
    scheduled = np.where(runs, lens, 0)  # [num_reqs]
    rows_and_lens = zip(index_mapping.tolist(), scheduled.tolist(), strict=True)
    slots = [encoder_slots(block_table[row], n, block_size) for row, n in rows_and_lens if n]
    return CrossInputs(
        encoder_seq_lens=lens.astype(INDEX_DTYPE),
        scheduled_encoder_lens=scheduled.astype(INDEX_DTYPE),
        cross_slot_mapping=np.concatenate([np.zeros(0, SLOT_DTYPE), *slots]),
    )


# ---- validation (spec/validate.py calls these at its numbered checks) ------------------------------------


def check_encoder_fields(new_requests: Sequence[NewRequest]) -> None:
    """Check 1: encoder_len is an integer >= 0."""
    for new in new_requests:
        if not is_integral(new.encoder_len) or new.encoder_len < 0:
            detail = f"{new.encoder_len!r}: needs an integer >= 0"
            raise InconsistentSchedulerOutputError(new.req_id, "encoder_len", detail)


def check_encoder_len(new: NewRequest, config: WorkerConfig) -> None:
    """Check 7: 1 <= encoder_len <= max_encoder_len with a cross group (its layers read the encoder), 0 without."""
    limit = config.max_encoder_len
    if cross_group(config) is None:
        if new.encoder_len:
            raise ModelLengthError(new.req_id, "encoder_len", f"{new.encoder_len}: no cross_attention group")
    elif not 1 <= new.encoder_len <= limit:
        raise ModelLengthError(new.req_id, "encoder_len", f"{new.encoder_len} not in [1, max_encoder_len={limit}]")


def check_cross_blocks(
    req_id: str, field: str, table: np.ndarray, encoder_len: int, num_computed: int, fresh: bool, block_size: int
) -> None:
    """Check 11: the cross table covers L tokens, and new cross blocks are filled by an encoder that runs now."""
    needed = cdiv(encoder_len, block_size)
    if table.size < needed:
        raise MissingBlockError(req_id, field, f"{encoder_len} encoder tokens need {needed} blocks, has {table.size}")
    if fresh and num_computed > 0:
        at = f"starts at {num_computed} with new cross blocks"
        raise MissingBlockError(req_id, "num_computed_tokens", f"{at}: the encoder's KV is written at position 0 only")


def written_cross_slots(table: np.ndarray, encoder_len: int, num_computed: int, block_size: int) -> np.ndarray:
    """Check 13's view of the cross group: the slots the step writes (the encoder's, on a step starting at 0)."""
    if num_computed or not encoder_len:
        return np.zeros(0, np.int64)
    return encoder_slots(table, encoder_len, block_size)


class CrossAttention(Feature):
    """The feature (spec/feature.py): each row's encoder length, the cross group's rules, the batch's cross fields."""

    name = CROSS_ATTENTION

    @classmethod
    def configured(cls, config: WorkerConfig) -> bool:
        return cross_group(config) is not None

    @classmethod
    def check_request_fields(cls, new_requests: Sequence[NewRequest], config: WorkerConfig) -> None:
        check_encoder_fields(new_requests)

    @classmethod
    def fields_given(cls, new_requests: Sequence[NewRequest]) -> bool:
        return any(r.encoder_len != 0 for r in new_requests)

    @classmethod
    def check_request_lengths(cls, new_requests: Sequence[NewRequest], config: WorkerConfig) -> None:
        for new in new_requests:
            check_encoder_len(new, config)

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.group: int = cross_group(config)  # type: ignore[assignment]  # configured: the group exists
        self.encoder_lens = np.zeros(config.max_num_reqs, np.int64)  # [R] req_state_idx -> L (0: a free row)
        self.step: dict[str, tuple[int, bool]] = {}  # req_id -> (L, new cross blocks) of the step being planned
        self._rules: dict[int, GroupRules] = {self.group: CrossRules(self)}

    def group_rules(self) -> dict[int, GroupRules]:
        return self._rules

    def read(self, state: PoolState, sched: SchedulerOutput, scheduled: list[ScheduledRequest]) -> None:
        """Each request's L and whether its cross blocks are new: a new request's, or a resumed one given others."""
        given = {new.req_id: int(new.encoder_len) for new in sched.new_requests}
        self.step = {}
        for s in scheduled:
            if s.is_new:
                self.step[s.req_id] = (given[s.req_id], True)
                continue
            row = state.row_of[s.req_id]
            other = s.resumed and not np.array_equal(s.tables[self.group], state.blocks(row, self.group))
            self.step[s.req_id] = (int(self.encoder_lens[row]), other)

    def plan(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan) -> np.ndarray:
        """[k] int64 each new request's L, in `sched.new_requests` order."""
        return np.array([int(new.encoder_len) for new in sched.new_requests], np.int64)

    def commit(self, state: PoolState, plan: StepPlan) -> None:
        self.encoder_lens[plan.freed_rows] = 0
        self.encoder_lens[plan.new_rows] = plan.features[self.name]

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> CrossInputs:
        block_size = self.config.kv_groups[self.group].block_size
        return cross_inputs(
            state.block_tables[self.group],
            np.asarray(batch.index_mapping),
            self.encoder_lens,
            state.num_computed_tokens,
            block_size,
        )

    def pad(self, record: CrossInputs, num_reqs_padded: int, pad_rows: Callable[[str, Any, int, Any], Any]) -> Any:
        """A padded row has no encoder output (length 0) and writes none; cross_slot_mapping, per encoder token
        written, gains nothing."""
        return CrossInputs(
            encoder_seq_lens=pad_rows("encoder_seq_lens", record.encoder_seq_lens, num_reqs_padded, 0),
            scheduled_encoder_lens=pad_rows(
                "scheduled_encoder_lens", record.scheduled_encoder_lens, num_reqs_padded, 0
            ),
            cross_slot_mapping=record.cross_slot_mapping,
        )


class CrossRules(NoTokenKV):
    """The cross group's table: ids and width as any group's (9, 10); it covers L tokens and is filled at position 0
    (11); its entries are check 9's (12); the step writes the encoder's slots (13); no decoder token writes here."""

    def __init__(self, feature: CrossAttention) -> None:
        self.feature = feature

    def check_present(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        encoder_len, fresh = self.feature.step[s.req_id]
        block_size = state.config.kv_groups[g].block_size
        check_cross_blocks(s.req_id, f"block_ids[{g}]", s.tables[g], encoder_len, s.num_computed, fresh, block_size)

    def check_not_null(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        return  # a group without a window holds no null entry: check 9 refused any

    def written(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        encoder_len = self.feature.step[s.req_id][0]
        return written_cross_slots(s.tables[g], encoder_len, s.num_computed, state.config.kv_groups[g].block_size)
