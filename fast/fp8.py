"""spec.fp8 on torch tensors: fp8 KV-cache codes, quantized with torch's float8 conversions (the kernels decode
as they load).

An fp8 cache is given to fast either as uint8 codes (vLLM's caches, and what NumPy can hold) or as a tensor
of torch's float8 dtype of the format (float8_e4m3fn for "fp8" / "fp8_e4m3", float8_e5m2 for "fp8_e5m2");
the kernels read and write both through a uint8 view of the same memory.

torch's conversions are spec's encode and decode bit for bit except for one documented case (spec/fp8.py):
torch's float8_e5m2 conversion overflows to inf where spec saturates, so quantize clamps to the format's
largest finite value first (a clamp keeps NaN, and moves nothing that rounds to a finite code).
tests/test_fp8.py checks both against spec on every code and on a sample of float32 values.
"""

from __future__ import annotations

import numpy as np
import torch

from spec.fp8 import Fp8Format

TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def torch_dtype(fmt: Fp8Format) -> torch.dtype:
    return TORCH_DTYPES[fmt.name]


def codes(cache: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 cache's memory (same shape and strides)."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def quantize(
    x: torch.Tensor,  # [T, num_kv_heads, head_dim] float16, bfloat16 or float32
    scales: torch.Tensor,  # [num_kv_heads] float32
    fmt: Fp8Format,
) -> torch.Tensor:  # [T, num_kv_heads, head_dim] uint8 codes
    scaled = x.to(torch.float32) / scales[None, :, None]  # float32 division, correctly rounded
    return scaled.clamp(-fmt.max_value, fmt.max_value).to(torch_dtype(fmt)).view(torch.uint8)


def scale_tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:  # [num_kv_heads] float32
    """spec.kv_cache.check_kv_scales' values on the device the kernels read them from."""
    host = torch.from_numpy(np.ascontiguousarray(values, np.float32))
    return host if device.type == "cpu" else host.to(device)
