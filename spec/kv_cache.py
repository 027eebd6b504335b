"""Stage 6, the KV write (reshape_and_cache): each new token's key and value go to its slot.

Cache layout per group: [num_blocks, block_size, num_kv_heads, head_dim]; viewed flat, slot s is
row s of [num_blocks * block_size, num_kv_heads, head_dim]. PAD_SLOT_ID tokens are skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spec.types import PAD_SLOT_ID


def write_kv(
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: np.ndarray,  # [T, num_kv_heads, head_dim]
    value: np.ndarray,  # [T, num_kv_heads, head_dim]
    slot_mapping: np.ndarray,  # [T] int64, flat token index -> slot
) -> None:
    check_kv_shapes(key_cache, value_cache, key, value, slot_mapping)
    slots = np.asarray(slot_mapping, np.int64)
    real = slots != PAD_SLOT_ID
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if ((slots[real] < 0) | (slots[real] >= num_slots)).any():
        raise ValueError(f"write_kv: slot_mapping holds slots outside [0, {num_slots}) other than PAD_SLOT_ID")
    flat_k = key_cache.reshape(num_slots, *key_cache.shape[2:])  # a view: caches are contiguous
    flat_v = value_cache.reshape(num_slots, *value_cache.shape[2:])
    flat_k[slots[real]] = key[real]
    flat_v[slots[real]] = value[real]


def check_kv_shapes(key_cache: Any, value_cache: Any, key: Any, value: Any, slot_mapping: Any) -> None:
    """Shape contract of write_kv, shared by every backend."""
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4:
        raise ValueError(f"write_kv: caches must share a 4-d shape, got {key_cache.shape} and {value_cache.shape}")
    if key.shape != value.shape or tuple(key.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(f"write_kv: key/value {tuple(key.shape)} do not match cache {tuple(key_cache.shape)}")
    if tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{key.shape[0]}]")
