"""Stage 6 for multi-head latent attention (MLA): each new token's latent vector goes to its slot.

DeepSeek-V2/V3/R1 and Kimi K2 cache one vector per token and layer instead of per-head keys and values: the
normalized latent `kv_c` (kv_lora_rank wide; every head's key and value are up-projections of it) and the
decoupled RoPE key part `k_pe` (qk_rope_head_dim wide, shared by every head). An mla group's cache
(KVCacheGroup(kind="mla"), `mla_cache_shape`) is `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`:
no head axis, no separate value cache. Its slots are an attention group's (`slot = block * block_size +
offset`, the same table rules): the group kind changes what a slot holds, not which slot a token takes.

write_mla_kv is vLLM's `concat_and_cache_mla`: token t's entry at slot `slot_mapping[t]` is `kv_c[t]` in
its first kv_lora_rank elements and `k_pe[t]` in the last qk_rope_head_dim; PAD_SLOT_ID tokens are skipped.
Rotation is the model's: k_pe arrives already rotated by RoPE at the token's position (vLLM's MLA layer
applies rotary_emb to q_pe and k_pe before the write), kv_c is never rotated, and the write copies both as
given. The cache is written in place through (block, offset) indexing, whatever its strides.

fp8 caches (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2", spec/fp8.py), as vLLM's fp8 MLA cache: one
scale for the whole entry (per tensor: vLLM passes the layer's k_scale; there is no head to scale apart), and
each element, latent and RoPE part alike, is stored as `encode(float32(x) / k_scale)`. kv_c and k_pe are then
float16, bfloat16 or float32, one dtype. With "auto" the cache holds kv_c's own float dtype, copied bit for
bit, and k_scale must be 1.

Input contract, shared by every backend (check_mla_kv_inputs; each violation a ValueError naming the
argument, nothing written): kv_cache 3-d (a 4-d cache with a head axis is an attention cache, refused);
kv_c [T, kv_lora_rank] with kv_lora_rank >= 1, k_pe [T, rope_dim] with rope_dim even (0 allowed);
kv_cache's last axis kv_lora_rank + rope_dim, contiguous; slot_mapping [T] int32 or int64 whose real slots
are inside the cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.fp8 import Fp8Format, cache_format, encode
from spec.kv_cache import (
    FP8_SOURCE_DTYPES,
    SLOT_DTYPES,
    check_kv_scales,
    dtype_name,
    element_strides,
    fp8_cache_dtypes,
    is_float,
)
from spec.types import PAD_SLOT_ID, KVCacheGroup


def write_mla_kv(
    kv_cache: np.ndarray,  # [num_blocks, block_size, kv_lora_rank + rope_dim], written in place
    kv_c: np.ndarray,  # [T, kv_lora_rank] the normalized latent, not rotated
    k_pe: np.ndarray,  # [T, rope_dim] the RoPE key part, already rotated by the model
    slot_mapping: np.ndarray,  # [T] int64, flat token index -> slot
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value for the whole entry (per tensor)
) -> None:
    fmt = check_mla_kv_inputs(kv_cache, kv_c, k_pe, slot_mapping, kv_cache_dtype=kv_cache_dtype)
    scale = mla_scale("write_mla_kv", fmt, k_scale)  # float32
    entries = np.concatenate([kv_c, k_pe], axis=1)  # [T, kv_lora_rank + rope_dim], latent first
    if fmt is not None:
        with np.errstate(over="ignore"):  # a quotient past float32's range is inf, and saturates
            entries = encode(entries.astype(np.float32) / scale, fmt)  # float32 / float32: IEEE, nearest
    slots = np.asarray(slot_mapping, np.int64)
    real = slots != PAD_SLOT_ID
    num_blocks, block_size = kv_cache.shape[:2]
    if ((slots[real] < 0) | (slots[real] >= num_blocks * block_size)).any():
        raise ValueError(
            f"write_mla_kv: slot_mapping holds slots outside [0, {num_blocks * block_size}) other than PAD_SLOT_ID"
        )
    kv_cache[slots[real] // block_size, slots[real] % block_size] = entries[real]


def mla_cache_shape(group: KVCacheGroup) -> tuple[int, int, int]:
    """The cache an mla group's layers each hold: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
    if group.kind != "mla":
        raise ValueError(f"mla_cache_shape: group must be an mla group, got kind={group.kind!r}")
    return (group.num_blocks, group.block_size, group.latent_width)


