"""The request state pool on torch tensors: spec/pool.py's interface, with the state on `device`.

    pool.apply(sched)                  # read and validate once (host), commit, write the device in one go
    batch = pool.prepare(sched)        # batch order on the host, then the batch's arrays
    pool.record_sampled(batch, ids)    # append each finished row's sampled (or accepted) tokens

One path per call:
- apply: fast.validate.plan_bulk_step reads the output once and checks it vectorised; what it does not
  vouch for goes to spec's plan_step (which raises spec's error, or accepts and is converted to the same
  StepPlan). `_commit` then applies that one plan to the host mirror and, where the device state is
  separate, launches one kernel with the step's final values (fast.writes.step_writes).
- prepare: reads only the applied plan (frozen at apply, as spec) and the state. The batch order is
  computed on the host; the arrays come from one kernel (Triton), or from compiled loops over the shared
  state (fast/flatten.py, fast/slots.py).
- record_sampled: spec's rules, checked in one compiled pass, one scatter of the accepted ids.
- drafts (speculative decoding, spec/drafts.py): apply writes each request's drafts into the token storage
  just past its known tokens (under Triton as token ops of apply's one launch), as vLLM v1 writes spec
  tokens into token_ids_cpu, so prepare (kernel or CPU) reads them as input ids with no extra launch;
  record_sampled writes the accepted tokens over them.
  Only the sampler's indices (num_reqs-sized) are computed on the host in a drafting step.

The kernel mode is fixed when the pool is built (fast.runtime.use_triton at that moment):
- Triton (CUDA tensors, or CPU tensors with the interpreter on): the state lives in separate tensors
  (fast.state.DeviceState); the tests compare that state with spec's, so the kernels' writes are checked.
- CPU without Triton: the "device" is host memory, so the tensors share memory with the host mirror:
  committing to the mirror is the device write, and prepare is NumPy over the shared arrays.
prepare never waits for the device: everything it needs on the host (rows, order, counts) is in the plan.

What a caller may keep: on plain CPU the batch's tensors are views of buffers the pool reuses, valid
until the next prepare (as vLLM's persistent input buffers); copy what must outlive the step. The host
copies of index_mapping and seq_lens that record_sampled reads are the pool's own.
"""

from __future__ import annotations

import dataclasses
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from fast.batch import batch_order
from fast.drafts import batch_drafts, draft_columns, draft_positions
from fast.flatten import flatten
from fast.kernels.prepare import prepare_triton
from fast.runtime import interpret, interpret_enabled, use_triton
from fast.sampled import append_accepted, append_sampled, as_int64_ids, check_accepted, check_sampled
from fast.slots import gather_block_tables, slot_mapping
from fast.state import DeviceState, HostMirror, write_prompts
from fast.validate import last_released_entries, plan_bulk_step
from fast.writes import apply_writes, step_writes, upload
from spec import drafts as spec_drafts
from spec.drafts import DraftLogits, accepted_rows, draft_logits
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError, UnknownRequestError
from spec.state import PoolState, StepPlan, ranges
from spec.types import (
    INDEX_DTYPE,
    BatchInputs,
    PoolSnapshot,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
    is_integral,
)
from spec.validate import plan_step


