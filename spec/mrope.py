"""M-RoPE positions: the three position rows (temporal, height, width) of a multimodal rotary embedding.

A model with M-RoPE (WorkerConfig.uses_mrope, vLLM's `model_config.uses_mrope`: Qwen2-VL, Qwen2.5-VL)
rotates each token by three positions instead of one. Its processor computes, once per request, a
position table for the prompt, `[3, prompt_len]` (an image's tokens at the positions of their grid, text
tokens with three equal rows), and a delta: how far the positions past the prompt lie from the plain
ones (`max(table) + 1 - prompt_len`). A request brings both in `NewRequest.mrope_positions` and
`NewRequest.mrope_position_delta`; its pool row keeps them until it finishes (preemption included, as
vLLM's CachedRequestState), and each step cuts its columns out of them:

    token at position p of a request with table M (prompt_len columns) and delta d:
        p <  prompt_len:  mrope_positions[:, t] = M[:, p]     a prompt token, in whichever chunk it falls
        p >= prompt_len:  mrope_positions[:, t] = p + d       decode, drafts, output recomputed after preemption
    a request without a table (text):  all three rows p   (a table of 0 columns, delta 0)
    padding tokens:                    0

This is vLLM's `_calc_mrope_positions` (gpu_model_runner: the prompt part of a step copied from the
request's table at `num_computed .. min(prompt_len, seq_len)`, the rest from
`get_next_input_positions`, `arange(context_len, seq_len) + mrope_position_delta`), per token. Two
consequences are the bug classes it rules out: a prompt's positions are the same under every chunking
(each chunk reads the table at its own positions and ends where the chunk ends; the delta is the
request's, never recomputed per chunk: vLLM PRs #10388, #10403), and a decode row beside prefill rows
gets its real positions p + d, not empty or plain ones (SGLang PR #11330).

Computing the table from image grids is the model processor's job (vLLM's `get_mrope_input_positions`),
not slotmap's: slotmap stores the table it is given and cuts each step's positions from it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from spec.errors import InconsistentSchedulerOutputError
from spec.feature import Feature
from spec.types import TOKEN_DTYPE, BatchInputs, NewRequest, SchedulerOutput, WorkerConfig, feature_record, is_integral

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan

NUM_MROPE_ROWS = 3  # temporal, height, width
# |delta| bound: p + delta stays inside int64 for every position p < max_model_len
MAX_MROPE_DELTA = 2**62


@dataclass(frozen=True)
class MRopeWrites:
    """One step's new M-RoPE tables, validated (a part of spec.state.StepPlan): what apply stores per row."""

    rows: np.ndarray  # [m] int64 req_state_idx of the step's new requests that carry a table
    lengths: np.ndarray  # [m] int64 columns of each table (its request's prompt length)
    deltas: np.ndarray  # [m] int64 each request's mrope_position_delta
    tables: np.ndarray  # [3, sum(lengths)] int64 the tables side by side, in `rows` order


def check_mrope_inputs(new: NewRequest, config: WorkerConfig) -> None:
    """Check 1 (spec/validate.py) for one new request's M-RoPE inputs: InconsistentSchedulerOutputError."""

    def fail(field: str, detail: str) -> None:
        raise InconsistentSchedulerOutputError(new.req_id, field, detail)

    table, delta = new.mrope_positions, new.mrope_position_delta
    if not config.uses_mrope and (table is not None or not is_integral(delta) or delta != 0):
        fail("mrope_positions" if table is not None else "mrope_position_delta", "the model does not use M-RoPE")
    if not is_integral(delta) or abs(int(delta)) >= MAX_MROPE_DELTA:
        fail("mrope_position_delta", f"{delta!r}: needs an integer with |delta| < 2**62")
    if table is None:
        if delta != 0:
            fail("mrope_position_delta", f"{delta} without a position table (a text request's rows are p)")
        return
    values = as_table(table)
    if values is None:
        fail("mrope_positions", f"not a [{NUM_MROPE_ROWS}, prompt_len] table of integer positions")
        return
    prompt_len = _length(new.prompt_token_ids)  # an unsized prompt is check 6's (TokenIdError)
    if prompt_len is not None and values.shape[1] != prompt_len:
        fail("mrope_positions", f"{values.shape[1]} columns for a prompt of {prompt_len} tokens")