def mla_scale(function: str, fmt: Fp8Format | None, k_scale: Any) -> np.float32:
    """k_scale as one float32 (spec.kv_cache's scale rules with one head: a number, or an array of 1 float)."""
    scales, _ = check_kv_scales(function, fmt, k_scale, 1.0, 1)  # [1]
    return scales[0]


def check_mla_kv_inputs(
    kv_cache: Any, kv_c: Any, k_pe: Any, slot_mapping: Any, *, kv_cache_dtype: Any
) -> Fp8Format | None:
    """The input contract of write_mla_kv (module docstring), for NumPy arrays and torch tensors alike.

    Returns the cache's fp8 format (None for "auto"); the scale is checked by mla_scale.
    """
    fmt = cache_format(kv_cache_dtype, "write_mla_kv")
    check_latent_cache("write_mla_kv", kv_cache)
    if kv_c.ndim != 2 or kv_c.shape[1] < 1:
        raise ValueError(f"write_mla_kv: kv_c {tuple(kv_c.shape)} must be [T, kv_lora_rank >= 1]")
    if k_pe.ndim != 2 or k_pe.shape[0] != kv_c.shape[0] or k_pe.shape[1] % 2:
        raise ValueError(f"write_mla_kv: k_pe {tuple(k_pe.shape)} must be [{kv_c.shape[0]}, even rope_dim]")
    if kv_cache.shape[2] != kv_c.shape[1] + k_pe.shape[1]:
        raise ValueError(
            f"write_mla_kv: kv_cache entries are {kv_cache.shape[2]} wide, kv_c and k_pe give "
            f"{kv_c.shape[1]} + {k_pe.shape[1]}"
        )
    if tuple(slot_mapping.shape) != (kv_c.shape[0],):
        raise ValueError(f"write_mla_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{kv_c.shape[0]}]")
    if dtype_name(slot_mapping.dtype) not in SLOT_DTYPES:
        raise ValueError(f"write_mla_kv: slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    if k_pe.dtype != kv_c.dtype:
        raise ValueError(f"write_mla_kv: k_pe is {dtype_name(k_pe.dtype)}, kv_c {dtype_name(kv_c.dtype)}")
    check_cache_dtype("write_mla_kv", fmt, kv_cache_dtype, kv_cache, kv_c, "kv_c")
    if fmt is not None and dtype_name(kv_c.dtype) not in FP8_SOURCE_DTYPES:
        raise ValueError(
            f"write_mla_kv: kv_c must be one of {FP8_SOURCE_DTYPES} for an fp8 cache, got {dtype_name(kv_c.dtype)}"
        )
    return fmt


def check_latent_cache(function: str, kv_cache: Any) -> None:
    """A latent cache: 3-d (no head axis), entries contiguous (what every MLA kernel addresses)."""
    if kv_cache.ndim != 3:
        raise ValueError(
            f"{function}: kv_cache {tuple(kv_cache.shape)} must be [num_blocks, block_size, kv_lora_rank + "
            "rope_dim]: an MLA cache has no head axis"
        )
    if kv_cache.shape[2] > 1 and element_strides(kv_cache)[2] != 1:
        raise ValueError(
            f"{function}: kv_cache must be contiguous along its entries, strides {element_strides(kv_cache)}"
        )


def check_cache_dtype(
    function: str, fmt: Fp8Format | None, kv_cache_dtype: str, kv_cache: Any, x: Any, name: str
) -> None:
    """An fp8 cache holds the format's codes; an "auto" cache holds floats of `x`'s dtype."""
    if fmt is not None:
        if dtype_name(kv_cache.dtype) not in fp8_cache_dtypes(fmt):
            raise ValueError(
                f"{function}: kv_cache must be one of {fp8_cache_dtypes(fmt)} for kv_cache_dtype={kv_cache_dtype!r}, "
                f"got {dtype_name(kv_cache.dtype)}"
            )
        return
    if not is_float(kv_cache.dtype):
        raise ValueError(f"{function}: kv_cache must hold floats, got {dtype_name(kv_cache.dtype)}")
    if x.dtype != kv_cache.dtype:
        raise ValueError(f"{function}: {name} is {dtype_name(x.dtype)}, kv_cache {dtype_name(kv_cache.dtype)}")
