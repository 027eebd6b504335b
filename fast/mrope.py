"""M-RoPE positions on torch tensors: spec/mrope.py's rule, the tables stored where prepare reads them.

Each row's table length and delta stay on the host (prepare gathers them per batch row and, under Triton,
uploads them with the launch: `[2, num_reqs]`, no device state to keep in step). The tables themselves:
`[R, 3, capacity]` int64, `capacity` growing (doubling, up to max_model_len) with the longest table held,
as fast.state grows its token store: an engine-sized pool (4096 rows x 131072 tokens would be 12 GiB)
allocates nothing until a multimodal request arrives. In host mode they are NumPy (prepare is a compiled
loop over them); under Triton they live on the device (prepare is fast.kernels.mrope's one launch).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from numba import njit

from fast.fallback import Fallback
from fast.feature import FastFeature, Placement
from fast.kernels.mrope import mrope_positions_triton
from fast.runtime import interpret, upload
from spec.mrope import MAX_MROPE_DELTA, NUM_MROPE_ROWS, MRope, MRopeInputs, MRopeWrites, as_table
from spec.state import PoolState, StepPlan
from spec.types import BatchInputs, SchedulerOutput, WorkerConfig

_MIN_CAPACITY = 256


class FastMRope(FastFeature, MRope):
    """spec's M-RoPE feature with the tables kept where prepare reads them (DeviceMRope), its fields of new
    requests read by the bulk planner (`plan_in_bulk`)."""

    reads_fields_in_bulk = True  # mrope_positions, mrope_position_delta

    def __init__(self, config: WorkerConfig, placement: Placement) -> None:
        self.placement = placement
        self.tables = DeviceMRope(config, placement.device, placement.host_mode)
        MRope.__init__(self, config, rows=self.tables)

    def plan_in_bulk(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan,
                     marks: np.ndarray | None) -> MRopeWrites | Fallback | None:  # fmt: skip
        """spec's check 1 of the new requests' M-RoPE inputs (spec.mrope.check_mrope_inputs), then their tables as
        spec's plan has them; the Fallback that leaves the step to plan_step (which names the fault) at the first
        fault. The prompts' lengths come from the plan, which read every prompt already."""
        carrying: list[tuple[int, int, np.ndarray]] = []  # (row, delta, [3, prompt_len] table)
        for new, row, prompt_len in zip(sched.new_requests, new_rows.tolist(), plan.prompt_lens.tolist(), strict=True):
            delta, given = new.mrope_position_delta, new.mrope_positions
            if type(delta) is not int or abs(delta) >= MAX_MROPE_DELTA or (given is None and delta):
                return Fallback.FEATURE_RULES
            if given is None:
                continue
            table = _as_table(given)
            if table is None or table.shape[1] != prompt_len:
                return Fallback.FEATURE_RULES
            carrying.append((row, delta, table))
        if not carrying:
            return None
        return MRopeWrites(
            rows=np.array([row for row, _, _ in carrying], np.int64),
            lengths=np.array([table.shape[1] for _, _, table in carrying], np.int64),
            deltas=np.array([delta for _, delta, _ in carrying], np.int64),
            tables=np.concatenate([table for _, _, table in carrying], 1),
        )

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> MRopeInputs:
        rows = plan.rows if order is None else plan.rows[order]  # [num_reqs] batch_idx -> req_state_idx, host copy
        with interpret(self.placement.interpret):
            return MRopeInputs(self.tables.positions(batch, rows))


def _as_table(value: object) -> np.ndarray | None:
    """spec.mrope.as_table, a table of rows of Python ints read a row at a time by array('q') (which takes what
    operator.index takes, and refuses floats and values past int64), where spec's reads each value through
    operator.index."""
    if type(value) in (tuple, list) and len(value) == NUM_MROPE_ROWS:  # type: ignore[arg-type]
        rows = cast(Sequence[Any], value)
        if all(type(row) in (tuple, list) for row in rows) and len(set(map(len, rows))) == 1:
            try:
                joined = b"".join([array("q", row) for row in rows])  # array() reads a tuple or list at C speed
                return np.frombuffer(joined, np.int64).reshape(NUM_MROPE_ROWS, -1)
            except (TypeError, OverflowError):
                return None
    return as_table(value)


