"""The request state pool on torch tensors: spec/pool.py's interface, with the state on `device`.

    pool.apply(sched)                  # read and validate once (host), commit, write the device in one go
    batch = pool.prepare(sched)        # batch order on the host, then the batch's arrays
    pool.record_sampled(batch, ids)    # append each finished row's sampled (or accepted) tokens

This file is the orchestration; each stage and mechanism has its own file:
- apply: fast/validate.py's plan_bulk_step checks the output in compiled passes; what it does not vouch
  for goes to spec's plan_step (which raises spec's error, or accepts), and `pool.fallbacks` counts each
  such step by its reason (fast/fallback.py). Either gives one spec.state.StepPlan,
  committed by spec's PoolState.commit to the host mirror (fast.state.HostMirror), then, under Triton, to
  the device in one launch (fast/writes.py). fast/released.py keeps the validator's per-row cache.
- prepare: the batch order on the host (fast/batch.py), then the arrays: fast/kernel_prepare.py (one
  launch) under Triton, fast/host_prepare.py in host mode. A drafting step adds the sampler's indices
  (fast/drafts.py), in host mode in the batch's own buffers beside its other arrays.
- record_sampled: fast/sampled.py, spec's rules checked in one compiled pass.

The mode is fixed when the pool is built (fast.runtime.use_triton at that moment):
- Triton (CUDA tensors, or CPU tensors with the interpreter on): the state lives in separate tensors
  (fast.state.DeviceState); the tests compare that state with spec's, so the kernels' writes are checked.
- host mode (CPU tensors without Triton): the "device" is host memory, so the tensors share memory with
  the host mirror: committing to the mirror is the device write, and prepare is compiled loops over it.
prepare never waits for the device: everything it needs on the host (rows, order, counts) is in the plan.

What a caller may keep: the batch's tensors are views of buffers the pool reuses (in both modes), valid
until the next prepare (as vLLM's persistent input buffers); copy what must outlive the step. The host
copies of index_mapping and seq_lens that record_sampled reads are the pool's own.
"""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from typing import Any, TypeVar

import numpy as np
import torch

from fast.batch import batch_order
from fast.classify import Classifier
from fast.drafts import drafts_end, store_drafts
from fast.fallback import Fallback
from fast.feature import Placement
from fast.graphs import CapturedGraphs, Dispatcher
from fast.host_prepare import HostBatch
from fast.kernel_prepare import DeviceBatch
from fast.model_kinds import fast_features_for
from fast.padding import PaddedRows
from fast.records import new_batch
from fast.released import ReleasedTails
from fast.runtime import interpret, interpret_enabled, use_triton
from fast.state import DeviceState, HostMirror, write_prompts
from fast.step_modes import host_array, step_mode
from fast.validate import PlannerMemory, plan_bulk_step
from fast.writes import apply_writes, step_writes
from spec.classify import step_decode_query_len
from spec.errors import InconsistentSchedulerOutputError, UnknownRequestError
from spec.feature import Feature, find
from spec.padding import pad_request_rows
from spec.pool import check_graphs_choice, check_last_applied, padded_tokens
from spec.state import StepPlan
from spec.types import BatchInputs, PoolSnapshot, RowSnapshot, SchedulerOutput, WorkerConfig
from spec.validate import plan_step

F = TypeVar("F", bound=Feature)


