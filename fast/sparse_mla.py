"""Sparse top-k attention over an MLA latent cache on torch tensors: spec.sparse_mla's functions, same
contract and errors.

Vectorised torch ops on any device, as fast/sparse_attention.py: each query's listed latent entries are gathered
([tokens, top_k, L + R], a chunk of tokens at a time so the gather stays under GATHER_ELEMENTS), fp8 codes decoded
by torch's float8 conversion (spec's values) times the one scale, every head against the one entry (MQA), all in
float32 whatever the input dtype; the output is rounded once to the query's dtype, the LSE stays float32 (as
fast.context_parallel's partials, and vLLM's). The slots' values are checked as one torch mask (one device->host
read); a violation is named by spec's check_topk_slots on a host copy, so both backends raise the same error.
"""

from __future__ import annotations

import torch

from fast.fp8 import codes, torch_dtype
from fast.sparse_attention import GATHER_ELEMENTS, bad_slots
from spec.fp8 import Fp8Format
from spec.mla_cache import mla_scale
from spec.sparse_attention import check_topk_slots
from spec.sparse_mla import check_sparse_mla_inputs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sparse_mla_attention(
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank] q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim] already rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    topk_slots: torch.Tensor,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value (per tensor)
) -> torch.Tensor:  # [T, num_heads, kv_lora_rank] in latent space
    return sparse_mla_attention_state(
        q_latent, q_pe, kv_cache, topk_slots, scale=scale, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale
    )[0]


def sparse_mla_attention_state(
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    topk_slots: torch.Tensor,  # [T, top_k] flat token index -> slots it reads, -1: none
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, num_heads, kv_lora_rank], [T, num_heads] float32 LSE; -inf: empty)
    function = "sparse_mla_attention_state"
    fmt = check_sparse_mla_inputs(function, q_latent, q_pe, kv_cache, topk_slots, scale, kv_cache_dtype)
    k_scale32 = float(mla_scale(function, fmt, k_scale))
    if len({t.device for t in (q_latent, q_pe, kv_cache, topk_slots)}) != 1:
        raise ValueError(f"{function}: q_latent, q_pe, kv_cache and topk_slots must be on one device")
    if q_latent.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{function}: q_latent must be one of {_FLOAT_DTYPES}, got {q_latent.dtype}")
    num_blocks, block_size, width = kv_cache.shape
    slots = topk_slots.to(torch.int64)  # [T, top_k]
    if bool(bad_slots(slots, num_blocks, block_size).any()):  # the one host read of the checks
        check_topk_slots(slots.cpu().numpy(), num_blocks, block_size)
        raise RuntimeError("fast.sparse_mla_attention_state: its check found a violation spec's did not (a bug)")
    num_tokens, num_heads = q_latent.shape[:2]
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q_latent.device)
    if slots.shape[1] == 0:
        return out.to(q_latent.dtype), lse
    cache = codes(kv_cache) if fmt is not None else kv_cache
    chunk = max(1, GATHER_ELEMENTS // (slots.shape[1] * width))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        out[start:end], lse[start:end] = _chunk_state(
            q_latent[start:end], q_pe[start:end], cache, slots[start:end], float(scale), fmt, k_scale32
        )
    return out.to(q_latent.dtype), lse


def _chunk_state(
    q_latent: torch.Tensor,  # [c, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [c, num_heads, rope_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim] floats, or uint8 codes
    slots: torch.Tensor,  # [c, top_k] int64, checked
    scale: float,
    fmt: Fp8Format | None,
    k_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([c, num_heads, kv_lora_rank] float32, [c, num_heads] float32)
    block_size, rank = cache.shape[1], q_latent.shape[2]
    listed = slots >= 0  # [c, top_k]
    safe = torch.where(listed, slots, block_size)  # an unlisted entry reads a real slot, then is masked out
    entries = cache[safe // block_size, safe % block_size]  # [c, top_k, L + R]
    if fmt is not None:  # codes -> values: torch's float8 reading is spec's decode on every code
        entries = entries.view(torch_dtype(fmt)).float() * k_scale
    entries = entries.float()
    latents, k_pe = entries[..., :rank], entries[..., rank:]  # [c, top_k, L], [c, top_k, R]
    logits = torch.einsum("chl,ckl->chk", q_latent.float(), latents)
    logits = (logits + torch.einsum("chr,ckr->chk", q_pe.float(), k_pe)) * scale  # [c, num_heads, top_k]
    logits = logits.masked_fill(~listed[:, None, :], float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    shift = torch.where(peak == float("-inf"), 0.0, peak)  # an empty row: exp(-inf - 0) = 0, not NaN
    weights = torch.exp(logits - shift)
    total = weights.sum(dim=-1, keepdim=True)
    safe_total = torch.where(total > 0, total, 1.0)
    out = torch.einsum("chk,ckl->chl", weights / safe_total, latents)
    lse = torch.where(total > 0, shift + torch.log(safe_total), float("-inf"))[..., 0]
    return out, lse
