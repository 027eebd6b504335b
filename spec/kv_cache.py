"""Stage 6, the KV write (reshape_and_cache): each new token's key and value go to its slot.

Cache layout per group: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is offset s % block_size
of block s // block_size. PAD_SLOT_ID tokens are skipped. The caches are written in place, whatever their
strides (a view such as `cache[:, :2]`, whose block and offset axes cannot be merged, included).

Input contract, shared by every backend (check_kv_inputs; each raises ValueError naming the argument):
caches 4-d, one shape; key/value [T, num_kv_heads, head_dim]; slot_mapping [T] int32 or int64; one float
dtype for all four; key_cache and value_cache laid out alike (same strides, head_dim contiguous), as every
paged-KV kernel addresses both with one set of strides.

fp8 caches (spec.fp8; vLLM's `kv_cache_dtype`): with kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2" the
caches hold uint8 codes and slot s of KV head h receives `encode(float32(key) / k_scale[h])` (the division
in float32, rounded to nearest, as vLLM's `float(x) / scale`; encode rounds to nearest even and saturates).
k_scale and v_scale are one positive finite float32 (per tensor: a number, or an array of 1 value) or
num_kv_heads of them (per KV head). key and value are then float16, bfloat16 or float32, one dtype.
With "auto" (the default) the caches hold key/value's own float dtype, copied bit for bit, and the scales
must be 1. Each violation raises ValueError naming the argument (check_kv_inputs, check_kv_scales).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from spec.fp8 import Fp8Format, cache_format, encode
from spec.types import PAD_SLOT_ID

SLOT_DTYPES = ("int32", "int64")
FP8_SOURCE_DTYPES = ("float16", "bfloat16", "float32")  # what an fp8 cache is written from (and read into)


def write_kv(
    key_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: np.ndarray,  # [T, num_kv_heads, head_dim]
    value: np.ndarray,  # [T, num_kv_heads, head_dim]
    slot_mapping: np.ndarray,  # [T] int64, flat token index -> slot
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float | np.ndarray = 1.0,  # one value, or [num_kv_heads]
    v_scale: float | np.ndarray = 1.0,
) -> None:
    fmt = check_kv_inputs(key_cache, value_cache, key, value, slot_mapping, kv_cache_dtype=kv_cache_dtype)
    k_scales, v_scales = check_kv_scales("write_kv", fmt, k_scale, v_scale, key_cache.shape[2])  # [num_kv_heads]
    if fmt is not None:
        key, value = quantize(key, k_scales, fmt), quantize(value, v_scales, fmt)  # [T, num_kv_heads, head_dim]
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


def quantize(
    x: np.ndarray,  # [T, num_kv_heads, head_dim] float16 or float32
    scales: np.ndarray,  # [num_kv_heads] float32
    fmt: Fp8Format,
) -> np.ndarray:  # [T, num_kv_heads, head_dim] uint8 codes
    with np.errstate(over="ignore"):  # a quotient past float32's range is inf, and saturates
        return encode(x.astype(np.float32) / scales[None, :, None], fmt)  # float32 / float32: IEEE, nearest


def check_kv_inputs(
    key_cache: Any, value_cache: Any, key: Any, value: Any, slot_mapping: Any, *, kv_cache_dtype: Any = "auto"
) -> Fp8Format | None:
    """The input contract of write_kv (module docstring), for NumPy arrays and torch tensors alike.

    Returns the cache's fp8 format (None for "auto"); the scales are checked by check_kv_scales.
    """
    fmt = cache_format(kv_cache_dtype, "write_kv")
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
    if fmt is not None:
        check_fp8_caches("write_kv", fmt, kv_cache_dtype, key_cache, value_cache)
        if dtype_name(key.dtype) not in FP8_SOURCE_DTYPES or value.dtype != key.dtype:
            raise ValueError(
                f"write_kv: key and value must share one of {FP8_SOURCE_DTYPES} for an fp8 cache, got "
                f"{dtype_name(key.dtype)} and {dtype_name(value.dtype)}"
            )
        check_cache_layout("write_kv", key_cache, value_cache)
        return fmt
    for name, x in (("value_cache", value_cache), ("key", key), ("value", value)):
        if x.dtype != key_cache.dtype:
            raise ValueError(f"write_kv: {name} is {dtype_name(x.dtype)}, key_cache {dtype_name(key_cache.dtype)}")
    if not is_float(key_cache.dtype):
        raise ValueError(f"write_kv: key_cache must hold floats, got {dtype_name(key_cache.dtype)}")
    check_cache_layout("write_kv", key_cache, value_cache)
    return None


def fp8_cache_dtypes(fmt: Fp8Format) -> tuple[str, ...]:
    """What an fp8 cache may be: uint8 codes (NumPy, and vLLM's caches), or torch's float8 dtype of the format."""
    return ("uint8", "float8_e4m3fn" if fmt.name == "e4m3" else "float8_e5m2")


def check_fp8_caches(function: str, fmt: Fp8Format, kv_cache_dtype: str, key_cache: Any, value_cache: Any) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if dtype_name(cache.dtype) not in fp8_cache_dtypes(fmt):
            raise ValueError(
                f"{function}: {name} must be one of {fp8_cache_dtypes(fmt)} for kv_cache_dtype={kv_cache_dtype!r}, "
                f"got {dtype_name(cache.dtype)}"
            )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"{function}: value_cache is {dtype_name(value_cache.dtype)}, key_cache {dtype_name(key_cache.dtype)}"
        )


def check_kv_scales(
    function: str, fmt: Fp8Format | None, k_scale: Any, v_scale: Any, num_kv_heads: int
) -> tuple[np.ndarray, np.ndarray]:  # ([num_kv_heads] float32, [num_kv_heads] float32)
    """k_scale and v_scale as num_kv_heads float32 values each, after the checks of the module docstring.

    A scale may be a real number, or a NumPy array or torch tensor (on any device: it is read on the host)
    of floats, shaped [] or [1] (per tensor) or [num_kv_heads] (per KV head).
    """
    return (
        _scale_values(function, "k_scale", fmt, k_scale, num_kv_heads),
        _scale_values(function, "v_scale", fmt, v_scale, num_kv_heads),
    )


def _scale_values(function: str, name: str, fmt: Fp8Format | None, scale: Any, num_kv_heads: int) -> np.ndarray:
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if scale == 1:  # the default, checked on every call: no array work (a third of a small decode's overhead)
            return np.ones(num_kv_heads, np.float32)
        values = np.full(1, scale, np.float64)  # [1]
    elif hasattr(scale, "shape") and hasattr(scale, "dtype") and not isinstance(scale, numbers.Number):
        if not is_float(scale.dtype):
            raise ValueError(f"{function}: {name} must hold floats, got {dtype_name(scale.dtype)}")
        if tuple(scale.shape) not in ((), (1,), (num_kv_heads,)):
            raise ValueError(
                f"{function}: {name} must be one value or [num_kv_heads={num_kv_heads}], got {tuple(scale.shape)}"
            )
        host = scale.detach().cpu().double().numpy() if hasattr(scale, "detach") else np.asarray(scale, np.float64)
        values = host.reshape(-1)  # [1] or [num_kv_heads]
    else:
        raise ValueError(f"{function}: {name} must be a real number or an array of floats, got {scale!r}")
    with np.errstate(over="ignore"):
        values32 = values.astype(np.float32)  # the precision every backend divides and multiplies in
    if not (np.isfinite(values32) & (values32 > 0)).all():
        raise ValueError(f"{function}: {name} must be finite and > 0 in float32, got {values.tolist()}")
    if fmt is None and not (values32 == 1).all():
        raise ValueError(
            f"{function}: {name} applies to fp8 caches only (kv_cache_dtype 'auto'), got {values.tolist()}"
        )
    return np.broadcast_to(values32, (num_kv_heads,)).copy()


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
