"""Stage 3-5 in host mode (CPU tensors without Triton): the batch's arrays from compiled loops over the state.

In host mode the device state IS the host mirror's memory (fast.state, DeviceState(mirror=...)), so
prepare is fast/flatten.py's and fast/slots.py's compiled loops writing into two buffers reused from step
to step and handed out as tensors: a batch's tensors are valid until the next prepare (as vLLM's
persistent input buffers). A step shaped like the last reuses the last step's tensor objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fast.flatten import flatten
from fast.records import new_batch
from fast.slots import tables_and_slots
from fast.state import DeviceState, HostMirror
from spec.types import BatchInputs


class HostBatch:
    """The buffers a host-mode pool's batches view, and the tensors over them for the last shape."""

    def __init__(self) -> None:
        self._out32 = np.zeros(0, np.int32)
        self._out64 = np.zeros(0, np.int64)
        self._views: dict[str, Any] = {}  # the batch's tensors over those buffers, for the shape in _views_key
        self._views_key: tuple[int, ...] = ()
        self._buffers_grown = 0  # times either buffer was reallocated: part of _views_key
        # [G * num_reqs, 3] what each gathered table row holds (fast.slots.tables_and_slots): valid for the out32
        # layout of _held_key, unknown (-1) when that changes
        self._held = np.zeros((0, 3), np.int64)
        self._held_key: tuple[int, int] = (-1, -1)

    def prepare(
        self,
        dev: DeviceState,  # shares memory with `state`
        state: HostMirror,  # the pool's: its table versions tell which gathered rows are current
        req_ids: tuple[str, ...],  # [num_reqs] batch order
        rows: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
        num_scheduled: np.ndarray,  # [num_reqs] int64 batch order
        cu_num_tokens: np.ndarray,  # [num_reqs] int64
        padded: int,
        fields: dict[str, Any],  # more of the batch's fields (the sampler's, logits_indices included; async's); or {}
    ) -> BatchInputs:
        groups = state.config.kv_groups
        n, t = len(req_ids), padded
        num_tokens = int(cu_num_tokens[-1]) if n else 0
        # out32 = index_mapping | num_scheduled | query_start_loc | seq_lens | logits_indices | tables per group
        out32 = self._buffer32(5 * n + 1 + n * dev.total_width)
        # out64 = positions | input_ids | slot mapping per group, each [T] | token rows [num_tokens] (scratch)
        out64 = self._buffer64((2 + len(groups)) * t + num_tokens)
        positions, token_rows = out64[:t], out64[(2 + len(groups)) * t :]
        token_ids = dev.token_ids_np if dev.token_ids_np is not None else dev.token_ids.numpy()  # host mode: the former
        input_ids = out64[t : 2 * t]
        flatten(rows, num_scheduled, state.num_computed_tokens, token_ids, out32, positions, input_ids, token_rows)
        tables = out32[5 * n + 1 :]
        slots = out64[2 * t : (2 + len(groups)) * t]  # [G * T]
        flat_tables = dev.tables_np if dev.tables_np is not None else dev.tables.numpy()  # host mode: the former
        if self._held_key != (n, self._buffers_grown):  # the tables start elsewhere in out32, or in a new one
            self._held = np.full((len(groups) * n, 3), -1, np.int64)
            self._held_key = (n, self._buffers_grown)
        tables_and_slots(flat_tables, state.config.max_num_reqs, dev.offsets_np, dev.widths_np, dev.block_sizes_np,
                         state.num_blocks, state.table_versions, rows, token_rows, positions, tables, self._held,
                         slots)  # fmt: skip
        # The tensors view the reused buffers, so a step of the same shape as the last (every decode step of a
        # steady batch) hands out the same tensor objects, now holding this step's values: no re-wrapping.
        key = (n, t, num_tokens, self._buffers_grown)
        if key != self._views_key:
            wrap = torch.from_numpy
            self._views = {
                "index_mapping": wrap(out32[:n]),
                "num_scheduled_tokens": wrap(out32[n : 2 * n]),
                "query_start_loc": wrap(out32[2 * n : 3 * n + 1]),
                "positions": wrap(positions),
                "input_ids": wrap(input_ids),
                "seq_lens": wrap(out32[3 * n + 1 : 4 * n + 1]),
                "logits_indices": wrap(out32[4 * n + 1 : 5 * n + 1]),
                "block_tables": tuple(
                    wrap(tables[n * off : n * (off + w)].reshape(n, w))
                    for off, w in zip(dev.offsets_np.tolist(), dev.widths_np.tolist(), strict=True)
                ),
                "slot_mappings": tuple(wrap(out64[(2 + g) * t : (3 + g) * t]) for g in range(len(groups))),
            }
            self._views_key = key
        views = self._views | fields if fields else self._views
        return new_batch(req_ids=req_ids, num_tokens=num_tokens, num_tokens_padded=padded, **views)

    def _buffer32(self, size: int) -> np.ndarray:
        if self._out32.size < size:
            self._out32 = np.zeros(max(size, 2 * self._out32.size), np.int32)
            self._buffers_grown += 1  # views over the old buffer are stale
        return self._out32[:size]

    def _buffer64(self, size: int) -> np.ndarray:
        if self._out64.size < size:
            self._out64 = np.zeros(max(size, 2 * self._out64.size), np.int64)
            self._buffers_grown += 1
        return self._out64[:size]
