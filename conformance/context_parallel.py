"""Decode context parallelism in the suite: a backend's CP functions, a config with a sharded and a
replicated group, a tiny deterministic model, and one step of one rank (write its KV, attend over it).

Used twice: by conformance/test_context_parallel.py, which plays every rank of a step in one process and
compares each with spec, and by conformance/cp_ranks.py, where every rank is its own process with its own
pool and the partials travel through torch.distributed. The single-rank reference is spec on the pool's
own layout: one cache of virtual blocks (bs * CP tokens) written at the pool's slots.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
import spec.context_parallel as spec_cp
from conformance.backends import BackendHandle, _in_mode, _ModeBackend
from conformance.scheduler import SchedulerKnobs
from conformance.tolerance import assert_attention_close
from spec.context_parallel import ContextParallel
from spec.types import PAD_SLOT_ID, BatchInputs, KVCacheGroup, WorkerConfig

CP_FUNCTIONS = ("rank_inputs", "cp_slot_mapping", "local_seq_lens", "partial_paged_attention", "merge_attention_states")
# MLA's reader under DCP (conformance/mla_context_parallel.py): None where a backend lacks it (one without MLA)
OPTIONAL_CP_FUNCTIONS = ("partial_mla_decode_attention",)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE = 4, 2, 8, 0.35
SHARDED, REPLICATED = 0, 1  # the groups of cp_worker_config
WINDOW = 6  # the replicated group's sliding window


def cp_functions(handle: BackendHandle) -> types.SimpleNamespace | None:
    """The backend's context-parallel functions (in its kernel mode), or None if it offers none.

    spec and fast have them (spec.context_parallel, fast.context_parallel); a third-party backend offers
    them as a `context_parallel` attribute with the same functions, an optional part like `interop`.
    """
    module: Any
    if handle.module is spec:
        module = spec_cp
    elif isinstance(handle.module, _ModeBackend):
        import fast.context_parallel

        enabled = handle.module.enabled
        return types.SimpleNamespace(
            **{
                name: _in_mode(getattr(fast.context_parallel, name), enabled)
                for name in CP_FUNCTIONS + OPTIONAL_CP_FUNCTIONS
            }
        )
    else:
        module = getattr(handle.module, "context_parallel", None)
        if module is None:
            return None
    return types.SimpleNamespace(
        **{name: getattr(module, name) for name in CP_FUNCTIONS},
        **{name: getattr(module, name, None) for name in OPTIONAL_CP_FUNCTIONS},
    )


def cp_worker_config(world_size: int, interleave: int, block_size: int = 4, max_model_len: int = 40) -> WorkerConfig:
    """Group 0 sharded (its pool block is the virtual block of block_size * world_size tokens), group 1 a
    replicated sliding window of block_size tokens per block."""
    virtual = block_size * world_size
    return WorkerConfig(
        max_num_reqs=4,
        max_model_len=max_model_len,
        max_num_batched_tokens=24,
        vocab_size=50,
        kv_groups=(
            KVCacheGroup(virtual, 4 * -(-max_model_len // virtual) + 1),
            KVCacheGroup(block_size, 4 * -(-max_model_len // block_size) + 1, sliding_window=WINDOW),
        ),
    )


CP_KNOBS = SchedulerKnobs(max_chunk=7, pad_buckets=(8, 16, 24), allocation_order="random")


class TinyQKV:
    """Query, key and value of a token from its id and position: the same on every rank, float64."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.q = rng.standard_normal((vocab_size, NUM_HEADS, HEAD_DIM))
        self.k = rng.standard_normal((vocab_size, NUM_KV_HEADS, HEAD_DIM))
        self.v = rng.standard_normal((vocab_size, NUM_KV_HEADS, HEAD_DIM))

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        angle = 0.3 * positions.astype(np.float64)[:, None, None]
        return self.q[input_ids] * np.cos(angle), self.k[input_ids] + np.sin(angle), self.v[input_ids] * np.cos(angle)


