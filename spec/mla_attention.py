"""Stage 7 for multi-head latent attention: each query token attends to its request's latent entries.

The cache (spec/mla_cache.py) holds, per slot, the latent c (kv_lora_rank = L wide) and the rotated RoPE key
part k_pe (R wide). The model's kv_b_proj up-projects a latent into each head's key and value: vLLM splits it
into W_UK [L, num_heads, qk_nope_head_dim] and W_UV [L, num_heads, v_head_dim] (`split_kv_b_proj`), so head h
of a cached token has key `[c @ W_UK[:, h, :], k_pe]` and value `c @ W_UV[:, h, :]`. The two forms:

- mla_decode_attention, absorbed (vLLM's forward_mqa, FlashMLA): the query's no-RoPE part is absorbed into
  latent space beforehand, `q_latent[t, h] = W_UK[:, h, :] @ q_nope[t, h]` ([T, H, L], vLLM's W_UK_T bmm), and
  the kernel reads the latents as they are: logits `(q_latent . c + q_pe . k_pe) * scale`, output
  `softmax . c` in latent space [T, H, L]; the model then applies W_UV (vLLM's _v_up_proj).
- mla_prefill_attention (vLLM's forward_mha): the cached latents are up-projected into per-head keys
  `[c @ W_UK[:, h, :], k_pe]` (k_pe broadcast over heads) and values `c @ W_UV[:, h, :]`, then ordinary
  attention of the query `[q_nope, q_pe]`; output [T, H, v_head_dim].

The equivalence the two satisfy (associativity of the products, exact in real arithmetic): with q_latent
absorbed as above, `mla_decode_attention(...)[t, h] @ W_UV[:, h, :] == mla_prefill_attention(...)[t, h]`,
since `q_latent . c = q_nope . (c @ W_UK[:, h, :])` and the softmax weights are the same. Either form is
therefore right for any row; the batch split (spec/mla_split.py) only says which kernel an engine runs.
Where vLLM's prefill path takes the new tokens' latents straight from the model (not from the cache), both
forms here read every position from the cache: with an fp8 cache, the new tokens' quantized values too.

Both forms are causal within the request (a query at position p sees positions <= p), take any query
length per row (a decode row of 1 + K tokens with drafts included) and compute in the query's dtype, as
spec.attention does (one function gives the float64 reference and the low-precision baseline of
conformance/tolerance.py); padding rows of the output are zero. MLA has no sliding window (an mla group
refuses one, spec/types.py) and no logit soft-cap (DeepSeek's and Kimi's MLA use none): neither is a
parameter here.

fp8 caches (kv_cache_dtype as spec/mla_cache.py): codes read as `decode(code) * k_scale` in the query's
dtype, one scale for the whole entry.

Input contract, shared by every backend (check_mla_attention_inputs; a ValueError naming the argument):
the shapes in the signatures; the latent width L = kv_cache.shape[2] - R >= 1; query, q_pe and the weights
of one float dtype, the cache too with "auto"; block_table, seq_lens and query_start_loc int32 or int64;
scale a real number.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np

from spec.attention import INDEX_DTYPES
from spec.fp8 import Fp8Format, cache_format, dequantize
from spec.kv_cache import dtype_name, is_float
from spec.mla_cache import check_cache_dtype, check_latent_cache, mla_scale


def mla_decode_attention(
    q_latent: np.ndarray,  # [T, num_heads, kv_lora_rank] q_nope absorbed through W_UK
    q_pe: np.ndarray,  # [T, num_heads, rope_dim] already rotated
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value (per tensor)
) -> np.ndarray:  # [T, num_heads, kv_lora_rank] in latent space
    fmt = check_mla_attention_inputs(
        "mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    if q_latent.shape[2] != kv_cache.shape[2] - q_pe.shape[2]:
        raise ValueError(
            f"mla_decode_attention: q_latent {tuple(q_latent.shape)} must be [T, H, kv_lora_rank="
            f"{kv_cache.shape[2] - q_pe.shape[2]}] (kv_cache {tuple(kv_cache.shape)} less rope_dim {q_pe.shape[2]})"
        )
    k_scale32 = mla_scale("mla_decode_attention", fmt, k_scale)
    dtype = q_latent.dtype.type
    rank = q_latent.shape[2]
    result = np.zeros_like(q_latent)
    for q_start, q_end, visible, entries in _rows(
        q_latent, kv_cache, block_table, seq_lens, query_start_loc, fmt, k_scale32
    ):
        latents, k_pe = entries[:, :rank], entries[:, rank:]  # [k, L], [k, R]
        logits = np.einsum("qhl,kl->hqk", q_latent[q_start:q_end], latents)
        logits = (logits + _rope_logits(q_pe[q_start:q_end], k_pe)) * dtype(scale)
        result[q_start:q_end] = np.einsum("hqk,kl->qhl", _softmax(logits, visible, dtype), latents)
    return result


def mla_prefill_attention(
    q_nope: np.ndarray,  # [T, num_heads, qk_nope_head_dim]
    q_pe: np.ndarray,  # [T, num_heads, rope_dim] already rotated
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    w_uk: np.ndarray,  # [kv_lora_rank, num_heads, qk_nope_head_dim] latent -> each head's no-RoPE key
    w_uv: np.ndarray,  # [kv_lora_rank, num_heads, v_head_dim] latent -> each head's value
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value (per tensor)
) -> np.ndarray:  # [T, num_heads, v_head_dim]
    fmt = check_mla_attention_inputs(
        "mla_prefill_attention", q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    check_up_projections(q_nope, w_uk, w_uv, kv_cache.shape[2] - q_pe.shape[2])
    k_scale32 = mla_scale("mla_prefill_attention", fmt, k_scale)
    dtype = q_nope.dtype.type
    rank = w_uk.shape[0]
    result = np.zeros((q_nope.shape[0], q_nope.shape[1], w_uv.shape[2]), q_nope.dtype)
    for q_start, q_end, visible, entries in _rows(
        q_nope, kv_cache, block_table, seq_lens, query_start_loc, fmt, k_scale32
    ):
        latents, k_pe = entries[:, :rank], entries[:, rank:]  # [k, L], [k, R]
        keys = np.einsum("kl,lhp->khp", latents, w_uk)  # [k, H, P] each head's no-RoPE key
        values = np.einsum("kl,lhv->khv", latents, w_uv)  # [k, H, V]
        logits = np.einsum("qhp,khp->hqk", q_nope[q_start:q_end], keys)
        logits = (logits + _rope_logits(q_pe[q_start:q_end], k_pe)) * dtype(scale)  # k_pe: every head's
        result[q_start:q_end] = np.einsum("hqk,khv->qhv", _softmax(logits, visible, dtype), values)
    return result


def _rows(
    query: np.ndarray,  # [T, num_heads, ...] only its dtype is read
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: np.ndarray,  # [num_reqs, max_blocks]
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    fmt: Fp8Format | None,
    k_scale: np.float32,
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """Per batch row: its queries' flat range, which positions each sees ([q, k] causal) and the entries of
    positions 0 .. seq_len - 1 ([k, L + R], in the query's dtype)."""
    block_size = kv_cache.shape[1]
    for b in range(len(seq_lens)):
        q_start, q_end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if q_end == q_start:  # no query: a graph's padded request row (spec/padding.py) has no output to make
            continue
        q_pos = np.arange(seq_len - (q_end - q_start), seq_len)  # [q] positions of this row's queries
        k_pos = np.arange(seq_len)  # [k]
        entries = kv_cache[block_table[b, k_pos // block_size], k_pos % block_size]  # [k, L + R]
        if fmt is not None:  # codes -> the values they stand for, in the query's dtype
            entries = dequantize(entries, fmt, np.asarray(k_scale), query.dtype.type)
        yield q_start, q_end, k_pos[None, :] <= q_pos[:, None], entries


def _rope_logits(q_pe: np.ndarray, k_pe: np.ndarray) -> np.ndarray:  # [q, H, R], [k, R] -> [H, q, k]
    """The RoPE part's logits, shared k_pe against each head's q_pe; zeros for a NoPE latent (R = 0). Spelled out
    because NumPy's einsum over an empty contraction is not reliably zero: in the differential suite it returned
    NaN (uninitialized float16 memory) for gathered latent entries."""
    if k_pe.shape[1] == 0:
        return np.zeros((q_pe.shape[1], q_pe.shape[0], k_pe.shape[0]), q_pe.dtype)
    return np.einsum("qhr,kr->hqk", q_pe, k_pe)


def _softmax(logits: np.ndarray, visible: np.ndarray, dtype: type) -> np.ndarray:  # [H, q, k]
    logits = np.where(visible[None], logits, dtype(-np.inf))  # [H, q, k]
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def check_up_projections(q_nope: Any, w_uk: Any, w_uv: Any, rank: int) -> None:
    """W_UK [L, H, qk_nope_head_dim] and W_UV [L, H, v_head_dim >= 1], of the query's dtype."""
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    if tuple(w_uk.shape) != (rank, num_heads, nope_dim):
        raise ValueError(
            f"mla_prefill_attention: w_uk {tuple(w_uk.shape)} must be [kv_lora_rank={rank}, {num_heads}, {nope_dim}]"
        )
    if w_uv.ndim != 3 or tuple(w_uv.shape[:2]) != (rank, num_heads) or w_uv.shape[2] < 1:
        raise ValueError(
            f"mla_prefill_attention: w_uv {tuple(w_uv.shape)} must be [kv_lora_rank={rank}, {num_heads}, v_head_dim]"
        )
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        if w.dtype != q_nope.dtype:
            raise ValueError(
                f"mla_prefill_attention: {name} is {dtype_name(w.dtype)}, q_nope {dtype_name(q_nope.dtype)}"
            )


def check_mla_attention_inputs(
    function: str,
    query: Any,
    q_pe: Any,
    kv_cache: Any,
    block_table: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    scale: Any,
    kv_cache_dtype: Any,
) -> Fp8Format | None:
    """What both forms share of the contract (module docstring), for NumPy arrays and torch tensors alike.

    `query` is q_latent or q_nope. Shapes, dtypes and the scalar options only (no value is read, so no
    device->host sync). Returns the cache's fp8 format (None for "auto").
    """
    fmt = cache_format(kv_cache_dtype, function)
    check_latent_cache(function, kv_cache)
    if query.ndim != 3 or query.shape[1] < 1:
        raise ValueError(f"{function}: query {tuple(query.shape)} must be [T, num_heads >= 1, width]")
    if q_pe.ndim != 3 or tuple(q_pe.shape[:2]) != tuple(query.shape[:2]) or q_pe.shape[2] % 2:
        raise ValueError(
            f"{function}: q_pe {tuple(q_pe.shape)} must be [{query.shape[0]}, {query.shape[1]}, even rope_dim]"
        )
    if kv_cache.shape[2] - q_pe.shape[2] < 1:
        raise ValueError(
            f"{function}: kv_cache entries ({kv_cache.shape[2]}) leave no latent beside rope_dim {q_pe.shape[2]}"
        )
    if not is_float(query.dtype):
        raise ValueError(f"{function}: query must hold floats, got {dtype_name(query.dtype)}")
    if q_pe.dtype != query.dtype:
        raise ValueError(f"{function}: q_pe is {dtype_name(q_pe.dtype)}, query {dtype_name(query.dtype)}")
    check_cache_dtype(function, fmt, kv_cache_dtype, kv_cache, query, "query")
    num_reqs = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
    if num_reqs < 0:
        raise ValueError(f"{function}: seq_lens {tuple(seq_lens.shape)} must be [num_reqs]")
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"{function}: block_table {tuple(block_table.shape)} must be [num_reqs={num_reqs}, max_blocks]"
        )
    if tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(f"{function}: query_start_loc {tuple(query_start_loc.shape)} must be [{num_reqs + 1}]")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if dtype_name(x.dtype) not in INDEX_DTYPES:
            raise ValueError(f"{function}: {name} must be int32 or int64, got {dtype_name(x.dtype)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{function}: scale must be a real number, got {scale!r}")
    return fmt
