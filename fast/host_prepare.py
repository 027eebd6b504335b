"""Stage 3-5 in host mode (CPU tensors without Triton): the batch's arrays from compiled loops over the state.

In host mode the device state IS the host mirror's memory (fast.state, DeviceState(mirror=...)), so
prepare is fast/flatten.py's and fast/slots.py's compiled loops writing into two buffers reused from step
to step and handed out as tensors: a batch's tensors are valid until the next prepare (as vLLM's
persistent input buffers). A step of a recent shape (one of the last VIEW_SHAPES) reuses that shape's tensor
objects.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import torch

from fast.drafts import FIELDS32, IDENTITY, BatchDrafts, StepDrafts, sampler_fields
from fast.flatten import flatten
from fast.records import new_batch
from fast.slots import tables_and_slots
from fast.state import DeviceState, HostMirror
from spec.types import BatchInputs

K = TypeVar("K")
V = TypeVar("V")


VIEW_SHAPES = 16  # batch shapes whose tensor views a HostBatch keeps (a few hundred bytes a tensor)


def _keep(cache: dict[K, V], key: K, value: V) -> V:
    """value, kept in cache under key; past VIEW_SHAPES entries the oldest goes."""
    cache[key] = value
    if len(cache) > VIEW_SHAPES:
        del cache[next(iter(cache))]
    return value


class HostBatch:
    """The buffers a host-mode pool's batches view, and the tensors over them for the last shape."""

    def __init__(self) -> None:
        self._out32 = np.zeros(0, np.int32)
        self._out64 = np.zeros(0, np.int64)
        self._t32, self._t64 = torch.from_numpy(self._out32), torch.from_numpy(self._out64)  # the whole buffers
        # the batch's tensors over those buffers, per shape (num_reqs, T, num_tokens, drafts or -1), for the last
        # VIEW_SHAPES shapes; those that depend on the rows alone, per (num_reqs, drafting). Both emptied when a
        # buffer is reallocated.
        self._views: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self._row_views: dict[tuple[int, bool], dict[str, Any]] = {}
        self._buffers_grown = 0  # times either buffer was reallocated: part of _held_key
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
        fields: dict[str, Any],  # more of the batch's fields (async's pending tokens, the row classes); or {}
        drafts: StepDrafts | None,  # a drafting step's drafts; None: nobody drafts
    ) -> tuple[BatchInputs, BatchDrafts | None]:
        """(the batch, its drafts in batch order for record_sampled: views of the int64 buffer, or None)."""
        num_groups = len(state.config.kv_groups)
        n, t = len(req_ids), padded
        num_tokens = int(cu_num_tokens[-1]) if n else 0
        d = -1 if drafts is None else drafts[1].shape[0]  # -1: no sampler fields (part of the views' key)
        # out32 = index_mapping | num_scheduled | query_start_loc | seq_lens | logits_indices | tables per group
        #         | with drafts, the sampler's fields (fast.drafts.FIELDS32; their logits_indices are the batch's)
        tables_at = 5 * n + 1
        sampler_at = tables_at + n * dev.total_width
        out32 = self._buffer32(sampler_at + (0 if drafts is None else 4 * n + 2 * d))
        # out64 = positions | input_ids | slot mapping per group, each [T] | token rows [num_tokens] (scratch)
        #         | with drafts, draft_token_ids [d] | num_drafts [n] in batch order
        scratch_at = (2 + num_groups) * t
        out64 = self._buffer64(scratch_at + num_tokens + (0 if drafts is None else n + d))
        positions, token_rows = out64[:t], out64[scratch_at : scratch_at + num_tokens]
        token_ids = dev.token_ids_np if dev.token_ids_np is not None else dev.token_ids.numpy()  # host mode: the former
        input_ids = out64[t : 2 * t]
        flatten(rows, num_scheduled, state.num_computed_tokens, token_ids, out32, positions, input_ids, token_rows)
        tables = out32[tables_at:sampler_at]
        slots = out64[2 * t : scratch_at]  # [G * T]
        flat_tables = dev.tables_np if dev.tables_np is not None else dev.tables.numpy()  # host mode: the former
        if self._held_key != (n, self._buffers_grown):  # the tables start elsewhere in out32, or in a new one
            self._held = np.full((num_groups * n, 3), -1, np.int64)
            self._held_key = (n, self._buffers_grown)
        tables_and_slots(flat_tables, state.config.max_num_reqs, dev.offsets_np, dev.widths_np, dev.block_sizes_np,
                         state.num_blocks, state.table_versions, rows, token_rows, positions, tables, self._held,
                         slots)  # fmt: skip
        batch_drafts = None
        if drafts is not None:  # the sampler's fields beside the batch's arrays, in the same buffers
            num_drafts, draft_ids, order = drafts
            sampler64 = out64[scratch_at + num_tokens :]
            sampler_fields(cu_num_tokens, num_drafts, draft_ids, IDENTITY if order is None else order,
                           out32[sampler_at:], sampler64)  # fmt: skip
            batch_drafts = (sampler64[d:], sampler64[:d])
        # The tensors view the reused buffers, so a step of a shape seen lately (every decode step of a steady
        # batch; a batch whose size moves as requests come and go) hands out the same tensor objects as then, now
        # holding this step's values: wrapping a dozen views costs a drafting or a mixed step more than its
        # compiled passes. A new shape with known rows wraps only the arrays over tokens.
        key = (n, t, num_tokens, d)
        views = self._views.get(key)
        if views is None:
            drafting = d >= 0
            rows_views = self._row_views.get((n, drafting))
            if rows_views is None:
                rows_views = _keep(self._row_views, (n, drafting), self._wrap_rows(dev, n, drafting))
            tokens_at = sampler_at + 3 * n  # the sampler's logits rows, after its three fields of [n]
            views = _keep(self._views, key, rows_views | self._wrap_tokens(num_groups, n, t, num_tokens, d, tokens_at))
        views = views | fields if fields else views
        return new_batch(req_ids=req_ids, num_tokens=num_tokens, num_tokens_padded=padded, **views), batch_drafts

    def _wrap_rows(self, dev: DeviceState, n: int, drafting: bool) -> dict[str, Any]:
        """The tensors whose place and length depend on the batch's rows alone: one split of the int32 buffer (a
        view costs a third of a from_numpy)."""
        widths = dev.widths_np.tolist()
        sizes = [n, n, n + 1, n, n, *(n * w for w in widths), *([n, n, n] if drafting else [])]
        parts = self._t32.split_with_sizes([*sizes, self._t32.shape[0] - sum(sizes)])
        views = {
            "index_mapping": parts[0],
            "num_scheduled_tokens": parts[1],
            "query_start_loc": parts[2],
            "seq_lens": parts[3],
            "logits_indices": parts[4],  # a drafting step's are the sampler's (_wrap_tokens)
            "block_tables": tuple(part.view(n, w) for part, w in zip(parts[5 : 5 + len(widths)], widths, strict=True)),
        }
        if drafting:  # fast.drafts.FIELDS32's first three, each [n]
            views |= dict(zip(FIELDS32[:3], parts[5 + len(widths) : 8 + len(widths)], strict=True))
        return views

    def _wrap_tokens(self, groups: int, n: int, t: int, num_tokens: int, d: int, logits_at: int) -> dict[str, Any]:
        """The tensors over the step's tokens (and drafts, d >= 0): one split of the int64 buffer."""
        sizes = [t, t, *([t] * groups), *([num_tokens, d] if d >= 0 else [])]
        parts = self._t64.split_with_sizes([*sizes, self._t64.shape[0] - sum(sizes)])
        views = {"positions": parts[0], "input_ids": parts[1], "slot_mappings": parts[2 : 2 + groups]}
        if d >= 0:  # the sampler's logits rows [n + d] and targets [d] follow its three fields of [n]
            views["logits_indices"] = torch.from_numpy(self._out32[logits_at : logits_at + n + d])
            views["target_logits_indices"] = torch.from_numpy(self._out32[logits_at + n + d : logits_at + n + 2 * d])
            views["draft_token_ids"] = parts[3 + groups]
        return views

    def _buffer32(self, size: int) -> np.ndarray:
        if self._out32.size < size:
            self._out32 = np.zeros(max(size, 2 * self._out32.size), np.int32)
            self._t32 = torch.from_numpy(self._out32)
            self._buffers_grown += 1
            self._views.clear()  # views over the old buffer are stale
            self._row_views.clear()
        return self._out32[:size]

    def _buffer64(self, size: int) -> np.ndarray:
        if self._out64.size < size:
            self._out64 = np.zeros(max(size, 2 * self._out64.size), np.int64)
            self._t64 = torch.from_numpy(self._out64)
            self._buffers_grown += 1
            self._views.clear()
            self._row_views.clear()
        return self._out64[:size]
