"""Mamba state groups in fast (spec/mamba.py): the state indices of a batch, under Triton or in host mode.

apply checks the groups' rules in bulk (fast/mamba_bulk.py), so the plan carries spec's `MambaSteps`;
prepare turns them into the batch's fields. Under Triton one small launch per mamba group reads the device
tables (fast/kernels/mamba.py); in host mode one compiled pass gathers them from the tables the device state
shares with the host mirror.

The read column and num_accepted_tokens depend on the count the step runs at, which under async scheduling is
the device's (fast/async_steps.py corrects num_computed there; the host mirror learns the rejected drafts one
apply later): both are computed where that count is, from the batch's seq_lens less its scheduled tokens, and
the host sends only what it knows exactly (each row's read base and the position of its first stored state).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fast.fallback import Fallback
from fast.feature import FastFeature, Placement
from fast.kernels.mamba import mamba_state_indices_triton
from fast.mamba_bulk import plan_in_bulk
from fast.runtime import interpret, upload
from fast.state import DeviceState
from spec.feature import in_batch_order
from spec.mamba import MAMBA, NO_STATE, Mamba, MambaSteps, StateIndices, batch_steps, keeps_speculative_states
from spec.state import PoolState, StepPlan
from spec.types import PAD_SLOT_ID, BatchInputs, SchedulerOutput, WorkerConfig


class FastMamba(FastFeature, Mamba):
    """spec's mamba feature (its rules and per-row record on the host), the batch's state indices on the device."""

    plans_in_bulk = True  # its groups' rules in compiled passes (fast/mamba_bulk.py)

    def __init__(self, config: WorkerConfig, placement: Placement) -> None:
        self.placement = placement
        Mamba.__init__(self, config)

    def plan_in_bulk(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan,
                     marks: np.ndarray | None) -> MambaSteps | Fallback:  # fmt: skip
        return plan_in_bulk(self, state, plan, marks)

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> StateIndices:
        drafts = np.zeros(plan.rows.size, np.int64) if plan.num_drafts is None else plan.num_drafts
        with interpret(self.placement.interpret):
            dev, host_mode = self.placement.dev, self.placement.host_mode
            return state_indices(batch, dev, plan, order, in_batch_order(drafts, order), host_mode)


def state_indices(
    batch: BatchInputs,
    dev: DeviceState,
    plan: StepPlan,  # its features["mamba"] (MambaSteps) in scheduler order
    order: np.ndarray | None,  # [num_reqs] batch_idx -> scheduler index; None: the same order
    num_drafts: np.ndarray,  # [num_reqs] int batch order
    host_mode: bool,
) -> StateIndices:
    """The mamba record of the batch; PAD_SLOT_ID in the mamba groups' slot mappings."""
    config = dev.config
    steps: MambaSteps = batch_steps(plan.features[MAMBA], order)
    num_reqs = batch.num_reqs
    # the step's counts on the device: seq_lens from its num_computed, corrected there (async rule 2)
    seq_lens, num_scheduled = batch.seq_lens, batch.num_scheduled_tokens
    if not host_mode:
        packed = np.concatenate([steps.bases, steps.firsts, num_drafts]).astype(np.int64)
        reads = upload(packed, dev.device).view(3, num_reqs)  # base | first | num_drafts, one copy
    written: list[torch.Tensor | None] = []
    prevs: list[torch.Tensor | None] = []
    accepted: torch.Tensor | None = None  # [num_reqs] int32 num_accepted_tokens, as each group's launch gives it
    for g, group in enumerate(config.kv_groups):
        if group.kind != MAMBA:
            written.append(None)
            prevs.append(None)
            continue
        if host_mode:  # the batch's tensors and the tables are host memory: one compiled pass, no torch op
            out = (np.empty((num_reqs, 1 + group.num_speculative_blocks), np.int32), np.empty(num_reqs, np.int32),
                   np.empty(num_reqs, np.int32))  # written, read, num_accepted_tokens  # fmt: skip
            _gather_host(dev.table(g).numpy(), batch.index_mapping.numpy(), seq_lens.numpy(),
                         num_scheduled.numpy(), steps.bases, steps.firsts, num_drafts, group.block_size,
                         batch.slot_mappings[g].numpy(), *out)  # fmt: skip
            w, p, accepted = (torch.from_numpy(a) for a in out)
        else:
            batch.slot_mappings[g].fill_(PAD_SLOT_ID)  # no token writes KV to a mamba group
            table = dev.table(g)
            w, p, accepted = mamba_state_indices_triton(table, batch.index_mapping, seq_lens, num_scheduled, reads,
                                                        group.block_size, group.num_speculative_blocks)  # fmt: skip
        written.append(w)
        prevs.append(p)
    return StateIndices(
        mamba_state_indices=tuple(written),
        mamba_prev_state_indices=tuple(prevs),
        # the batch's row classes' flags (fast/classify.py, a CPU tensor over host memory), on the device
        is_prefilling=batch.row_classes.is_prefilling.to(dev.device),
        num_accepted_tokens=accepted if keeps_speculative_states(config) else None,
    )


@njit(cache=True, nogil=True)
def _gather_host(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the mamba group's table
    index_mapping: np.ndarray,  # [num_reqs] int32 batch_idx -> req_state_idx
    seq_lens: np.ndarray,  # [num_reqs] int32, from the corrected count
    num_scheduled: np.ndarray,  # [num_reqs] int32
    bases: np.ndarray,  # [num_reqs] int64 batch order: each row's read base (spec.mamba.StateRead.base)
    firsts: np.ndarray,  # [num_reqs] int64 the position whose state the base column holds
    num_drafts: np.ndarray,  # [num_reqs] int batch order
    block_size: int,
    slots: np.ndarray,  # [T] int64 out: the group's slot mapping, all PAD_SLOT_ID (no token writes KV here)
    written: np.ndarray,  # [num_reqs, 1 + S] int32 out: the state blocks each row writes, NO_STATE past its drafts
    read: np.ndarray,  # [num_reqs] int32 out: the state block it starts from, or NO_STATE
    accepted: np.ndarray,  # [num_reqs] int32 out: num_accepted_tokens
) -> None:
    """spec.mamba.state_indices for one group, row by row, at the count each row runs at (seq_lens - num_scheduled:
    corrected under async scheduling)."""
    slots[:] = PAD_SLOT_ID
    for b in range(index_mapping.shape[0]):
        row = index_mapping[b]
        accepted[b] = seq_lens[b] - num_scheduled[b] - firsts[b]  # the corrected count less the first state's position
        write = (seq_lens[b] - 1) // block_size
        for j in range(written.shape[1]):
            written[b, j] = table[row, write + j] if j <= num_drafts[b] else NO_STATE
        read[b] = NO_STATE if bases[b] < 0 else table[row, bases[b] // block_size + accepted[b] - 1]