def as_table(value: object) -> np.ndarray | None:
    """A position table as a `[3, n]` int64 array (a copy), or None if it is not one.

    Accepted: a 2-D NumPy array of an integer dtype with 3 rows, or a tuple or list of 3 tuples or lists
    of integers (`operator.index`) of one length. Values past int64 are not positions.
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 2 or value.shape[0] != NUM_MROPE_ROWS or (value.size and value.dtype.kind not in "iu"):
            return None
        if value.size and value.dtype.kind == "u" and int(value.max()) >= 2**63:
            return None
        return value.astype(np.int64)
    if not isinstance(value, tuple | list) or len(value) != NUM_MROPE_ROWS:
        return None
    if not all(isinstance(row, tuple | list) for row in value) or len({len(row) for row in value}) != 1:
        return None
    try:
        return np.array([[operator.index(v) for v in row] for row in value], np.int64).reshape(NUM_MROPE_ROWS, -1)
    except (TypeError, OverflowError):
        return None


def _length(prompt: object) -> int | None:
    if isinstance(prompt, tuple | list) or (isinstance(prompt, np.ndarray) and prompt.ndim == 1):
        return len(prompt)
    return None


def mrope_writes(new_requests: Sequence[NewRequest], new_rows: Sequence[int]) -> MRopeWrites | None:
    """The validated tables of a step's new requests (check 1 passed), frozen: later edits cannot reach them.
    None when no new request carries one (the plan of a text-only step is the plan it always was)."""
    carrying = [(row, new) for row, new in zip(new_rows, new_requests, strict=True) if new.mrope_positions is not None]
    if not carrying:
        return None
    tables = [as_table(new.mrope_positions) for _, new in carrying]
    return MRopeWrites(
        rows=np.array([row for row, _ in carrying], np.int64),
        lengths=np.array([t.shape[1] for t in tables if t is not None], np.int64),
        deltas=np.array([int(new.mrope_position_delta) for _, new in carrying], np.int64),
        tables=np.concatenate([np.zeros((NUM_MROPE_ROWS, 0), np.int64), *(t for t in tables if t is not None)], 1),
    )


class MRopeStore(Protocol):
    def commit(self, freed_rows: np.ndarray, writes: MRopeWrites | None) -> None:
        """Finished rows lose their table (the next owner may be a text request), then new tables are stored."""


class MRopeRows:
    """Every row's position table and delta: the state M-RoPE positions are cut from.

    A table per row, as long as its prompt: memory follows the tables held, never [R, 3, max_model_len].
    """

    def __init__(self, config: WorkerConfig) -> None:
        rows = config.max_num_reqs
        # [R] req_state_idx -> its [3, prompt_len] int64 table; [3, 0] for a text request (and a free row)
        self.tables: list[np.ndarray] = [_NO_TABLE] * rows
        self.deltas = np.zeros(rows, np.int64)  # [R] req_state_idx -> mrope_position_delta

    def commit(self, freed_rows: np.ndarray, writes: MRopeWrites | None) -> None:
        """Finished rows lose their table (the next owner may be a text request), then new tables are stored."""
        for row in freed_rows.tolist():  # [f] req_state_idx
            self.tables[row] = _NO_TABLE
        self.deltas[freed_rows] = 0
        if writes is None:
            return
        starts = np.cumsum(writes.lengths) - writes.lengths  # [m] where each table begins in writes.tables
        for row, start, length in zip(writes.rows.tolist(), starts.tolist(), writes.lengths.tolist(), strict=True):
            self.tables[row] = writes.tables[:, start : start + length].copy()
        self.deltas[writes.rows] = writes.deltas

    def positions(
        self,
        positions: np.ndarray,  # [T] int64 flat token index -> position in its request (0 for padding)
        token_rows: np.ndarray,  # [num_tokens] int64 flat token index -> req_state_idx (not padded)
    ) -> np.ndarray:
        """`[3, T]` int64: the module docstring's rule for every real token, 0 for padding."""
        lengths = np.array([t.shape[1] for t in self.tables], np.int64)  # [R] table columns (0: no table)
        deltas = self.deltas
        num_tokens = token_rows.size
        out = np.zeros((NUM_MROPE_ROWS, positions.size), TOKEN_DTYPE)  # [3, T] padding columns stay 0
        p = positions[:num_tokens]  # [num_tokens]
        out[:, :num_tokens] = p + deltas[token_rows]  # past the prompt (and without a table): p + delta on all rows
        in_prompt = p < lengths[token_rows]  # [num_tokens] a prompt token of a request with a table
        for row in np.unique(token_rows[in_prompt]).tolist():
            mine = np.flatnonzero(in_prompt & (token_rows == row))  # [k] flat indices of the row's prompt tokens
            out[:, mine] = self.tables[row][:, p[mine]]  # column p of its table
        return out


