"""spec/step_modes.py on torch tensors: when the pool learns a step's samples, in step or one step late.

fast/pool.py calls its mode at the same points as spec's pool and never asks which it is. `InStep` checks the
ids as they are recorded (fast/sampled.py, the one host sync); `Ahead` is async scheduling, the ids never read
by the host in time (fast/async_steps.py's AheadState does the work on the device).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from fast.async_steps import AheadState, async_drafts_hold, pending_tokens_into, placeholder_runs
from fast.fallback import Fallback
from fast.runtime import upload
from fast.sampled import record_accepted, record_one_per_row
from fast.state import DeviceState
from spec.async_steps import forget_unrecorded
from spec.drafts import accepted_rows, proposed_ids, token_rows
from spec.errors import InconsistentSchedulerOutputError
from spec.state import PoolState, StepPlan
from spec.types import WorkerConfig

_NO_DRAFTS = np.zeros(0, np.int64)  # a step without drafts: none per row (read as 0), no ids
_INTEGER_DTYPES = frozenset(
    (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
)


class StepMode(Protocol):
    def before_apply(self, state: PoolState, applied_steps: int) -> None:
        """Before validation: what the host learns now of earlier records (a fault due now raises)."""

    def vouch(self, state: PoolState, plan: StepPlan) -> Fallback | None:
        """The mode's own checks of a plan the bulk planner made; a Fallback hands the step to spec's plan_step."""
        ...

    def after_commit(self, state: PoolState, plan: StepPlan) -> None:
        """After the host commit: what the step's output tells of the last record (the device learns it)."""

    def batch_fields(
        self,
        state: PoolState,
        index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx, host copy
        num_computed: np.ndarray,  # [num_reqs] batch order, as the host counts
        cu_num_tokens: np.ndarray,  # [num_reqs] int64 host copy: query_start_loc[1:]
        num_scheduled: np.ndarray,  # [num_reqs]
    ) -> dict[str, Any]:
        """The BatchInputs fields the mode adds (none in step)."""
        ...

    def record(
        self,
        state: PoolState,
        applied_steps: int,
        req_ids: tuple[str, ...],  # [num_reqs] batch order
        rows: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx, as prepared
        seq_lens: np.ndarray,  # [num_reqs] as prepared
        drafts: tuple[np.ndarray, np.ndarray] | None,  # [num_reqs] drafts per row, [num_drafts] ids; None: none
        sampled_token_ids: object,
        next_draft_ids: object,  # [num_reqs, P] the drafter's ids (async only, spec/async_steps.py rule 8), or None
    ) -> None:
        """record_sampled's effect, spec's errors in spec's order."""

    def placeholder_drafts(self, rows: np.ndarray, num_drafts: np.ndarray, draft_ids: np.ndarray) -> Any:
        """The sampler's draft_token_ids where the step applied last has placeholder drafts (rule 8): [num_drafts]
        int64 the drafts of the batch rows `rows` (num_drafts each, draft_ids as sent) as stored; else None."""
        ...

    def known_counts(self, state: PoolState) -> tuple[np.ndarray, np.ndarray]:
        """([R] known tokens, [R] num_computed) as they truly are (what a snapshot shows)."""
        ...


