"""Stage 6, the KV write (reshape_and_cache) on torch tensors: each new token's key and value go to its slot.

Same contract as spec.kv_cache.write_kv (the same inputs accepted and refused: spec.kv_cache.check_kv_inputs,
plus one device for all tensors). CUDA tensors (or CPU tensors with the Triton interpreter on)
run fast.kernels.write_kv; other CPU tensors take one row-copying NumPy assignment per cache (through views
of the same memory), after one min/max pass over the slots that both checks their range and tells whether
any token is padding (only then are the real tokens selected, once for both caches).

The slot range check that spec performs needs the slot values on the host: on CUDA it costs one
device->host synchronisation per call. The kernel also skips out-of-range slots, so a bad slot can never
write outside the cache even if that check were removed.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.runtime import use_triton
from spec.kv_cache import check_kv_inputs
from spec.types import PAD_SLOT_ID


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, flat token index -> slot
) -> None:
    check_kv_inputs(key_cache, value_cache, key, value, slot_mapping)
    check_kv_tensors(key_cache, value_cache, key, value, slot_mapping)
    if not use_triton(key_cache.device):
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
    write_kv_triton(key_cache, value_cache, key, value, slot_mapping.contiguous())


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
