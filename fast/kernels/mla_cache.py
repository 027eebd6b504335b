"""concat_and_cache_mla: each token's latent kv_c and RoPE part k_pe, side by side in its slot of the latent cache.

One program per token. Slots are int64 throughout (num_blocks * block_size may exceed 2**31). The kernel
copies elements of the cache's own dtype: for an fp8 cache the launcher (fast.mla_cache) hands it uint8 codes
already encoded (fast.fp8.quantize, spec's codes), so the copy is the same for every cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel


def write_mla_kv_triton(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim], written in place
    kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank] of the cache's dtype (uint8 codes for fp8), last axis stride 1
    k_pe: torch.Tensor,  # [num_tokens, rope_dim] of the cache's dtype, last axis stride 1
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), flat token index -> slot, stride 1
) -> None:
    num_blocks, block_size, width = kv_cache.shape
    num_tokens, rank = kv_c.shape
    if num_tokens == 0:  # nothing to write; the strides of an empty tensor mean nothing
        return
    if kv_cache.stride(2) != 1 or slot_mapping.stride(0) != 1 or (rank > 1 and kv_c.stride(1) != 1):
        raise ValueError("write_mla_kv: the kernel needs the cache entries, kv_c rows and slot_mapping contiguous")
    if k_pe.shape[1] > 1 and k_pe.stride(1) != 1:
        raise ValueError("write_mla_kv: the kernel needs k_pe's rows contiguous")
    if not kv_cache.dtype == kv_c.dtype == k_pe.dtype:
        raise ValueError(f"write_mla_kv: the kernel copies: kv_cache, kv_c, k_pe must share a dtype, got "
                         f"{kv_cache.dtype}, {kv_c.dtype}, {k_pe.dtype}")  # fmt: skip
    _write_mla_kv_kernel[(num_tokens,)](
        kv_cache, kv_c, k_pe, slot_mapping,
        num_blocks * block_size, block_size, rank, width - rank,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        BLOCK_L=triton.next_power_of_2(rank), BLOCK_R=triton.next_power_of_2(max(width - rank, 1)),
    )  # fmt: skip


@kernel
def _write_mla_kv_kernel(
    kv_cache_ptr,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    kv_c_ptr,  # [num_tokens, kv_lora_rank]
    k_pe_ptr,  # [num_tokens, rope_dim]
    slot_mapping_ptr,  # [num_tokens] flat token index -> slot, PAD_SLOT_ID (-1) for padding
    num_slots,  # num_blocks * block_size
    block_size,
    rank,  # kv_lora_rank
    rope_dim,
    kv_c_stride_t,
    k_pe_stride_t,
    cache_stride_b,  # per physical block
    cache_stride_o,  # per offset within a block
    BLOCK_L: tl.constexpr,  # next_power_of_2(kv_lora_rank)
    BLOCK_R: tl.constexpr,  # next_power_of_2(rope_dim), at least 1
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # PAD_SLOT_ID, and anything outside the cache: never write
        return
    entry = kv_cache_ptr + (slot // block_size) * cache_stride_b + (slot % block_size) * cache_stride_o
    lanes_l = tl.arange(0, BLOCK_L)
    lanes_r = tl.arange(0, BLOCK_R)
    latent = tl.load(kv_c_ptr + token * kv_c_stride_t + lanes_l, mask=lanes_l < rank)
    rope = tl.load(k_pe_ptr + token * k_pe_stride_t + lanes_r, mask=lanes_r < rope_dim)
    tl.store(entry + lanes_l, latent, mask=lanes_l < rank)  # the latent first, then the RoPE part
    tl.store(entry + rank + lanes_r, rope, mask=lanes_r < rope_dim)
