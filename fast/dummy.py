"""Dummy batches on torch tensors (spec/dummy.py's rule): a rank with no request runs a peer's token count.

Built on the device, PAD from the first op: the slot mappings are created full of PAD_SLOT_ID (torch.full), never
allocated empty and cleared afterwards, so no kernel can see a slot a backend has not yet overwritten (the
vllm-ascend #15417 class spec/dummy.py names). The dispatch and the classification are host decisions on host
counts (an empty batch), the request rows a FULL graph replays are padded as fast/padding.py pads them.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.classify import classify
from fast.padding import PaddedRows
from spec.graphs import CapturedGraphs, dispatch
from spec.padding import pad_request_rows
from spec.types import PAD_SLOT_ID, BatchInputs, WorkerConfig, is_integral


def dummy_batch(
    config: WorkerConfig,
    num_tokens: int,  # the peer's token count
    graphs: CapturedGraphs | None = None,
    *,
    device: torch.device | str = "cpu",
) -> BatchInputs:
    """spec.dummy.dummy_batch with torch tensors on `device`."""
    if not is_integral(num_tokens) or num_tokens < 0:
        raise ValueError(f"dummy_batch: num_tokens must be an integer >= 0, got {num_tokens!r}")
    if graphs is not None and not isinstance(graphs, CapturedGraphs):
        raise ValueError(f"dummy_batch: graphs must be a CapturedGraphs, got {type(graphs).__name__}")
    device = torch.device(device)
    none = np.zeros(0, np.int64)  # [0] no request: the host's counts
    classes = classify(none, none, none, 1 if graphs is None else graphs.uniform_decode_query_len)
    descriptor = None if graphs is None else dispatch(graphs, int(num_tokens), 0, classes)
    padded = int(num_tokens) if descriptor is None else descriptor.num_tokens

    def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    groups = range(len(config.kv_groups))
    batch = BatchInputs(
        req_ids=(),
        index_mapping=zeros(0),  # [0]
        num_scheduled_tokens=zeros(0),  # [0]
        query_start_loc=zeros(1),  # [1]
        positions=zeros(padded, dtype=torch.int64),  # [T_pad]
        input_ids=zeros(padded, dtype=torch.int64),  # [T_pad]
        seq_lens=zeros(0),  # [0]
        logits_indices=zeros(0),  # [0]
        block_tables=tuple(zeros(0, config.max_blocks_per_req(g)) for g in groups),  # per group [0, width]
        slot_mappings=tuple(
            torch.full((padded,), PAD_SLOT_ID, dtype=torch.int64, device=device) for _ in groups
        ),  # per group [T_pad], PAD from the start
        num_tokens=0,
        num_tokens_padded=padded,
        row_classes=classes,
    )
    if graphs is None or descriptor is None:
        return batch
    return pad_request_rows(batch, descriptor, graphs.profile, (), PaddedRows(device, 0))
