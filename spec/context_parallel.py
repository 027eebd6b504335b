"""Decode context parallelism (DCP): one request's KV cache spread over the ranks of a group.

With world size CP and interleave size I, position p of a request belongs to rank `(p // I) % CP`: the
ranks take turns, I consecutive positions each. The scheduler does not know about ranks: for a sharded
KV group its block is the *virtual* block of `bs * CP` tokens (vLLM multiplies the block size by the DCP
world size on the scheduler side), so the pool's KVCacheGroup of a sharded group has
`block_size = bs * CP`, tables `cdiv(max_model_len, bs * CP)` wide, and every rank holds the same pool.
Physical block `b` of a rank's cache holds `bs` tokens: the rank's share of virtual block `b`.

Per rank r, for a sharded group (`off = p % (bs*CP)`, `bi = p // (bs*CP)`):
  - p is local when `(off // I) % CP == r`; its slot is `table[bi] * bs + (off // (I*CP)) * I + off % I`,
    and PAD_SLOT_ID on every other rank (write_kv skips it);
  - the local sequence length of a request of length L is `L // (CP*I) * I + clamp(L % (CP*I) - r*I, 0, I)`;
  - local KV entry j (in slot order: the rank's own paged sequence) holds position
    `(j // I) * (CP*I) + r*I + j % I`.
Replicated groups (any group not in `sharded_groups`; a sliding-window group must be one) get no
transform: every rank holds all their KV, at the pool's own slots.

Attention over a sharded group: every rank sees all queries and attends over its local KV only,
returning the partial output and its log-sum-exp per query token and head (`partial_paged_attention`);
`merge_attention_states` weights the ranks' partials by their LSE. A query that sees no local key has
output 0 and LSE -inf (an empty state); merging only empty states gives output 0 and LSE -inf, never NaN.
The merge of all ranks' partials equals spec.attention.paged_attention on the single-rank layout.

MLA (spec/mla_cache.py, spec/mla_attention.py) is DCP's main user (DeepSeek): an mla group is sharded as any
other, its latent entries taking the slots above (what a slot holds does not change which slot a token
takes). Its reader is partial_mla_decode_attention: the absorbed decode is multi-query attention with one KV
head whose key and value are both the latent entry [c, k_pe], against the query [q_latent, q_pe]
(`q_latent . c + q_pe . k_pe` is that one dot product), so it is partial_paged_attention over the latent cache
viewed with a head axis of 1, keeping the output's first kv_lora_rank columns (the latent c; the RoPE columns
of the value are dropped). Its merge equals spec.mla_attention.mla_decode_attention on the single-rank layout.

Numerics: as spec.attention, computed in the dtype of the inputs; the LSE has the query's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.attention import check_attention_inputs
from spec.fp8 import dequantize
from spec.kv_cache import dtype_name, is_float
from spec.mla_attention import check_mla_attention_inputs
from spec.mla_cache import mla_scale
from spec.types import PAD_SLOT_ID, SLOT_DTYPE, BatchInputs, WorkerConfig, is_integral

__all__ = [
    "ContextParallel",
    "RankInputs",
    "cp_slot_mapping",
    "local_kv_positions",
    "local_seq_lens",
    "merge_attention_states",
    "partial_mla_decode_attention",
    "partial_paged_attention",
    "rank_inputs",
]


@dataclass(frozen=True)
class ContextParallel:
    world_size: int  # CP: ranks a sharded group's KV is spread over
    rank: int  # this rank, 0 <= rank < world_size
    interleave: int = 1  # I: consecutive positions one rank holds before the next rank's turn
    sharded_groups: tuple[int, ...] = (0,)  # KV group indices that are sharded; every other group is replicated

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharded_groups", tuple(self.sharded_groups))
        for name in ("world_size", "rank", "interleave"):
            if not is_integral(getattr(self, name)):
                raise ValueError(f"ContextParallel.{name} must be an integer, got {getattr(self, name)!r}")
        if self.world_size < 1 or self.interleave < 1:
            raise ValueError(f"ContextParallel needs world_size >= 1 and interleave >= 1, got {self}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ContextParallel.rank must be in [0, {self.world_size}), got {self.rank}")
        groups = self.sharded_groups
        if not all(is_integral(g) and g >= 0 for g in groups) or len(set(groups)) != len(groups):
            raise ValueError(f"ContextParallel.sharded_groups must be distinct group indices >= 0, got {groups!r}")

    def is_sharded(self, group: int) -> bool:
        return group in self.sharded_groups

    def check_config(self, config: WorkerConfig) -> None:
        """The pool's config fits this split: each sharded group's virtual block is whole rank blocks of whole
        interleave runs (`bs * CP` with `bs % I == 0`), and holds no sliding window (windows are replicated)."""
        for g in self.sharded_groups:
            if g >= len(config.kv_groups):
                raise ValueError(
                    f"ContextParallel.sharded_groups: group {g} does not exist ({len(config.kv_groups)} groups)"
                )
            group = config.kv_groups[g]
            if group.kind == "cross_attention":  # the encoder's KV is not split by position (cross_attention.py)
                raise ValueError(f"ContextParallel.sharded_groups: group {g} holds the encoder's KV; it is replicated")
            if group.kind == "mamba":  # one state per request, not KV per position (spec/mamba.py)
                raise ValueError(f"ContextParallel.sharded_groups: group {g} holds Mamba states; it is replicated")
            if group.sliding_window is not None:
                raise ValueError(f"ContextParallel.sharded_groups: group {g} has a sliding window; it is replicated")
            if group.block_size % self.world_size or (group.block_size // self.world_size) % self.interleave:
                raise ValueError(
                    f"ContextParallel: group {g}'s block_size {group.block_size} must be bs * world_size "
                    f"({self.world_size}) with bs a multiple of interleave ({self.interleave})"
                )

    def block_size(self, config: WorkerConfig, group: int) -> int:
        """Tokens per physical block of this rank's cache of `group` (the pool's block size if replicated)."""
        size = config.kv_groups[group].block_size
        return size // self.world_size if self.is_sharded(group) else size


@dataclass(frozen=True, eq=False)
class RankInputs:
    """What one rank's model reads besides BatchInputs: per KV group, slots and sequence lengths in its cache."""

    slot_mappings: tuple[Any, ...]  # per group: [T] int64, flat token index -> slot in this rank's cache (or PAD)
    seq_lens: tuple[Any, ...]  # per group: [num_reqs] int32, batch_idx -> KV entries this rank holds
    block_sizes: tuple[int, ...]  # per group: tokens per physical block of this rank's cache


def rank_inputs(
    batch: BatchInputs,
    config: WorkerConfig,
    cp: ContextParallel,
    slot_mapping: Callable[..., Any] | None = None,  # a backend's cp_slot_mapping for its arrays; None: this one
    seq_lens: Callable[..., Any] | None = None,  # a backend's local_seq_lens; None: this one
) -> RankInputs:
    """Rank `cp.rank`'s slots and lengths for a batch prepared by the (rank-agnostic) pool."""
    cp.check_config(config)
    slot_mapping, seq_lens = slot_mapping or cp_slot_mapping, seq_lens or local_seq_lens
    slots, lens = [], []
    for g in range(len(config.kv_groups)):
        if cp.is_sharded(g):
            bs = cp.block_size(config, g)
            slots.append(slot_mapping(batch.positions, batch.query_start_loc, batch.block_tables[g], bs, cp))
            lens.append(seq_lens(batch.seq_lens, cp))
        else:
            slots.append(batch.slot_mappings[g])
            lens.append(batch.seq_lens)
    return RankInputs(tuple(slots), tuple(lens), tuple(cp.block_size(config, g) for g in range(len(slots))))


def cp_slot_mapping(
    positions: np.ndarray,  # [T] flat token index -> position (0 for padding)
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> virtual block ids (the pool's gathered table)
    block_size: int,  # bs: tokens per physical block of a rank (the virtual block holds bs * world_size)
    cp: ContextParallel,
) -> np.ndarray:  # [T] int64, flat token index -> slot in rank cp.rank's cache, PAD_SLOT_ID if not local
    check_slot_inputs(positions, query_start_loc, block_table, block_size)
    world, inter = cp.world_size, cp.interleave
    out = np.full(positions.shape[0], PAD_SLOT_ID, dtype=SLOT_DTYPE)
    for b in range(block_table.shape[0]):
        for t in range(int(query_start_loc[b]), int(query_start_loc[b + 1])):
            p = int(positions[t])
            off, bi = p % (block_size * world), p // (block_size * world)
            if bi >= block_table.shape[1]:
                raise ValueError(
                    f"cp_slot_mapping: positions[{t}] = {p} lies past block_table's {block_table.shape[1]} blocks"
                )
            if (off // inter) % world == cp.rank:
                out[t] = int(block_table[b, bi]) * block_size + (off // (inter * world)) * inter + off % inter
    return out


def local_seq_lens(seq_lens: np.ndarray, cp: ContextParallel) -> np.ndarray:  # [num_reqs] int32
    """KV entries rank cp.rank holds of requests of these lengths (vLLM's dcp_local_seq_lens)."""
    if seq_lens.ndim != 1 or dtype_name(seq_lens.dtype) not in ("int32", "int64"):
        raise ValueError(f"local_seq_lens: seq_lens must be [num_reqs] int32 or int64, got {seq_lens.dtype}")
    lens = np.asarray(seq_lens, np.int64)
    turn = cp.world_size * cp.interleave
    rest = np.clip(lens % turn - cp.rank * cp.interleave, 0, cp.interleave)
    return (lens // turn * cp.interleave + rest).astype(np.int32)


def local_kv_positions(num_local: int, cp: ContextParallel) -> np.ndarray:  # [num_local] int64
    """The position in its request of each of a rank's first `num_local` KV entries, in slot order."""
    j = np.arange(num_local, dtype=np.int64)
    return (j // cp.interleave) * (cp.world_size * cp.interleave) + cp.rank * cp.interleave + j % cp.interleave


def partial_paged_attention(
    query: np.ndarray,  # [T, num_heads, head_dim], every query of the batch
    key_cache: np.ndarray,  # [num_blocks, bs, num_kv_heads, head_dim], this rank's cache
    value_cache: np.ndarray,  # [num_blocks, bs, num_kv_heads, head_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> block ids (the pool's gathered table)
    seq_lens: np.ndarray,  # [num_reqs] the requests' full lengths (not the local ones)
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    cp: ContextParallel,
    scale: float,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # ([T, num_heads, head_dim], [T, num_heads] LSE)
    """Causal attention of every query over the KV this rank holds: the output and its log-sum-exp.

    Padding rows, and queries that see no local key, are empty states: output 0, LSE -inf.
    """
    check_attention_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=None, softcap=softcap,
    )  # fmt: skip
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_heads = query.shape[1]
    dtype = query.dtype.type
    out = np.zeros_like(query)
    lse = np.full(query.shape[:2], -np.inf, dtype=query.dtype)
    local = local_seq_lens(seq_lens, cp)
    for b in range(len(seq_lens)):
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        q_pos = np.arange(seq_len - (q_end - q_start), seq_len)  # [q] positions of this row's queries
        j = np.arange(int(local[b]))  # [k] this rank's KV entries of the row
        k_pos = local_kv_positions(len(j), cp)  # [k] their positions in the request
        keys = key_cache[block_table[b, j // block_size], j % block_size]  # [k, num_kv_heads, head_dim]
        values = value_cache[block_table[b, j // block_size], j % block_size]
        group = num_heads // num_kv_heads
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # [k, H, D]
        logits = np.einsum("qhd,khd->hqk", query[q_start:q_end], keys) * dtype(scale)
        if softcap is not None:
            logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
        logits = np.where((k_pos[None, :] <= q_pos[:, None])[None], logits, dtype(-np.inf))
        row_out, row_lse = _normalise(logits, values)
        out[q_start:q_end], lse[q_start:q_end] = row_out, row_lse
    return out, lse


def partial_mla_decode_attention(
    q_latent: np.ndarray,  # [T, num_heads, kv_lora_rank] every query of the batch, q_nope absorbed through W_UK
    q_pe: np.ndarray,  # [T, num_heads, rope_dim] already rotated
    kv_cache: np.ndarray,  # [num_blocks, bs, kv_lora_rank + rope_dim], this rank's latent cache
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> block ids (the pool's gathered table)
    seq_lens: np.ndarray,  # [num_reqs] the requests' full lengths (not the local ones)
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    cp: ContextParallel,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value (per tensor)
) -> tuple[np.ndarray, np.ndarray]:  # ([T, num_heads, kv_lora_rank] in latent space, [T, num_heads] LSE)
    """MLA's absorbed decode over the latent entries this rank holds: the output and its log-sum-exp, empty
    states as partial_paged_attention's. The model applies W_UV to the merged output, not to the partials."""
    fmt = check_mla_attention_inputs(
        "partial_mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    rank = kv_cache.shape[2] - q_pe.shape[2]
    if q_latent.shape[2] != rank:
        raise ValueError(
            f"partial_mla_decode_attention: q_latent {tuple(q_latent.shape)} must be [T, H, kv_lora_rank={rank}]"
        )
    k_scale32 = mla_scale("partial_mla_decode_attention", fmt, k_scale)
    entries = kv_cache if fmt is None else dequantize(kv_cache, fmt, np.asarray(k_scale32), q_latent.dtype.type)
    entries = entries[:, :, None, :]  # [num_blocks, bs, 1, L + R]: one KV head, the key and the value alike
    query = np.concatenate([q_latent, q_pe], axis=2)  # [T, H, L + R]
    out, lse = partial_paged_attention(
        query, entries, entries, block_table, seq_lens, query_start_loc, cp=cp, scale=scale
    )
    return np.ascontiguousarray(out[:, :, :rank]), lse


def _normalise(logits: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax of `logits` [H, q, k] applied to `values` [k, H, D], and its LSE; an all -inf row is empty."""
    peak = logits.max(axis=-1, keepdims=True, initial=-np.inf)  # [H, q, 1]
    shift = np.where(peak == -np.inf, 0, peak)  # an empty row subtracts 0: exp(-inf) = 0, not exp(nan)
    weights = np.exp(logits - shift)
    total = weights.sum(axis=-1, keepdims=True)  # [H, q, 1]
    safe = np.where(total > 0, total, 1)
    out = np.einsum("hqk,khd->qhd", weights / safe, values)
    lse = np.where(total > 0, shift + np.log(safe), -np.inf)[..., 0].T  # [q, H]
    return out, lse


def merge_attention_states(
    outputs: np.ndarray,  # [N, T, num_heads, head_dim] the partial outputs of N ranks
    lses: np.ndarray,  # [N, T, num_heads] their log-sum-exps (-inf: empty state)
) -> tuple[np.ndarray, np.ndarray]:  # ([T, num_heads, head_dim], [T, num_heads])
    """Attention over the union of the partials' keys: each partial weighted by exp(lse - merged lse)."""
    check_merge_inputs(outputs, lses)
    dtype = outputs.dtype.type
    peak = lses.max(axis=0)  # [T, H]
    shift = np.where(peak == -np.inf, dtype(0), peak)
    weights = np.exp(lses - shift[None])  # [N, T, H]: 0 for an empty state
    total = weights.sum(axis=0)  # [T, H]
    empty = total == 0  # every partial empty: output 0, LSE -inf (0/0 would be NaN)
    safe = np.where(empty, dtype(1), total)
    out = (weights[..., None] * outputs).sum(axis=0) / safe[..., None]
    return out.astype(outputs.dtype), np.where(empty, dtype(-np.inf), shift + np.log(safe)).astype(outputs.dtype)


def check_slot_inputs(positions: Any, query_start_loc: Any, block_table: Any, block_size: Any) -> None:
    """The input contract of cp_slot_mapping, for NumPy arrays and torch tensors alike (shapes and dtypes)."""
    if positions.ndim != 1 or dtype_name(positions.dtype) not in ("int32", "int64"):
        raise ValueError(f"cp_slot_mapping: positions must be [T] int32 or int64, got {tuple(positions.shape)}")
    if block_table.ndim != 2 or dtype_name(block_table.dtype) not in ("int32", "int64"):
        raise ValueError("cp_slot_mapping: block_table must be [num_reqs, max_blocks] int32 or int64")
    if tuple(query_start_loc.shape) != (block_table.shape[0] + 1,):
        raise ValueError(
            f"cp_slot_mapping: query_start_loc {tuple(query_start_loc.shape)} must be [{block_table.shape[0] + 1}]"
        )
    if not is_integral(block_size) or block_size < 1:
        raise ValueError(f"cp_slot_mapping: block_size must be an int >= 1, got {block_size!r}")


def check_merge_inputs(outputs: Any, lses: Any) -> None:
    """The input contract of merge_attention_states, for NumPy arrays and torch tensors alike."""
    if outputs.ndim != 4 or outputs.shape[0] < 1:
        raise ValueError(
            f"merge_attention_states: outputs must be [N >= 1, T, num_heads, head_dim], got {tuple(outputs.shape)}"
        )
    if tuple(lses.shape) != tuple(outputs.shape[:3]):
        raise ValueError(f"merge_attention_states: lses {tuple(lses.shape)} must be {tuple(outputs.shape[:3])}")
    if not is_float(outputs.dtype) or not is_float(lses.dtype):
        raise ValueError(
            f"merge_attention_states: outputs and lses must hold floats, got {outputs.dtype}, {lses.dtype}"
        )
