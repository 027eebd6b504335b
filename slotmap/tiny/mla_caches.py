"""Per-layer latent caches of an MLA model in a backend's own arrays, reached only through its MLA kernels.

One cache per layer, `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` of the mla group
(spec/mla_cache.py), filled with NaN so that a kernel reading a slot nobody wrote poisons the logits. `write`
is the backend's write_mla_kv at the batch's slot_mappings[g]; `attend` splits the batch as vLLM's MLA builder
does (spec/mla_split.py: decodes first, a decode a short row that is not prefilling) and runs the absorbed
decode form on the decode rows and the prefill form on the others, each over its own sub-batch (the rows'
block-table rows, seq_lens and a query_start_loc from 0), as vLLM's kernels see `[:num_decodes]` and
`[num_decodes:]` of its reordered batch. The engine's batch is not reordered (prepare's order is rule 5's):
the sub-batches gather their rows' tokens instead, and the outputs go back to the tokens' flat indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conformance.backends import BackendHandle, mla_kernels_of
from spec.mla_split import decode_first_order, split_mla_batch
from spec.types import BatchInputs, KVCacheGroup


class LatentKV:
    def __init__(
        self,
        backend: BackendHandle,
        group: KVCacheGroup,  # the mla group every layer's latents live in
        num_layers: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if group.kind != "mla":
            raise ValueError(f"LatentKV: group must be an mla group, got kind={group.kind!r}")
        kernels = mla_kernels_of(backend)
        if kernels is None:
            raise ValueError(f"LatentKV: backend {backend.name!r} has no MLA kernels (spec.MlaBackend)")
        self.backend, self.kernels, self.dtype, self.device = backend, kernels, dtype, torch.device(device)
        self.native_torch = isinstance(backend.asarray(np.zeros(1, np.float32)), torch.Tensor)
        shape = (group.num_blocks, group.block_size, group.latent_width)
        self.caches: list[Any] = [self._native(torch.full(shape, float("nan"), dtype=dtype)) for _ in range(num_layers)]

    def _native(self, x: torch.Tensor) -> Any:
        """A model tensor (or a host index array's tensor) as the backend's array."""
        if self.native_torch:
            return x.to(self.device)
        return self.backend.asarray(x.detach().cpu().numpy())

    def _host(self, array: Any) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(array))

    def _torch(self, out: Any) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            return out.to(self.device)
        return torch.as_tensor(np.asarray(self.backend.to_numpy(out)), device=self.device)

    def write(
        self,
        layer: int,
        kv_c: torch.Tensor,  # [T, kv_lora_rank] normalized, not rotated
        k_pe: torch.Tensor,  # [T, rope_dim] rotated at the token's position
        slot_mapping: Any,  # [T] the batch's slot_mappings[g], PAD_SLOT_ID skipped
    ) -> None:
        self.kernels.write_mla_kv(
            self.caches[layer], self._native(kv_c.contiguous()), self._native(k_pe.contiguous()), slot_mapping
        )

    def attend(
        self,
        layer: int,
        q_nope: torch.Tensor,  # [T, H, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, H, rope_dim] rotated
        w_uk: torch.Tensor,  # [kv_lora_rank, H, qk_nope_head_dim]
        w_uv: torch.Tensor,  # [kv_lora_rank, H, v_head_dim]
        batch: BatchInputs,
        g: int,  # the mla group's index among the config's groups
        is_prefilling: Sequence[bool],  # [num_reqs] batch_idx -> the row's scheduled tokens include prompt tokens
        *,
        scale: float,
        decode_threshold: int,  # reorder_batch_threshold
        treat_short_extends_as_decodes: bool = False,
    ) -> torch.Tensor:  # [T, H, v_head_dim]; padding tokens' rows zero
        qsl = self._host(batch.query_start_loc).astype(np.int64)  # [num_reqs + 1]
        query_lens = np.diff(qsl)  # [num_reqs]
        prefilling = np.asarray(is_prefilling, bool)  # [num_reqs]
        options = dict(treat_short_extends_as_decodes=treat_short_extends_as_decodes)
        order = decode_first_order(query_lens, prefilling, decode_threshold, **options)  # new row -> batch_idx
        split = split_mla_batch(query_lens[order], prefilling[order], decode_threshold, **options)
        out = torch.zeros((*q_nope.shape[:2], w_uv.shape[2]), dtype=q_nope.dtype, device=q_nope.device)
        table = self._host(batch.block_tables[g])  # [num_reqs, max_blocks] batch_idx -> block ids
        seq_lens = self._host(batch.seq_lens)  # [num_reqs]
        for rows, decode in ((order[: split.num_decodes], True), (order[split.num_decodes :], False)):
            if rows.size == 0:
                continue
            tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in rows])  # sub-batch token -> flat token
            index = torch.as_tensor(tokens, device=q_nope.device)
            sub = (
                self._native(torch.from_numpy(np.ascontiguousarray(table[rows]))),  # [rows, max_blocks]
                self._native(torch.from_numpy(seq_lens[rows].copy())),  # [rows]
                self._native(torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens[rows])]).astype(np.int32))),
            )
            nope, rope = q_nope[index], q_pe[index]  # [t, H, P], [t, H, R]
            if decode:  # vLLM's forward_mqa: q_nope absorbed through W_UK, the output up-projected by W_UV
                q_latent = torch.einsum("thp,lhp->thl", nope, w_uk)
                latent = self.kernels.mla_decode_attention(
                    self._native(q_latent.contiguous()), self._native(rope.contiguous()), self.caches[layer], *sub,
                    scale=scale,
                )  # fmt: skip
                out[index] = torch.einsum("thl,lhv->thv", self._torch(latent), w_uv)
            else:  # vLLM's forward_mha: the cached latents up-projected into each head's keys and values
                values = self.kernels.mla_prefill_attention(
                    self._native(nope.contiguous()), self._native(rope.contiguous()), self.caches[layer],
                    self._native(w_uk.contiguous()), self._native(w_uv.contiguous()), *sub, scale=scale,
                )  # fmt: skip
                out[index] = self._torch(values)
        return out
