"""reshape_and_cache: copy each token's key and value into its slot of the paged KV cache.

One program per (token, tile of KV heads, key or value). Slots are int64 throughout: num_blocks *
block_size, and so the element offset of a slot, may exceed 2**31.

fp8 caches (FP8_MANTISSA > 0): the caches are uint8 codes; each element is divided by its KV head's scale in
float32 (tl.math.div_rn: IEEE division, as spec's float32 `/`; Triton's plain `/` may be approximate) and
encoded as spec.fp8.encode does (round to nearest even, saturation, NaN -> sign | 0x7f), in integer
arithmetic on the float32 bits: the same codes compiled and under the interpreter, on every GPU (Triton's
own float8 conversions need sm_89 or later and have no interpreter counterpart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel
from spec.fp8 import Fp8Format

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
    *,
    fmt: Fp8Format | None = None,  # an fp8 cache of uint8 codes, or None: the caches hold key's dtype
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] float32, for an fp8 cache
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    if num_tokens == 0:  # an empty step (say, one that only finishes requests); its strides mean nothing
        return
    _check_launch(key_cache, value_cache, key, value, slot_mapping, fmt, k_scale, v_scale)
    block_h, block_d = head_tile(num_kv_heads, head_dim, key.element_size())
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h), 2)
    _write_kv_kernel[grid](
        key_cache, value_cache, key, value, slot_mapping,
        key if k_scale is None else k_scale, value if v_scale is None else v_scale,  # unread without fp8
        num_blocks * block_size, block_size, num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
        FP8_MANTISSA=0 if fmt is None else fmt.mantissa_bits, FP8_BIAS=0 if fmt is None else fmt.bias,
        FP8_MAX_CODE=0 if fmt is None else fmt.max_code,
    )  # fmt: skip


def _check_launch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Fp8Format | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """What the kernel's addressing assumes; fast.kv_cache.write_kv arranges all of it for its callers."""
    num_tokens = key.shape[0]
    if key_cache.ndim != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"write_kv: key_cache {tuple(key_cache.shape)} and value_cache must share a 4-d shape")
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(f"write_kv: key/value {tuple(key.shape)} do not match key_cache {tuple(key_cache.shape)}")
    if tuple(slot_mapping.shape) != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be [{num_tokens}] int32 or int64, got {slot_mapping.dtype}")
    if fmt is None and not key_cache.dtype == value_cache.dtype == key.dtype == value.dtype:
        raise ValueError("write_kv: key_cache, value_cache, key and value must share a dtype")
    if fmt is not None:
        if not key_cache.dtype == value_cache.dtype == torch.uint8 or key.dtype != value.dtype:
            raise ValueError("write_kv: an fp8 cache is uint8 codes, written from key and value of one dtype")
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None or tuple(scale.shape) != (key.shape[1],) or scale.dtype != torch.float32:
                raise ValueError(f"write_kv: {name} must be [{key.shape[1]}] float32 for an fp8 cache")
            if scale.stride(0) != 1:
                raise ValueError(f"write_kv: {name} must have stride 1, got {scale.stride(0)}")
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
    k_scale_ptr,  # [num_kv_heads] float32, read only for an fp8 cache
    v_scale_ptr,  # [num_kv_heads] float32, read only for an fp8 cache
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
    FP8_MANTISSA: tl.constexpr,  # 0: the caches hold key's dtype; 3 (e4m3) or 2 (e5m2): uint8 codes
    FP8_BIAS: tl.constexpr,  # the format's exponent bias (7, 15)
    FP8_MAX_CODE: tl.constexpr,  # its largest finite positive code (0x7e, 0x7b)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # PAD_SLOT_ID and anything else outside the cache: never write (the launcher's caller rejects the latter)
    if (slot < 0) | (slot >= num_slots):
        return
    if tl.program_id(2) == 0:  # this program's tensor: the key, or the value
        src_ptr, cache_ptr, scale_ptr, src_stride_t, src_stride_h = (
            key_ptr,
            key_cache_ptr,
            k_scale_ptr,
            key_stride_t,
            key_stride_h,
        )
    else:
        src_ptr, cache_ptr, scale_ptr, src_stride_t, src_stride_h = (
            value_ptr,
            value_cache_ptr,
            v_scale_ptr,
            value_stride_t,
            value_stride_h,
        )
    block = slot // block_size  # int64: slot may exceed 2**31
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]
    cache_off = block * cache_stride_b + offset * cache_stride_o + heads[:, None] * cache_stride_h + dims[None, :]
    x = tl.load(src_ptr + token * src_stride_t + heads[:, None] * src_stride_h + dims[None, :], mask=mask)
    if FP8_MANTISSA == 0:
        tl.store(cache_ptr + cache_off, x, mask=mask)
    else:
        scale = tl.load(scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)  # [BLOCK_H]
        scaled = tl.math.div_rn(x.to(tl.float32), scale[:, None])  # [BLOCK_H, BLOCK_D]
        bits = scaled.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF  # |scaled|'s bits: ordered like the magnitudes
        # normal: round the float32 mantissa to FP8_MANTISSA bits (to nearest, ties to even), rebias the exponent
        low = 23 - FP8_MANTISSA
        rounded = a + ((1 << (low - 1)) - 1) + ((a >> low) & 1)
        normal = (rounded >> low) - ((127 - FP8_BIAS) << FP8_MANTISSA)
        # subnormal (below 2**(1 - bias)): the number of quanta 2**(1 - bias - mantissa), rounded to nearest even
        exponent = a >> 23
        mantissa = (a & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
        shift = tl.minimum(tl.maximum(151 - FP8_BIAS - FP8_MANTISSA - exponent, 1), 31)
        quanta = mantissa >> shift
        rest = mantissa - (quanta << shift)
        half = 1 << (shift - 1)
        subnormal = quanta + ((rest > half) | ((rest == half) & ((quanta & 1) == 1))).to(tl.int32)
        max_bits = ((127 + (FP8_MAX_CODE >> FP8_MANTISSA) - FP8_BIAS) << 23) | (
            (FP8_MAX_CODE & ((1 << FP8_MANTISSA) - 1)) << low
        )  # the largest finite value's float32 bits
        code = tl.where(a < ((128 - FP8_BIAS) << 23), subnormal, normal)
        code = tl.where(a >= max_bits, FP8_MAX_CODE, code)  # saturation, inf included
        code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
        tl.store(cache_ptr + cache_off, (code | sign).to(tl.uint8), mask=mask)