class RequestStatePool:
    def __init__(self, config: WorkerConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" is the current device, by its index:
            self.device = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N, compared to it
        triton = use_triton(self.device)  # the mode, fixed for the pool's life (module docstring)
        self._interpret = interpret_enabled()
        if not triton and self.device.type != "cpu":
            raise ValueError(f"fast runs on CUDA (Triton) or CPU tensors, not {self.device}")
        self.host_mode = not triton  # CPU tensors sharing the host mirror's memory, compiled loops for prepare
        mirror = HostMirror(config)
        self.state: HostMirror = mirror  # validation and batch order read only this
        self.dev = DeviceState(config, self.device, mirror=mirror if self.host_mode else None)
        # the model kind's features (fast/feature.py): none for a plain decoder
        self.features = fast_features_for(config, Placement(self.dev, self.host_mode, self._interpret))
        self.released = ReleasedTails(config)  # the validator's per-row cache of released entries
        # every apply the bulk planner handed to spec's plan_step, accepted or refused, by reason (fast/fallback.py)
        self.fallbacks: Counter[Fallback] = Counter()
        self._planner = PlannerMemory(config, self.features)  # the bulk planner's scratch maps, last rows (validate.py)
        # the buffers batches are handed out in, reused from step to step: compiled loops over the mirror's
        # memory in host mode (fast/host_prepare.py), one launch into device buffers under Triton (kernel_prepare.py)
        self._batch_buffers = HostBatch() if self.host_mode else DeviceBatch(self.dev, self._interpret)
        self._classify = Classifier()  # each step's row classes (fast/classify.py), in a reused buffer
        self._dispatch = Dispatcher()  # each step's graph (fast/graphs.py), the last answer kept
        # the padded request rows of a batch prepared with graphs (fast/padding.py), reused from step to step
        self._padded_rows = PaddedRows(self.device, config.max_num_reqs + 1, self.host_mode)
        self._applied: SchedulerOutput | None = None
        self._plan: StepPlan | None = None  # the applied output as validated: all prepare reads of it
        self._prepared: BatchInputs | None = None  # the batch record_sampled may take
        self._prepared_rows_np = np.zeros(0, np.int64)  # [num_reqs] its batch_idx -> req_state_idx
        self._prepared_seq_lens_np = np.zeros(0, np.int64)  # [num_reqs] its seq_lens
        self._prepared_drafts: tuple[np.ndarray, np.ndarray] | None = None  # its batch_drafts; None: none
        self._applied_steps = 0  # outputs applied: the clock of async scheduling's late reads (spec/async_steps.py)
        # when the pool learns the samples: in step, or one step late (async scheduling, fast/step_modes.py)
        self.mode = step_mode(config, self.dev, self.host_mode, self._interpret)

    # ---- apply -------------------------------------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> None:
        self.mode.before_apply(self.state, self._applied_steps)
        plan = self._plan_step(sched)
        self._commit(plan)
        self._applied_steps += 1
        self._applied, self._plan, self._prepared = sched, plan, None

    def _plan_step(self, sched: SchedulerOutput) -> StepPlan:
        """The bulk planner's plan; where it falls back, spec's plan_step's (its error, or it accepts), counted."""
        planned = plan_bulk_step(self.state, sched, self.features, self.released.tails, self._planner)
        if isinstance(planned, StepPlan):
            refused = self.mode.vouch(self.state, planned)  # async scheduling's own checks (fast/step_modes.py)
            if refused is None:
                self._planner.accepted()
                return planned
            planned = refused
        self._planner.forget()  # what plan_step commits, if it accepts, is no plan the planner's memory followed
        self.fallbacks[planned] += 1
        return plan_step(self.state, sched, self.features)

    def _commit(self, plan: StepPlan) -> None:
        """spec's commit to the host mirror (in host mode, the device state itself), then the device in one launch."""
        state, dev = self.state, self.dev
        longest = max(plan.prompt_lens.tolist(), default=0)  # a few prompts: NumPy's max costs more than the list
        if plan.num_drafts is not None:  # drafts go past the known tokens: room for them too
            longest = max(longest, drafts_end(plan.num_computed, plan.num_scheduled))  # past each last draft
        dev.reserve_tokens(longest)
        writes = None if self.host_mode else step_writes(state, plan)  # needs the mirror as it was
        state.commit(plan)
        if plan.freed_rows.size:  # a remembered request that left may come back in another row
            self._planner.rows.freed(plan.freed_rows)
        for feature in self.features:  # their per-row state (spec's records; fast's M-RoPE tables on the device)
            feature.commit(state, plan)
        self.released.refresh(state, plan)
        if writes is not None:  # prompts and drafts ride in the same launch
            with interpret(self._interpret):
                apply_writes(dev, writes)
        elif dev.token_ids_np is not None:
            if plan.new_rows.size:
                write_prompts(dev.token_ids_np, plan.new_rows, plan.prompt_lens, plan.prompt_tokens)
            if plan.num_drafts is not None:
                store_drafts(dev.token_ids_np, plan, plan.num_drafts)
        self.mode.after_commit(state, plan)  # async: the device corrects what the scheduler counted optimistically

    # ---- prepare -----------------------------------------------------------------------------------
    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        plan = check_last_applied(sched, self._applied, self._plan)
        check_graphs_choice(pad_to, graphs)
        # from here on in batch order: index_mapping [num_reqs] batch_idx -> req_state_idx
        order, index_mapping, num_scheduled = batch_order(plan.rows, plan.num_scheduled)
        req_ids = plan.req_ids if order is None else itemgetter(*order)(plan.req_ids)  # order: 2+ entries
        cu_num_tokens = num_scheduled.cumsum()  # [num_reqs] int64
        num_tokens = int(cu_num_tokens[-1]) if index_mapping.size else 0
        # a bad pad_to is refused here, before the classifier writes its reused buffer (the last batch's flags)
        padded = padded_tokens(pad_to, num_tokens)
        # [num_reqs] int64 as the host counts (optimistically, under async scheduling: spec/async_steps.py)
        computed = plan.num_computed if order is None else plan.num_computed[order]
        seq_lens = computed + num_scheduled
        decode_query_len = step_decode_query_len(plan.num_drafts) if graphs is None else graphs.uniform_decode_query_len
        classes = self._classify(num_scheduled, computed, self.state.prompt_lens[index_mapping], decode_query_len)
        descriptor = None if graphs is None else self._dispatch(graphs, num_tokens, len(req_ids), classes)
        if descriptor is not None:
            padded = descriptor.num_tokens
        # fields beyond the plain batch's: a drafting step's sampler indices, async scheduling's pending tokens
        fields: dict[str, Any] = self.mode.batch_fields(
            self.state, index_mapping, computed, cu_num_tokens, num_scheduled
        )
        # a descriptor whose request rows are the batch's own pads tokens only: it rides in the batch as built
        pads_rows = descriptor is not None and descriptor.num_reqs > len(req_ids)
        extra = {"row_classes": classes} if pads_rows or descriptor is None else {"row_classes": classes,
                                                                                  "descriptor": descriptor}  # fmt: skip
        fields = fields | extra if fields else extra
        # input ids are right already (apply stored the drafts): a drafting step adds the sampler's indices
        step_drafts = None if plan.num_drafts is None else (plan.num_drafts, plan.draft_ids, order)
        batch, drafts = self._batch_buffers.prepare(
            self.dev, self.state, req_ids, index_mapping, num_scheduled, cu_num_tokens, padded, fields, step_drafts
        )
        if drafts is not None:
            on_device = self.mode.placeholder_drafts(index_mapping, *drafts)  # rule 8: the drafter's ids, if so
            if on_device is not None:
                batch = new_batch(**(batch.__dict__ | {"draft_token_ids": on_device}))
        if self.features:  # the model kind's records of the batch (fast/feature.py)
            records = tuple(f.prepare(self.state, plan, batch, order) for f in self.features)
            batch = new_batch(**(batch.__dict__ | {"features": records}))
        if pads_rows and graphs is not None and descriptor is not None:  # the graph's request rows, reused buffers
            batch = pad_request_rows(batch, descriptor, graphs.profile, self.features, self._padded_rows)
        self._prepared_drafts = drafts
        self._prepared = batch
        self._prepared_rows_np = index_mapping
        self._prepared_seq_lens_np = seq_lens
        return batch

    # ---- record_sampled ----------------------------------------------------------------------------
    def record_sampled(self, batch: BatchInputs, sampled_token_ids: object, next_draft_ids: object = None) -> None:
        """spec.RequestStatePool.record_sampled on device state: same rows, same errors, same order of checks."""
        if batch is not self._prepared and not self._equals_prepared(batch):
            detail = "not the batch of the last prepare (or recorded already)"
            raise InconsistentSchedulerOutputError(None, "batch", detail)
        rows, seq_lens = self._prepared_rows_np, self._prepared_seq_lens_np
        self.mode.record(self.state, self._applied_steps, batch.req_ids, rows, seq_lens, self._prepared_drafts,
                         sampled_token_ids, next_draft_ids)  # fmt: skip
        self._prepared = None

    def _equals_prepared(self, batch: BatchInputs) -> bool:
        """A batch with the last prepared batch's requests, rows and lengths (a wrapper's copy of it)."""
        prepared = self._prepared
        if prepared is None:
            return False
        return (
            tuple(batch.req_ids) == prepared.req_ids
            and np.array_equal(host_array(batch.index_mapping)[: batch.num_reqs], self._prepared_rows_np)
            and np.array_equal(host_array(batch.seq_lens)[: batch.num_reqs], self._prepared_seq_lens_np)
            # an earlier padded batch's rows view the reused padded-row buffers (fast/padding.py), so they read as
            # the last batch's: its graph tells them apart
            and batch.descriptor == prepared.descriptor
            and batch.num_tokens_padded == prepared.num_tokens_padded
        )

    # ---- inspection ----------------------------------------------------------------------------------
    def feature(self, kind: type[F]) -> F | None:
        """The pool's instance of a feature class (fast/feature.py), or None where its config lacks the feature."""
        return find(self.features, kind)

    def row_of(self, req_id: str) -> int:
        if req_id not in self.state.row_of:
            raise UnknownRequestError(req_id, "req_id", "request holds no row")
        return self.state.row_of[req_id]

    def snapshot(self) -> PoolSnapshot:
        """In time proportional to the tokens held: one device->host copy of the occupied rows' known tokens."""
        state = self.state
        occupied = [row for row, req_id in enumerate(state.req_ids) if req_id is not None]
        known, computed = self.mode.known_counts(state)  # [R], [R] async: the device's, not the optimistic host's
        lengths = known[occupied]
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
                num_computed_tokens=int(computed[row]),
                block_ids=tuple(tuple(state.blocks(row, g).tolist()) for g in range(len(self.config.kv_groups))),
            )
            for row, at, length in zip(occupied, rows_at, lengths.tolist(), strict=True)
        )
