"""Stage 7, paged attention: each query token attends to its request's keys through the block table.

A query at position p of batch row b sees key positions k with k <= p (causal within the request)
and k > p - sliding_window (if set). Logits are `scale * q.k`, then `softcap * tanh(logits / softcap)`
(if set). Query head h reads KV head h // (num_heads // num_kv_heads) (GQA).

Numerics: the reference computes in the dtype of its inputs (float16 arithmetic for float16 inputs),
so that one function gives both the high-precision reference (float64 inputs) and the
low-precision baseline the tolerance rule compares against. Padding rows of the output are zero.
Non-finite inputs follow IEEE arithmetic: a NaN anywhere in a row's visible logits (a NaN query, scale=NaN)
makes that row NaN.

Input contract, shared by every backend (check_attention_inputs; each raises ValueError naming the
argument): the shapes in the signature; query and both caches of one float dtype; block_table, seq_lens and
query_start_loc int32 or int64; the caches laid out alike (spec.kv_cache.check_cache_layout); sliding_window
an int >= 1 or None; softcap a finite number > 0 or None; scale a real number.

fp8 caches (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2", spec.kv_cache): the caches hold uint8 codes
and attention reads key `decode(code) * k_scale[h]` and value `decode(code) * v_scale[h]` for KV head h,
computed in the query's dtype like everything else (decode is exact in float16, bfloat16 and float32; the
product with the scale is rounded to the query's dtype); the query is then any float dtype, its values the
only floats of the call. The scales follow spec.kv_cache.check_kv_scales (1 with "auto").
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from spec.fp8 import Fp8Format, cache_format, dequantize
from spec.kv_cache import check_cache_layout, check_fp8_caches, check_kv_scales, dtype_name, is_float

INDEX_DTYPES = ("int32", "int64")


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
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value, or [num_kv_heads]
    v_scale: float | np.ndarray = 1.0,
    out: np.ndarray | None = None,  # [T, num_heads, head_dim] like query: receives the result, which is returned
) -> np.ndarray:  # [T, num_heads, head_dim]
    fmt = check_attention_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=sliding_window, softcap=softcap, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    if out is not None:
        check_out(out, query)
    block_size, num_kv_heads = key_cache.shape[1:3]
    k_scales, v_scales = check_kv_scales("paged_attention", fmt, k_scale, v_scale, num_kv_heads)  # [num_kv_heads]
    num_heads = query.shape[1]
    dtype = query.dtype.type
    result = np.zeros_like(query)
    for b in range(len(seq_lens)):
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if q_end == q_start:  # a row with no query this call (a micro-batch's, spec/ubatch.py): nothing to attend
            continue
        q_pos = np.arange(seq_len - (q_end - q_start), seq_len)  # [q] positions of this row's queries
        first = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        k_pos = np.arange(first, seq_len)  # [k] the only positions any query of this row may read
        blocks = block_table[b, k_pos // block_size]
        keys = key_cache[blocks, k_pos % block_size]  # [k, num_kv_heads, head_dim]
        values = value_cache[blocks, k_pos % block_size]
        if fmt is not None:  # codes -> the values they stand for, in the query's dtype
            keys = dequantize(keys, fmt, k_scales[None, :, None], dtype)
            values = dequantize(values, fmt, v_scales[None, :, None], dtype)
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
        result[q_start:q_end] = np.einsum("hqk,khd->qhd", weights, values)
    if out is None:
        return result
    out[...] = result
    return out


def check_out(out: Any, query: Any) -> None:
    """An output buffer paged_attention can write: the query's shape and dtype (NumPy arrays and torch tensors)."""
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise ValueError(f"paged_attention: out must be an array like query, got {type(out).__name__}")
    if tuple(out.shape) != tuple(query.shape) or dtype_name(out.dtype) != dtype_name(query.dtype):
        raise ValueError(
            f"paged_attention: out must be {tuple(query.shape)} {dtype_name(query.dtype)} like query, got "
            f"{tuple(out.shape)} {dtype_name(out.dtype)}"
        )


def check_attention_inputs(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_table: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    scale: Any,
    sliding_window: Any,
    softcap: Any,
    kv_cache_dtype: Any = "auto",
) -> Fp8Format | None:
    """The input contract of paged_attention (module docstring), for NumPy arrays and torch tensors alike.

    Shapes, dtypes, layouts and the scalar options only: checking values would cost a device->host sync.
    Returns the caches' fp8 format (None for "auto"); the scales are checked by check_kv_scales.
    """
    fmt = cache_format(kv_cache_dtype, "paged_attention")
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"paged_attention: key_cache and value_cache must share a 4-d shape, got {tuple(key_cache.shape)}, "
            f"{tuple(value_cache.shape)}"
        )
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.ndim != 3 or query.shape[1] % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit key_cache {tuple(key_cache.shape)}")
    num_reqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if num_reqs < 0:
        raise ValueError(f"paged_attention: seq_lens {tuple(seq_lens.shape)} must be [num_reqs]")
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"paged_attention: block_table {tuple(block_table.shape)} must be [num_reqs={num_reqs}, max_blocks]"
        )
    if tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(f"paged_attention: query_start_loc {tuple(query_start_loc.shape)} must be [{num_reqs + 1}]")
    if fmt is not None:
        check_fp8_caches("paged_attention", fmt, kv_cache_dtype, key_cache, value_cache)
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if fmt is None and x.dtype != query.dtype:
            raise ValueError(f"paged_attention: {name} is {dtype_name(x.dtype)}, query {dtype_name(query.dtype)}")
    if not is_float(query.dtype):
        raise ValueError(f"paged_attention: query must hold floats, got {dtype_name(query.dtype)}")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if dtype_name(x.dtype) not in INDEX_DTYPES:
            raise ValueError(f"paged_attention: {name} must be int32 or int64, got {dtype_name(x.dtype)}")
    check_cache_layout("paged_attention", key_cache, value_cache)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"paged_attention: scale must be a real number, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1
    ):
        raise ValueError(f"paged_attention: sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < float(softcap) < math.inf
    ):
        raise ValueError(f"paged_attention: softcap must be a finite number > 0 or None, got {softcap!r}")
    return fmt
