"""Stage 6, the KV write (reshape_and_cache): each new token's key and value go to its slot.

Cache layout per group: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is offset s % block_size
of block s // block_size. PAD_SLOT_ID tokens are skipped. The caches are written in place, whatever their
strides (a view such as `cache[:, :2]`, whose block and offset axes cannot be merged, included).

Input contract, shared by every backend (check_kv_inputs; each raises ValueError naming the argument):
caches 4-d, one shape; key/value [T, num_kv_heads, head_dim]; slot_mapping [T] int32 or int64; one float
dtype for all four; key_cache and value_cache laid out alike (same strides, head_dim contiguous), as every
paged-KV kernel addresses both with one set of strides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.types import PAD_SLOT_ID

SLOT_DTYPES = ("int32", "int64")


def write_kv(
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: np.ndarray,  # [T, num_kv_heads, head_dim]
    value: np.ndarray,  # [T, num_kv_heads, head_dim]
    slot_mapping: np.ndarray,  # [T] int64, flat token index -> slot
) -> None:
    check_kv_inputs(key_cache, value_cache, key, value, slot_mapping)
    slots = np.asarray(slot_mapping, np.int64)
    real = slots != PAD_SLOT_ID
    num_blocks, block_size = key_cache.shape[:2]
    if ((slots[real] < 0) | (slots[real] >= num_blocks * block_size)).any():
        raise ValueError(
            f"write_kv: slot_mapping holds slots outside [0, {num_blocks * block_size}) other than PAD_SLOT_ID"
        )
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    key_cache[blocks, offsets] = key[real]  # (block, offset) indexing writes through any view
    value_cache[blocks, offsets] = value[real]


def check_kv_inputs(key_cache: Any, value_cache: Any, key: Any, value: Any, slot_mapping: Any) -> None:
    """The input contract of write_kv (module docstring), for NumPy arrays and torch tensors alike."""
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"write_kv: key_cache and value_cache must share a 4-d shape, got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}"
        )
    if key.ndim != 3 or key.shape != value.shape or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(
            f"write_kv: key/value {tuple(key.shape)}, {tuple(value.shape)} must be [T, "
            f"{key_cache.shape[2]}, {key_cache.shape[3]}] to match key_cache {tuple(key_cache.shape)}"
        )
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{key.shape[0]}]")
    if dtype_name(slot_mapping.dtype) not in SLOT_DTYPES:
        raise ValueError(f"write_kv: slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    for name, x in (("value_cache", value_cache), ("key", key), ("value", value)):
        if x.dtype != key_cache.dtype:
            raise ValueError(f"write_kv: {name} is {dtype_name(x.dtype)}, key_cache {dtype_name(key_cache.dtype)}")
    if not is_float(key_cache.dtype):
        raise ValueError(f"write_kv: key_cache must hold floats, got {dtype_name(key_cache.dtype)}")
    check_cache_layout("write_kv", key_cache, value_cache)


def check_cache_layout(function: str, key_cache: Any, value_cache: Any) -> None:
    """Both caches addressed with one set of strides, head_dim contiguous (what every paged-KV kernel assumes)."""
    if element_strides(value_cache) != element_strides(key_cache):
        raise ValueError(
            f"{function}: value_cache strides {element_strides(value_cache)} differ from key_cache's "
            f"{element_strides(key_cache)}"
        )
    if key_cache.shape[3] > 1 and element_strides(key_cache)[3] != 1:
        strides = element_strides(key_cache)
        raise ValueError(f"{function}: key_cache must be contiguous along head_dim, strides {strides}")


def element_strides(x: Any) -> tuple[int, ...]:
    """Strides in elements: torch's stride(), NumPy's byte strides divided by the item size."""
    if callable(getattr(x, "stride", None)):
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def is_float(dtype: Any) -> bool:
    floating = getattr(dtype, "is_floating_point", None)  # torch.dtype
    if isinstance(floating, bool):
        return floating
    return np.dtype(dtype).kind == "f"
