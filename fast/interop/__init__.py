"""spec.interop on device tensors: the same functions, reading a fast BatchInputs, with no host sync
when the caller passes the step's host counts (spec.interop.host_counts). Host-only pieces (from_vllm,
V2RowPolicy, vllm_table_width, host_counts, the layout dataclasses) are spec's own, re-exported."""

from fast.interop.flashinfer import paged_attention, paged_kv_layout
from fast.interop.sglang import sglang_layout
from fast.interop.vllm import flash_attn_metadata
from spec.interop import (
    FlashAttnMetadata,
    HostCounts,
    PagedKVLayout,
    SGLangLayout,
    V2RowPolicy,
    VllmCachedRequestData,
    VllmConversionError,
    VllmNewRequestData,
    VllmSchedulerOutput,
    from_vllm,
    host_counts,
    vllm_table_width,
)

__all__ = [
    "FlashAttnMetadata",
    "HostCounts",
    "PagedKVLayout",
    "SGLangLayout",
    "V2RowPolicy",
    "VllmCachedRequestData",
    "VllmConversionError",
    "VllmNewRequestData",
    "VllmSchedulerOutput",
    "flash_attn_metadata",
    "from_vllm",
    "host_counts",
    "paged_attention",
    "paged_kv_layout",
    "sglang_layout",
    "vllm_table_width",
]
