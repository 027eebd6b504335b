"""The request state pool on torch tensors: spec/pool.py's interface, with the state on `device`.

    pool.apply(sched)                  # validate on the host mirror, then one packed write to the device
    batch = pool.prepare(sched)        # batch order on the host, then one kernel launch (CUDA/interpreter)
    pool.record_sampled(batch, ids)    # append each finished row's sampled token

On CUDA (or CPU with the Triton interpreter on, see fast.runtime) apply and prepare launch one
Triton kernel each. On plain CPU tensors apply scatters with torch index writes, and prepare does the
index arithmetic the host already knows in NumPy and reads the device state with torch gathers
(fast/flatten.py says why). prepare never waits for the device: everything it needs on the host
(rows, batch order, token counts) is in the host mirror.

apply validates the common decode step (continuing requests only) in bulk (fast/validate.py) and
everything else with spec's plan_step, so both raise spec's errors in spec's order.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.batch import batch_order
from fast.flatten import flatten
from fast.kernels.prepare import prepare_triton
from fast.runtime import use_triton
from fast.slots import gather_block_tables, slot_mapping
from fast.state import DeviceState
from fast.validate import CachedStepPlan, plan_cached_step
from fast.writes import StepWrites, apply_writes, ranges, table_diff_ops, upload, writes_from_ops
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError, UnknownRequestError
from spec.state import PoolState
from spec.types import INDEX_DTYPE, BatchInputs, PoolSnapshot, RowSnapshot, SchedulerOutput, WorkerConfig
from spec.validate import plan_step


class RequestStatePool:
    def __init__(self, config: WorkerConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.state = PoolState(config)  # host mirror: validation and batch order read only this
        self.dev = DeviceState(config, self.device)
        self._applied: SchedulerOutput | None = None
        # host copies of the last prepared batch, so record_sampled needs no device->host copy of them
        self._prepared: BatchInputs | None = None
        self._prepared_rows_np = np.zeros(0, np.int64)  # [num_reqs] batch_idx -> req_state_idx
        self._prepared_seq_lens_np = np.zeros(0, np.int64)  # [num_reqs]

    def apply(self, sched: SchedulerOutput) -> None:
        bulk = plan_cached_step(self.state, sched)
        writes = self._commit_cached(bulk) if bulk is not None else self._commit_general(sched)
        apply_writes(self.dev, writes)
        self._applied = sched

    def _commit_cached(self, plan: CachedStepPlan) -> StepWrites:
        state = self.state
        ops = plan.table_ops
        if len(ops):
            row, group, lo, hi, _, src = ops.T
            for g in np.unique(group).tolist():  # appends: a handful of groups, each one vectorised scatter
                mine = group == g
                op, within = ranges((hi - lo)[mine])
                state.block_tables[g][row[mine][op], lo[mine][op] + within] = plan.data[src[mine][op] + within]
                state.num_blocks[g, row[mine]] = hi[mine]
        state.num_computed_tokens[plan.rows] = plan.num_computed
        return writes_from_ops(ops, plan.data, [], plan.rows, plan.num_computed)

    def _commit_general(self, sched: SchedulerOutput) -> StepWrites:
        state = self.state
        plan = plan_step(state, sched)  # raises spec's error before anything below runs
        update_rows = [u.row for u in plan.table_updates]
        touched = np.array(sorted({*plan.freed_rows, *plan.new_rows, *update_rows}), np.int64)
        before = [table[touched] for table in state.block_tables]
        new = sched.new_requests
        state.commit(plan, [r.req_id for r in new], [len(r.prompt_token_ids) for r in new])
        table_ops, table_data = table_diff_ops(touched, before, state.block_tables, state.num_blocks)
        computed_rows = np.array(sorted({*plan.freed_rows, *plan.num_computed_tokens}), np.int64)
        return writes_from_ops(
            table_ops,
            table_data,
            [(row, r.prompt_token_ids) for row, r in zip(plan.new_rows, new, strict=True)],
            computed_rows,
            state.num_computed_tokens[computed_rows],
        )

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        if sched is not self._applied and sched != self._applied:
            raise InconsistentSchedulerOutputError(None, "prepare", "not the last applied scheduler output")
        req_ids, index_mapping_np, num_scheduled_np = batch_order(sched, self.state.row_of)
        num_reqs = len(req_ids)
        query_start_loc_np = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
        num_tokens = int(query_start_loc_np[-1])
        padded = num_tokens if pad_to is None else pad_to
        if padded < num_tokens:
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to} < {num_tokens} scheduled tokens")
        # the small host arrays travel in one copy: index_mapping | num_scheduled | query_start_loc
        batch_np = np.concatenate([index_mapping_np, num_scheduled_np, query_start_loc_np]).astype(INDEX_DTYPE)
        batch_dev = upload(batch_np, self.device)
        index_mapping = batch_dev[:num_reqs]
        num_scheduled = batch_dev[num_reqs : 2 * num_reqs]
        query_start_loc = batch_dev[2 * num_reqs :]
        groups = self.config.kv_groups
        if use_triton(self.device):
            out = prepare_triton(self.dev, batch_dev, num_reqs, num_tokens, padded)
            arrays = (
                out.positions,
                out.input_ids,
                out.seq_lens,
                out.logits_indices,
                out.block_tables,
                out.slot_mappings,
            )
        else:
            flat = flatten(
                index_mapping_np,
                num_scheduled_np,
                query_start_loc_np,
                self.state.num_computed_tokens,
                self.dev.token_ids,
                padded,
            )
            tables = [self.dev.table(g) for g in range(len(groups))]
            arrays = (
                flat.positions,
                flat.input_ids,
                flat.seq_lens,
                flat.logits_indices,
                tuple(gather_block_tables(t, index_mapping_np) for t in tables),
                tuple(
                    slot_mapping(t, flat.token_rows_np, flat.positions_np, g.block_size)
                    for t, g in zip(tables, groups, strict=True)
                ),
            )
        positions, input_ids, seq_lens, logits_indices, block_tables, slot_mappings = arrays
        batch = BatchInputs(
            req_ids=req_ids,
            index_mapping=index_mapping,
            num_scheduled_tokens=num_scheduled,
            query_start_loc=query_start_loc,
            positions=positions,
            input_ids=input_ids,
            seq_lens=seq_lens,
            logits_indices=logits_indices,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )
        rows_np = index_mapping_np.astype(np.int64)
        self._prepared = batch
        self._prepared_rows_np = rows_np
        self._prepared_seq_lens_np = self.state.num_computed_tokens[rows_np] + num_scheduled_np
        return batch

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: object) -> None:
        """spec.RequestStatePool.record_sampled on device state: same rows, same errors, same order of checks."""
        sampled = _host_array(sampled_token_ids).reshape(-1)  # the one sync: the ids must be validated
        if sampled.shape[0] != batch.num_reqs:
            raise InconsistentSchedulerOutputError(
                None, "sampled_token_ids", f"{sampled.shape[0]} ids for {batch.num_reqs} batch rows"
            )
        if batch is self._prepared:
            rows, seq_lens = self._prepared_rows_np, self._prepared_seq_lens_np
        else:
            rows = _host_array(batch.index_mapping).astype(np.int64)
            seq_lens = _host_array(batch.seq_lens)
        num_tokens = self.state.num_tokens
        takes = np.flatnonzero(seq_lens == num_tokens[rows])  # [k] batch_idx of rows that reached the end
        taking_rows = rows[takes]
        tokens = sampled[takes]
        if tokens.dtype.kind == "f":
            tokens = np.trunc(tokens)  # as spec's int(token)
        bad_id = ~((tokens >= 0) & (tokens < self.config.vocab_size))
        bad_len = num_tokens[taking_rows] >= self.config.max_model_len
        bad = np.flatnonzero(bad_id | bad_len)
        if bad.size:
            first = int(bad[0])
            req_id = batch.req_ids[int(takes[first])]
            if bad_id[first]:
                raise TokenIdError(
                    req_id, "sampled_token_ids", f"{int(tokens[first])} not in [0, {self.config.vocab_size})"
                )
            raise ModelLengthError(req_id, "sampled_token_ids", "no room past max_model_len")
        if takes.size:
            flat = taking_rows * self.config.max_model_len + num_tokens[taking_rows]
            packed = upload(np.concatenate([flat, tokens.astype(np.int64)]), self.device)
            self.dev.token_ids.view(-1)[packed[: takes.size]] = packed[takes.size :]
            num_tokens[taking_rows] += 1

    def row_of(self, req_id: str) -> int:
        if req_id not in self.state.row_of:
            raise UnknownRequestError(req_id, "req_id", "request holds no row")
        return self.state.row_of[req_id]

    def snapshot(self) -> PoolSnapshot:
        state = self.state
        occupied = [row for row, req_id in enumerate(state.req_ids) if req_id is not None]
        token_ids = self.dev.token_ids[occupied].cpu().numpy()  # [occupied, L], one device->host copy
        return tuple(
            RowSnapshot(
                row=row,
                req_id=state.req_ids[row],  # type: ignore[arg-type]
                token_ids=tuple(token_ids[i, : state.num_tokens[row]].tolist()),
                num_computed_tokens=int(state.num_computed_tokens[row]),
                block_ids=tuple(tuple(state.blocks(row, g).tolist()) for g in range(len(self.config.kv_groups))),
            )
            for i, row in enumerate(occupied)
        )


def _host_array(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)
