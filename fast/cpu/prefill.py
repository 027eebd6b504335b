"""Prefill rows of CPU paged attention: the request's visible blocks gathered once, then torch's fused SDPA.

A row with several queries reuses each key for every query, so one copy of the blocks it reads costs little
beside the matrix products, and torch's SDPA does those products faster than fast.cpu.attention's
row-at-a-time loops: measured side by side at one thread (interleaved, medians), 0.84x the kernel's time
for rows of 2 queries on 512 keys, 0.59x for 8, 0.25x for 32, and 0.26x for the mixed batch of
benchmarks/cpu_kernel_cases.py (4 x 512 prefill on 512 + 64 decodes). Decode rows, soft-capped rows and
rows with a non-finite query or scale stay with the kernel, which reads blocks in place and follows IEEE
arithmetic where SDPA would zero a NaN row. An fp8 cache's gathered codes are dequantized once
(fast.fp8.dequantize: decode(code) * scale in float32) before SDPA.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

from fast.fp8 import dequantize
from spec.fp8 import Fp8Format

MIN_QUERIES = 2  # a row with at least this many queries takes SDPA (from 2 on it is the faster, measured above)


def sdpa_rows(
    query: torch.Tensor,  # [T, num_heads, head_dim] float32
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    scale: float,
    softcap: float | None,
) -> np.ndarray:  # [k] int64 batch_idx of the rows this path takes
    """Rows of MIN_QUERIES queries or more, without soft-cap, whose queries and scale are finite."""
    counts = np.diff(query_start_loc.astype(np.int64))
    if softcap is not None or not math.isfinite(scale) or not (counts >= MIN_QUERIES).any():
        return np.zeros(0, np.int64)
    rows = np.flatnonzero(counts >= MIN_QUERIES)
    finite = [bool(torch.isfinite(query[query_start_loc[b] : query_start_loc[b + 1]]).all()) for b in rows]
    return rows[np.array(finite, bool)].astype(np.int64)


def prefill_sdpa(
    out: torch.Tensor,  # [T, num_heads, head_dim] float32, written for the rows' queries
    query: torch.Tensor,  # [T, num_heads, head_dim] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids (checked by plan_items)
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    rows: np.ndarray,  # [k] batch_idx of the rows to compute (sdpa_rows)
    *,
    scale: float,
    sliding_window: int | None,
    fmt: Fp8Format | None = None,  # caches of uint8 codes of this format, or None: a float dtype
    k_scale: np.ndarray | None = None,  # [num_kv_heads] float32, for an fp8 cache
    v_scale: np.ndarray | None = None,  # [num_kv_heads] float32, for an fp8 cache
) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    for b in rows.tolist():
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        num_q = q_end - q_start
        first_q_pos = seq_len - num_q
        k_first = 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)
        first_block, end_block = k_first // block_size, -(-seq_len // block_size)
        blocks = torch.from_numpy(block_table[b, first_block:end_block].astype(np.int64))
        # whole blocks, then the slots before k_first and from seq_len on cut off before any arithmetic
        cut = slice(k_first - first_block * block_size, seq_len - first_block * block_size)
        keys = key_cache.index_select(0, blocks).flatten(0, 1)[cut]  # [k, num_kv_heads, D]
        values = value_cache.index_select(0, blocks).flatten(0, 1)[cut]
        if fmt is not None and k_scale is not None and v_scale is not None:
            keys, values = (dequantize(keys, fmt, torch.from_numpy(k_scale)),
                            dequantize(values, fmt, torch.from_numpy(v_scale)))  # fmt: skip
        keys, values = keys.float(), values.float()
        # [num_q, num_heads, D] -> [num_kv_heads, group, num_q, D]; K/V broadcast over the group (no copy)
        q = query[q_start:q_end].view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        k4 = keys.transpose(0, 1)[:, None].expand(num_kv_heads, group, -1, head_dim)
        v4 = values.transpose(0, 1)[:, None].expand(num_kv_heads, group, -1, head_dim)
        plain_causal = first_q_pos == 0 and sliding_window is None
        mask = None if plain_causal else _visible(first_q_pos, num_q, k_first, seq_len, sliding_window)
        o = scaled_dot_product_attention(q, k4, v4, attn_mask=mask, is_causal=plain_causal, scale=scale)
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)


def _visible(
    first_q_pos: int, num_q: int, k_first: int, seq_len: int, sliding_window: int | None
) -> torch.Tensor:  # [num_q, seq_len - k_first] bool: which keys each query sees
    k_pos = torch.arange(k_first, seq_len)
    q_pos = torch.arange(first_q_pos, first_q_pos + num_q)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask
