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
  is_prefilling: c < the request's prompt length (vLLM's `num_computed_tokens < prefill_len`).

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

import dataclasses
from dataclasses import dataclass

import numpy as np

from spec.errors import BlockIdError, BlockTableOverflowError, MissingBlockError, NullBlockError
from spec.types import INDEX_DTYPE, NULL_BLOCK_ID, PAD_SLOT_ID, BatchInputs, KVCacheGroup, WorkerConfig

MAMBA = "mamba"
NO_STATE = -1  # a state index of a row with no prior state, or of a column the row writes nothing to


def has_mamba(config: WorkerConfig) -> bool:
    return any(g.kind == MAMBA for g in config.kv_groups)


def keeps_speculative_states(config: WorkerConfig) -> bool:
    """BatchInputs.num_accepted_tokens is given exactly when some mamba group keeps speculative blocks."""
    return any(g.kind == MAMBA and g.num_speculative_blocks > 0 for g in config.kv_groups)


class MambaRows:
    """Per row, what the next step's read needs of the last one: the pool's own record, cleared with the row."""

    def __init__(self, rows: int) -> None:
        self.prompt_lens = np.zeros(rows, np.int64)  # [R] the request's prompt length
        self.last_seq_lens = np.zeros(rows, np.int64)  # [R] seq_len of the row's last step
        self.last_num_drafts = np.zeros(rows, np.int64)  # [R] drafts of the row's last step

    def commit(
        self,
        freed_rows: np.ndarray,  # [f] req_state_idx
        new_rows: np.ndarray,  # [k] req_state_idx of the new requests
        prompt_lens: np.ndarray,  # [k]
        rows: np.ndarray,  # [n] scheduler order -> req_state_idx
        seq_lens: np.ndarray,  # [n] scheduler order
        num_drafts: np.ndarray | None,  # [n] scheduler order; None: nobody drafts
    ) -> None:
        for array in (self.prompt_lens, self.last_seq_lens, self.last_num_drafts):
            array[freed_rows] = 0  # the next owner of a row starts from nothing (vLLM PR #37728)
        self.prompt_lens[new_rows] = prompt_lens
        self.last_seq_lens[rows] = seq_lens
        self.last_num_drafts[rows] = 0 if num_drafts is None else num_drafts


@dataclass(frozen=True)
class StateRead:
    """Where one scheduled request's initial state is: the state after position num_computed - 1."""

    base: int  # position whose block's column is the read column's base: c - 1 fresh, s' - 1 continuing; -1: none
    num_accepted: int  # the read column is base // B + num_accepted - 1
    prompt_len: int
    missing: str | None  # why the state after position c - 1 was never stored (check 11), else None

    def column(self, block_size: int) -> int:
        return NO_STATE if self.base < 0 else self.base // block_size + self.num_accepted - 1


def state_read(
    num_computed: int, prompt_len: int, fresh: bool, last_seq_len: int, last_num_drafts: int, min_block: int
) -> StateRead:
    """The read of one request: `fresh` for a new or resumed one, else from its last step's seq_len and drafts.

    `min_block` is the smallest mamba block size: a fresh row's hit must be whole blocks of every mamba group.
    """
    c = num_computed
    if fresh:
        missing = None if c % min_block == 0 else f"{c} computed: a cached state covers whole blocks of {min_block}"
        return StateRead(c - 1, 1, prompt_len, missing)
    first_stored = last_seq_len - 1 - last_num_drafts  # the states after positions first_stored .. last_seq_len - 1
    accepted = c - first_stored
    missing = None
    if not 1 <= accepted <= 1 + last_num_drafts:
        stored = f"{first_stored}..{last_seq_len - 1}"
        missing = f"{c} computed, but the last step stored the states after positions {stored} only"
    return StateRead(last_seq_len - 1, accepted, prompt_len, missing)


def write_column(num_computed: int, num_scheduled: int, block_size: int) -> int:
    return (num_computed + num_scheduled - 1) // block_size


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
    req_id: str, g: int, group: KVCacheGroup, table: np.ndarray, read: StateRead, write: int, num_drafts: int
) -> None:
    """11: the read state was stored, and the table reaches the read column and the last written one."""
    if read.missing is not None:
        raise MissingBlockError(req_id, "num_computed_tokens", f"no state to start from: {read.missing}")
    last = max(read.column(group.block_size), write + num_drafts)
    if last >= table.size:
        detail = f"the state needs entry {last} (write column {write} + {num_drafts} drafts), table has {table.size}"
        raise MissingBlockError(req_id, f"block_ids[{g}]", detail)


