"""MLA under decode context parallelism in the suite: an mla group's latent cache sharded over the ranks.

DCP exists in vLLM mainly for MLA (DeepSeek): each rank holds its share of the latent cache, every rank runs the
absorbed decode with all queries over its share and returns the output and its LSE, and the ranks' states are
merged (vLLM's `cp_lse_ag_out_rs`) before W_UV. Here: conformance.context_parallel's config with group 0 an mla
group (sharded) beside the replicated sliding-window group, a tiny deterministic latent model, one rank's step
(write its latents at its slots with the backend's write_mla_kv, then its partial_mla_decode_attention), and
spec's single-rank reference (the pool's own layout, spec.mla_decode_attention) to merge against.

Used by conformance/test_mla_context_parallel.py (every rank in one process) and conformance/cp_ranks.py (ranks
as processes over torch.distributed).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np

import spec
from conformance.backends import BackendHandle, mla_kernels_of
from conformance.context_parallel import SHARDED, cp_worker_config, owner_slot
from conformance.tolerance import assert_attention_close
from spec.context_parallel import ContextParallel, RankInputs
from spec.types import BatchInputs, WorkerConfig

KV_LORA_RANK, ROPE_DIM, NUM_HEADS, SCALE = 6, 4, 3, 0.3


def mla_cp_worker_config(world_size: int, interleave: int) -> WorkerConfig:
    """cp_worker_config with its sharded group 0 an mla group (the same virtual blocks of bs * world_size)."""
    config = cp_worker_config(world_size, interleave)
    mla = dataclasses.replace(config.kv_groups[SHARDED], kind="mla", kv_lora_rank=KV_LORA_RANK,
                              qk_rope_head_dim=ROPE_DIM)  # fmt: skip
    return dataclasses.replace(config, kv_groups=(mla, *config.kv_groups[SHARDED + 1 :]))


def mla_cp_available(handle: BackendHandle, functions: types.SimpleNamespace | None) -> bool:
    """The backend offers context parallelism with MLA's reader, and MLA's write."""
    return (
        functions is not None
        and functions.partial_mla_decode_attention is not None
        and (mla_kernels_of(handle) is not None)
    )


class TinyLatent:
    """A token's absorbed query, RoPE query, latent and RoPE key part from its id and position: float32 values."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed + 100)
        self.q_latent = rng.standard_normal((vocab_size, NUM_HEADS, KV_LORA_RANK))
        self.q_pe = rng.standard_normal((vocab_size, NUM_HEADS, ROPE_DIM))
        self.kv_c = rng.standard_normal((vocab_size, KV_LORA_RANK))
        self.k_pe = rng.standard_normal((vocab_size, ROPE_DIM))

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, ...]:
        """(q_latent [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R]), float32."""
        cos, sin = (
            np.cos(0.3 * positions.astype(np.float64))[:, None],
            np.sin(0.3 * positions.astype(np.float64))[:, None],
        )
        out = (self.q_latent[input_ids] * cos[..., None], self.q_pe[input_ids] + sin[..., None],
               self.kv_c[input_ids] * cos, self.k_pe[input_ids] - sin)  # fmt: skip
        return tuple(x.astype(np.float32) for x in out)


