"""Stage 1 on the device: the pool's persistent tensors, and the host mirror validation reads.

The device holds what the kernels read: token ids, block tables, block counts and num_computed_tokens.
The host keeps a `spec.state.PoolState` (a HostMirror, which fast.pool owns; no token ids) so that
validation, batch ordering and the choice of what to upload never need a device->host copy.

All groups' block tables live in ONE flat int32 tensor, group g's table being the contiguous
[R, max_blocks_per_req(g)] slice starting at R * table_offset(g). One buffer means one kernel
argument for every group, so a single launch can address all of them.

Token ids are int32 (spec.types.TOKEN_STORAGE_DTYPE) in an array that grows with the longest request
held (`reserve_tokens`), not [R, max_model_len] up front: a pool sized for 4096 x 131072 tokens
allocates nothing for tokens until requests arrive, and a step's token reads stay in a few cache lines.

Host mode (`DeviceState(config, cpu, mirror=host_mirror)`, CPU tensors without Triton): the "device" is
host memory, so keeping a second copy would only double every write. The tensors are then views of
the mirror's arrays (HostMirror keeps its block tables as views of one flat buffer, as above) and of a
NumPy token array, `token_ids_np`: a commit to the mirror is the device write. `num_blocks` is then
the mirror's int64 array (nothing on the host path reads it as int32). With Triton (CUDA, or CPU under
the interpreter) the state stays separate, so the kernels' writes are what the tests check.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fast.runtime import upload
from spec.state import PoolState, StepPlan, TableWrites
from spec.types import NULL_BLOCK_ID, WorkerConfig

_MIN_TOKEN_CAPACITY = 256
_TOKEN_CAPACITY_ALIGN = 64  # columns: rows start on cache-line boundaries


def table_layout(config: WorkerConfig) -> tuple[np.ndarray, np.ndarray]:
    """All groups' tables in one flat buffer: per group its width [G] (max_blocks_per_req) and its offset [G]
    (the widths of the groups before it); group g's [R, width] table starts at R * offset[g]."""
    widths = np.array([config.max_blocks_per_req(g) for g in range(len(config.kv_groups))], np.int64)
    return widths, np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)


