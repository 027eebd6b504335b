"""Stage 3-5 under Triton (CUDA, or CPU under the interpreter): the batch's arrays from one kernel launch.

The host knows the batch order (fast/batch.py); `index_mapping | num_scheduled_tokens | query_start_loc`
go up in one copy and fast.kernels.prepare computes everything else on the device.
"""

from __future__ import annotations

import numpy as np

from fast.kernels.prepare import prepare_triton
from fast.runtime import upload
from fast.state import DeviceState
from spec.types import INDEX_DTYPE, BatchInputs


def prepare_on_device(
    dev: DeviceState,
    req_ids: tuple[str, ...],  # [num_reqs] batch order
    rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    num_scheduled: np.ndarray,  # [num_reqs] int64 batch order
    cu_num_tokens: np.ndarray,  # [num_reqs] int64
    padded: int,
) -> BatchInputs:
    num_reqs = len(req_ids)
    num_tokens = int(cu_num_tokens[-1]) if num_reqs else 0
    # the small host arrays travel in one copy: index_mapping | num_scheduled | query_start_loc
    batch_np = np.concatenate([rows, num_scheduled, [0], cu_num_tokens]).astype(INDEX_DTYPE)
    batch_dev = upload(batch_np, dev.device)
    out = prepare_triton(dev, batch_dev, num_reqs, num_tokens, padded)
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
