"""Encoder-decoder cross-attention on torch tensors: spec/cross_attention.py's three cross fields of a batch.

They are computed on the host mirror, which holds every table prepare reads (fast/state.py), in a few
vectorised NumPy calls, and go to the device in one copy; the cross group's slot_mappings[g] becomes
PAD_SLOT_ID. The attention over the encoder's KV is fast/encoder_attention.py. apply checks the cross group's
rules in bulk (fast/cross_bulk.py).
"""

from __future__ import annotations

import numpy as np
import torch

from fast.cross_bulk import plan_in_bulk
from fast.fallback import Fallback
from fast.feature import FastFeature, Placement
from fast.runtime import upload
from spec.cross_attention import CrossAttention, CrossInputs
from spec.state import PoolState, StepPlan, ranges
from spec.types import INDEX_DTYPE, PAD_SLOT_ID, BatchInputs, SchedulerOutput, WorkerConfig


class FastCrossAttention(FastFeature, CrossAttention):
    """spec's cross-attention feature, its rules checked in bulk (fast/cross_bulk.py), its batch record built on the
    host mirror and uploaded in one copy."""

    plans_in_bulk = True
    reads_fields_in_bulk = True  # encoder_len

    def __init__(self, config: WorkerConfig, placement: Placement) -> None:
        self.placement = placement
        CrossAttention.__init__(self, config)

    def own_tables(self) -> frozenset[int]:
        return frozenset((self.group,))

    def plan_in_bulk(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan,
                     marks: np.ndarray | None) -> np.ndarray | Fallback:  # fmt: skip
        return plan_in_bulk(self, state, sched.new_requests, new_rows, plan, marks)

    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> CrossInputs:
        rows = plan.rows if order is None else plan.rows[order]  # [num_reqs] batch_idx -> req_state_idx, host copy
        batch.slot_mappings[self.group].fill_(PAD_SLOT_ID)  # [T] decoder tokens write no cross KV
        return cross_inputs(state, self.group, self.encoder_lens, rows, self.placement.device)


def cross_inputs(
    state: PoolState,  # the host mirror
    group: int,
    encoder_lens: np.ndarray,  # [R] req_state_idx -> L
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx, the host's copy
    device: torch.device,
) -> CrossInputs:
    """spec.cross_attention.cross_inputs from the host mirror, in one upload."""
    block_size = state.config.kv_groups[group].block_size
    lens = encoder_lens[index_mapping]  # [num_reqs]
    scheduled = np.where(state.num_computed_tokens[index_mapping] == 0, lens, 0)  # [num_reqs] encoder runs
    which, within = ranges(scheduled)  # [sum(scheduled)] batch row, encoder position of each encoder token
    blocks = state.block_tables[group][index_mapping[which], within // block_size].astype(np.int64)
    slots = blocks * block_size + within % block_size  # [sum(scheduled)] int64
    n = lens.size
    packed = upload(np.concatenate([lens, scheduled, slots]).astype(np.int64), device)
    return CrossInputs(
        encoder_seq_lens=packed[:n].to(getattr(torch, INDEX_DTYPE)),
        scheduled_encoder_lens=packed[n : 2 * n].to(getattr(torch, INDEX_DTYPE)),
        cross_slot_mapping=packed[2 * n :],
    )