class RequestStatePool:
    def __init__(self, config: WorkerConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self._triton = use_triton(self.device)  # the kernel mode, fixed for the pool's life (module docstring)
        self._interpret = interpret_enabled()
        if not self._triton and self.device.type != "cpu":
            raise ValueError(f"fast runs on CUDA (Triton) or CPU tensors, not {self.device}")
        self.state: PoolState = HostMirror(config)  # validation and batch order read only this
        self.dev = DeviceState(config, self.device, mirror=None if self._triton else self.state)
        # per sliding-window group [R]: last released entry of each row's table (fast.validate.last_released_entries)
        self._released_tails: list[np.ndarray | None] = [
            np.full(config.max_num_reqs, -1, np.int64) if g.sliding_window is not None else None
            for g in config.kv_groups
        ]
        self._applied: SchedulerOutput | None = None
        self._plan: StepPlan | None = None  # the applied output as validated: all prepare reads of it
        self._prepared: BatchInputs | None = None  # the batch record_sampled may take
        self._prepared_rows_np = np.zeros(0, np.int64)  # [num_reqs] its batch_idx -> req_state_idx
        self._prepared_seq_lens_np = np.zeros(0, np.int64)  # [num_reqs] its seq_lens
        self._prepared_drafts: tuple[np.ndarray, np.ndarray] | None = None  # its batch_drafts; None: none
        # plain CPU: the buffers the batches' tensors view, reused step after step (grown when a step needs more)
        self._out32 = np.zeros(0, np.int32)
        self._out64 = np.zeros(0, np.int64)
        self._views: dict[str, Any] = {}  # the batch's tensors over those buffers, for the shape in _views_key
        self._views_key: tuple[int, ...] = ()
        self._buffers_grown = 0  # times either buffer was reallocated: part of _views_key

    # ---- apply -------------------------------------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> None:
        plan = plan_bulk_step(self.state, sched, self._released_tails)
        if plan is None:
            plan = plan_step(self.state, sched)  # raises spec's error, or accepts what the bulk path left to it
        self._commit(plan)
        self._applied, self._plan, self._prepared = sched, plan, None

    def _commit(self, plan: StepPlan) -> None:
        """spec's commit to the host mirror (on plain CPU, the device state itself), then the device in one launch."""
        state, dev = self.state, self.dev
        longest = int(plan.prompt_lens.max()) if plan.prompt_lens.size else 0
        if plan.num_drafts is not None:  # drafts go past the known tokens: room for them too
            longest = max(longest, int((draft_columns(plan, plan.num_drafts) + plan.num_drafts).max()))
        dev.reserve_tokens(longest)
        writes = None if dev.shared else step_writes(state, plan)  # needs the mirror as it was
        state.commit(plan)
        if any(t is not None for t in self._released_tails):
            self._refresh_released_tails(plan)
        if writes is not None:  # prompts and drafts ride in the same launch
            with interpret(self._interpret):
                apply_writes(dev, writes)
        elif dev.token_ids_np is not None:
            if plan.new_rows.size:
                write_prompts(dev.token_ids_np, plan.new_rows, plan.prompt_lens, plan.prompt_tokens)
            if plan.num_drafts is not None:
                self._store_tokens(*draft_positions(plan, plan.num_drafts), plan.draft_ids)

    def _refresh_released_tails(self, plan: StepPlan) -> None:
        """Rows whose tables changed get new tails (an append may hand back an id a window released)."""
        for g, tails in enumerate(self._released_tails):
            if tails is None:
                continue
            rows = np.union1d(plan.tables[g].rows, plan.freed_rows)
            if rows.size:
                tails[rows] = last_released_entries(self.state, g, rows)

    # ---- prepare -----------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        plan = self._plan
        if plan is None or (sched is not self._applied and sched != self._applied):
            raise InconsistentSchedulerOutputError(None, "prepare", "not the last applied scheduler output")
        order, rows, num_scheduled = batch_order(plan.rows, plan.num_scheduled)
        req_ids = tuple(plan.req_ids) if order is None else itemgetter(*order)(plan.req_ids)  # order: 2+ entries
        cu_num_tokens = num_scheduled.cumsum()  # [num_reqs] int64
        num_tokens = int(cu_num_tokens[-1]) if rows.size else 0
        padded = num_tokens if pad_to is None else pad_to
        if not is_integral(padded):
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to!r} is not an integer")
        if padded < num_tokens:
            raise InconsistentSchedulerOutputError(None, "pad_to", f"{pad_to} < {num_tokens} scheduled tokens")
        padded = int(padded)
        seq_lens = self.state.num_computed_tokens[rows] + num_scheduled  # [num_reqs] int64
        if self.dev.shared:
            batch = self._prepare_host(req_ids, rows, num_scheduled, num_tokens, padded)
        else:
            with interpret(self._interpret):
                batch = self._prepare_kernel(req_ids, rows, num_scheduled, cu_num_tokens, padded)
        drafts = None
        if plan.num_drafts is not None:  # input ids are right already (apply stored the drafts): add the indices
            drafts = batch_drafts(plan.num_drafts, plan.draft_ids, order)  # [num_reqs], [num_drafts] batch order
            sampler = draft_logits(np.concatenate([[0], cu_num_tokens]), *drafts)
            batch = dataclasses.replace(batch, **self._sampler_tensors(sampler))
        self._prepared_drafts = drafts
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
        num_tokens: int,
        padded: int,
    ) -> BatchInputs:
        dev, state, groups = self.dev, self.state, self.config.kv_groups
        n, t = len(req_ids), padded
        # out32 = index_mapping | num_scheduled | query_start_loc | seq_lens | logits_indices | tables per group
        out32 = self._buffer32(5 * n + 1 + n * dev.total_width)
        # out64 = positions | input_ids | slot mapping per group, each [T] | token rows [num_tokens] (scratch)
        out64 = self._buffer64((2 + len(groups)) * t + num_tokens)
        positions, token_rows = out64[:t], out64[(2 + len(groups)) * t :]
        token_ids = dev.token_ids_np if dev.token_ids_np is not None else dev.token_ids.numpy()  # shared: the former
        input_ids = out64[t : 2 * t]
        flatten(rows, num_scheduled, state.num_computed_tokens, token_ids, out32, positions, input_ids, token_rows)
        tables = out32[5 * n + 1 :]
        block_tables, slot_mappings = [], []
        for g, (off, w) in enumerate(zip(dev.offsets_np.tolist(), dev.widths_np.tolist(), strict=True)):
            out = tables[n * off : n * (off + w)].reshape(n, w)
            block_tables.append(gather_block_tables(state.block_tables[g], rows, out))
            slots = out64[(2 + g) * t : (3 + g) * t]
            slot_mapping(state.block_tables[g], token_rows, positions, groups[g].block_size, slots)
            slot_mappings.append(slots)
        # The tensors view the reused buffers, so a step of the same shape as the last (every decode step of a
        # steady batch) hands out the same tensor objects, now holding this step's values: no re-wrapping.
        key = (n, t, num_tokens, self._buffers_grown)
        if key != self._views_key:
            wrap = torch.from_numpy
            self._views = {
                "index_mapping": wrap(out32[:n]),
                "num_scheduled_tokens": wrap(out32[n : 2 * n]),
                "query_start_loc": wrap(out32[2 * n : 3 * n + 1]),
                "positions": wrap(positions),
                "input_ids": wrap(input_ids),
                "seq_lens": wrap(out32[3 * n + 1 : 4 * n + 1]),
                "logits_indices": wrap(out32[4 * n + 1 : 5 * n + 1]),
                "block_tables": tuple(map(wrap, block_tables)),
                "slot_mappings": tuple(map(wrap, slot_mappings)),
            }
            self._views_key = key
        return BatchInputs(req_ids=req_ids, num_tokens=num_tokens, num_tokens_padded=padded, **self._views)

    def _sampler_tensors(self, sampler: DraftLogits) -> dict[str, Any]:
        """The sampler's indices as BatchInputs fields: the int32 ones in one host->device copy, the ids in another."""
        int32 = [sampler.logits_indices, sampler.num_draft_tokens, sampler.cu_num_draft_tokens,
                 sampler.target_logits_indices, sampler.bonus_logits_indices]  # fmt: skip
        packed = upload(np.concatenate(int32).astype(INDEX_DTYPE), self.device)
        ends = np.cumsum([a.size for a in int32]).tolist()
        parts = [packed[end - a.size : end] for a, end in zip(int32, ends, strict=True)]
        names = ("logits_indices", "num_draft_tokens", "cu_num_draft_tokens", "target_logits_indices",
                 "bonus_logits_indices")  # fmt: skip
        return dict(zip(names, parts, strict=True)) | {"draft_token_ids": upload(sampler.draft_token_ids, self.device)}

    def _buffer32(self, size: int) -> np.ndarray:
        if self._out32.size < size:
            self._out32 = np.zeros(max(size, 2 * self._out32.size), np.int32)
            self._buffers_grown += 1  # views over the old buffer are stale
        return self._out32[:size]

    def _buffer64(self, size: int) -> np.ndarray:
        if self._out64.size < size:
            self._out64 = np.zeros(max(size, 2 * self._out64.size), np.int64)
            self._buffers_grown += 1
        return self._out64[:size]

    # ---- record_sampled ----------------------------------------------------------------------------
    def record_sampled(self, batch: BatchInputs, sampled_token_ids: object) -> None:
        """spec.RequestStatePool.record_sampled on device state: same rows, same errors, same order of checks."""
        if batch is not self._prepared and not self._equals_prepared(batch):
            detail = "not the batch of the last prepare (or recorded already)"
            raise InconsistentSchedulerOutputError(None, "batch", detail)
        sampled = _host_array(sampled_token_ids)  # the one sync: the ids must be validated
        if sampled.size and sampled.dtype.kind not in "iu":
            detail = f"dtype {sampled.dtype}: needs integer ids"
            raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
        if sampled.ndim > 1 or self._prepared_drafts is not None:
            self._record_accepted(batch, sampled)
            self._prepared = None
            return
        sampled = sampled.reshape(-1)
        if sampled.shape[0] != batch.num_reqs:
            raise InconsistentSchedulerOutputError(
                None, "sampled_token_ids", f"{sampled.shape[0]} rows of ids for {batch.num_reqs} batch rows"
            )
        rows, seq_lens, num_tokens = self._prepared_rows_np, self._prepared_seq_lens_np, self.state.num_known_tokens
        takes = np.empty(rows.size, np.int64)  # [k] batch_idx of the rows that reached their last token
        vocab, max_len = self.config.vocab_size, self.config.max_model_len
        bad, count, longest = check_sampled(rows, seq_lens, num_tokens, sampled, vocab, max_len, takes)
        if bad >= 0:  # spec's order: the first taking row with a fault, the id checked before the length
            req_id, token = batch.req_ids[bad], int(sampled[bad])
            if not 0 <= token < vocab:
                raise TokenIdError(req_id, "sampled_token_ids", f"{token} not in [0, {vocab})")
            raise ModelLengthError(req_id, "sampled_token_ids", "no room past max_model_len")
        if count:
            self.dev.reserve_tokens(longest + 1)
            if self.dev.token_ids_np is not None:
                append_sampled(rows, takes[:count], num_tokens, sampled, self.dev.token_ids_np)
            else:
                taking_rows = rows[takes[:count]]
                self._store_tokens(taking_rows, num_tokens[taking_rows], sampled[takes[:count]])
                num_tokens[taking_rows] += 1
        self._prepared = None

    def _record_accepted(self, batch: BatchInputs, sampled: np.ndarray) -> None:
        """The accepted tokens of a step with drafts (or ids given as [num_reqs, width]): spec/drafts.py's rules.

        Every taking row is checked in one compiled pass; the first faulty one then goes through spec's own
        check, which raises the class spec raises for it.
        """
        tokens_in, counts = accepted_rows(sampled, batch.num_reqs)  # [n, width], [n]
        vocab, max_len = self.config.vocab_size, self.config.max_model_len
        tokens = as_int64_ids(tokens_in, vocab)
        rows, seq_lens, num_known = self._prepared_rows_np, self._prepared_seq_lens_np, self.state.num_known_tokens
        num_drafts, draft_ids = self._prepared_drafts or (np.zeros(rows.size, np.int64), _NO_DRAFTS)
        takes = np.empty(rows.size, np.int64)  # [k] batch_idx of the taking rows
        checked = check_accepted(
            rows, seq_lens, num_known, num_drafts, draft_ids, tokens, counts, vocab, max_len, takes
        )
        bad, count, longest = checked
        if bad >= 0:
            first = int(num_drafts[:bad].sum())
            drafts = draft_ids[first : first + num_drafts[bad]]
            known = int(num_known[rows[bad]])
            spec_drafts.check_accepted(batch.req_ids[bad], tokens_in[bad], int(counts[bad]), drafts, known, self.config)
            raise AssertionError(f"record_sampled: row {bad} looked faulty but spec's check accepts it")
        if not count:
            return
        self.dev.reserve_tokens(longest)
        taking = takes[:count]
        if self.dev.token_ids_np is not None:
            append_accepted(rows, taking, tokens, counts, num_known, self.dev.token_ids_np)
        else:
            which, within = ranges(counts[taking])
            taking_rows = rows[taking]
            self._store_tokens(
                taking_rows[which], num_known[taking_rows][which] + within, tokens[taking[which], within]
            )
            num_known[taking_rows] += counts[taking]

    def _store_tokens(
        self,
        rows: np.ndarray,  # [k] req_state_idx (repeated for several tokens of one row)
        positions: np.ndarray,  # [k] where each id goes
        tokens: np.ndarray,  # [k] validated ids
    ) -> None:
        dev = self.dev
        dev.reserve_tokens(int(positions.max()) + 1)
        if dev.token_ids_np is not None:
            dev.token_ids_np[rows, positions] = tokens
        else:
            flat = rows * dev.token_ids.stride(0) + positions
            packed = upload(np.concatenate([flat, tokens.astype(np.int64)]), self.device)
            dev.token_ids.view(-1)[packed[: rows.size]] = packed[rows.size :].to(dev.token_ids.dtype)

    def _equals_prepared(self, batch: BatchInputs) -> bool:
        """A batch with the last prepared batch's requests, rows and lengths (a wrapper's copy of it)."""
        prepared = self._prepared
        if prepared is None:
            return False
        return (
            tuple(batch.req_ids) == prepared.req_ids
            and np.array_equal(_host_array(batch.index_mapping), self._prepared_rows_np)
            and np.array_equal(_host_array(batch.seq_lens), self._prepared_seq_lens_np)
        )

    # ---- inspection ----------------------------------------------------------------------------------
    def row_of(self, req_id: str) -> int:
        if req_id not in self.state.row_of:
            raise UnknownRequestError(req_id, "req_id", "request holds no row")
        return self.state.row_of[req_id]

    def snapshot(self) -> PoolSnapshot:
        """In time proportional to the tokens held: one device->host copy of the occupied rows' known tokens."""
        state = self.state
        occupied = [row for row, req_id in enumerate(state.req_ids) if req_id is not None]
        lengths = state.num_known_tokens[occupied]
        held = int(lengths.max()) if occupied else 0
        if self.dev.token_ids_np is not None:
            token_ids = self.dev.token_ids_np
            rows_at = occupied
        else:
            token_ids = self.dev.token_ids[occupied, :held].cpu().numpy()  # [occupied, longest held]
            rows_at = list(range(len(occupied)))
        return tuple(
            RowSnapshot(
                row=row,
                req_id=state.req_ids[row],  # type: ignore[arg-type]
                token_ids=tuple(token_ids[at, :length].tolist()),
                num_computed_tokens=int(state.num_computed_tokens[row]),
                block_ids=tuple(tuple(state.blocks(row, g).tolist()) for g in range(len(self.config.kv_groups))),
            )
            for row, at, length in zip(occupied, rows_at, lengths.tolist(), strict=True)
        )


_NO_DRAFTS = np.zeros(0, np.int32)


def _host_array(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)
