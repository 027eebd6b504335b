"""Stage 6, the KV write (reshape_and_cache) on torch tensors: each new token's key and value go to its slot.

Same contract as spec.kv_cache.write_kv (the same inputs accepted and refused: spec.kv_cache.check_kv_inputs,
plus one device for all tensors). CUDA tensors (or CPU tensors with the Triton interpreter on)
run fast.kernels.write_kv; other CPU tensors take one row-copying NumPy assignment per cache (through views
of the same memory), after one min/max pass over the slots that both checks their range and tells whether
any token is padding (only then are the real tokens selected, once for both caches).

The slot range check that spec performs needs the slot values on the host: on CUDA it costs one
device->host synchronisation per call. The kernel also skips out-of-range slots, so a bad slot can never
write outside the cache even if that check were removed.

fp8 caches (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2", spec.kv_cache): the caches are uint8 codes or
torch's float8 dtype of the format (fast.fp8), written through a uint8 view. The Triton kernel quantizes
each element (float32 division by the KV head's scale, then spec's encode in integer arithmetic); the CPU
path quantizes with torch's float8 conversion (fast.fp8.quantize) and scatters the codes like any cache.
The scales are checked on the host (spec.kv_cache.check_kv_scales): a scale given as a CUDA tensor costs
one more device->host copy per call.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.fp8 import codes, quantize, scale_tensor
from fast.runtime import use_triton
from spec.kv_cache import check_kv_inputs, check_kv_scales
from spec.types import PAD_SLOT_ID


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, flat token index -> slot
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value, or [num_kv_heads]
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    fmt = check_kv_inputs(key_cache, value_cache, key, value, slot_mapping, kv_cache_dtype=kv_cache_dtype)
    k_values, v_values = check_kv_scales("write_kv", fmt, k_scale, v_scale, key_cache.shape[2])  # [num_kv_heads]
    check_kv_tensors(key_cache, value_cache, key, value, slot_mapping)
    k_scales = v_scales = None  # [num_kv_heads] float32 on the device, for an fp8 cache
    if fmt is not None:
        key_cache, value_cache = codes(key_cache), codes(value_cache)
        k_scales, v_scales = scale_tensor(k_values, key.device), scale_tensor(v_values, key.device)
    if not use_triton(key_cache.device):
        if fmt is not None and k_scales is not None and v_scales is not None:
            key, value = quantize(key, k_scales, fmt), quantize(value, v_scales, fmt)
        _write_kv_torch(key_cache, value_cache, key, value, slot_mapping)
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    out_of_range = ((slots < 0) & (slots != PAD_SLOT_ID)) | (slots >= num_slots)
    if bool(out_of_range.any()):  # the one host sync of this function (see module docstring)
        raise _out_of_range(num_slots)
    from fast.kernels.write_kv import write_kv_triton  # lazily: the torch path works without Triton

    # the kernel reads head_dim without a stride; spec takes any layout of the (small) new keys and values
    key, value = (x if x.stride(2) == 1 else x.contiguous() for x in (key, value))
    write_kv_triton(key_cache, value_cache, key, value, slot_mapping.contiguous(), fmt=fmt, k_scale=k_scales,
                    v_scale=v_scales)  # fmt: skip


def check_kv_tensors(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What torch adds to spec's contract: one device."""
    tensors = (key_cache, value_cache, key, value, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"write_kv: tensors on several devices: {[str(t.device) for t in tensors]}")


def _write_kv_torch(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64 or int32, PAD_SLOT_ID for padding
) -> None:
    """Checks, then writes both caches through NumPy views of the same memory.

    NumPy's fancy assignment copies whole rows (4-5x faster on CPU than torch's index_copy_, which indexes
    element by element), bit for bit. The mask of real tokens is computed once, and only when needed.
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.numpy()  # [T]
    if slots.shape[0] == 0:
        return
    new_keys, new_values = _bits(key), _bits(value)  # [T, num_kv_heads, head_dim]
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:  # padding, anywhere (the tail is not promised)
        real = np.flatnonzero(slots != PAD_SLOT_ID)  # [num_real] token indices
        slots = slots[real]
        if slots.shape[0] and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
            raise _out_of_range(num_slots)  # before any write: the caches stay unchanged
        new_keys, new_values = new_keys[real], new_values[real]
    _scatter(_bits(key_cache), new_keys, slots)
    _scatter(_bits(value_cache), new_values, slots)


def _scatter(
    cache: np.ndarray,  # [num_blocks, block_size, num_kv_heads, head_dim], a view of the cache, written in place
    new: np.ndarray,  # [n, num_kv_heads, head_dim]
    slots: np.ndarray,  # [n], all inside the cache
) -> None:
    num_blocks, block_size = cache.shape[:2]
    if cache.flags.c_contiguous:  # rows of num_kv_heads * head_dim: one memcpy per token
        row = cache.shape[2] * cache.shape[3]  # spelled out: reshape cannot infer -1 for zero tokens
        cache.reshape(num_blocks * block_size, row)[slots] = new.reshape(new.shape[0], row)
    else:  # a strided view (e.g. padded blocks) has no flat slot view: index (block, offset)
        cache[slots // block_size, slots % block_size] = new


def _bits(x: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (same shape and strides); bfloat16, which NumPy lacks, as int16 bits."""
    if x.requires_grad:
        x = x.detach()
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def _out_of_range(num_slots: int) -> ValueError:
    return ValueError(f"write_kv: slot_mapping holds slots outside [0, {num_slots}) other than PAD_SLOT_ID")