class DeviceState:
    def __init__(self, config: WorkerConfig, device: torch.device, mirror: HostMirror | None = None) -> None:
        self.config = config
        self.device = device
        rows, groups = config.max_num_reqs, len(config.kv_groups)
        widths, offsets = table_layout(config)
        self.widths_np = widths  # [G] max_blocks_per_req(g)
        self.offsets_np = offsets  # [G] table_offset(g), in units of rows' widths
        self.block_sizes_np = np.array([g.block_size for g in config.kv_groups], np.int64)  # [G]
        self.total_width = int(widths.sum())
        # [3, G] int64, the kernels' per-group constants, row r at group_meta_ptr + r * G:
        # block_size | max_blocks_per_req (width) | table_offset (the widths of the groups before g)
        self.group_meta = torch.from_numpy(np.stack([self.block_sizes_np, widths, offsets])).to(device)
        self.token_capacity = 0  # token columns held: reserve_tokens grows it
        if mirror is None:
            self.token_ids_np: np.ndarray | None = None
            self.tables_np: np.ndarray | None = None
            self.token_ids = torch.zeros((rows, 0), dtype=torch.int32, device=device)  # [R, token_capacity]
            self.tables = torch.zeros(rows * self.total_width, dtype=torch.int32, device=device)  # all groups, flat
            self.num_blocks = torch.zeros((groups, rows), dtype=torch.int32, device=device)  # [G, R] filled entries
            self.num_computed = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        else:
            if device.type != "cpu":
                raise ValueError(f"only CPU state can be shared with the host mirror, not {device}")
            self.token_ids_np = np.zeros((rows, 0), np.int32)  # [R, token_capacity]
            self.token_ids = torch.from_numpy(self.token_ids_np)
            self.tables_np = mirror.flat_tables  # [R * total_width] the mirror's tables, all groups, one buffer
            self.tables = torch.from_numpy(self.tables_np)
            self.num_blocks = torch.from_numpy(mirror.num_blocks)  # [G, R] int64, the mirror's
            self.num_computed = torch.from_numpy(mirror.num_computed_tokens)  # [R]

        self._table_views = tuple(  # per group: a contiguous [R, max_blocks_per_req(g)] view of `tables`
            self.tables[rows * int(off) : rows * int(off + width)].view(rows, int(width))
            for off, width in zip(offsets, widths, strict=True)
        )

    def reserve_tokens(self, length: int) -> None:
        """Room for `length` tokens in every row; grows geometrically (amortised O(1) a token), up to max_model_len."""
        if length <= self.token_capacity:
            return
        limit = self.config.max_model_len
        capacity = min(limit, max(length, 2 * self.token_capacity, _MIN_TOKEN_CAPACITY))
        capacity = min(limit, -(-capacity // _TOKEN_CAPACITY_ALIGN) * _TOKEN_CAPACITY_ALIGN)
        held = self.token_capacity
        if self.token_ids_np is not None:
            grown = np.zeros((self.config.max_num_reqs, capacity), np.int32)
            grown[:, :held] = self.token_ids_np
            self.token_ids_np, self.token_ids = grown, torch.from_numpy(grown)
        else:
            tensor = torch.zeros((self.config.max_num_reqs, capacity), dtype=torch.int32, device=self.device)
            tensor[:, :held] = self.token_ids
            self.token_ids = tensor
        self.token_capacity = capacity

    def store_tokens(
        self,
        rows: np.ndarray,  # [k] req_state_idx (repeated for several tokens of one row)
        positions: np.ndarray,  # [k] where each id goes
        tokens: np.ndarray,  # [k] validated ids
    ) -> None:
        """Scattered token writes (drafts, accepted tokens): in place in host mode, one upload and scatter else."""
        if not rows.size:
            return
        self.reserve_tokens(int(positions.max()) + 1)
        if self.token_ids_np is not None:
            self.token_ids_np[rows, positions] = tokens
        else:
            flat = rows * self.token_ids.stride(0) + positions
            packed = upload(np.concatenate([flat, tokens.astype(np.int64)]), self.device)
            self.token_ids.view(-1)[packed[: rows.size]] = packed[rows.size :].to(self.token_ids.dtype)

    def table(self, group: int) -> torch.Tensor:
        """Group g's persistent block table, [R, max_blocks_per_req(g)] int32, sharing `tables`' memory."""
        return self._table_views[group]


class HostMirror(PoolState):
    """spec's PoolState with its table writes compiled: the same commit, without a dozen NumPy calls per group.

    Its tables are views of one flat buffer (`flat_tables`, table_layout's order), allocated here once: in host
    mode the device state's `tables` tensor shares that memory, so a commit to the mirror is the device write.
    """

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        rows = config.max_num_reqs
        widths, offsets = table_layout(config)
        self.flat_tables = np.full(rows * int(widths.sum()), NULL_BLOCK_ID, np.int32)  # [R * total_width]
        self.block_tables = [  # per group [R, max_blocks_per_req(g)], a view of flat_tables; never rebound
            self.flat_tables[rows * int(off) : rows * int(off + width)].reshape(rows, int(width))
            for off, width in zip(offsets, widths, strict=True)
        ]
        # [G, R] bumped whenever a row's table changes: a gathered copy of the row with the same version is current
        # (fast.slots.tables_and_slots copies only the rows whose version moved)
        self.table_versions = np.zeros((len(config.kv_groups), rows), np.int64)
        self._offsets, self._widths = offsets.astype(np.int64), widths.astype(np.int64)  # [G] table_layout's

    def commit(self, plan: StepPlan) -> None:
        """spec's PoolState.commit with its array writes in one compiled pass (a dozen NumPy calls in spec, most
        of a step's commit when requests finish and start); the tables' versions bumped with every change."""
        freed, new_rows = plan.freed_rows, plan.new_rows
        for row in freed.tolist():
            del self.row_of[self.req_ids[row]]
            self.req_ids[row] = None
        for row, req_id in zip(new_rows.tolist(), plan.new_req_ids, strict=True):
            self.req_ids[row] = req_id
            self.row_of[req_id] = row
        _commit_rows(freed, new_rows, plan.prompt_lens, self.num_known_tokens, self.num_computed_tokens,
                     self.prompt_lens, self.num_blocks, self.sampled_in, self.flat_tables, self._offsets,
                     self._widths, self.table_versions)  # fmt: skip
        for g, writes in enumerate(plan.tables):
            if writes.rows.size:
                self.write_table(g, writes)
        _set_at(self.num_computed_tokens, plan.rows, plan.num_computed)

    def write_table(self, g: int, writes: TableWrites) -> None:
        w = writes
        write_tables(self.block_tables[g], self.num_blocks[g], w.rows, w.starts, w.lengths, w.ids, w.replaced,
                     self.table_versions[g])  # fmt: skip


@njit(cache=True, nogil=True)
def _commit_rows(  # pragma: no cover - compiled; tested through the pool against spec
    freed: np.ndarray,  # [f] int64 req_state_idx of the finished requests
    new_rows: np.ndarray,  # [k] int64 req_state_idx of the new requests
    prompt_lens: np.ndarray,  # [k] int64 their prompt lengths
    num_known: np.ndarray,  # [R] int64
    num_computed: np.ndarray,  # [R] int64
    row_prompt_lens: np.ndarray,  # [R] int64
    num_blocks: np.ndarray,  # [G, R] int64
    sampled_in: np.ndarray,  # [R] int64
    flat_tables: np.ndarray,  # [R * total_width] int32, every group's [R, width] table
    offsets: np.ndarray,  # [G] int64 each group's table offset, in rows' widths
    widths: np.ndarray,  # [G] int64
    versions: np.ndarray,  # [G, R] int64 table versions
) -> None:
    """spec's commit for finished rows (cleared: no count, no pending token, no stale id for the next owner) and
    new rows (known tokens and prompt length)."""
    num_rows = num_known.shape[0]
    for i in range(freed.shape[0]):
        row = freed[i]
        num_known[row] = num_computed[row] = row_prompt_lens[row] = 0
        sampled_in[row] = -1
        for g in range(offsets.shape[0]):
            num_blocks[g, row] = 0
            versions[g, row] += 1
            start = num_rows * offsets[g] + row * widths[g]
            flat_tables[start : start + widths[g]] = NULL_BLOCK_ID
    for i in range(new_rows.shape[0]):
        num_known[new_rows[i]] = row_prompt_lens[new_rows[i]] = prompt_lens[i]


@njit(cache=True, nogil=True)
def _set_at(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[at] = values, at [n] distinct."""
    for i in range(at.shape[0]):
        out[at[i]] = values[i]


@njit(cache=True, nogil=True)
def write_tables(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32, one group's table (the host mirror's)
    num_blocks: np.ndarray,  # [R] int64 filled entries per row
    rows: np.ndarray,  # [k] int64 req_state_idx
    starts: np.ndarray,  # [k] int64 first entry written
    lengths: np.ndarray,  # [k] int64 ids written
    ids: np.ndarray,  # [sum(lengths)] int64, row after row
    replaced: np.ndarray,  # [k] bool: the row's table is replaced (entries past the new ones cleared)
    versions: np.ndarray,  # [R] int64 each row's table version, bumped for every row written
) -> None:
    """One group's table changes of a validated step: appends after each row's filled entries, or whole tables."""
    at = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if replaced[i]:
            table[row, :] = NULL_BLOCK_ID
        for j in range(lengths[i]):
            table[row, starts[i] + j] = ids[at + j]
        at += lengths[i]
        num_blocks[row] = starts[i] + lengths[i]
        versions[row] += 1


@njit(cache=True, nogil=True)
def write_prompts(  # pragma: no cover - compiled; tested through the pool against spec
    token_ids: np.ndarray,  # [R, capacity] int32 (room reserved)
    rows: np.ndarray,  # [k] int64 req_state_idx of the new requests
    lengths: np.ndarray,  # [k] int64 prompt lengths
    tokens: np.ndarray,  # [sum(lengths)] int32 the prompts end to end
) -> None:
    at = 0
    for i in range(rows.shape[0]):
        token_ids[rows[i], : lengths[i]] = tokens[at : at + lengths[i]]
        at += lengths[i]
