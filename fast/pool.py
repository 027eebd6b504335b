"""The request state pool on torch tensors: spec/pool.py's interface, with the state on `device`.

    pool.apply(sched)                  # validate on the host mirror, then write the step's changes
    batch = pool.prepare(sched)        # batch order on the host, then the batch's arrays
    pool.record_sampled(batch, ids)    # append each finished row's sampled token

The kernel mode is fixed when the pool is built (fast.runtime.use_triton at that moment), and every
later call runs in it whatever `fast.runtime.interpret` says then:
- Triton (CUDA tensors, or CPU tensors with the interpreter on): the state lives in separate tensors
  (fast.state.DeviceState); apply validates on the host mirror and then launches one kernel that writes
  the step's final values, prepare launches one kernel that builds the whole batch. The tests compare
  that separate state with spec's, so the kernels' writes are really checked.
- CPU without Triton: the "device" is host memory, so the tensors share memory with the host mirror
  (DeviceState's shared mode): apply's commit to the mirror is the device write, and prepare is NumPy
  over the shared arrays (fast/flatten.py, fast/slots.py) writing into two fresh buffers that the
  batch's tensors view. A step of continuing requests validated in bulk (fast/validate.py) also hands
  prepare the rows, positions and slots it already computed.
prepare never waits for the device: everything it needs on the host (rows, batch order, token counts)
is in the host mirror. Every prepare returns tensors in fresh memory: a later step never changes them.

apply validates the usual step (continuing requests, none resumed, plus new and finished ones) in bulk
(fast/validate.py) and everything else with spec's plan_step, so both raise spec's errors in spec's order.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.batch import batch_order, scheduled_rows
from fast.flatten import flatten, gather_input_ids
from fast.kernels.prepare import prepare_triton
from fast.runtime import interpret, interpret_enabled, use_triton
from fast.slots import gather_block_tables, slot_mapping
from fast.state import DeviceState
from fast.validate import BulkStepPlan, last_null_entries, plan_bulk_step
from fast.writes import StepWrites, apply_writes, ranges, table_diff_ops, upload, writes_from_ops
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError, UnknownRequestError
from spec.state import PoolState, StepPlan, TableUpdate
from spec.types import INDEX_DTYPE, PAD_SLOT_ID, BatchInputs, PoolSnapshot, RowSnapshot, SchedulerOutput, WorkerConfig
from spec.validate import plan_step


class RequestStatePool:
    def __init__(self, config: WorkerConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._triton = use_triton(self.device)  # the kernel mode, fixed for the pool's life (module docstring)
        self._interpret = interpret_enabled()
        if not self._triton and self.device.type != "cpu":
            raise ValueError(f"fast runs on CUDA (Triton) or CPU tensors, not {self.device}")
        self.state = PoolState(config)  # host mirror: validation and batch order read only this
        self.dev = DeviceState(config, self.device, mirror=None if self._triton else self.state)
        # per sliding-window group [R]: last null entry of each row's table (fast.validate.last_null_entries)
        self._null_tails = [
            np.full(config.max_num_reqs, -1, np.int64) if g.sliding_window is not None else None
            for g in config.kv_groups
        ]
        self._table_layout = list(zip(self.dev.offsets_np.tolist(), self.dev.widths_np.tolist(), strict=True))
        self._applied: SchedulerOutput | None = None
        self._plan: BulkStepPlan | None = None  # the bulk plan of the applied step, if it covers the whole batch
        # host copies of the last prepared batch, so record_sampled needs no device->host copy of them
        self._prepared: BatchInputs | None = None
        self._prepared_rows_np = np.zeros(0, np.int64)  # [num_reqs] batch_idx -> req_state_idx
        self._prepared_seq_lens_np = np.zeros(0, np.int64)  # [num_reqs]

    def apply(self, sched: SchedulerOutput) -> None:
        plan = plan_bulk_step(self.state, sched, self._null_tails)
        if plan is None:
            writes = self._commit_general(sched)
        elif plan.new_rows or plan.freed_rows:
            writes = self._commit_mixed(sched, plan)
        else:
            writes = self._commit_cached(plan)
        if writes is not None:
            with interpret(self._interpret):
                apply_writes(self.dev, writes)
        self._applied, self._plan = sched, plan if plan is not None and plan.cached_only else None

    def _commit_cached(self, plan: BulkStepPlan) -> StepWrites | None:
        self._commit_cached_mirror(plan)
        if self.dev.shared:
            return None  # the mirror's arrays are the device's
        table_ops, table_data = plan.table_ops()
        return writes_from_ops(table_ops, table_data, [], plan.rows, plan.num_computed)

    def _commit_cached_mirror(self, plan: BulkStepPlan) -> None:
        """The cached requests' appends and progress, on the host mirror."""
        state = self.state
        for g, a in enumerate(plan.appends):  # appends only, past each row's filled entries: no null among them
            if a.rows.size:
                table = state.block_tables[g]
                if a.ids.size == a.rows.size:  # one id per request (a decode crossing a block boundary)
                    table[a.rows, a.counts] = a.ids
                else:
                    op, within = ranges(a.lengths)
                    table[a.rows[op], a.counts[op] + within] = a.ids
                state.num_blocks[g, a.rows] = a.counts + a.lengths
        state.num_computed_tokens[plan.rows] = plan.num_computed

    def _commit_mixed(self, sched: SchedulerOutput, plan: BulkStepPlan) -> StepWrites | None:
        """A bulk-validated step with finished or new rows: spec's commit for those, the bulk one for the rest."""
        state, new = self.state, sched.new_requests
        # plan_step's StepPlan less the cached requests' part (their rows are neither freed nor new)
        step = StepPlan(
            freed_rows=plan.freed_rows,
            new_rows=plan.new_rows,
            table_updates=[
                TableUpdate(row, g, tuple(ids), True)
                for r, row in zip(new, plan.new_rows, strict=True)
                for g, ids in enumerate(r.block_ids)
            ],
            num_computed_tokens={row: r.num_computed_tokens for r, row in zip(new, plan.new_rows, strict=True)},
        )
        touched = np.array(sorted({*plan.freed_rows, *plan.new_rows}), np.int64)
        before = [] if self.dev.shared else [table[touched] for table in state.block_tables]
        state.commit(step, [r.req_id for r in new], [len(r.prompt_token_ids) for r in new])
        self._commit_cached_mirror(plan)
        self._update_null_tails(touched)
        if self.dev.shared:
            token_ids = self.dev.token_ids_np
            assert token_ids is not None
            which, within = ranges(plan.prompt_lens)  # the prompts, already converted by the bulk checks
            token_ids[np.array(plan.new_rows, np.int64)[which], within] = plan.prompt_tokens
            return None
        table_ops, table_data = table_diff_ops(touched, before, state.block_tables, state.num_blocks)
        append_ops, append_data = plan.table_ops()
        append_ops[:, -1] += table_data.size  # data index: the appends' ids follow the touched rows'
        computed_rows = np.concatenate([touched, plan.rows])
        return writes_from_ops(
            np.concatenate([table_ops, append_ops]),
            np.concatenate([table_data, append_data]),
            [(row, r.prompt_token_ids) for row, r in zip(plan.new_rows, new, strict=True)],
            computed_rows,
            state.num_computed_tokens[computed_rows],
        )

    def _update_null_tails(self, rows: np.ndarray) -> None:  # [k] req_state_idx whose tables were replaced
        for g, tails in enumerate(self._null_tails):
            if tails is not None and rows.size:
                tails[rows] = last_null_entries(self.state, g, rows)

    def _commit_general(self, sched: SchedulerOutput) -> StepWrites | None:
        state = self.state
        plan = plan_step(state, sched)  # raises spec's error before anything below runs
        update_rows = [u.row for u in plan.table_updates]
        touched = np.array(sorted({*plan.freed_rows, *plan.new_rows, *update_rows}), np.int64)
        before = [] if self.dev.shared else [table[touched] for table in state.block_tables]
        new = sched.new_requests
        state.commit(plan, [r.req_id for r in new], [len(r.prompt_token_ids) for r in new])
        self._update_null_tails(touched)
        if self.dev.shared:
            token_ids = self.dev.token_ids_np
            assert token_ids is not None
            for row, r in zip(plan.new_rows, new, strict=True):
                token_ids[row, : len(r.prompt_token_ids)] = r.prompt_token_ids
            return None
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
        plan = self._plan if sched is self._applied else None
        if plan is not None and plan.in_schedule_order:
            ordered = batch_order(plan.req_ids, plan.rows, plan.num_scheduled, known_sorted=plan.uniform)
        else:
            plan = None
            ordered = batch_order(*scheduled_rows(sched, self.state.row_of))
        req_ids, rows, num_scheduled, unchanged = ordered
        tokens_from = plan if unchanged else None  # its token arrays are in its request order
        cu_num_tokens = num_scheduled.cumsum()  # [num_reqs] int64
        num_tokens = int(cu_num_tokens[-1]) if len(req_ids) else 0
        padded = num_tokens if pad_to is None else pad_to
        if padded < num_tokens:
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to} < {num_tokens} scheduled tokens")
        seq_lens = self.state.num_computed_tokens[rows] + num_scheduled  # [num_reqs] int64
        if self.dev.shared:
            batch = self._prepare_host(req_ids, rows, num_scheduled, cu_num_tokens, seq_lens, padded, tokens_from)
        else:
            with interpret(self._interpret):
                batch = self._prepare_kernel(req_ids, rows, num_scheduled, cu_num_tokens, padded)
        self._prepared = batch
        self._prepared_rows_np = rows
        self._prepared_seq_lens_np = seq_lens
        return batch

    def _prepare_kernel(
        self,
        req_ids: tuple[str, ...],
        rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
        num_scheduled: np.ndarray,  # [num_reqs] int64
        cu_num_tokens: np.ndarray,  # [num_reqs] int64
        padded: int,
    ) -> BatchInputs:
        num_reqs = len(req_ids)
        num_tokens = int(cu_num_tokens[-1]) if num_reqs else 0
        # the small host arrays travel in one copy: index_mapping | num_scheduled | query_start_loc
        batch_np = np.concatenate([rows, num_scheduled, [0], cu_num_tokens]).astype(INDEX_DTYPE)
        batch_dev = upload(batch_np, self.device)
        out = prepare_triton(self.dev, batch_dev, num_reqs, num_tokens, padded)
        return BatchInputs(
            req_ids=req_ids,
            index_mapping=batch_dev[:num_reqs],
            num_scheduled_tokens=batch_dev[num_reqs : 2 * num_reqs],
            query_start_loc=batch_dev[2 * num_reqs :],
            positions=out.positions,
            input_ids=out.input_ids,
            seq_lens=out.seq_lens,
            logits_indices=out.logits_indices,
            block_tables=out.block_tables,
            slot_mappings=out.slot_mappings,
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )

    def _prepare_host(
        self,
        req_ids: tuple[str, ...],
        rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
        num_scheduled: np.ndarray,  # [num_reqs] int64
        cu_num_tokens: np.ndarray,  # [num_reqs] int64
        seq_lens: np.ndarray,  # [num_reqs] int64
        padded: int,
        plan: BulkStepPlan | None,  # the applied step's bulk plan, when its request order is the batch order
    ) -> BatchInputs:
        dev, state, groups = self.dev, self.state, self.config.kv_groups
        n, t = len(req_ids), padded
        num_tokens = int(cu_num_tokens[-1]) if n else 0
        # Two fresh buffers per step, carved into the batch's arrays (as fast.kernels.prepare does):
        # out32 = index_mapping | num_scheduled | query_start_loc | seq_lens | logits_indices | tables per group
        out32 = np.empty(5 * n + 1 + n * dev.total_width, np.int32)
        out32[:n] = rows
        out32[n : 2 * n] = num_scheduled
        out32[2 * n] = 0
        out32[2 * n + 1 : 3 * n + 1] = cu_num_tokens
        out32[3 * n + 1 : 4 * n + 1] = seq_lens
        np.subtract(cu_num_tokens, 1, out=out32[4 * n + 1 : 5 * n + 1])
        tables = out32[5 * n + 1 :]
        block_tables = [
            gather_block_tables(state.block_tables[g], rows, out=tables[n * off : n * (off + w)].reshape(n, w))
            for g, (off, w) in enumerate(self._table_layout)
        ]
        # out64 = positions | input_ids | slot mapping per group, each [T]
        out64 = np.empty((2 + len(groups)) * t, np.int64)
        positions = out64[:t]
        if plan is not None:
            token_rows = plan.token_rows
            positions[:num_tokens] = plan.positions
        else:
            token_rows, positions[:num_tokens] = flatten(rows, num_scheduled, state.num_computed_tokens)
        positions[num_tokens:] = 0
        assert dev.token_ids_np is not None
        gather_input_ids(dev.token_ids_np, token_rows, positions[:num_tokens], out64[t : 2 * t])
        for g, group in enumerate(groups):
            slots = out64[(2 + g) * t : (3 + g) * t]
            if plan is not None:
                slots[:num_tokens] = plan.slots[g]
                slots[num_tokens:] = PAD_SLOT_ID
            else:
                slot_mapping(state.block_tables[g], token_rows, positions, group.block_size, out=slots)
        # one torch.from_numpy per array: cheaper than slicing one tensor (torch indexing costs more than NumPy's)
        wrap = torch.from_numpy
        return BatchInputs(
            req_ids=req_ids,
            index_mapping=wrap(out32[:n]),
            num_scheduled_tokens=wrap(out32[n : 2 * n]),
            query_start_loc=wrap(out32[2 * n : 3 * n + 1]),
            positions=wrap(positions),
            input_ids=wrap(out64[t : 2 * t]),
            seq_lens=wrap(out32[3 * n + 1 : 4 * n + 1]),
            logits_indices=wrap(out32[4 * n + 1 : 5 * n + 1]),
            block_tables=tuple(map(wrap, block_tables)),
            slot_mappings=tuple(wrap(out64[(2 + g) * t : (3 + g) * t]) for g in range(len(groups))),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )

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
        known = num_tokens[rows]  # [num_reqs]
        takes = np.flatnonzero(seq_lens == known)  # [k] batch_idx of rows that reached the end
        if not takes.size:
            return
        if takes.size == rows.size:  # every row samples (a decode step): no subsetting
            taking_rows, tokens, lengths = rows, sampled, known
        else:
            taking_rows, tokens, lengths = rows[takes], sampled[takes], known[takes]
        if tokens.dtype.kind == "f":
            tokens = np.trunc(tokens)  # as spec's int(token)
        vocab, max_len = self.config.vocab_size, self.config.max_model_len
        # three reductions clear the common case; anything else (NaN, odd dtypes, a real error) is looked at whole
        if tokens.dtype.kind != "i" or tokens.min() < 0 or tokens.max() >= vocab or lengths.max() >= max_len:
            bad_id = ~((tokens >= 0) & (tokens < vocab))
            bad = np.flatnonzero(bad_id | (lengths >= max_len))
            if bad.size:
                first = int(bad[0])
                req_id = batch.req_ids[int(takes[first])]
                if bad_id[first]:
                    raise TokenIdError(req_id, "sampled_token_ids", f"{int(tokens[first])} not in [0, {vocab})")
                raise ModelLengthError(req_id, "sampled_token_ids", "no room past max_model_len")
        if self.dev.token_ids_np is not None:
            self.dev.token_ids_np[taking_rows, lengths] = tokens
        else:
            flat = taking_rows * max_len + lengths
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
        if self.dev.token_ids_np is not None:
            token_ids = self.dev.token_ids_np[occupied]
        else:
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
