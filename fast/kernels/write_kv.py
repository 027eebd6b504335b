"""reshape_and_cache: copy each token's key and value into its slot of the paged KV cache.

One program per (token, tile of KV heads). Slots are int64 throughout: num_blocks * block_size, and
so the element offset of a slot, may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel

# bytes of key (and as many of value) one program moves: 32 KV heads x 128 float32 lanes in one program took
# 80 registers a thread (tests/test_kernel_compile.py); 8 KiB keeps every dtype within 64
_MAX_TILE_BYTES = 8192


def head_tile(num_kv_heads: int, head_dim: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D): KV heads per program (a power of two) and padded head_dim."""
    block_d = triton.next_power_of_2(head_dim)
    return min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE_BYTES // (block_d * element_size))), block_d


def write_kv_triton(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32), flat token index -> slot
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:  # an empty step (say, one that only finishes requests); its strides mean nothing
        return
    _check_launch(key_cache, value_cache, key, value, slot_mapping)
    block_h, block_d = head_tile(num_kv_heads, head_dim, key.element_size())
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key_cache, value_cache, key, value, slot_mapping,
        num_blocks * block_size, block_size, num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def _check_launch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What the kernel's addressing assumes; fast.kv_cache.write_kv arranges all of it for its callers."""
    num_tokens = key.shape[0]
    if key_cache.ndim != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"write_kv: key_cache {tuple(key_cache.shape)} and value_cache must share a 4-d shape")
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(f"write_kv: key/value {tuple(key.shape)} do not match key_cache {tuple(key_cache.shape)}")
    if tuple(slot_mapping.shape) != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be [{num_tokens}] int32 or int64, got {slot_mapping.dtype}")
    if not key_cache.dtype == value_cache.dtype == key.dtype == value.dtype:
        raise ValueError("write_kv: key_cache, value_cache, key and value must share a dtype")
    if key_cache.stride() != value_cache.stride():  # one set of strides addresses both caches
        raise ValueError(f"write_kv: value_cache strides {value_cache.stride()} differ from key_cache's")
    # the head_dim axis is addressed without a stride, so that loads and stores vectorise
    for name, stride in (
        ("key_cache", key_cache.stride(3)), ("key", key.stride(2)), ("value", value.stride(2)),
        ("slot_mapping", slot_mapping.stride(0)),
    ):  # fmt: skip
        if stride != 1:
            raise ValueError(f"write_kv: {name} must have stride 1 along its last axis, got {stride}")


@kernel
def _write_kv_kernel(
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] flat token index -> slot, PAD_SLOT_ID (-1) for padding
    num_slots,  # num_blocks * block_size (Triton passes it as int64 when it exceeds int32)
    block_size,
    num_kv_heads,
    head_dim,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_b,  # per physical block
    cache_stride_o,  # per offset within a block
    cache_stride_h,  # per KV head
    BLOCK_H: tl.constexpr,  # KV heads per program, a power of two
    BLOCK_D: tl.constexpr,  # next_power_of_2(head_dim): lanes past head_dim are masked
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # PAD_SLOT_ID and anything else outside the cache: never write (the launcher's caller rejects the latter)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size  # int64: slot may exceed 2**31
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    cache_off = block * cache_stride_b + offset * cache_stride_o + heads[:, None] * cache_stride_h + dims[None, :]
    k = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_off, k, mask=mask)
    tl.store(value_cache_ptr + cache_off, v, mask=mask)
