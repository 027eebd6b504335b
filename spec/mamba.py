"""Mamba state groups: which state block a hybrid model's recurrent layers read and write, per request and step.

A KV cache group of kind "mamba" (vLLM's MambaSpec group) holds no KV per token. Each entry of a request's
table is a *state block*: one slot of the model's state cache (a Mamba layer's conv and SSM state; what a
state holds and how it is updated are the model's kernels' business, not slotmap's). The group's
block_size is vLLM's mamba_block_size: one table entry per block_size tokens, so that with prefix caching
("align" mode) the state after the last token of each full block can stay cached in that block; a
block_size >= max_model_len gives one entry per request (vLLM's mode without prefix caching). The table
also holds `num_speculative_blocks` entries past the running state's, for the states after each draft
(vLLM's MambaSpec.num_speculative_blocks): the table's width is cdiv(max_model_len, block_size) plus those.

The rule, for a batch row with num_computed c, seq_len s = c + num_scheduled, k drafts, block size B:

  write: column w = (s - 1) // B holds the state after the row's last non-draft token (position s - 1 - k),
         column w + i the state after its i-th draft (vLLM's mamba_get_block_table_tensor in "align" mode:
         `block_table[(seq_lens - 1) // block_size + arange(1 + num_speculative_blocks)]`).
  read:  the state after position c - 1, from the step that stored it:
         - a fresh row (new, or resumed with a new table): column (c - 1) // B, a prefix-cache hit, so c is a
           multiple of B (only whole blocks' states are cached); c == 0: no prior state (index -1);
         - a continuing row: its previous step (seq_len s', k' drafts, write column w') stored the states after
           positions s' - 1 - k' + i at columns w' + i, so the row reads column w' + a - 1, where
           a = c - (s' - 1 - k') is num_accepted_tokens (1 + the drafts kept; vLLM's preprocess_mamba reads
           `block_ids[prev_state_idx + num_accepted_tokens - 1]`). Without drafts a = 1: column (c - 1) // B.
  is_prefilling: c < the request's prompt length (vLLM's `num_computed_tokens < prefill_len`): the batch's own
         row_classes.is_prefilling (spec/classify.py), so the record and the graph dispatch read one flag.

Under async scheduling (spec/async_steps.py) a step sent before the verdict on its row's last k' drafts carries
the scheduler's optimistic c; the pool runs it at c - r (rule 2, r drafts rejected), and the read, num_accepted_tokens
a = 1 + k' - r and the write all follow that corrected count, as vLLM's kernels index the state with the accepted
count read on the device (`num_accepted_tokens`), never with the count sent. The read is therefore kept as its
base and `first` = s' - 1 - k' (a = c - first), and prepare takes c from the batch (seq_lens - num_scheduled): fast
computes it where the corrected count is, on the device. A row's last seq_len is its num_computed_tokens as the
pool holds it (corrected) plus the step's tokens. The checks read every count a verdict may give, c - k' .. c,
as rule 4 does for windows: 11 requires the state after c' - 1 kept for each (so such a step is sent at c = s'
exactly), 12 no null block at any entry some verdict reads or writes, 13 no other request writing a block some
verdict has this one write. Fresh rows are never corrected.

vLLM copies the read state into the write column before the forward when the two differ (preprocess_mamba);
slotmap names both blocks and leaves the copy, like every state update, to the model. BatchInputs carries,
per mamba group, `mamba_state_indices` [num_reqs, 1 + num_speculative_blocks] (the write blocks, -1 past the
row's drafts) and `mamba_prev_state_indices` [num_reqs] (the read block, -1 for no prior state), and
`is_prefilling`, `num_accepted_tokens`. A mamba group's slot_mappings entry is all PAD_SLOT_ID (no token writes
KV there) and its block_tables entry the gathered table rows, as for any group.

Validation (spec/validate.py's numbered checks, each for mamba groups only): 9 ids in range, non-null ids
distinct (null entries are allowed: vLLM's align mode nulls the entries it no longer needs); 10 at most
num_speculative_blocks drafts; 11 the read state exists (a fresh row's c a multiple of B, a continuing row's
a in 1 .. 1 + k') and the table reaches the read column and w + k; 12 no read or written state block is the
null block (vLLM PR #33937: block 0 gathered as a state index mixes requests' states); 13 no two requests of
a step write one state block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spec.async_steps import lowest_start
from spec.errors import BlockIdError, BlockTableOverflowError, MissingBlockError, NullBlockError
from spec.feature import Feature, in_batch_order
from spec.group_rules import AttentionRules, GroupRules, NoTokenKV
from spec.request import ScheduledRequest
from spec.types import (
    INDEX_DTYPE,
    NULL_BLOCK_ID,
    BatchInputs,
    KVCacheGroup,
    SchedulerOutput,
    WorkerConfig,
    feature_record,
)

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan

MAMBA = "mamba"
NO_STATE = -1  # a state index of a row with no prior state, or of a column the row writes nothing to


def has_mamba(config: WorkerConfig) -> bool:
    return any(g.kind == MAMBA for g in config.kv_groups)


def keeps_speculative_states(config: WorkerConfig) -> bool:
    """BatchInputs.num_accepted_tokens is given exactly when some mamba group keeps speculative blocks."""
    return any(g.kind == MAMBA and g.num_speculative_blocks > 0 for g in config.kv_groups)


class MambaRows:
    """Per row, what the next step's read needs of the last one: the pool's own record, cleared with the row.

    The last step's seq_len is the row's num_computed_tokens (the pool's, which async scheduling corrects after
    this commit: spec/async_steps.py rule 2) plus its scheduled tokens, so it is kept as the scheduled count.
    """

    def __init__(self, rows: int) -> None:
        self.last_num_scheduled = np.zeros(rows, np.int64)  # [R] tokens of the row's last step
        self.last_num_drafts = np.zeros(rows, np.int64)  # [R] drafts of the row's last step

    def commit(
        self,
        freed_rows: np.ndarray,  # [f] req_state_idx
        rows: np.ndarray,  # [n] scheduler order -> req_state_idx
        num_scheduled: np.ndarray,  # [n] scheduler order
        num_drafts: np.ndarray | None,  # [n] scheduler order; None: nobody drafts
    ) -> None:
        for array in (self.last_num_scheduled, self.last_num_drafts):
            array[freed_rows] = 0  # the next owner of a row starts from nothing (vLLM PR #37728)
        self.last_num_scheduled[rows] = num_scheduled
        self.last_num_drafts[rows] = 0 if num_drafts is None else num_drafts

    def last_seq_len(self, state: PoolState, row: int) -> int:
        """seq_len of the row's last step, from the pool's num_computed_tokens as it stands (corrected)."""
        return int(state.num_computed_tokens[row]) + int(self.last_num_scheduled[row])


@dataclass(frozen=True)
class StateRead:
    """Where one scheduled request's initial state is: the state after position num_computed - 1.

    The read column is `base // B + a - 1` with a = num_computed - first (num_accepted_tokens), taken from the count
    the step runs at: under async scheduling the corrected one, anywhere from `lowest` to the count sent.
    """

    base: int  # position whose block's column is the read column's base: c - 1 fresh, s' - 1 continuing; -1: none
    first: int  # position whose state the base column holds: c - 1 fresh, s' - 1 - k' continuing
    lowest: int  # the lowest num_computed a verdict may give the step (async rule 4's start); c where exact
    missing: str | None  # why the state after position c - 1 may never have been stored (check 11), else None

    def column(self, block_size: int, num_computed: int) -> int:
        """The entry read by the step run at `num_computed` (NO_STATE without a prior state)."""
        return NO_STATE if self.base < 0 else self.base // block_size + num_computed - self.first - 1


def state_read(
    num_computed: int,
    lowest: int,
    fresh: bool,
    last_seq_len: int,
    last_num_drafts: int,
    min_block: int,
) -> StateRead:
    """The read of one request: `fresh` for a new or resumed one, else from its last step's seq_len and drafts.

    `lowest` is the lowest num_computed the unread verdict on the last step's drafts may give the step (async
    scheduling, spec/async_steps.py rule 2; num_computed otherwise): the state must have been stored for every
    count from there to num_computed, so with k' unverified drafts the step must be sent at s' exactly. A fresh
    row's count is never corrected. `min_block` is the smallest mamba block size: a fresh row's hit must be whole
    blocks of every mamba group.
    """
    c = num_computed
    if fresh:
        missing = None if c % min_block == 0 else f"{c} computed: a cached state covers whole blocks of {min_block}"
        return StateRead(c - 1, c - 1, c, missing)
    first_stored = last_seq_len - 1 - last_num_drafts  # the states after positions first_stored .. last_seq_len - 1
    missing = None
    if not (lowest - first_stored >= 1 and c - first_stored <= 1 + last_num_drafts):
        stored = f"{first_stored}..{last_seq_len - 1}"
        verdict = "" if lowest == c else f" ({lowest} if the unread verdict rejects its {c - lowest} drafts)"
        missing = f"{c} computed{verdict}, but the last step stored the states after positions {stored} only"
    return StateRead(last_seq_len - 1, first_stored, lowest, missing)


def write_column(num_computed: int, num_scheduled: int, block_size: int) -> int:
    return (num_computed + num_scheduled - 1) // block_size


def written_columns(read: StateRead, num_computed: int, num_scheduled: int, block_size: int, num_drafts: int) -> range:
    """The entries a step may write, for every verdict (async: its count anywhere from read.lowest on): from the
    lowest count's write column to the sent count's, then its drafts' (rule 8's may follow unverified ones)."""
    low = write_column(read.lowest, num_scheduled, block_size)
    return range(low, write_column(num_computed, num_scheduled, block_size) + num_drafts + 1)


# ---- the numbered checks, for a mamba group (spec/validate.py calls them in its order) --------------------


def check_ids(req_id: str, g: int, group: KVCacheGroup, table: np.ndarray) -> None:
    """9: ids in range (the caller checked), non-null ids distinct; null entries are entries nothing reads."""
    real = np.sort(table[table != NULL_BLOCK_ID])
    if (real[1:] == real[:-1]).any():
        again = int(real[1:][real[1:] == real[:-1]][0])
        raise BlockIdError(req_id, f"block_ids[{g}]", f"state block {again} appears twice")


def check_drafts(req_id: str, g: int, group: KVCacheGroup, num_drafts: int) -> None:
    """10: each draft's state needs a speculative block of the table."""
    if num_drafts > group.num_speculative_blocks:
        detail = f"{num_drafts} drafts, but the mamba group keeps {group.num_speculative_blocks} speculative blocks"
        raise BlockTableOverflowError(req_id, f"block_ids[{g}]", detail)