@dataclass
class Partials:
    """One rank's attention of a step: the sharded group's partial state, the replicated group's output."""

    output: Any  # [T, num_heads, head_dim] backend array
    lse: Any  # [T, num_heads]
    replicated: Any  # [T, num_heads, head_dim]


class RankModel:
    """One rank's KV caches (its share of the sharded group, all of the replicated one), in a backend's arrays."""

    def __init__(self, handle: BackendHandle, functions: types.SimpleNamespace, config: WorkerConfig,
                 cp: ContextParallel, qkv: TinyQKV) -> None:  # fmt: skip
        self.handle, self.functions, self.config, self.cp, self.qkv = handle, functions, config, cp, qkv
        self.caches = []
        for g, group in enumerate(config.kv_groups):
            shape = (group.num_blocks, cp.block_size(config, g), NUM_KV_HEADS, HEAD_DIM)
            self.caches.append(
                (handle.asarray(np.zeros(shape, np.float32)), handle.asarray(np.zeros(shape, np.float32)))
            )

    def step(self, batch: BatchInputs) -> tuple[Any, Partials]:
        """Rank inputs of the batch, the rank's KV written at its slots, and its attention."""
        h = self.handle
        ranked = self.functions.rank_inputs(batch, self.config, self.cp)
        positions, ids = h.to_numpy(batch.positions), h.to_numpy(batch.input_ids)
        q, k, v = (h.asarray(x.astype(np.float32)) for x in self.qkv(ids, positions))
        for g, (key_cache, value_cache) in enumerate(self.caches):
            h.module.write_kv(key_cache, value_cache, k, v, ranked.slot_mappings[g])
        out, lse = self.functions.partial_paged_attention(
            q, *self.caches[SHARDED], batch.block_tables[SHARDED], batch.seq_lens, batch.query_start_loc,
            cp=self.cp, scale=SCALE,
        )  # fmt: skip
        replicated = h.module.paged_attention(
            q, *self.caches[REPLICATED], batch.block_tables[REPLICATED], batch.seq_lens, batch.query_start_loc,
            scale=SCALE, sliding_window=WINDOW,
        )  # fmt: skip
        return ranked, Partials(out, lse, replicated)


class SingleRank:
    """spec's single-rank reference: caches of the pool's own blocks, float64 and float32 (tolerance.py's rule)."""

    def __init__(self, config: WorkerConfig, qkv: TinyQKV) -> None:
        self.config, self.qkv = config, qkv
        self.caches = {
            dtype: [
                (np.zeros(shape, dtype), np.zeros(shape, dtype))
                for shape in ((g.num_blocks, g.block_size, NUM_KV_HEADS, HEAD_DIM) for g in config.kv_groups)
            ]
            for dtype in (np.float64, np.float32)
        }

    def step(self, batch: BatchInputs) -> dict[type, list[np.ndarray]]:
        """Per dtype, per group: spec.paged_attention of the step's queries over everything written so far."""
        q, k, v = self.qkv(np.asarray(batch.input_ids), np.asarray(batch.positions))
        k, v, q = (x.astype(np.float32).astype(np.float64) for x in (k, v, q))  # the values the ranks see
        outs: dict[type, list[np.ndarray]] = {}
        for dtype, caches in self.caches.items():
            outs[dtype] = []
            for g, (key_cache, value_cache) in enumerate(caches):
                spec.write_kv(key_cache, value_cache, k.astype(dtype), v.astype(dtype), batch.slot_mappings[g])
                outs[dtype].append(
                    spec.paged_attention(
                        q.astype(dtype),
                        key_cache,
                        value_cache,
                        batch.block_tables[g],
                        batch.seq_lens,
                        batch.query_start_loc,
                        scale=SCALE,
                        sliding_window=self.config.kv_groups[g].sliding_window,
                    )
                )
        return outs


