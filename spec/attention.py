"""Stage 7, paged attention: each query token attends to its request's keys through the block table.

A query at position p of batch row b sees key positions k with k <= p (causal within the request)
and k > p - sliding_window (if set). Logits are `scale * q.k`, then `softcap * tanh(logits / softcap)`
(if set). Query head h reads KV head h // (num_heads // num_kv_heads) (GQA).

Numerics: the reference computes in the dtype of its inputs (float16 arithmetic for float16 inputs),
so that one function gives both the high-precision reference (float64 inputs) and the
low-precision baseline the tolerance rule compares against. Padding rows of the output are zero.
"""

from __future__ import annotations

import numpy as np


def paged_attention(
    query: np.ndarray,  # [T, num_heads, head_dim]
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:  # [T, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if num_heads % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"paged_attention: query {query.shape} does not fit cache {key_cache.shape}")
    dtype = query.dtype.type
    out = np.zeros_like(query)
    for b in range(len(seq_lens)):
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        q_pos = np.arange(seq_len - (q_end - q_start), seq_len)  # [q] positions of this row's queries
        first = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        k_pos = np.arange(first, seq_len)  # [k] the only positions any query of this row may read
        blocks = block_table[b, k_pos // block_size]
        keys = key_cache[blocks, k_pos % block_size]  # [k, num_kv_heads, head_dim]
        values = value_cache[blocks, k_pos % block_size]
        group = num_heads // num_kv_heads
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # [k, H, D]
        logits = np.einsum("qhd,khd->hqk", query[q_start:q_end], keys) * dtype(scale)
        if softcap is not None:
            logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        logits = np.where(visible[None], logits, dtype(-np.inf))
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[q_start:q_end] = np.einsum("hqk,khd->qhd", weights, values)
    return out