def check_present(
    req_id: str, g: int, group: KVCacheGroup, table: np.ndarray, read: StateRead, c: int, write: int, num_drafts: int
) -> None:
    """11: the read state was stored, and the table reaches the read column and the last written one (both the
    highest at the count sent, `c`, whose write column is `write`)."""
    if read.missing is not None:
        raise MissingBlockError(req_id, "num_computed_tokens", f"no state to start from: {read.missing}")
    last = max(read.column(group.block_size, c), write + num_drafts)
    if last >= table.size:
        detail = f"the state needs entry {last} (write column {write} + {num_drafts} drafts), table has {table.size}"
        raise MissingBlockError(req_id, f"block_ids[{g}]", detail)


def check_not_null(
    req_id: str, g: int, group: KVCacheGroup, table: np.ndarray, read: StateRead, c: int, written: range
) -> None:
    """12: no state the step reads or writes, for any verdict (counts read.lowest .. c), is the null block, which
    every request would share."""
    for count in range(read.lowest, c + 1):
        read_col = read.column(group.block_size, count)
        if read_col != NO_STATE and table[read_col] == NULL_BLOCK_ID:
            raise NullBlockError(req_id, f"block_ids[{g}]", f"the state read (entry {read_col}) is the null block")
    blocks = table[written.start : written.stop]
    if (blocks == NULL_BLOCK_ID).any():
        entry = written.start + int(np.flatnonzero(blocks == NULL_BLOCK_ID)[0])
        raise NullBlockError(req_id, f"block_ids[{g}]", f"the state written to entry {entry} is the null block")