def merge_partials(handle: BackendHandle, functions: types.SimpleNamespace, outputs: list[Any],
                   lses: list[Any]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The backend's merge of the ranks' partial states (each [T, H, D] and [T, H]), as NumPy."""
    stacked = handle.asarray(np.stack([handle.to_numpy(o) for o in outputs]))
    merged, merged_lse = functions.merge_attention_states(
        stacked, handle.asarray(np.stack([handle.to_numpy(x) for x in lses]))
    )
    return handle.to_numpy(merged), handle.to_numpy(merged_lse)


def check_attention(merged: np.ndarray, merged_lse: np.ndarray, replicated: list[np.ndarray],
                    reference: dict[type, list[np.ndarray]], num_tokens: int) -> None:  # fmt: skip
    """The merged partials equal the single-rank attention of the sharded group (tolerance.py's rule), and
    every rank's attention over its replicated group equals the single-rank one too."""
    assert np.all(merged[num_tokens:] == 0), "padding rows of the merged output must be zero"
    assert np.all(merged_lse[num_tokens:] == -np.inf), "padding rows of the merged LSE must be -inf (empty)"
    assert np.isfinite(merged_lse[:num_tokens]).all(), "every real query sees at least itself on some rank"
    ref64, low = reference[np.float64], reference[np.float32]
    assert_attention_close(merged, ref64[SHARDED], low[SHARDED], "float32")
    for rank, out in enumerate(replicated):
        try:
            assert_attention_close(out, ref64[REPLICATED], low[REPLICATED], "float32")
        except AssertionError as e:
            raise AssertionError(f"rank {rank}, replicated group: {e}") from e


def owner_slot(position: int, table_row: np.ndarray, block_size: int, cp: ContextParallel) -> tuple[int, int]:
    """(owning rank, slot there) of a position, from the round-robin definition (not spec's formula):
    runs of I positions go to ranks in turn; a rank's k-th local entry lies at its own table's block k // bs."""
    run, within = divmod(position, cp.interleave)
    owner = run % cp.world_size
    local = (run // cp.world_size) * cp.interleave + within
    return owner, int(table_row[local // block_size]) * block_size + local % block_size


def check_rank_slots(batch_np: dict[str, Any], per_rank: list[Any], config: WorkerConfig,
                     world_size: int, interleave: int, to_numpy: Callable[[Any], np.ndarray]) -> None:  # fmt: skip
    """Properties of all ranks' inputs of one step, independent of spec's formulas."""
    n = batch_np["num_tokens"]
    qsl, positions, seq_lens = batch_np["query_start_loc"], batch_np["positions"], batch_np["seq_lens"]
    rows = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))
    for g in range(len(config.kv_groups)):
        slots = np.stack([to_numpy(r.slot_mappings[g]) for r in per_rank])  # [CP, T]
        lens = np.stack([to_numpy(r.seq_lens[g]) for r in per_rank])  # [CP, num_reqs]
        assert np.all(slots[:, n:] == PAD_SLOT_ID), f"group {g}: a padding token has a slot on some rank"
        if g != SHARDED:
            for rank in range(world_size):
                assert np.array_equal(slots[rank], batch_np["slot_mappings"][g]), (
                    f"replicated group {g}: rank {rank}'s slots differ from the pool's"
                )
                assert np.array_equal(lens[rank], seq_lens), f"replicated group {g}: rank {rank}'s seq_lens differ"
            continue
        assert np.array_equal(lens.sum(axis=0), seq_lens), (
            "sharded group: the ranks' local seq_lens must sum to seq_lens"
        )
        bs = config.kv_groups[g].block_size // world_size
        for t in range(n):
            owner, slot = owner_slot(int(positions[t]), batch_np["block_tables"][g][rows[t]], bs,
                                     ContextParallel(world_size, 0, interleave))  # fmt: skip
            expected = [slot if rank == owner else PAD_SLOT_ID for rank in range(world_size)]
            assert slots[:, t].tolist() == expected, (
                f"token {t} at position {positions[t]}: slots {slots[:, t]}, expected {expected}"
            )
