"""What one step changes on the device, packed into one int64 buffer and applied in one go.

The host mirror is updated first; what goes to the device is only the final value of every entry the
step touched, so the device writes need no order among themselves (a row freed and refilled in the
same step is a single write of its new contents, with the stale tail zeroed).

Packed layout (int64), the argument of fast.kernels.apply_writes:
    table_ops [n_t, 6]  row, group, lo, hi, count, data index: table[row, lo:hi] = data[...], count -> num_blocks
    token_ops [n_p, 4]  row, column, length, data index: token_ids[row, column:column + length] = data[...]
                        (a new prompt from column 0; a request's drafts past its known tokens)
    computed  [n_c, 2]  row, value: num_computed_tokens[row] = value
    data      [D]       block ids, then prompt tokens, then drafts
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fast.drafts import draft_columns
from fast.kernels.apply_writes import apply_writes_triton
from fast.runtime import upload
from fast.state import DeviceState
from spec.state import ranges

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan, TableWrites

TABLE_OP_FIELDS = 6
TOKEN_OP_FIELDS = 4
COMPUTED_FIELDS = 2


@dataclass(frozen=True)
class StepWrites:
    table_ops: np.ndarray  # [n_t, 6] int64, see module docstring
    token_ops: np.ndarray  # [n_p, 4] int64
    computed: np.ndarray  # [n_c, 2] int64
    data: np.ndarray  # [D] int64

    @property
    def empty(self) -> bool:
        return not (len(self.table_ops) or len(self.token_ops) or len(self.computed))

    def packed(self) -> np.ndarray:  # [6 n_t + 4 n_p + 2 n_c + D] int64: the four parts end to end
        parts = (self.table_ops, self.token_ops, self.computed, self.data)
        return np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64, copy=False)


def apply_writes(dev: DeviceState, writes: StepWrites) -> None:
    """Kernel 1, for pools whose device state is separate from the host mirror (CUDA, or the interpreter).

    A host-mode pool shares its tensors with the mirror, so committing the plan already wrote them.
    """
    if writes.empty:
        return  # nothing to launch
    apply_writes_triton(
        dev,
        upload(writes.packed(), dev.device),
        len(writes.table_ops),
        len(writes.token_ops),
        len(writes.computed),
        len(writes.data),
    )


def step_writes(state: PoolState, plan: StepPlan) -> StepWrites:
    """The device writes of a validated step, from the host mirror as it stands BEFORE the plan is committed.

    Every touched (row, group) gets one table op holding its final contents over the range that changes:
    a replaced table (new or resumed request, possibly on a row freed in the same step) is written over
    max(old, new) entries with a zero tail, a freed row that nobody takes is cleared over its old entries,
    an append covers just its ids.
    """
    ops, data = [], []
    data_len = 0
    for g, writes in enumerate(plan.tables):
        old = state.num_blocks[g]  # [R] filled entries before the step
        rep, app = writes.replaced, ~writes.replaced
        replaced_rows, appended_rows = writes.rows[rep], writes.rows[app]
        cleared_rows = plan.freed_rows[~np.isin(plan.freed_rows, replaced_rows)]  # freed and nobody takes them
        none = np.zeros(cleared_rows.size, np.int64)
        rows = np.concatenate([replaced_rows, cleared_rows, appended_rows])  # [k] one op each
        lo = np.concatenate([0 * replaced_rows, none, writes.starts[app]])
        appended_end = writes.starts[app] + writes.lengths[app]
        count = np.concatenate([writes.lengths[rep], none, appended_end])  # [k] filled entries after the step
        hi = np.concatenate([np.maximum(writes.lengths[rep], old[replaced_rows]), old[cleared_rows], appended_end])
        ids = np.concatenate([_segments(writes, rep), _segments(writes, app)])
        num_ids = np.concatenate([writes.lengths[rep], none, writes.lengths[app]])  # [k] ids at the head of each op
        spans = hi - lo  # [k] entries each op writes: its ids, then zeros
        first = data_len + spans.cumsum() - spans  # [k] where each op's entries begin in the data
        block = np.zeros(int(spans.sum()), np.int64)
        which, within = ranges(num_ids)
        block[first[which] - data_len + within] = ids
        ops.append(np.stack([rows, np.full(rows.size, g), lo, hi, count, first], axis=1))
        data.append(block)
        data_len += block.size
    # prompts from column 0, then each drafting request's drafts from its known length (they are input ids
    # prepare reads, not known tokens: record_sampled writes the accepted ones over them)
    rows, columns, lengths = plan.new_rows, np.zeros_like(plan.new_rows), plan.prompt_lens
    token_data = [plan.prompt_tokens.astype(np.int64)]
    if plan.num_drafts is not None:
        drafting = np.flatnonzero(plan.num_drafts)  # [d] scheduler order
        rows = np.concatenate([rows, plan.rows[drafting]])
        columns = np.concatenate([columns, draft_columns(plan, plan.num_drafts)[drafting]])
        lengths = np.concatenate([lengths, plan.num_drafts[drafting]])
        token_data.append(plan.draft_ids.astype(np.int64))
    token_ops = np.stack([rows, columns, lengths, data_len + lengths.cumsum() - lengths], axis=1)
    cleared = plan.freed_rows[~np.isin(plan.freed_rows, plan.rows)]  # freed rows nobody takes: progress to 0
    computed = np.concatenate(
        [np.stack([plan.rows, plan.num_computed], axis=1), np.stack([cleared, 0 * cleared], axis=1)]
    )
    return StepWrites(
        table_ops=np.concatenate(ops).reshape(-1, TABLE_OP_FIELDS),
        token_ops=token_ops.reshape(-1, TOKEN_OP_FIELDS),
        computed=computed.reshape(-1, COMPUTED_FIELDS),
        data=np.concatenate([*data, *token_data]),
    )


def _segments(writes: TableWrites, keep: np.ndarray) -> np.ndarray:
    """The ids of the kept rows' writes, in order."""
    which, _ = ranges(writes.lengths)
    return writes.ids[keep[which]]
