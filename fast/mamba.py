"""Mamba state groups in fast (spec/mamba.py): the state indices of a batch, under Triton or in host mode.

apply leaves the rules to spec (fast/validate.py hands every step of a model with a mamba group to spec's
plan_step), so the plan carries spec's `MambaSteps`; prepare turns them into the batch's fields. Under
Triton one small launch per mamba group reads the device tables (fast/kernels/mamba.py); in host mode
the same gathers run as torch ops on the tables the device state shares with the host mirror.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.feature import FastFeature, Placement
from fast.kernels.mamba import mamba_state_indices_triton
from fast.runtime import interpret, upload
from fast.state import DeviceState
from spec.feature import in_batch_order
from spec.mamba import MAMBA, NO_STATE, Mamba, MambaSteps, StateIndices, batch_steps, keeps_speculative_states
from spec.state import PoolState, StepPlan
from spec.types import INDEX_DTYPE, PAD_SLOT_ID, BatchInputs, WorkerConfig


class FastMamba(FastFeature, Mamba):
    """spec's mamba feature (its rules and per-row record on the host), the batch's state indices on the device."""

    def __init__(self, config: WorkerConfig, placement: Placement) -> None:
        self.placement = placement
        Mamba.__init__(self, config)

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> StateIndices:
        drafts = np.zeros(plan.rows.size, np.int64) if plan.num_drafts is None else plan.num_drafts
        with interpret(self.placement.interpret):
            steps = plan.features[self.name]
            dev, host_mode = self.placement.dev, self.placement.host_mode
            return state_indices(batch, dev, steps, order, in_batch_order(drafts, order), host_mode)


def state_indices(
    batch: BatchInputs,
    dev: DeviceState,
    plan_steps: MambaSteps,  # StepPlan.features["mamba"], scheduler order
    order: np.ndarray | None,  # [num_reqs] batch_idx -> scheduler index; None: the same order
    num_drafts: np.ndarray,  # [num_reqs] int batch order
    host_mode: bool,
) -> StateIndices:
    """The mamba record of the batch; PAD_SLOT_ID in the mamba groups' slot mappings."""
    config = dev.config
    steps = batch_steps(plan_steps, order)
    num_reqs = batch.num_reqs
    packed = np.concatenate([steps.bases, steps.num_accepted, num_drafts.astype(np.int64)]).astype(np.int64)
    reads = upload(packed, dev.device).view(3, num_reqs)  # base | num_accepted | num_drafts, one copy
    written: list[torch.Tensor | None] = []
    prevs: list[torch.Tensor | None] = []
    for g, group in enumerate(config.kv_groups):
        if group.kind != MAMBA:
            written.append(None)
            prevs.append(None)
            continue
        batch.slot_mappings[g].fill_(PAD_SLOT_ID)  # no token writes KV to a mamba group
        table = dev.table(g)
        if host_mode:
            w, p = _gather_host(table, batch.index_mapping, batch.seq_lens, reads, group.block_size,
                                group.num_speculative_blocks)  # fmt: skip
        else:
            w, p = mamba_state_indices_triton(table, batch.index_mapping, batch.seq_lens, reads, group.block_size,
                                              group.num_speculative_blocks)  # fmt: skip
        written.append(w)
        prevs.append(p)
    small = upload(np.concatenate([steps.is_prefilling, steps.num_accepted]).astype(INDEX_DTYPE), dev.device)
    return StateIndices(
        mamba_state_indices=tuple(written),
        mamba_prev_state_indices=tuple(prevs),
        is_prefilling=small[:num_reqs].to(torch.bool),
        num_accepted_tokens=small[num_reqs:] if keeps_speculative_states(config) else None,
    )


def _gather_host(
    table: torch.Tensor,  # [R, width] int32
    index_mapping: torch.Tensor,  # [num_reqs] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    reads: torch.Tensor,  # [3, num_reqs] int64
    block_size: int,
    num_speculative_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = index_mapping.long()  # [num_reqs]
    base, accepted, drafts = reads[0], reads[1], reads[2]
    cols = torch.arange(1 + num_speculative_blocks)  # [columns]
    used = cols[None, :] <= drafts[:, None]  # [num_reqs, columns]
    write = (seq_lens.long() - 1) // block_size  # [num_reqs]
    entries = torch.where(used, write[:, None] + cols[None, :], 0)
    picked = table[rows[:, None], entries]
    written = torch.where(used, picked, NO_STATE).to(torch.int32)
    has_prior = base >= 0
    column = torch.where(has_prior, base.clamp(min=0) // block_size + accepted - 1, 0)
    read = torch.where(has_prior, table[rows, column], NO_STATE).to(torch.int32)
    return written, read
