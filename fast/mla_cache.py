"""Stage 6 for MLA on torch tensors: each new token's latent entry goes to its slot (vLLM's concat_and_cache_mla).

Same contract as spec.mla_cache.write_mla_kv (spec.mla_cache.check_mla_kv_inputs, plus one device for all
tensors). CUDA tensors (or CPU tensors with the Triton interpreter on) run fast.kernels.mla_cache's kernel:
one program per token, the latent and the RoPE part read from their own rows (kv_c is often a strided slice
of the model's projection output) and stored side by side. Other CPU tensors concatenate, quantize (fp8:
fast.fp8's torch conversion, spec's codes) and scatter with one indexed assignment through the cache's view.

The slot range check needs the slots on the host: on CUDA one device->host synchronisation per call, as
fast.kv_cache.write_kv. The kernel also skips out-of-range slots, so a bad slot never writes outside the cache.
fp8 caches: the entries are quantized first on either path (fast.fp8.quantize: torch's float8 conversion on
the tensors' device, spec's codes) and the codes scattered like any entry.
"""

from __future__ import annotations

import torch

from fast.fp8 import codes, quantize, scale_tensor
from fast.runtime import use_triton
from spec.mla_cache import check_mla_kv_inputs, mla_scale
from spec.types import PAD_SLOT_ID


def write_mla_kv(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim], written in place
    kv_c: torch.Tensor,  # [T, kv_lora_rank] the normalized latent, not rotated
    k_pe: torch.Tensor,  # [T, rope_dim] the RoPE key part, already rotated by the model
    slot_mapping: torch.Tensor,  # [T] int64, flat token index -> slot
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value for the whole entry (per tensor)
) -> None:
    fmt = check_mla_kv_inputs(kv_cache, kv_c, k_pe, slot_mapping, kv_cache_dtype=kv_cache_dtype)
    scale = mla_scale("write_mla_kv", fmt, k_scale)
    tensors = (kv_cache, kv_c, k_pe, slot_mapping)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"write_mla_kv: tensors on several devices: {[str(t.device) for t in tensors]}")
    if fmt is not None:
        kv_cache = codes(kv_cache)
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    slots = slot_mapping.to(torch.int64)  # [T]
    if bool((((slots < 0) & (slots != PAD_SLOT_ID)) | (slots >= num_slots)).any()):  # the one host sync
        raise ValueError(f"write_mla_kv: slot_mapping holds slots outside [0, {num_slots}) other than PAD_SLOT_ID")
    rank = kv_c.shape[1]
    if fmt is not None:  # [T, kv_lora_rank + rope_dim] uint8 codes, latent first
        entries = quantize(torch.cat([kv_c, k_pe], dim=1)[:, None, :], scale_tensor(scale.reshape(1), kv_c.device), fmt)
        kv_c, k_pe = entries[:, 0, :rank], entries[:, 0, rank:]
    if use_triton(kv_cache.device):
        from fast.kernels.mla_cache import write_mla_kv_triton  # lazily: host mode works without Triton

        kv_c, k_pe = (x if x.shape[1] < 2 or x.stride(1) == 1 else x.contiguous() for x in (kv_c, k_pe))
        write_mla_kv_triton(kv_cache, kv_c, k_pe, slot_mapping.contiguous())
        return
    entries = torch.cat([kv_c, k_pe], dim=1)  # [T, kv_lora_rank + rope_dim], latent first
    real = torch.nonzero(slots != PAD_SLOT_ID).flatten()  # [num_real] token indices
    block_size = kv_cache.shape[1]
    with torch.no_grad():  # an engine's cache is a buffer, not a graph leaf
        kv_cache[slots[real] // block_size, slots[real] % block_size] = entries[real]
