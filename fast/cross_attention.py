"""Encoder-decoder cross-attention on torch tensors: spec/cross_attention.py's three cross fields of a batch.

They are computed on the host mirror, which holds every table prepare reads (fast/state.py), in one compiled
pass, and go to the device in one copy; the cross group's slot_mappings[g] becomes
PAD_SLOT_ID. The attention over the encoder's KV is fast/encoder_attention.py. apply checks the cross group's
rules in bulk (fast/cross_bulk.py).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fast.cross_bulk import plan_in_bulk
from fast.fallback import Fallback
from fast.feature import FastFeature, Placement
from fast.runtime import upload
from spec.cross_attention import CrossAttention, CrossInputs
from spec.state import PoolState, StepPlan
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
    """spec.cross_attention.cross_inputs from the host mirror: one compiled pass, one upload."""
    n = index_mapping.shape[0]
    packed_host = np.empty(2 * n + _encoder_tokens(encoder_lens, state.num_computed_tokens, index_mapping), np.int64)
    block_size = state.config.kv_groups[group].block_size
    _cross_fields(state.block_tables[group], encoder_lens, state.num_computed_tokens, index_mapping, block_size,
                  packed_host)  # fmt: skip
    packed = upload(packed_host, device)  # [2 num_reqs + encoder tokens]: lens | scheduled lens | slots
    return CrossInputs(
        encoder_seq_lens=packed[:n].to(getattr(torch, INDEX_DTYPE)),
        scheduled_encoder_lens=packed[n : 2 * n].to(getattr(torch, INDEX_DTYPE)),
        cross_slot_mapping=packed[2 * n :],
    )


@njit(cache=True, nogil=True)
def _encoder_tokens(  # pragma: no cover - compiled
    encoder_lens: np.ndarray,  # [R] req_state_idx -> L
    num_computed: np.ndarray,  # [R] req_state_idx -> the step's first position
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
) -> int:
    """The encoder tokens the step writes: L of every row whose step starts at 0."""
    total = 0
    for b in range(index_mapping.shape[0]):
        if num_computed[index_mapping[b]] == 0:
            total += encoder_lens[index_mapping[b]]
    return total


@njit(cache=True, nogil=True)
def _cross_fields(  # pragma: no cover - compiled; tested through the pool against spec
    table: np.ndarray,  # [R, width] int32 the cross group's table
    encoder_lens: np.ndarray,  # [R] int64 req_state_idx -> L
    num_computed: np.ndarray,  # [R] int64 req_state_idx -> the step's first position
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    block_size: int,
    out: np.ndarray,  # [2 num_reqs + encoder tokens] int64 out: L | L where the encoder runs, else 0 | slots
) -> None:
    """spec.cross_attention.cross_inputs's three fields, end to end in `out`: a row whose step starts at 0 runs
    its encoder, whose tokens go to its first cdiv(L, bs) cross blocks, from each block's offset 0."""
    n = index_mapping.shape[0]
    at = 2 * n
    for b in range(n):
        row = index_mapping[b]
        length = encoder_lens[row]
        runs = num_computed[row] == 0
        out[b], out[n + b] = length, length if runs else 0
        if runs:
            for p in range(length):
                out[at + p] = np.int64(table[row, p // block_size]) * block_size + p % block_size
            at += length
