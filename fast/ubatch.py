"""Micro-batches (dual-batch overlap) on torch tensors: spec/ubatch.py's split, with no host sync.

The slices come from host counts only (the split point from num_tokens_padded, the request slices from the
host query lengths, as vLLM's maybe_create_ubatch_slices reads its NumPy num_scheduled_tokens); the rebase and
clamp of query_start_loc and the cut of the straddling request's seq_len run as torch ops on the batch's
device (v2's _slice_query_start_loc and _slice_seq_lens), and every other field is a view of the batch's.
Given query_lens_np, nothing waits for the device (tests/test_ubatch.py counts it); without, their host copy
costs one device->host read.
"""

from __future__ import annotations

import numpy as np
import torch

from spec.types import BatchInputs
from spec.ubatch import MicroBatch, UbatchSplitError, check_split, ubatch_slices

__all__ = ["MicroBatch", "UbatchSplitError", "split_batch"]


def split_batch(
    batch: BatchInputs,
    split_point: int | None = None,  # first token of the second half; None: num_tokens_padded // 2
    *,
    query_lens_np: np.ndarray | None = None,  # [num_reqs] host query lengths; None: read from the device (a sync)
) -> tuple[MicroBatch, MicroBatch]:
    """The batch's two micro-batches, as spec.ubatch.split_batch; the halves' tensors on the batch's device."""
    if query_lens_np is None:
        query_lens_np = batch.num_scheduled_tokens[: batch.num_reqs].cpu().numpy()
    split, lens = check_split(batch, split_point, query_lens_np)
    slices = ubatch_slices(lens, int(batch.index_mapping.shape[0]), batch.num_tokens_padded, split)
    first, second = (_half(batch, requests, tokens) for requests, tokens in slices.halves())
    return first, second


def _half(batch: BatchInputs, requests: slice, tokens: slice) -> MicroBatch:
    start, stop = requests.start, requests.stop
    num_tokens_padded = tokens.stop - tokens.start
    qsl = batch.query_start_loc  # [num_reqs_padded + 1] int32, on the device
    # [n + 1] int32: a new tensor (torch.sub), so the clamp leaves the batch's as it was
    half_qsl = torch.sub(qsl[start : stop + 1], tokens.start).clamp_(0, num_tokens_padded)
    seq_lens = batch.seq_lens[start:stop].clone()  # [n] int32
    # the last row's tokens past the half's end, read on the device: [1], 0 unless it straddles
    seq_lens[-1:] -= (qsl[stop : stop + 1] - tokens.stop).clamp_(min=0).to(seq_lens.dtype)
    num_reqs = max(0, min(stop, batch.num_reqs) - start)
    return MicroBatch(
        request_slice=requests,
        token_slice=tokens,
        req_ids=batch.req_ids[start : start + num_reqs],
        index_mapping=batch.index_mapping[start:stop],
        num_scheduled_tokens=torch.diff(half_qsl)[:num_reqs],
        query_start_loc=half_qsl,
        seq_lens=seq_lens,
        positions=batch.positions[tokens],
        input_ids=batch.input_ids[tokens],
        block_tables=tuple(t[start:stop] for t in batch.block_tables),
        slot_mappings=tuple(s[tokens] for s in batch.slot_mappings),
        num_tokens=max(0, min(tokens.stop, batch.num_tokens) - tokens.start),
        num_tokens_padded=num_tokens_padded,
        features=tuple(r.split_for_ubatch(requests, tokens) for r in batch.features),
    )