class InStep:
    def __init__(self, dev: DeviceState) -> None:
        self.dev = dev

    def before_apply(self, state: PoolState, applied_steps: int) -> None:
        return

    def vouch(self, state: PoolState, plan: StepPlan) -> Fallback | None:
        return None

    def after_commit(self, state: PoolState, plan: StepPlan) -> None:
        return

    def batch_fields(
        self,
        state: PoolState,
        index_mapping: np.ndarray,
        num_computed: np.ndarray,
        cu_num_tokens: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> dict[str, Any]:
        return {}

    def record(
        self,
        state: PoolState,
        applied_steps: int,
        req_ids: tuple[str, ...],
        rows: np.ndarray,
        seq_lens: np.ndarray,
        drafts: tuple[np.ndarray, np.ndarray] | None,
        sampled_token_ids: object,
        next_draft_ids: object,
    ) -> None:
        sampled = host_array(sampled_token_ids)  # the one sync: the ids must be validated
        if sampled.size and sampled.dtype.kind not in "iu":
            detail = f"dtype {sampled.dtype}: needs integer ids"
            raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
        if next_draft_ids is not None:  # refused after the ids' shape checks, as spec orders them
            token_rows(sampled, len(req_ids))
            proposed_ids(next_draft_ids, len(req_ids), self.dev.config)
        prepared = (self.dev, state, req_ids, rows, seq_lens)
        if sampled.ndim > 1 or drafts is not None:
            record_accepted(*prepared, drafts, sampled)
        else:
            record_one_per_row(*prepared, sampled)

    def placeholder_drafts(self, rows: np.ndarray, num_drafts: np.ndarray, draft_ids: np.ndarray) -> Any:
        return None  # validation refuses placeholders without async scheduling

    def known_counts(self, state: PoolState) -> tuple[np.ndarray, np.ndarray]:
        return state.num_known_tokens, state.num_computed_tokens


class Ahead:
    """Async scheduling (spec/async_steps.py), the values checked and appended on the device."""

    def __init__(self, config: WorkerConfig, dev: DeviceState, host_mode: bool, interpreted: bool) -> None:
        self.dev = dev
        self.state = AheadState(config, dev, host_mode, interpreted)
        self._placeholders_applied = False  # the step applied last has placeholder drafts (rule 8)
        self.recorded = False  # the last step applied had its batch recorded: its samples may be pending (rule 3)
        self._pending = np.zeros(0, np.int32)  # [2 num_reqs] rule 3's indices | sources, reused
        self._pending_views: tuple[int, int, dict[str, Any]] | None = None  # on CPU: (n, count, the two views)

    def before_apply(self, state: PoolState, applied_steps: int) -> None:
        self.state.read_due(state, applied_steps)  # the copies of records a step old: the mirror learns verdicts

    def vouch(self, state: PoolState, plan: StepPlan) -> Fallback | None:
        """Rules 5, 7 and 8 (check 8) on the bulk planner's plan, one compiled pass; spec names any fault."""
        if plan.num_drafts is None and not self.state.unverified:
            return None
        tables = plan.tables[0]
        drafts = _NO_DRAFTS if plan.num_drafts is None else plan.num_drafts
        if async_drafts_hold(plan.rows, drafts, plan.draft_ids, tables.rows, tables.replaced,
                             state.num_unverified_drafts, state.num_proposed):  # fmt: skip
            return None
        return Fallback.ASYNC_RULES

    def after_commit(self, state: PoolState, plan: StepPlan) -> None:
        if self.state.unverified:  # the step after this one is scheduled knowing the verdicts
            state.num_unverified_drafts[:] = 0
            self.state.unverified = False
        forget_unrecorded(state, self.recorded)  # rule 3: pending tokens come from the batch run just before
        self.recorded = False
        self.state.commit(plan)  # rule 2 on the device
        placeholders = placeholder_rows(plan)
        self._placeholders_applied = placeholders is not None
        if placeholders is not None:  # rule 8: at the corrected count, so after the commit
            self.state.take_proposals(*placeholders)

    def batch_fields(
        self,
        state: PoolState,
        index_mapping: np.ndarray,
        num_computed: np.ndarray,
        cu_num_tokens: np.ndarray,
        num_scheduled: np.ndarray,
    ) -> dict[str, Any]:
        # rule 3 (spec.async_steps.pending_tokens) in one compiled pass: indices | sources, each [num_pending]
        n = index_mapping.shape[0]
        if self._pending.shape[0] < 2 * n:
            self._pending, self._pending_views = np.zeros(4 * n, np.int32), None
        packed = self._pending[: 2 * n]
        count = pending_tokens_into(state.sampled_in, state.num_known_tokens, index_mapping, num_computed,
                                    cu_num_tokens, num_scheduled, packed)  # fmt: skip
        if self.dev.device.type != "cpu":
            tensor = upload(packed, self.dev.device)
            return {"pending_token_indices": tensor[:count], "pending_prev_batch_idx": tensor[n : n + count]}
        # on CPU two views of the reused buffer, made again only when the shape changes: like the batch's other
        # arrays they are valid until the next prepare (fast/pool.py)
        if self._pending_views is None or self._pending_views[:2] != (n, count):
            views = {"pending_token_indices": torch.from_numpy(packed[:count]),
                     "pending_prev_batch_idx": torch.from_numpy(packed[n : n + count])}  # fmt: skip
            self._pending_views = (n, count, views)
        return self._pending_views[2]

    def record(
        self,
        state: PoolState,
        applied_steps: int,
        req_ids: tuple[str, ...],
        rows: np.ndarray,
        seq_lens: np.ndarray,
        drafts: tuple[np.ndarray, np.ndarray] | None,
        sampled_token_ids: object,
        next_draft_ids: object,
    ) -> None:
        """What the host can check without the values now, the rest on the device (in host mode, NumPy)."""
        sampled = self._integers(sampled_token_ids, "sampled_token_ids")
        if not 1 <= sampled.ndim <= 2 or sampled.shape[0] != len(req_ids):  # spec's shape errors (values unread)
            shape = tuple(sampled.shape)
            accepted_rows(np.empty(shape if len(shape) != 2 else (shape[0], 0), np.int64), len(req_ids))
        proposed = None
        if next_draft_ids is not None:  # spec.drafts.proposed_ids's checks, the values not read (rule 8)
            proposed = self._integers(next_draft_ids, "next_draft_ids")
            if proposed.ndim != 2 or proposed.shape[0] != len(req_ids):
                detail = f"shape {tuple(proposed.shape)}: needs [num_reqs={len(req_ids)}, num_proposed]"
                raise InconsistentSchedulerOutputError(None, "next_draft_ids", detail)
            if isinstance(proposed, np.ndarray):
                proposed = proposed.astype(np.int64, copy=False)
            else:
                proposed = proposed.to(torch.int64)
        num_drafts, draft_ids = drafts or (_NO_DRAFTS, _NO_DRAFTS)
        self.state.record(state, applied_steps, req_ids, rows, seq_lens, num_drafts, draft_ids, sampled, proposed)
        self.recorded = True

    def _integers(self, ids: object, field: str) -> np.ndarray | torch.Tensor:
        """The caller's ids where the record reads them (host mode: NumPy; else the device), an integer dtype."""
        host_mode = self.state.host_mode
        if isinstance(ids, torch.Tensor):
            dtype = ids.dtype
            if dtype not in _INTEGER_DTYPES and ids.numel():  # one set lookup: the usual case costs least
                detail = f"dtype {str(dtype).removeprefix('torch.')}: needs integer ids"
                raise InconsistentSchedulerOutputError(None, field, detail)
            if host_mode:  # a view of CPU ids
                return (ids if ids.is_cpu else ids.cpu()).numpy()
            return ids.to(self.dev.device)
        array = np.asarray(ids)
        if array.size and array.dtype.kind not in "iu":
            raise InconsistentSchedulerOutputError(None, field, f"dtype {array.dtype}: needs integer ids")
        return array if host_mode else torch.from_numpy(np.ascontiguousarray(array)).to(self.dev.device)

    def placeholder_drafts(self, rows: np.ndarray, num_drafts: np.ndarray, draft_ids: np.ndarray) -> Any:
        if not self._placeholders_applied:
            return None
        return self.state.batch_drafts(rows, num_drafts, draft_ids.shape[0])

    def known_counts(self, state: PoolState) -> tuple[np.ndarray, np.ndarray]:
        """The host's counts are optimistic until read: ask the device (a sync)."""
        return self.state.known_counts(), self.dev.num_computed.cpu().numpy()


def step_mode(config: WorkerConfig, dev: DeviceState, host_mode: bool, interpreted: bool) -> StepMode:
    return Ahead(config, dev, host_mode, interpreted) if config.async_scheduling else InStep(dev)


def host_array(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):  # a CPU tensor outside autograd shares its memory as it is (half the calls)
        return x.numpy() if x.is_cpu and not x.requires_grad else x.detach().cpu().numpy()
    return np.asarray(x)


def placeholder_rows(plan: StepPlan) -> tuple[np.ndarray, np.ndarray] | None:
    """([p] req_state_idx, [p] drafts) of the plan's requests whose drafts are placeholders (rule 8), or None."""
    if plan.num_drafts is None:
        return None
    on_device = np.empty(plan.num_drafts.shape[0], np.bool_)
    if not placeholder_runs(plan.num_drafts, plan.draft_ids, on_device):
        return None
    return plan.rows[on_device], plan.num_drafts[on_device]