def check_not_null(
    req_id: str, g: int, group: KVCacheGroup, table: np.ndarray, read: StateRead, write: int, num_drafts: int
) -> None:
    """12: no state the step reads or writes is the null block, which every request would share."""
    read_col = read.column(group.block_size)
    if read_col != NO_STATE and table[read_col] == NULL_BLOCK_ID:
        raise NullBlockError(req_id, f"block_ids[{g}]", f"the state read (entry {read_col}) is the null block")
    written = table[write : write + num_drafts + 1]
    if (written == NULL_BLOCK_ID).any():
        entry = write + int(np.flatnonzero(written == NULL_BLOCK_ID)[0])
        raise NullBlockError(req_id, f"block_ids[{g}]", f"the state written to entry {entry} is the null block")


def written_blocks(table: np.ndarray, write: int, num_drafts: int) -> np.ndarray:
    """13: the state blocks a step writes (no two requests may share one)."""
    return table[write : write + num_drafts + 1].astype(np.int64)


# ---- the plan and the batch ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MambaSteps:
    """StepPlan.mamba: the reads of the scheduled requests, in scheduler order."""

    bases: np.ndarray  # [n] int64 scheduler order: StateRead.base
    num_accepted: np.ndarray  # [n] int64 scheduler order
    is_prefilling: np.ndarray  # [n] bool scheduler order


def plan_fields(reads: list[StateRead], num_computed: np.ndarray) -> MambaSteps:
    """`reads` and `num_computed` [n] in scheduler order."""
    return MambaSteps(
        bases=np.array([r.base for r in reads], np.int64),
        num_accepted=np.array([r.num_accepted for r in reads], np.int64),
        is_prefilling=num_computed < np.array([r.prompt_len for r in reads], np.int64),
    )


@dataclass(frozen=True)
class StateIndices:
    """The BatchInputs fields of the mamba groups, in batch order."""

    mamba_state_indices: tuple[np.ndarray | None, ...]  # per group: [num_reqs, 1 + num_speculative_blocks] int32
    mamba_prev_state_indices: tuple[np.ndarray | None, ...]  # per group: [num_reqs] int32
    is_prefilling: np.ndarray  # [num_reqs] bool
    num_accepted_tokens: np.ndarray | None  # [num_reqs] int32


def state_indices(
    config: WorkerConfig,
    block_tables: list[np.ndarray],  # per group: [R, max_blocks_per_req(g)] req_state_idx -> block ids
    index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    seq_lens: np.ndarray,  # [num_reqs] batch order
    num_drafts: np.ndarray,  # [num_reqs] batch order
    steps: MambaSteps,  # arrays in batch order (`batch_steps`)
) -> StateIndices:
    writes: list[np.ndarray | None] = []
    prevs: list[np.ndarray | None] = []
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
        read = np.where(has_prior, steps.bases // group.block_size + steps.num_accepted - 1, 0)  # [num_reqs]
        prevs.append(np.where(has_prior, table[index_mapping, read], NO_STATE).astype(INDEX_DTYPE))
    accepted = steps.num_accepted.astype(INDEX_DTYPE) if keeps_speculative_states(config) else None
    return StateIndices(tuple(writes), tuple(prevs), steps.is_prefilling.copy(), accepted)


def batch_steps(steps: MambaSteps, order: np.ndarray | None) -> MambaSteps:
    """The plan's arrays in batch order (`order` [num_reqs] batch_idx -> scheduler index; None: the same)."""
    if order is None:
        return steps
    return MambaSteps(steps.bases[order], steps.num_accepted[order], steps.is_prefilling[order])


def with_state_indices(
    batch: BatchInputs,
    config: WorkerConfig,
    block_tables: list[np.ndarray],  # per group: [R, max_blocks_per_req(g)] the pool's tables
    steps: MambaSteps | None,  # the plan's reads, scheduler order (StepPlan.mamba)
    scheduled_req_ids: tuple[str, ...],  # [n] scheduler order
    num_drafts: np.ndarray,  # [num_reqs] batch order
) -> BatchInputs:
    """The batch with its mamba fields, and PAD_SLOT_ID for every token in the mamba groups' slot mappings."""
    if steps is None:
        return batch
    at = {r: i for i, r in enumerate(scheduled_req_ids)}
    order = np.array([at[r] for r in batch.req_ids], np.int64)  # [num_reqs] batch_idx -> scheduler index
    index_mapping = np.asarray(batch.index_mapping)
    fields = state_indices(
        config, block_tables, index_mapping, np.asarray(batch.seq_lens), num_drafts, batch_steps(steps, order)
    )
    slot_mappings = tuple(
        np.full_like(slots, PAD_SLOT_ID) if group.kind == MAMBA else slots
        for slots, group in zip(batch.slot_mappings, config.kv_groups, strict=True)
    )
    return dataclasses.replace(batch, slot_mappings=slot_mappings, **vars(fields))
