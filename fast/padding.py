"""Padded request rows in fast (spec/padding.py's rule): written into buffers the pool keeps from step to step.

A captured graph replays fixed addresses, so the padded per-row arrays live in one buffer per array, kept for the
pool's life (grown, never shrunk): each step copies its real rows in and fills EVERY padded row with its pad value,
so rows an earlier, larger batch left in the buffer never reach a smaller one (block-table rows included). Under
Triton the copy and the fill are device ops on device tensors: no host sync. In host mode the buffers are NumPy
memory under CPU tensors and the copy and fill are NumPy's (a torch op on a small CPU tensor costs several times
more in dispatch than the bytes it moves). spec's pad_request_rows does the rest, with this padder in place of spec's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class PaddedRows:
    """spec.padding.RowPadder over reused buffers, one per array key (`index_mapping`, `block_tables/0`, ...)."""

    def __init__(self, device: torch.device, min_rows: int, host_mode: bool = False) -> None:
        self.device = device
        self.min_rows = min_rows  # rows a buffer holds at least (max_num_reqs + 1): one allocation in the common case
        self.host_mode = host_mode  # CPU buffers written through NumPy views
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, int], tuple[torch.Tensor, np.ndarray]] = {}  # (key, rows) -> its rows, both ways

    def __call__(self, key: str, array: Any, rows: int, value: Any) -> torch.Tensor:
        n = array.shape[0]  # the real rows
        buffer = self._buffer(key, array, rows)
        if not self.host_mode:
            out = buffer[:rows]
            out[:n].copy_(array)
            out[n:].fill_(value)
            return out
        view = self._views.get((key, rows))
        if view is None or view[0].data_ptr() != buffer.data_ptr():
            view = (buffer[:rows], buffer[:rows].numpy())
            self._views[(key, rows)] = view
        out_t, out_np = view
        out_np[:n] = array.numpy() if isinstance(array, torch.Tensor) else array
        out_np[n:] = value
        return out_t

    def _buffer(self, key: str, array: torch.Tensor, rows: int) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if (
            buffer is None
            or buffer.shape[0] < rows
            or buffer.shape[1:] != array.shape[1:]
            or buffer.dtype != array.dtype
        ):
            size = max(rows, self.min_rows, 0 if buffer is None else 2 * buffer.shape[0])
            buffer = torch.empty((size, *array.shape[1:]), dtype=array.dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer
