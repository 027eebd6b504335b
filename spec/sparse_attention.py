"""Sparse top-k attention over an ordinary paged cache: each query reads exactly the slots its row lists.

`topk_slots` [T, top_k] is spec/sparse_topk.py's output (or any rank's share of it under DCP): slots of the
cache, -1 for none. Query t attends over the keys at its row's slots and nothing else; causality, windows and
the blocks a request holds were settled when the indices became slots, so the reader applies no mask of its
own. Logits are `scale * q.k`, then `softcap * tanh(logits / softcap)` if set; query head h reads KV head
h // (num_heads // num_kv_heads) (GQA), as spec.attention.

A row that lists no slot (a padded token, or a query none of whose keys this DCP rank holds) is the empty
state: output 0, LSE -inf, which merge_attention_states (spec/context_parallel.py) weighs as nothing, as vLLM's
sparse backends fill such rows (flashmla_sparse's empty_rows). sparse_attention_state returns the output and
its LSE (for the DCP merge); sparse_paged_attention the output alone.

This is the reader of an attention group's cache [num_blocks, block_size, num_kv_heads, head_dim]; an MLA
latent cache takes the same slots (the mapping does not depend on what a slot holds) and only its reader
differs. Caches hold floats ("auto"): fp8 codes are not read here.

Numerics: as spec.attention, in the dtype of the inputs (float64 inputs give the reference, float32 the
baseline of conformance/tolerance.py); the LSE has the query's dtype.

Input contract, shared by every backend (check_sparse_attention_inputs: a ValueError naming the argument):
the shapes in the signature; query and both caches of one float dtype; topk_slots int32 or int64 with a row
per query; the caches laid out alike; scale a real number; softcap a finite number > 0 or None. Values
(check_topk_slots, spec/sparse_topk.py's errors naming the token): every slot -1 or a real slot of the cache,
[block_size, num_blocks * block_size) (the null block holds no KV: InvalidIndexError outside the cache,
ReleasedBlockIndexError on the null block), each at most once per row (DuplicateIndexError).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from spec.kv_cache import check_cache_layout, dtype_name, is_float
from spec.sparse_topk import (
    INDEX_DTYPES,
    DuplicateIndexError,
    InvalidIndexError,
    ReleasedBlockIndexError,
    SparseIndexError,
    repeated_entries,
)


def sparse_paged_attention(
    query: np.ndarray,  # [T, num_heads, head_dim]
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    topk_slots: np.ndarray,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    softcap: float | None = None,
) -> np.ndarray:  # [T, num_heads, head_dim]
    return sparse_attention_state(query, key_cache, value_cache, topk_slots, scale=scale, softcap=softcap)[0]


def sparse_attention_state(
    query: np.ndarray,  # [T, num_heads, head_dim]
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    topk_slots: np.ndarray,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # ([T, num_heads, head_dim], [T, num_heads] LSE; -inf: empty)
    check_sparse_attention_inputs("sparse_attention_state", query, key_cache, value_cache, topk_slots, scale, softcap)
    check_topk_slots(np.asarray(topk_slots), key_cache.shape[0], key_cache.shape[1])
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = query.shape[1] // num_kv_heads
    dtype = query.dtype.type
    out = np.zeros_like(query)
    lse = np.full(query.shape[:2], -np.inf, dtype=query.dtype)
    for t in range(query.shape[0]):
        slots = np.asarray(topk_slots[t], np.int64)
        slots = slots[slots >= 0]  # [k] this query's keys
        if slots.size == 0:
            continue
        keys = np.repeat(key_cache[slots // block_size, slots % block_size], group, axis=1)  # [k, H, D]
        values = np.repeat(value_cache[slots // block_size, slots % block_size], group, axis=1)
        logits = np.einsum("hd,khd->hk", query[t], keys) * dtype(scale)  # [H, k]
        if softcap is not None:
            logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
        peak = logits.max(axis=1, keepdims=True)  # [H, 1]
        weights = np.exp(logits - peak)
        total = weights.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hk,khd->hd", weights / total, values)
        lse[t] = (peak + np.log(total))[:, 0]
    return out, lse


def check_sparse_attention_inputs(
    function: str, query: Any, key_cache: Any, value_cache: Any, topk_slots: Any, scale: Any, softcap: Any
) -> None:
    """Shapes, dtypes, layouts and the scalars (module docstring), for NumPy arrays and torch tensors alike."""
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"{function}: key_cache and value_cache must share a 4-d shape, got {tuple(key_cache.shape)}, "
            f"{tuple(value_cache.shape)}"
        )
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.ndim != 3 or query.shape[1] % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"{function}: query {tuple(query.shape)} does not fit key_cache {tuple(key_cache.shape)}")
    if topk_slots.ndim != 2 or topk_slots.shape[0] != query.shape[0]:
        raise ValueError(f"{function}: topk_slots {tuple(topk_slots.shape)} must be [T={query.shape[0]}, top_k]")
    if dtype_name(topk_slots.dtype) not in INDEX_DTYPES:
        raise ValueError(f"{function}: topk_slots must be int32 or int64, got {dtype_name(topk_slots.dtype)}")
    if not is_float(query.dtype):
        raise ValueError(f"{function}: query must hold floats, got {dtype_name(query.dtype)}")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if x.dtype != query.dtype:
            raise ValueError(f"{function}: {name} is {dtype_name(x.dtype)}, query {dtype_name(query.dtype)}")
    check_cache_layout(function, key_cache, value_cache)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{function}: scale must be a real number, got {scale!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < float(softcap) < math.inf
    ):
        raise ValueError(f"{function}: softcap must be a finite number > 0 or None, got {softcap!r}")


def check_topk_slots(topk_slots: np.ndarray, num_blocks: int, block_size: int) -> None:
    """The slots' values (module docstring): the first offending (token, entry) in row-major order raises."""
    slots = np.asarray(topk_slots, np.int64)  # [T, top_k]
    num_slots = num_blocks * block_size

    def refuse(error: type[SparseIndexError], bad: np.ndarray, detail: str) -> None:
        if bad.any():
            t, j = (int(i) for i in np.argwhere(bad)[0])
            raise error(None, t, f"topk_slots[{t}, {j}]", f"= {int(slots[t, j])} {detail}")

    refuse(
        InvalidIndexError, (slots < -1) | (slots >= num_slots), f"is not -1 nor a slot of the cache [0, {num_slots})"
    )
    refuse(ReleasedBlockIndexError, (slots >= 0) & (slots < block_size), "lies in the null block, which holds no KV")
    refuse(DuplicateIndexError, repeated_entries(slots), "is listed twice in the row")