def written_blocks(table: np.ndarray, written: range) -> np.ndarray:
    """13: the state blocks a step may write, for any verdict (no two requests may share one)."""
    return table[written.start : written.stop].astype(np.int64)


# ---- the plan and the batch ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MambaSteps:
    """StepPlan.mamba: the reads of the scheduled requests, in scheduler order."""

    bases: np.ndarray  # [n] int64 scheduler order: StateRead.base
    firsts: np.ndarray  # [n] int64 scheduler order: StateRead.first (num_accepted_tokens = num_computed - first)


def plan_fields(reads: list[StateRead]) -> MambaSteps:
    """`reads` in scheduler order."""
    return MambaSteps(
        bases=np.array([r.base for r in reads], np.int64),
        firsts=np.array([r.first for r in reads], np.int64),
    )


@feature_record
@dataclass(frozen=True)
class StateIndices:
    """Mamba's record of a batch (BatchInputs.features): the mamba groups' fields, in batch order."""

    # per group (None for the other groups): [num_reqs, 1 + num_speculative_blocks(g)] int32, the state blocks the
    # step writes: column 0 the state after the row's last non-draft token, column i after its i-th draft, -1 past
    # the row's drafts
    mamba_state_indices: Any
    mamba_prev_state_indices: Any  # per group as above: [num_reqs] int32, the state block the row starts from, or -1
    is_prefilling: Any  # [num_reqs] bool, num_computed_tokens < the request's prompt length: the batch's row classes'
    # [num_reqs] int32, tokens of the row's previous step whose state is kept (1 + its accepted drafts; 1 for a row
    # fresh or without drafts); None unless a mamba group keeps speculative blocks (vLLM's, with drafts)
    num_accepted_tokens: Any