class DeviceMRope:
    def __init__(self, config: WorkerConfig, device: torch.device, host_mode: bool) -> None:
        rows = config.max_num_reqs
        self.config, self.device, self.host_mode = config, device, host_mode
        self.lengths = np.zeros(rows, np.int64)  # [R] req_state_idx -> table columns (0: a text request)
        self.deltas = np.zeros(rows, np.int64)  # [R] req_state_idx -> mrope_position_delta
        self.capacity = 0  # table columns held: _reserve grows it
        # [R, 3, capacity] int64 req_state_idx -> position table: NumPy in host mode, else on the device
        self.tables_np = np.zeros((rows, NUM_MROPE_ROWS, 0), np.int64) if host_mode else None
        self.tables = torch.zeros((rows, NUM_MROPE_ROWS, 0), dtype=torch.int64, device=device)

    def commit(self, freed_rows: np.ndarray, writes: MRopeWrites | None) -> None:
        """spec.mrope.MRopeRows.commit: finished rows lose their table, then the step's new tables are stored."""
        self.lengths[freed_rows] = 0
        self.deltas[freed_rows] = 0
        if writes is None or not writes.rows.size:
            return
        starts = np.cumsum(writes.lengths) - writes.lengths  # [m] where each table begins in writes.tables
        self._reserve(int(writes.lengths.max()))
        if self.tables_np is not None:
            store_tables(self.tables_np, writes.rows, starts, writes.lengths, writes.tables)
        else:
            packed = upload(writes.tables, self.device)  # [3, sum(lengths)] one copy for the step's tables
            for row, start, n in zip(writes.rows.tolist(), starts.tolist(), writes.lengths.tolist(), strict=True):
                self.tables[row, :, :n] = packed[:, start : start + n]
        self.lengths[writes.rows] = writes.lengths
        self.deltas[writes.rows] = writes.deltas

    def _reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        capacity = min(self.config.max_model_len, max(length, 2 * self.capacity, _MIN_CAPACITY))
        shape = (self.config.max_num_reqs, NUM_MROPE_ROWS, capacity)
        if self.tables_np is not None:
            grown_np = np.zeros(shape, np.int64)
            grown_np[:, :, : self.capacity] = self.tables_np
            self.tables_np = grown_np
        else:
            grown = torch.zeros(shape, dtype=torch.int64, device=self.device)
            grown[:, :, : self.capacity] = self.tables
            self.tables = grown
        self.capacity = capacity

    def positions(self, batch: BatchInputs, rows: np.ndarray) -> torch.Tensor:
        """`[3, T]` int64 M-RoPE positions of a prepared batch (its positions, query_start_loc and rows)."""
        out = torch.empty((NUM_MROPE_ROWS, batch.num_tokens_padded), dtype=torch.int64, device=self.device)
        if self.tables_np is not None:
            mrope_positions_host(
                out.numpy(), batch.positions.numpy(), batch.query_start_loc.numpy(), rows,
                self.tables_np, self.lengths, self.deltas,
            )  # fmt: skip
        else:
            lengths_deltas = upload(np.stack([self.lengths[rows], self.deltas[rows]]), self.device)  # [2, num_reqs]
            mrope_positions_triton(
                out, batch.positions, batch.query_start_loc, batch.index_mapping, lengths_deltas, self.tables
            )
        return out


@njit(cache=True, nogil=True)
def store_tables(  # pragma: no cover - compiled; tested through the pool against spec
    tables: np.ndarray,  # [R, 3, capacity] int64 (room reserved)
    rows: np.ndarray,  # [m] int64 req_state_idx
    starts: np.ndarray,  # [m] int64 where each table begins in `packed`
    lengths: np.ndarray,  # [m] int64 columns of each table
    packed: np.ndarray,  # [3, sum(lengths)] int64 the tables side by side
) -> None:
    for i in range(rows.shape[0]):
        for j in range(3):
            tables[rows[i], j, : lengths[i]] = packed[j, starts[i] : starts[i] + lengths[i]]


@njit(cache=True, nogil=True)
def mrope_positions_host(  # pragma: no cover - compiled; tested through the pool against spec
    out: np.ndarray,  # [3, T] int64, written
    positions: np.ndarray,  # [T] int64 flat token index -> position
    query_start_loc: np.ndarray,  # [num_reqs + 1] int32
    rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    tables: np.ndarray,  # [R, 3, capacity] int64
    lengths: np.ndarray,  # [R] int64 req_state_idx -> table columns
    deltas: np.ndarray,  # [R] int64 req_state_idx -> delta
) -> None:
    for b in range(rows.shape[0]):
        row = rows[b]
        for t in range(query_start_loc[b], query_start_loc[b + 1]):
            p = positions[t]
            for j in range(3):
                out[j, t] = tables[row, j, p] if p < lengths[row] else p + deltas[row]
    out[:, query_start_loc[rows.shape[0]] :] = 0
