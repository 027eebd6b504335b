"""Stage 6, the KV write (reshape_and_cache) on torch tensors: each new token's key and value go to its slot.

Same contract as spec.kv_cache.write_kv. CUDA tensors (or CPU tensors with the Triton interpreter on)
run fast.kernels.write_kv; other CPU tensors take one vectorised index_copy_ per cache.

The slot range check that spec performs needs the slot values on the host: on CUDA it costs one
device->host synchronisation per call. The kernel also skips out-of-range slots, so a bad slot can never
write outside the cache even if that check were removed.
"""

from __future__ import annotations

import torch

from fast.runtime import use_triton
from spec.kv_cache import check_kv_shapes
from spec.types import PAD_SLOT_ID

_SLOT_DTYPES = (torch.int32, torch.int64)


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, flat token index -> slot
) -> None:
    check_kv_shapes(key_cache, value_cache, key, value, slot_mapping)
    check_kv_tensors(key_cache, value_cache, key, value, slot_mapping)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    out_of_range = ((slots < 0) & (slots != PAD_SLOT_ID)) | (slots >= num_slots)
    if bool(out_of_range.any()):  # the one host sync of this function (see module docstring)
        raise ValueError(f"write_kv: slot_mapping holds slots outside [0, {num_slots}) other than PAD_SLOT_ID")
    if use_triton(key_cache.device):
        from fast.kernels.write_kv import write_kv_triton  # lazily: the torch path works without Triton

        write_kv_triton(key_cache, value_cache, key, value, slot_mapping)
    else:
        _write_kv_torch(key_cache, key, slots)
        _write_kv_torch(value_cache, value, slots)


def check_kv_tensors(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What torch adds to spec's shape contract: one device, one float dtype, integer slots."""
    tensors = (key_cache, value_cache, key, value, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"write_kv: tensors on several devices: {[str(t.device) for t in tensors]}")
    if len({key_cache.dtype, value_cache.dtype, key.dtype, value.dtype}) != 1:
        raise ValueError(
            f"write_kv: caches and key/value must share a dtype, got {key_cache.dtype}, {value_cache.dtype}, "
            f"{key.dtype}, {value.dtype}"
        )
    if slot_mapping.dtype not in _SLOT_DTYPES:
        raise ValueError(f"write_kv: slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")


def _write_kv_torch(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    new: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slots: torch.Tensor,  # [T] int64, PAD_SLOT_ID for padding
) -> None:
    real = slots != PAD_SLOT_ID
    real_slots, real_new = slots[real], new[real]
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, real_slots, real_new)
    else:  # a strided view (e.g. padded blocks) has no flat slot view: index (block, offset)
        block_size = cache.shape[1]
        cache.index_put_((real_slots // block_size, real_slots % block_size), real_new)
