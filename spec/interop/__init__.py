"""Engines plug in: vLLM's scheduler output converted, and the layouts other engines' attention takes.

- `vllm`: `from_vllm` (vLLM-shaped SchedulerOutput -> slotmap's), `copy_vllm` (a record of one),
  `flash_attn_metadata` (vLLM's names, and `vllm_compatible` conventions), `V2RowPolicy` (model runner
  v2's row numbering);
- `flashinfer`: `paged_kv_layout` (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len
  per group) and `paged_attention` reading that layout;
- `sglang`: `sglang_layout` (req_to_token, req_pool_indices, out_cache_loc, seq_lens, extend lengths);
- `host`: `host_counts`, the step's counts from the scheduler output (fast's layouts take them so
  they never read device values back).

Every function here is a pure function of a BatchInputs (plus the config); fast.interop has the same
functions on device tensors. docs/porting.md says how each convention maps, with the tests behind it.
"""

from spec.interop.flashinfer import PagedKVLayout, paged_attention, paged_kv_layout
from spec.interop.host import HostCounts, host_counts
from spec.interop.sglang import SGLangLayout, sglang_layout
from spec.interop.vllm import (
    FlashAttnMetadata,
    V2RowPolicy,
    VllmCachedRequestData,
    VllmConversionError,
    VllmNewRequestData,
    VllmSchedulerOutput,
    copy_vllm,
    flash_attn_metadata,
    from_vllm,
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
    "copy_vllm",
    "flash_attn_metadata",
    "from_vllm",
    "host_counts",
    "paged_attention",
    "paged_kv_layout",
    "sglang_layout",
    "vllm_table_width",
]
