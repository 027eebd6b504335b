"""Stage 7, paged attention on torch tensors: each query token attends to its request's keys via the block table.

Same contract as spec.attention.paged_attention (causal within the request, sliding window, soft-cap,
GQA, zero padding rows, the same inputs accepted and refused: spec.attention.check_attention_inputs plus one
device and a dtype torch computes in), but always accumulated in float32 whatever the input dtype, and the
output is in the input dtype. CUDA tensors (or CPU tensors with the Triton interpreter on) run the unified
varlen kernel of fast.kernels.paged_attention; other CPU tensors run its CPU counterpart,
fast.cpu.attention: the same walk over the visible blocks with an online softmax, compiled with Numba,
reading the cache in place in every dtype. Both take decode, prefill and mixed batches in one launch.

fp8 caches (kv_cache_dtype "fp8" / "fp8_e4m3" / "fp8_e5m2", spec.attention): uint8 codes or torch's float8
dtype of the format (fast.fp8), read through a uint8 view; the query is float16, bfloat16 or float32 as
always. Both kernels decode the codes as they load them and apply the scales as FlashInfer does (the
logits' scale times k_scale of the KV head, the output times its v_scale), so no dequantized copy of the
cache is ever made. The scales are checked on the host (spec.kv_cache.check_kv_scales): a scale given as a
CUDA tensor costs one device->host copy per call.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.cpu.attention import as_float32, narrow_into, narrowed, paged_attention_cpu
from fast.fp8 import codes, scale_tensor
from fast.runtime import use_triton
from spec.attention import check_attention_inputs
from spec.attention import check_out as spec_check_out
from spec.kv_cache import check_kv_scales

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value, or [num_kv_heads]
    v_scale: float | torch.Tensor = 1.0,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim] like query: written in place and returned
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Attention of every query row over its request's keys; `out`, if given, receives it (an engine's buffer,
    reused from layer to layer: a fresh output's first writes are page faults, about 9% of a large prefill's
    time on CPU). An `out` sharing query's memory is refused; one overlapping the caches is not checked and
    must not be passed. On a refused call `out` is left as it was."""
    fmt = check_attention_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=sliding_window, softcap=softcap, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    k_values, v_values = check_kv_scales("paged_attention", fmt, k_scale, v_scale, key_cache.shape[2])
    check_attention_tensors(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    if out is not None:
        check_out(out, query)
    if fmt is not None:
        key_cache, value_cache = codes(key_cache), codes(value_cache)
    if use_triton(query.device):
        from fast.kernels.paged_attention import paged_attention_triton  # lazily: the CPU path needs no Triton

        out = torch.zeros_like(query) if out is None else out.zero_()  # padding rows past the last query stay 0
        # the kernel reads head_dim and the index arrays without strides; spec takes any layout of these
        query = query if query.stride(2) == 1 else query.contiguous()
        block_table, seq_lens, query_start_loc = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (block_table, seq_lens, query_start_loc)
        )
        k_scales = v_scales = None  # [num_kv_heads] float32 on the device, for an fp8 cache
        if fmt is not None:
            k_scales, v_scales = scale_tensor(k_values, query.device), scale_tensor(v_values, query.device)
        paged_attention_triton(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=float(scale), sliding_window=sliding_window, softcap=softcap, fmt=fmt, k_scale=k_scales,
            v_scale=v_scales,
        )  # fmt: skip
        return out
    query32 = as_float32(query.detach())  # the CPU kernels read and write float32 rows
    in_place = out is not None and out.dtype == torch.float32
    # otherwise NumPy's zeros (calloc) rather than torch's parallel fill: at two threads on a busy machine each
    # torch parallel region waits for a second core (several ms per call)
    out32 = out.detach() if in_place else torch.from_numpy(np.zeros(query32.shape, np.float32))  # type: ignore[union-attr]
    paged_attention_cpu(
        out32, query32, key_cache.detach(), value_cache.detach(), block_table, seq_lens, query_start_loc,
        scale=float(scale), sliding_window=sliding_window, softcap=softcap, fmt=fmt, k_scale=k_values,
        v_scale=v_values,
    )  # fmt: skip
    if out is None:
        return narrowed(out32, query.dtype)
    if not in_place:
        narrow_into(out32, out.detach())
    return out


def check_out(out: torch.Tensor, query: torch.Tensor) -> None:
    """spec's check of an output buffer, and what the kernels add: query's device, contiguous, not query's memory."""
    spec_check_out(out, query)
    if out.device != query.device:
        raise ValueError(f"paged_attention: out must be on {query.device} like query, got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"paged_attention: out must be contiguous, got strides {out.stride()}")
    if out.untyped_storage().data_ptr() == query.untyped_storage().data_ptr():
        raise ValueError("paged_attention: out shares its memory with query; the kernels read query while writing out")


def check_attention_tensors(*tensors: torch.Tensor) -> None:
    """What torch adds to spec's contract: one device, and a float dtype torch computes attention in."""
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"paged_attention: tensors on several devices: {[str(t.device) for t in tensors]}")
    if tensors[0].dtype not in _FLOAT_DTYPES:
        raise ValueError(f"paged_attention: query must be one of {_FLOAT_DTYPES}, got {tensors[0].dtype}")