class MlaRankModel:
    """One rank's share of the mla group's latent cache, in a backend's arrays."""

    def __init__(self, handle: BackendHandle, functions: types.SimpleNamespace, config: WorkerConfig,
                 cp: ContextParallel, latent: TinyLatent) -> None:  # fmt: skip
        self.handle, self.functions, self.config, self.cp, self.latent = handle, functions, config, cp, latent
        group = config.kv_groups[SHARDED]
        shape = (group.num_blocks, cp.block_size(config, SHARDED), group.latent_width)
        self.cache = handle.asarray(np.zeros(shape, np.float32))  # [num_blocks, bs, L + R]

    def step(self, batch: BatchInputs) -> tuple[RankInputs, Any, Any]:
        """(rank inputs, partial output [T, H, L], its LSE [T, H]): latents written at this rank's slots, then
        the partial absorbed decode of every query over them."""
        h = self.handle
        kernels = mla_kernels_of(h)
        assert kernels is not None, "mla_cp_available(handle) was not checked"
        ranked = self.functions.rank_inputs(batch, self.config, self.cp)
        q_latent, q_pe, kv_c, k_pe = (h.asarray(x) for x in self.latent(h.to_numpy(batch.input_ids),
                                                                           h.to_numpy(batch.positions)))  # fmt: skip
        kernels.write_mla_kv(self.cache, kv_c, k_pe, ranked.slot_mappings[SHARDED])
        out, lse = self.functions.partial_mla_decode_attention(
            q_latent, q_pe, self.cache, batch.block_tables[SHARDED], batch.seq_lens, batch.query_start_loc,
            cp=self.cp, scale=SCALE,
        )  # fmt: skip
        return ranked, out, lse


class MlaSingleRank:
    """spec's single-rank reference: latent caches of the pool's own blocks, float64 and float32."""

    def __init__(self, config: WorkerConfig, latent: TinyLatent) -> None:
        self.latent = latent
        shape = spec.mla_cache_shape(config.kv_groups[SHARDED])
        self.caches = {dtype: np.zeros(shape, dtype) for dtype in (np.float64, np.float32)}

    def step(self, batch: BatchInputs) -> dict[type, np.ndarray]:
        """Per dtype: spec.mla_decode_attention of the step's queries over every latent written so far."""
        q_latent, q_pe, kv_c, k_pe = self.latent(np.asarray(batch.input_ids), np.asarray(batch.positions))
        outs: dict[type, np.ndarray] = {}
        for dtype, cache in self.caches.items():
            spec.write_mla_kv(cache, kv_c.astype(dtype), k_pe.astype(dtype), batch.slot_mappings[SHARDED])
            outs[dtype] = spec.mla_decode_attention(
                q_latent.astype(dtype), q_pe.astype(dtype), cache, batch.block_tables[SHARDED], batch.seq_lens,
                batch.query_start_loc, scale=SCALE,
            )  # fmt: skip
        return outs


def check_mla_attention(merged: np.ndarray, merged_lse: np.ndarray, reference: dict[type, np.ndarray],
                        num_tokens: int) -> None:  # fmt: skip
    """The merged partial states equal single-rank mla_decode_attention (tolerance.py's rule, float32)."""
    assert np.all(merged[num_tokens:] == 0), "padding rows of the merged output must be zero"
    assert np.all(merged_lse[num_tokens:] == -np.inf), "padding rows of the merged LSE must be -inf (empty)"
    assert np.isfinite(merged_lse[:num_tokens]).all(), "every real query sees at least its own latent on some rank"
    assert_attention_close(merged, reference[np.float64], reference[np.float32], "float32")


def check_latent_placement(rank_caches: list[np.ndarray], single: np.ndarray, batch_np: dict[str, Any],
                           world_size: int, interleave: int) -> None:  # fmt: skip
    """Every position of every scheduled request lies, bit for bit, in the cache of the rank the round-robin
    definition gives it (owner_slot, not spec's formula), at the slot it gives; `single` is the single-rank
    float32 cache of virtual blocks."""
    bs = single.shape[1] // world_size
    cp = ContextParallel(world_size, 0, interleave)
    table, seq_lens = batch_np["block_tables"][SHARDED], batch_np["seq_lens"]
    virtual = single.shape[1]
    for row, seq_len in enumerate(seq_lens.tolist()):
        for p in range(seq_len):
            owner, slot = owner_slot(p, table[row], bs, cp)
            want = single[table[row, p // virtual], p % virtual]
            got = rank_caches[owner][slot // bs, slot % bs]
            assert np.array_equal(got, want), f"row {row} position {p}: rank {owner} slot {slot} holds {got}"
