"""Stage 3-5 under Triton (CUDA, or CPU under the interpreter): the batch's arrays from one kernel launch.

The host knows the batch order (fast/batch.py); `index_mapping | num_scheduled_tokens | query_start_loc`
go up in one copy and fast.kernels.prepare computes everything else on the device.

Every array lands in buffers the pool allocates once (`DeviceBatch`, as host mode's HostBatch and vLLM's
persistent input buffers): a batch's tensors are views of them, valid until the next prepare, and a step of
the same shape as an earlier one gets the same addresses, which is what a captured CUDA graph replays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fast.drafts import BatchDrafts, SamplerFields, StepDrafts
from fast.kernels.prepare import output_sizes, prepare_triton
from fast.records import new_batch
from fast.runtime import interpret, upload_into
from fast.state import DeviceState
from spec.state import PoolState
from spec.types import INDEX_DTYPE, BatchInputs


class DeviceBatch:
    """The device buffers a Triton-mode pool's batches view, sized once for the config's largest step.

    A step padded past max_num_batched_tokens (pad_to may be any count at least the step's) grows the int64
    buffer once, to twice what it needs; nothing else is ever reallocated.
    """

    def __init__(self, dev: DeviceState, interpreted: bool) -> None:
        config, device = dev.config, dev.device
        self.interpreted = interpreted  # the kernel through Triton's interpreter (CPU tensors), as the pool was built
        rows = config.max_num_reqs
        self.batch = torch.zeros(3 * rows + 1, dtype=torch.int32, device=device)  # [3 R + 1] the host's arrays
        size64, size32 = output_sizes(dev, rows, config.max_num_batched_tokens)
        self.out64 = torch.empty(size64, dtype=torch.int64, device=device)  # [(2 + G) T_max] token arrays
        self.out32 = torch.empty(size32, dtype=torch.int32, device=device)  # [R (2 + total_width)] request arrays
        self._sampler = SamplerFields()  # a drafting step's sampler fields, built on the host (fast/drafts.py)

    def prepare(
        self,
        dev: DeviceState,
        state: PoolState,  # the host mirror (unread here: the kernel reads the device state)
        req_ids: tuple[str, ...],  # [num_reqs] batch order
        rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
        num_scheduled: np.ndarray,  # [num_reqs] int64 batch order
        cu_num_tokens: np.ndarray,  # [num_reqs] int64
        padded: int,
        fields: dict[str, Any],  # more of the batch's fields (async's pending tokens, the row classes); or {}
        drafts: StepDrafts | None,  # a drafting step's drafts; None: nobody drafts
    ) -> tuple[BatchInputs, BatchDrafts | None]:
        """(the batch, its drafts in batch order for record_sampled, or None)."""
        num_reqs = len(req_ids)
        num_tokens = int(cu_num_tokens[-1]) if num_reqs else 0
        size64, _ = output_sizes(dev, num_reqs, padded)
        if size64 > self.out64.numel():
            self.out64 = torch.empty(2 * size64, dtype=torch.int64, device=dev.device)
        # the small host arrays travel in one copy: index_mapping | num_scheduled | query_start_loc
        batch_np = np.concatenate([rows, num_scheduled, [0], cu_num_tokens]).astype(INDEX_DTYPE)
        batch_dev = upload_into(self.batch[: batch_np.size], batch_np)
        with interpret(self.interpreted):
            out = prepare_triton(dev, batch_dev, num_reqs, num_tokens, padded, self.out64, self.out32)
        fields = {"logits_indices": out.logits_indices} | fields
        batch_drafts = None
        if drafts is not None:  # the sampler's fields, logits_indices included, built on the host and uploaded
            sampler, batch_drafts = self._sampler.build(cu_num_tokens, drafts, dev.device)
            fields = fields | sampler
        batch = new_batch(  # BatchInputs without its dataclass __init__ (fast/records.py)
            req_ids=req_ids,
            index_mapping=batch_dev[:num_reqs],
            num_scheduled_tokens=batch_dev[num_reqs : 2 * num_reqs],
            query_start_loc=batch_dev[2 * num_reqs :],
            positions=out.positions,
            input_ids=out.input_ids,
            seq_lens=out.seq_lens,
            block_tables=out.block_tables,
            slot_mappings=out.slot_mappings,
            num_tokens=num_tokens,
            num_tokens_padded=padded,
            **fields,
        )
        return batch, batch_drafts
