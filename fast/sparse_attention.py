"""Sparse top-k attention on torch tensors: spec.sparse_attention's functions, same contract and errors.

Vectorised torch ops on any device: the listed keys and values are gathered per query ([tokens, top_k,
num_kv_heads, head_dim], a chunk of tokens at a time so the gather stays under GATHER_ELEMENTS), the query
heads grouped by KV head (no repeated keys for GQA), accumulated in float32 whatever the input dtype; the
output is in the query's dtype and the LSE float32 (as fast.context_parallel's partials, and vLLM's). The
slots' values are checked as one torch mask (one device->host read); a violation is named by spec's
check_topk_slots on a host copy, so both backends raise the same error.
"""

from __future__ import annotations

import torch

from spec.sparse_attention import check_sparse_attention_inputs, check_topk_slots

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATHER_ELEMENTS = 1 << 24  # the most key elements one chunk gathers (64 MiB of float32 keys, as many of values)


def sparse_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    topk_slots: torch.Tensor,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    return sparse_attention_state(query, key_cache, value_cache, topk_slots, scale=scale, softcap=softcap)[0]


def sparse_attention_state(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    topk_slots: torch.Tensor,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, num_heads, head_dim], [T, num_heads] float32 LSE; -inf: empty)
    check_sparse_attention_inputs("sparse_attention_state", query, key_cache, value_cache, topk_slots, scale, softcap)
    if len({t.device for t in (query, key_cache, value_cache, topk_slots)}) != 1:
        raise ValueError("sparse_attention_state: query, caches and topk_slots must be on one device")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"sparse_attention_state: query must be one of {_FLOAT_DTYPES}, got {query.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = topk_slots.to(torch.int64)  # [T, top_k]
    if bool(bad_slots(slots, num_blocks, block_size).any()):  # the one host read of the checks
        check_topk_slots(slots.cpu().numpy(), num_blocks, block_size)
        raise RuntimeError("fast.sparse_attention_state: its check found a violation spec's did not (a bug)")
    num_tokens, num_heads = query.shape[:2]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
    width = slots.shape[1]
    if width == 0:
        return out.to(query.dtype), lse
    chunk = max(1, GATHER_ELEMENTS // (width * num_kv_heads * head_dim))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        out[start:end], lse[start:end] = _chunk_state(
            query[start:end], key_cache, value_cache, slots[start:end], float(scale), softcap
        )
    return out.to(query.dtype), lse


def _chunk_state(
    query: torch.Tensor,  # [c, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [c, top_k] int64, checked
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([c, num_heads, head_dim] float32, [c, num_heads] float32)
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    c, num_heads = query.shape[:2]
    listed = slots >= 0  # [c, top_k]
    safe = torch.where(listed, slots, block_size)  # an unlisted entry reads a real slot, then is masked out
    keys = key_cache[safe // block_size, safe % block_size].float()  # [c, top_k, num_kv_heads, head_dim]
    values = value_cache[safe // block_size, safe % block_size].float()
    q = query.float().view(c, num_kv_heads, num_heads // num_kv_heads, head_dim)  # heads grouped by KV head
    logits = torch.einsum("cngd,cknd->cngk", q, keys) * scale  # [c, num_kv_heads, group, top_k]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~listed[:, None, None, :], float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    shift = torch.where(peak == float("-inf"), 0.0, peak)  # an empty row: exp(-inf - 0) = 0, not NaN
    weights = torch.exp(logits - shift)
    total = weights.sum(dim=-1, keepdim=True)
    safe_total = torch.where(total > 0, total, 1.0)
    out = torch.einsum("cngk,cknd->cngd", weights / safe_total, values).reshape(c, num_heads, head_dim)
    lse = torch.where(total > 0, shift + torch.log(safe_total), float("-inf")).reshape(c, num_heads)
    return out, lse


def bad_slots(slots: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:  # [T, top_k] bool
    """The entries spec.sparse_attention.check_topk_slots refuses, all rules at once."""
    bad = (slots < -1) | (slots >= num_blocks * block_size) | ((slots >= 0) & (slots < block_size))
    if slots.shape[1] > 1:
        ranked = torch.sort(slots, dim=1).values
        bad[:, 1:] |= (ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)
    return bad