def state_indices(
    config: WorkerConfig,
    block_tables: list[np.ndarray],  # per group: [R, max_blocks_per_req(g)] req_state_idx -> block ids
    index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    seq_lens: np.ndarray,  # [num_reqs] batch order
    num_computed: np.ndarray,  # [num_reqs] batch order: the count the step runs at (async: corrected, rule 2)
    num_drafts: np.ndarray,  # [num_reqs] batch order
    steps: MambaSteps,  # arrays in batch order (`batch_steps`)
    # [num_reqs] bool the batch's row_classes.is_prefilling (spec/classify.py); the same for the count sent and the
    # corrected one (async): a row with unverified drafts sampled, so both counts are past its prompt
    is_prefilling: np.ndarray,
) -> StateIndices:
    writes: list[np.ndarray | None] = []
    prevs: list[np.ndarray | None] = []
    accepted = num_computed.astype(np.int64) - steps.firsts  # [num_reqs] num_accepted_tokens (1 for a fresh row)
    for g, group in enumerate(config.kv_groups):
        if group.kind != MAMBA:
            writes.append(None)
            prevs.append(None)
            continue
        table = block_tables[g]
        width = 1 + group.num_speculative_blocks
        write = (seq_lens.astype(np.int64) - 1) // group.block_size  # [num_reqs]
        cols = write[:, None] + np.arange(width)  # [num_reqs, width]
        used = np.arange(width)[None, :] <= num_drafts[:, None]  # [num_reqs, width] columns the row writes
        picked = table[index_mapping[:, None], np.where(used, cols, 0)]
        writes.append(np.where(used, picked, NO_STATE).astype(INDEX_DTYPE))
        has_prior = steps.bases >= 0  # [num_reqs]
        read = np.where(has_prior, steps.bases // group.block_size + accepted - 1, 0)  # [num_reqs]
        prevs.append(np.where(has_prior, table[index_mapping, read], NO_STATE).astype(INDEX_DTYPE))
    kept = accepted.astype(INDEX_DTYPE) if keeps_speculative_states(config) else None
    return StateIndices(tuple(writes), tuple(prevs), np.array(is_prefilling, np.bool_), kept)


def batch_steps(steps: MambaSteps, order: np.ndarray | None) -> MambaSteps:
    """The plan's arrays in batch order (`order` [num_reqs] batch_idx -> scheduler index; None: the same)."""
    if order is None:
        return steps
    return MambaSteps(steps.bases[order], steps.firsts[order])


class Mamba(Feature):
    """The feature (spec/feature.py): each row's last step, where each request's state is read, the groups' rules."""

    name = MAMBA

    @classmethod
    def configured(cls, config: WorkerConfig) -> bool:
        return has_mamba(config)

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.rows = MambaRows(config.max_num_reqs)  # each row's last step, which its next state read needs
        self.min_block = min(g.block_size for g in config.kv_groups if g.kind == MAMBA)
        self.reads: dict[str, StateRead] = {}  # req_id -> its read, for the step being planned
        rules = MambaRules(self)
        groups = enumerate(config.kv_groups)
        self._rules: dict[int, GroupRules] = {g: rules for g, group in groups if group.kind == MAMBA}

    def group_rules(self) -> dict[int, GroupRules]:
        return self._rules

    def read(self, state: PoolState, sched: SchedulerOutput, scheduled: list[ScheduledRequest]) -> None:
        """Each request's read: fresh ones from their prefix-cache hit, the others from their row's last step."""
        rows = self.rows
        self.reads = {}
        for s in scheduled:
            c = s.num_computed
            row = state.row_of.get(s.req_id)
            if row is None:  # a new request (check 3): its known tokens are its prompt; the row's record is not its own
                self.reads[s.req_id] = state_read(c, c, True, 0, 0, self.min_block)
                continue
            last = rows.last_seq_len(state, row), int(rows.last_num_drafts[row])
            fresh = s.fresh_tables
            lowest = lowest_start(state, s.req_id, c, s.resumed)  # rule 2 corrects no fresh row's count
            self.reads[s.req_id] = state_read(c, lowest, fresh, *last, self.min_block)

    def plan(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan) -> MambaSteps:
        return plan_fields([self.reads[r] for r in plan.req_ids])  # scheduler order

    def commit(self, state: PoolState, plan: StepPlan) -> None:
        self.rows.commit(plan.freed_rows, plan.rows, plan.num_scheduled, plan.num_drafts)

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> StateIndices:
        steps: MambaSteps = plan.features[self.name]
        drafts = np.zeros(plan.rows.size, np.int64) if plan.num_drafts is None else plan.num_drafts
        # the count the step runs at: the batch's, corrected by the drafts the last record rejected (async rule 2),
        # never the plan's, which is the count the scheduler sent
        num_computed = np.asarray(batch.seq_lens) - np.asarray(batch.num_scheduled_tokens)
        return state_indices(
            self.config,
            state.block_tables,
            np.asarray(batch.index_mapping),
            np.asarray(batch.seq_lens),
            num_computed,
            in_batch_order(drafts, order),
            batch_steps(steps, order),
            batch.row_classes.is_prefilling,
        )

    def pad(self, record: StateIndices, num_reqs_padded: int, pad_rows: Callable[[str, Any, int, Any], Any]) -> Any:
        """Padded rows read and write no state (NO_STATE: vLLM's mamba builders pad state indices with PAD_SLOT_ID),
        are not prefilling (vLLM zeroes is_prefilling past num_reqs) and keep 1 accepted token (vLLM's fill(1))."""
        n = num_reqs_padded

        def per_group(name: str, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(None if a is None else pad_rows(f"{name}/{g}", a, n, NO_STATE) for g, a in enumerate(arrays))

        accepted = record.num_accepted_tokens
        return StateIndices(
            mamba_state_indices=per_group("mamba_state_indices", record.mamba_state_indices),
            mamba_prev_state_indices=per_group("mamba_prev_state_indices", record.mamba_prev_state_indices),
            is_prefilling=pad_rows("mamba_is_prefilling", record.is_prefilling, n, False),
            num_accepted_tokens=None if accepted is None else pad_rows("num_accepted_tokens", accepted, n, 1),
        )


class MambaRules(NoTokenKV):
    """A mamba group's table: the module docstring's checks 9 to 13; no token writes KV here."""

    def __init__(self, feature: Mamba) -> None:
        self.feature = feature

    def check_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        AttentionRules.check_range(state, s, g)
        check_ids(s.req_id, g, state.config.kv_groups[g], s.tables[g])

    def held_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        table = s.tables[g]  # every non-null entry is a state the request holds
        return table[table != NULL_BLOCK_ID]

    def check_size(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        super().check_size(state, s, g)
        check_drafts(s.req_id, g, state.config.kv_groups[g], s.num_drafts)

    def check_present(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        group = state.config.kv_groups[g]
        write = write_column(s.num_computed, s.num_scheduled, group.block_size)
        read = self.feature.reads[s.req_id]
        check_present(s.req_id, g, group, s.tables[g], read, s.num_computed, write, s.num_drafts)

    def check_not_null(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        group = state.config.kv_groups[g]
        read = self.feature.reads[s.req_id]
        written = written_columns(read, s.num_computed, s.num_scheduled, group.block_size, s.num_drafts)
        check_not_null(s.req_id, g, group, s.tables[g], read, s.num_computed, written)

    def written(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        """State blocks, not slots: no two requests may write one, whatever the verdicts."""
        read = self.feature.reads[s.req_id]
        block_size = state.config.kv_groups[g].block_size
        return written_blocks(s.tables[g], written_columns(read, s.num_computed, s.num_scheduled, block_size,
                                                           s.num_drafts))  # fmt: skip
