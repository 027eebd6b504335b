"""Stage 7 for MLA on torch tensors: the absorbed decode form and the prefill form over the latent cache.

Same contract as spec.mla_attention (spec.mla_attention.check_mla_attention_inputs, plus one device and a dtype
torch computes in: float16, bfloat16 or float32), always accumulated in float32, the output rounded once to the
query's dtype, as spec.attention's flash-attention rule expects of a backend.

The absorbed decode form takes the paths fast's paged attention takes: CUDA tensors (or CPU tensors with the
Triton interpreter on) run fast.kernels.mla_attention, which reads each latent entry once per tile for every
head; other CPU tensors run fast.cpu's paged attention kernels on the cache as it lies, the absorbed form being
multi-query attention with one KV head (_decode_host). Both decode fp8 codes as they load them and apply the one
scale as FlashInfer does (logits times scale * k_scale, output times k_scale), so no dequantized copy is made.

The prefill form runs on torch ops: per batch row the row's latent entries gathered through its block table (fp8
codes decoded by torch's float8 conversion, spec's values, times the scale), up-projected by W_UK and W_UV, then
one masked softmax: a few dense products per row, which torch already runs on either device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from fast.cpu.attention import as_float32, narrowed, paged_attention_cpu
from fast.fp8 import codes, torch_dtype
from fast.runtime import use_triton
from spec.fp8 import Fp8Format
from spec.mla_attention import check_mla_attention_inputs, check_up_projections
from spec.mla_cache import mla_scale

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mla_decode_attention(
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank] q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim] already rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value (per tensor)
) -> torch.Tensor:  # [T, num_heads, kv_lora_rank] in latent space
    fmt = check_mla_attention_inputs(
        "mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    rank = kv_cache.shape[2] - q_pe.shape[2]
    if q_latent.shape[2] != rank:
        raise ValueError(
            f"mla_decode_attention: q_latent {tuple(q_latent.shape)} must be [T, H, kv_lora_rank={rank}] "
            f"(kv_cache {tuple(kv_cache.shape)} less rope_dim {q_pe.shape[2]})"
        )
    k_scale32 = float(mla_scale("mla_decode_attention", fmt, k_scale))
    check_mla_tensors("mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc)
    if use_triton(q_latent.device):
        from fast.kernels.mla_attention import mla_decode_triton  # lazily: the CPU path needs no Triton

        out = torch.zeros_like(q_latent)  # padding rows past the last query stay 0
        mla_decode_triton(
            out, rows_contiguous(q_latent), rows_contiguous(q_pe), codes(kv_cache) if fmt is not None else kv_cache,
            *(t if t.stride(-1) == 1 else t.contiguous() for t in (block_table, seq_lens, query_start_loc)),
            scale=float(scale), fmt=fmt, k_scale=k_scale32,
        )  # fmt: skip
        return out
    return _decode_host(q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc, float(scale), fmt, k_scale32)


def _decode_host(
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    scale: float,
    fmt: Fp8Format | None,
    k_scale: float,
) -> torch.Tensor:  # [T, num_heads, kv_lora_rank]
    """The absorbed form is multi-query attention with one KV head: the key is the whole entry [c, k_pe] and the
    query [q_latent, q_pe], the value is the entry too, of which the output keeps the latent part. So fast's CPU
    paged attention runs it as it lies in the cache (decode rows register-blocked over keys and heads, rows of
    several queries tiled), with the one scale applied as to any fp8 cache: logits times scale * k_scale, output
    times k_scale. The value's RoPE columns cost 64 / 576 of the P.V products, and spare a second kernel."""
    rank = q_latent.shape[2]
    width = kv_cache.shape[2]
    query32 = torch.cat((as_float32(q_latent.detach()), as_float32(q_pe.detach())), dim=2)  # [T, H, L + R]
    # otherwise NumPy's zeros (calloc) rather than torch's parallel fill, as fast.attention does
    out32 = torch.from_numpy(np.zeros(query32.shape, np.float32))  # [T, H, L + R]
    cache = codes(kv_cache) if fmt is not None else kv_cache
    entries = cache.detach().unsqueeze(2)  # [num_blocks, block_size, 1, L + R]: one KV head
    if entries.stride(3) != 1 and width > 1:
        entries = entries.contiguous()
    scales = np.full(1, k_scale, np.float32)  # [1]: the one KV head's
    paged_attention_cpu(
        out32, query32, entries, entries, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=None, softcap=None, fmt=fmt, k_scale=scales, v_scale=scales,
    )  # fmt: skip
    latent = out32[:, :, :rank]  # [T, H, L]: narrowed reads it in place; a float32 result is made contiguous
    return narrowed(latent, q_latent.dtype).contiguous()


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with stride 1 along its last axis, the one the kernel addresses without a stride."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def mla_prefill_attention(
    q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim] already rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    w_uk: torch.Tensor,  # [kv_lora_rank, num_heads, qk_nope_head_dim] latent -> each head's no-RoPE key
    w_uv: torch.Tensor,  # [kv_lora_rank, num_heads, v_head_dim] latent -> each head's value
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value (per tensor)
) -> torch.Tensor:  # [T, num_heads, v_head_dim]
    fmt = check_mla_attention_inputs(
        "mla_prefill_attention", q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    rank = kv_cache.shape[2] - q_pe.shape[2]
    check_up_projections(q_nope, w_uk, w_uv, rank)
    k_scale32 = float(mla_scale("mla_prefill_attention", fmt, k_scale))
    check_mla_tensors(
        "mla_prefill_attention", q_nope, q_pe, kv_cache, w_uk, w_uv, block_table, seq_lens, query_start_loc
    )
    query, q_rope = q_nope.detach().float(), q_pe.detach().float()
    w_k, w_v = w_uk.detach().float(), w_uv.detach().float()
    out = torch.zeros((*q_nope.shape[:2], w_uv.shape[2]), dtype=torch.float32, device=q_nope.device)
    for q_start, q_end, visible, entries in _rows(kv_cache, block_table, seq_lens, query_start_loc, fmt, k_scale32):
        latents, k_pe = entries[:, :rank], entries[:, rank:]  # [k, L], [k, R]
        keys = torch.einsum("kl,lhp->khp", latents, w_k)  # [k, H, P] each head's no-RoPE key
        values = torch.einsum("kl,lhv->khv", latents, w_v)  # [k, H, V]
        logits = torch.einsum("qhp,khp->hqk", query[q_start:q_end], keys)
        logits += torch.einsum("qhr,kr->hqk", q_rope[q_start:q_end], k_pe)  # k_pe: every head's
        out[q_start:q_end] = torch.einsum("hqk,khv->qhv", _softmax(logits * scale, visible), values)
    return out.to(q_nope.dtype)


def _rows(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    fmt: Fp8Format | None,
    k_scale: float,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:  # q range, visible [q, k] bool, entries [k, L + R] f32
    """Per batch row, as spec.mla_attention._rows: the row's query range, its causal mask and its entries."""
    block_size = kv_cache.shape[1]
    cache = codes(kv_cache) if fmt is not None else kv_cache
    seq_lens_host, starts = seq_lens.tolist(), query_start_loc.tolist()  # the one host read of the indices
    for b, seq_len in enumerate(seq_lens_host):
        q_start, q_end = starts[b], starts[b + 1]
        k_pos = torch.arange(seq_len, device=kv_cache.device)  # [k]
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=kv_cache.device)  # [q]
        entries = cache[block_table[b, k_pos // block_size].long(), k_pos % block_size]  # [k, L + R]
        if fmt is not None:  # codes -> values: torch's float8 reading is spec's decode on every code
            entries = entries.view(torch_dtype(fmt)).float() * k_scale
        yield q_start, q_end, k_pos[None, :] <= q_pos[:, None], entries.float()


def _softmax(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:  # [H, q, k] float32
    return torch.softmax(logits.masked_fill(~visible[None], -torch.inf), dim=-1)


def check_mla_tensors(function: str, *tensors: torch.Tensor) -> None:
    """What torch adds to spec's contract: one device, and a float dtype torch computes in."""
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{function}: tensors on several devices: {[str(t.device) for t in tensors]}")
    if tensors[0].dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{function}: query must be one of {_FLOAT_DTYPES}, got {tensors[0].dtype}")