_NO_TABLE = np.zeros((NUM_MROPE_ROWS, 0), np.int64)


@feature_record
@dataclass(frozen=True)
class MRopeInputs:
    """M-RoPE's record of a batch (BatchInputs.features)."""

    mrope_positions: Any  # [3, T] int64 M-RoPE positions (temporal, height, width), 0 for padding

    def split_for_ubatch(self, request_slice: slice, token_slice: slice) -> MRopeInputs:
        """A micro-batch's record (spec/ubatch.py, rule 8): its tokens' columns, as vLLM's slice_model_inputs."""
        return MRopeInputs(self.mrope_positions[:, token_slice])


class MRope(Feature):
    """The feature (spec/feature.py): new requests bring tables, rows keep them, prepare cuts each step's columns."""

    name = "mrope"
    plans_in_bulk = True

    @classmethod
    def configured(cls, config: WorkerConfig) -> bool:
        return config.uses_mrope

    @classmethod
    def check_request_fields(cls, new_requests: Sequence[NewRequest], config: WorkerConfig) -> None:
        for new in new_requests:
            check_mrope_inputs(new, config)

    @classmethod
    def fields_given(cls, new_requests: Sequence[NewRequest]) -> bool:
        return any(
            r.mrope_positions is not None or type(r.mrope_position_delta) is not int or r.mrope_position_delta
            for r in new_requests
        )

    def __init__(self, config: WorkerConfig, rows: MRopeStore | None = None) -> None:
        """`rows`: where the tables are kept (a backend may keep them on its device); default: MRopeRows."""
        super().__init__(config)
        self.rows: MRopeStore = MRopeRows(config) if rows is None else rows

    def plan(
        self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan
    ) -> MRopeWrites | None:
        return mrope_writes(sched.new_requests, new_rows.tolist())

    def commit(self, state: PoolState, plan: StepPlan) -> None:
        self.rows.commit(plan.freed_rows, plan.features.get(self.name))

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> MRopeInputs:
        token_rows = np.repeat(np.asarray(batch.index_mapping, np.int64), batch.num_scheduled_tokens)  # [num_tokens]
        rows: MRopeRows = self.rows  # type: ignore[assignment]  # spec's pool keeps spec's rows
        return MRopeInputs(rows.positions(batch.positions, token_rows))

    def pad(self, record: MRopeInputs, num_reqs_padded: int, pad_rows: Callable[[str, Any, int, Any], Any]) -> Any:
        """M-RoPE's record is per token ([3, T], 0 past the real tokens since prepare padded T): no request row."""
        return record
