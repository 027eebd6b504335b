"""Attention over the encoder's KV (cross-attention, spec/cross_attention.py): each decoder query sees all L keys.

Row b's queries (query_start_loc[b]..query_start_loc[b + 1]) attend to the L = encoder_seq_lens[b] encoder
keys in the row's cross blocks, block_table[b][:cdiv(L, block_size)], with no causal mask: every query of
the row sees the same keys, whatever its decoder position. A row with L = 0 and padding rows are zero.
Logits, GQA, numerics and the input contract are spec/attention.py's paged_attention's (no window, no
soft-cap), with encoder_seq_lens in seq_lens' place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.attention import check_attention_inputs


def cross_attention(
    query: np.ndarray,  # [T, num_heads, head_dim] the decoder's queries
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim] the cross group's cache
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> the request's cross blocks
    encoder_seq_lens: np.ndarray,  # [num_reqs] L of each row
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    scale: float,
) -> np.ndarray:  # [T, num_heads, head_dim]
    check_cross_attention_inputs(query, key_cache, value_cache, block_table, encoder_seq_lens, query_start_loc, scale)
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = query.shape[1] // num_kv_heads
    dtype = query.dtype.type
    out = np.zeros_like(query)
    for b in range(len(encoder_seq_lens)):
        q_start, q_end, length = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(encoder_seq_lens[b])
        if length == 0 or q_end == q_start:
            continue
        k_pos = np.arange(length)  # [L] every encoder position
        blocks = block_table[b, k_pos // block_size]
        keys = np.repeat(key_cache[blocks, k_pos % block_size], group, axis=1)  # [L, H, D]
        values = np.repeat(value_cache[blocks, k_pos % block_size], group, axis=1)
        logits = np.einsum("qhd,khd->hqk", query[q_start:q_end], keys) * dtype(scale)  # [H, q, L]
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[q_start:q_end] = np.einsum("hqk,khd->qhd", weights, values)
    return out


def check_cross_attention_inputs(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_table: Any,
    encoder_seq_lens: Any,
    query_start_loc: Any,
    scale: Any,
) -> None:
    """paged_attention's input contract (spec/attention.py), with encoder_seq_lens in seq_lens' place."""
    try:
        check_attention_inputs(
            query, key_cache, value_cache, block_table, encoder_seq_lens, query_start_loc,
            scale=scale, sliding_window=None, softcap=None,
        )  # fmt: skip
    except ValueError as e:
        message = str(e).replace("paged_attention", "cross_attention", 1).replace("seq_lens", "encoder_seq_lens")
        raise ValueError(message) from None
