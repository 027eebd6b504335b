"""Sparse top-k attention over an MLA latent cache: DeepSeek-V3.2's case, the absorbed form at the listed slots.

The cache is an mla group's (spec/mla_cache.py): per slot the latent c (kv_lora_rank = L wide) and the rotated
RoPE key part k_pe (R wide). The query is in the absorbed form of spec/mla_attention.py (`q_latent` = q_nope
through W_UK, `q_pe` rotated), as vLLM's sparse MLA backends (FlashMLASparse and its kin) take it: for query t
and head h, over the slots its row of `topk_slots` lists and nothing else,

    logit[t, h, s] = (q_latent[t, h] . c[s] + q_pe[t, h] . k_pe[s]) * scale
    out[t, h]      = sum_s softmax(logit[t, h])[s] * c[s]          (latent space [L]; the model applies W_UV)
    lse[t, h]      = log sum_s exp(logit[t, h, s])

which is mla_decode_attention restricted to the selected keys: causality and the blocks a request holds were
settled when spec/sparse_topk.py turned positions into slots, so the reader applies no mask of its own. Every
query head reads the one latent entry (multi-query attention); MLA has no soft-cap and no window here.

A row that lists no slot (a padded token, or a query none of whose keys this DCP rank holds) is the empty state,
output 0 and LSE -inf, as flashmla_sparse fills its empty_rows, so merge_attention_states (spec/context_parallel.py)
of the DCP ranks' partials weighs it as nothing. sparse_mla_attention_state returns the output and the LSE (what
vLLM's sparse MLA kernels return, the LSE in natural log here as every LSE of the project); sparse_mla_attention
the output alone.

fp8 caches: codes read as `decode(code) * k_scale` in the query's dtype, one scale per tensor, exactly as
spec/mla_attention.py reads them. Numerics as spec.attention: in the query's dtype (float64 gives the reference,
lower dtypes the baseline of conformance/tolerance.py); the LSE has the query's dtype.

Input contract, shared by every backend (check_sparse_mla_inputs: a ValueError naming the argument): q_latent
[T, H >= 1, L], q_pe [T, H, even R], kv_cache a latent cache [num_blocks, block_size, L + R] with L >= 1,
query and q_pe of one float dtype, the cache too with "auto" (an fp8 format's codes otherwise); topk_slots
[T, top_k] int32 or int64; scale a real number. The slots' values as spec/sparse_attention.py's
check_topk_slots: -1 or a real slot, never the null block, never twice in a row (SparseIndexError naming the
token and `topk_slots[t, j]`).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from spec.fp8 import Fp8Format, cache_format, dequantize
from spec.kv_cache import dtype_name, is_float
from spec.mla_cache import check_cache_dtype, check_latent_cache, mla_scale
from spec.sparse_attention import check_topk_slots
from spec.sparse_topk import INDEX_DTYPES


def sparse_mla_attention(
    q_latent: np.ndarray,  # [T, num_heads, kv_lora_rank] q_nope absorbed through W_UK
    q_pe: np.ndarray,  # [T, num_heads, rope_dim] already rotated
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    topk_slots: np.ndarray,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value (per tensor)
) -> np.ndarray:  # [T, num_heads, kv_lora_rank] in latent space
    return sparse_mla_attention_state(
        q_latent, q_pe, kv_cache, topk_slots, scale=scale, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale
    )[0]


def sparse_mla_attention_state(
    q_latent: np.ndarray,  # [T, num_heads, kv_lora_rank]
    q_pe: np.ndarray,  # [T, num_heads, rope_dim]
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    topk_slots: np.ndarray,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,
) -> tuple[np.ndarray, np.ndarray]:  # ([T, num_heads, kv_lora_rank], [T, num_heads] LSE; -inf: empty)
    function = "sparse_mla_attention_state"
    fmt = check_sparse_mla_inputs(function, q_latent, q_pe, kv_cache, topk_slots, scale, kv_cache_dtype)
    k_scale32 = mla_scale(function, fmt, k_scale)
    check_topk_slots(np.asarray(topk_slots), kv_cache.shape[0], kv_cache.shape[1])
    block_size, rank = kv_cache.shape[1], q_latent.shape[2]
    dtype = q_latent.dtype.type
    out = np.zeros_like(q_latent)
    lse = np.full(q_latent.shape[:2], -np.inf, dtype=q_latent.dtype)
    for t in range(q_latent.shape[0]):
        slots = np.asarray(topk_slots[t], np.int64)
        slots = slots[slots >= 0]  # [k] this query's keys
        if slots.size == 0:
            continue
        entries = kv_cache[slots // block_size, slots % block_size]  # [k, L + R]
        if fmt is not None:  # codes -> the values they stand for, in the query's dtype
            entries = dequantize(entries, fmt, np.asarray(k_scale32), dtype)
        latents, k_pe = entries[:, :rank], entries[:, rank:]  # [k, L], [k, R]
        # matmul, not einsum: a NoPE latent (R = 0) contracts over nothing, which matmul makes exact zeros
        logits = (q_latent[t] @ latents.T + q_pe[t] @ k_pe.T) * dtype(scale)  # [H, k]
        peak = logits.max(axis=1, keepdims=True)  # [H, 1]
        weights = np.exp(logits - peak)
        total = weights.sum(axis=1, keepdims=True)
        out[t] = (weights / total) @ latents
        lse[t] = (peak + np.log(total))[:, 0]
    return out, lse


def check_sparse_mla_inputs(
    function: str, q_latent: Any, q_pe: Any, kv_cache: Any, topk_slots: Any, scale: Any, kv_cache_dtype: Any
) -> Fp8Format | None:
    """Shapes, dtypes and scalars (module docstring), for NumPy arrays and torch tensors alike; no value is read.
    Returns the cache's fp8 format (None for "auto")."""
    fmt = cache_format(kv_cache_dtype, function)
    check_latent_cache(function, kv_cache)
    if q_latent.ndim != 3 or q_latent.shape[1] < 1:
        raise ValueError(f"{function}: q_latent {tuple(q_latent.shape)} must be [T, num_heads >= 1, kv_lora_rank]")
    if q_pe.ndim != 3 or tuple(q_pe.shape[:2]) != tuple(q_latent.shape[:2]) or q_pe.shape[2] % 2:
        raise ValueError(
            f"{function}: q_pe {tuple(q_pe.shape)} must be [{q_latent.shape[0]}, {q_latent.shape[1]}, even rope_dim]"
        )
    rank = kv_cache.shape[2] - q_pe.shape[2]
    if rank < 1 or q_latent.shape[2] != rank:
        raise ValueError(
            f"{function}: q_latent {tuple(q_latent.shape)} must be [T, H, kv_lora_rank = {rank} >= 1] "
            f"(kv_cache {tuple(kv_cache.shape)} less rope_dim {q_pe.shape[2]})"
        )
    if not is_float(q_latent.dtype):
        raise ValueError(f"{function}: q_latent must hold floats, got {dtype_name(q_latent.dtype)}")
    if q_pe.dtype != q_latent.dtype:
        raise ValueError(f"{function}: q_pe is {dtype_name(q_pe.dtype)}, q_latent {dtype_name(q_latent.dtype)}")
    check_cache_dtype(function, fmt, kv_cache_dtype, kv_cache, q_latent, "q_latent")
    if topk_slots.ndim != 2 or topk_slots.shape[0] != q_latent.shape[0]:
        raise ValueError(f"{function}: topk_slots {tuple(topk_slots.shape)} must be [T={q_latent.shape[0]}, top_k]")
    if dtype_name(topk_slots.dtype) not in INDEX_DTYPES:
        raise ValueError(f"{function}: topk_slots must be int32 or int64, got {dtype_name(topk_slots.dtype)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{function}: scale must be a real number, got {scale!r}")
    return fmt
