"""Mamba state groups in fast (spec/mamba.py): the state indices of a batch, under Triton or in host mode.

apply leaves the rules to spec (fast/validate.py hands every step of a model with a mamba group to spec's
plan_step), so the plan carries spec's `MambaSteps`; prepare turns them into the batch's fields. Under
Triton one small launch per mamba group reads the device tables (fast/kernels/mamba.py); in host mode
the same gathers run as torch ops on the tables the device state shares with the host mirror.

The read column and num_accepted_tokens depend on the count the step runs at, which under async scheduling is
the device's (fast/async_steps.py corrects num_computed there; the host mirror learns the rejected drafts one
apply later): both are computed where that count is, from the batch's seq_lens less its scheduled tokens, and
the host sends only what it knows exactly (each row's read base and the position of its first stored state).
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
from spec.types import PAD_SLOT_ID, BatchInputs, WorkerConfig


class FastMamba(FastFeature, Mamba):
    """spec's mamba feature (its rules and per-row record on the host), the batch's state indices on the device."""

    def __init__(self, config: WorkerConfig, placement: Placement) -> None:
        self.placement = placement
        Mamba.__init__(self, config)

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
    packed = np.concatenate([steps.bases, steps.firsts, num_drafts]).astype(np.int64)
    reads = upload(packed, dev.device).view(3, num_reqs)  # base | first | num_drafts, one copy
    # the step's counts on the device: seq_lens from its num_computed, corrected there (async rule 2)
    seq_lens, num_scheduled = batch.seq_lens, batch.num_scheduled_tokens
    written: list[torch.Tensor | None] = []
    prevs: list[torch.Tensor | None] = []
    accepted: torch.Tensor | None = None  # [num_reqs] int32 num_accepted_tokens, as each group's launch gives it
    for g, group in enumerate(config.kv_groups):
        if group.kind != MAMBA:
            written.append(None)
            prevs.append(None)
            continue
        batch.slot_mappings[g].fill_(PAD_SLOT_ID)  # no token writes KV to a mamba group
        table = dev.table(g)
        if host_mode:  # [num_reqs] the count each row runs at: the device's (host memory here), corrected
            computed = seq_lens.long() - num_scheduled.long()
            w, p, accepted = _gather_host(table, batch.index_mapping, seq_lens, computed, reads, group.block_size,
                                          group.num_speculative_blocks)  # fmt: skip
        else:
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


def _gather_host(
    table: torch.Tensor,  # [R, width] int32
    index_mapping: torch.Tensor,  # [num_reqs] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, from the corrected count
    computed: torch.Tensor,  # [num_reqs] int64 num_computed, corrected: seq_lens - num_scheduled
    reads: torch.Tensor,  # [3, num_reqs] int64: base | first | num_drafts
    block_size: int,
    num_speculative_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(written [num_reqs, 1 + S] int32, read [num_reqs] int32, num_accepted_tokens [num_reqs] int32)."""
    rows = index_mapping.long()  # [num_reqs]
    base, first, drafts = reads[0], reads[1], reads[2]
    accepted = computed - first  # [num_reqs] num_accepted_tokens: the corrected count less the first state's position
    cols = torch.arange(1 + num_speculative_blocks)  # [columns]
    used = cols[None, :] <= drafts[:, None]  # [num_reqs, columns]
    write = (seq_lens.long() - 1) // block_size  # [num_reqs]
    entries = torch.where(used, write[:, None] + cols[None, :], 0)
    picked = table[rows[:, None], entries]
    written = torch.where(used, picked, NO_STATE).to(torch.int32)
    has_prior = base >= 0
    column = torch.where(has_prior, base.clamp(min=0) // block_size + accepted - 1, 0)
    read = torch.where(has_prior, table[rows, column], NO_STATE).to(torch.int32)
    return written, read, accepted.to(torch.int32)
