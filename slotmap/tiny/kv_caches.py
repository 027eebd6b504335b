"""Per-layer paged KV caches held in a backend's own array type, reached only through its two kernels.

The model computes in torch. A torch-native backend (fast) gets its tensors as they are; any other
(spec: NumPy) gets NumPy copies and hands NumPy back. The model runs in float32; `copy_to` can widen
a snapshot to float64 so a step can be replayed as a high-precision reference. Caches start as NaN,
so a kernel that reads a slot nobody wrote poisons the logits instead of quietly reading zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conformance.backends import BackendHandle, cross_attention_of
from spec.types import KVCacheGroup


class PagedKV:
    def __init__(
        self,
        backend: BackendHandle,
        kv_groups: Sequence[KVCacheGroup],
        layer_groups: Sequence[int],  # [num_layers] layer -> KV group
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        cross_group: KVCacheGroup | None = None,  # an encoder-decoder model's: one cross cache per layer
    ) -> None:
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.native_torch = isinstance(backend.asarray(np.zeros(1, np.float32)), torch.Tensor)
        self.layer_groups = tuple(layer_groups)
        self.key_caches: list[Any] = []  # per layer: [num_blocks_g, block_size_g, num_kv_heads, head_dim]
        self.value_caches: list[Any] = []  # per layer: same shape as its key cache
        for g in self.layer_groups:
            shape = (kv_groups[g].num_blocks, kv_groups[g].block_size, num_kv_heads, head_dim)
            self.key_caches.append(self._nan(shape))
            self.value_caches.append(self._nan(shape))
        # per layer of a hybrid model: [num_blocks, state_size], the recurrent states (slotmap/tiny/recurrent.py)
        self.states: list[torch.Tensor] = []
        self.cross_key_caches: list[Any] = []  # per layer, the encoder's KV (spec/cross_attention.py)
        self.cross_value_caches: list[Any] = []
        if cross_group is not None:
            shape = (cross_group.num_blocks, cross_group.block_size, num_kv_heads, head_dim)
            self.cross_key_caches = [self._nan(shape) for _ in self.layer_groups]
            self.cross_value_caches = [self._nan(shape) for _ in self.layer_groups]

    def _nan(self, shape: tuple[int, ...]) -> Any:
        if self.native_torch:
            return torch.full(shape, float("nan"), dtype=torch.float32, device=self.device)
        return self.backend.asarray(np.full(shape, np.nan, np.float32))

    def index_tensor(self, array: Any) -> torch.Tensor:
        """A BatchInputs array as a torch tensor on the model's device (no copy when it already is one)."""
        if isinstance(array, torch.Tensor):
            return array.to(self.device)
        return torch.as_tensor(self.backend.to_numpy(array), device=self.device)

    def _native(self, x: Any) -> Any:
        if self.native_torch or not isinstance(x, torch.Tensor):
            return x
        return self.backend.asarray(x.detach().cpu().numpy())

    def write(
        self,
        layer: int,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        slot_mapping: Any,  # [T] int64, PAD_SLOT_ID skipped
    ) -> None:
        self.backend.module.write_kv(
            self.key_caches[layer],
            self.value_caches[layer],
            self._native(key.contiguous()),
            self._native(value.contiguous()),
            slot_mapping,
        )

    def attend(
        self,
        layer: int,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        block_table: Any,  # [num_reqs, max_blocks] batch_idx -> physical block ids
        seq_lens: Any,  # [num_reqs]
        query_start_loc: Any,  # [num_reqs + 1]
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim] in self.dtype
        out = self.backend.module.paged_attention(
            self._native(query.contiguous()),
            self.key_caches[layer],
            self.value_caches[layer],
            block_table,
            seq_lens,
            query_start_loc,
            scale=scale,
            sliding_window=sliding_window,
        )
        if isinstance(out, torch.Tensor):
            return out.to(self.device)
        return torch.as_tensor(np.asarray(self.backend.to_numpy(out)), device=self.device)

    def write_cross(self, layer: int, key: torch.Tensor, value: torch.Tensor, cross_slot_mapping: Any) -> None:
        """The encoder's K/V [n_enc, num_kv_heads, head_dim] of the rows whose encoder runs, at their slots."""
        self.backend.module.write_kv(
            self.cross_key_caches[layer], self.cross_value_caches[layer],
            self._native(key.contiguous()), self._native(value.contiguous()), cross_slot_mapping,
        )  # fmt: skip

    def attend_cross(
        self,
        layer: int,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        block_table: Any,  # [num_reqs, max_blocks] the cross group's
        encoder_seq_lens: Any,  # [num_reqs]
        query_start_loc: Any,  # [num_reqs + 1]
        *,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim] in self.dtype
        cross = cross_attention_of(self.backend)
        if cross is None:
            raise ValueError(f"backend {self.backend.name!r} has no cross_attention")
        out = cross(
            self._native(query.contiguous()), self.cross_key_caches[layer], self.cross_value_caches[layer],
            block_table, encoder_seq_lens, query_start_loc, scale=scale,
        )  # fmt: skip
        if isinstance(out, torch.Tensor):
            return out.to(self.device)
        return torch.as_tensor(np.asarray(self.backend.to_numpy(out)), device=self.device)

    def copy_to(
        self, backend: BackendHandle, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> PagedKV:
        """The same cache contents in another backend's arrays (to replay one step there), exactly widened."""
        clone = PagedKV.__new__(PagedKV)
        clone.backend, clone.device, clone.dtype = backend, torch.device(device), dtype
        clone.native_torch = isinstance(backend.asarray(np.zeros(1, np.float32)), torch.Tensor)
        clone.layer_groups = self.layer_groups

        def convert(cache: Any) -> Any:
            host = np.array(self.backend.to_numpy(cache), str(dtype).removeprefix("torch."), copy=True)
            return torch.from_numpy(host).to(clone.device) if clone.native_torch else backend.asarray(host)

        clone.key_caches = [convert(c) for c in self.key_caches]
        clone.value_caches = [convert(c) for c in self.value_caches]
        clone.cross_key_caches = [convert(c) for c in self.cross_key_caches]
        clone.cross_value_caches = [convert(c) for c in self.cross_value_caches]
        clone.states = [s.to(clone.device, dtype).clone() for s in self.states]
        return clone
