"""FlashInfer's paged-KV layout on device tensors: spec/interop/flashinfer.py's contract, without host syncs.

The only data-dependent size is the page count (paged_kv_indices' length). It comes from `host`
(spec.interop.host_counts, read from the scheduler output); without it this is the one place that
reads a device value back (one `.item()`, documented in docs/porting.md). The attention entry
rebuilds a padded block table from the CSR form on the device (a scatter) and runs fast's paged
attention kernel on it, so FlashInfer's layout and the block-table form share one kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from fast.attention import paged_attention as block_table_attention
from spec.interop.flashinfer import PagedKVLayout
from spec.interop.host import HostCounts
from spec.types import BatchInputs

INDPTR_DTYPE = torch.int32


def paged_kv_layout(batch: BatchInputs, group: int, block_size: int, host: HostCounts | None = None) -> PagedKVLayout:
    seq_lens: torch.Tensor = batch.seq_lens  # [num_reqs] int32
    table: torch.Tensor = batch.block_tables[group]  # [num_reqs, max_blocks]
    num_pages = (seq_lens.long() + block_size - 1) // block_size  # [num_reqs]
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64, device=seq_lens.device)  # [num_reqs + 1]
    torch.cumsum(num_pages, 0, out=indptr[1:])
    # the one host sync happens only when the caller has no host counts
    total = int(num_pages_np(host, block_size).sum()) if host is not None else int(indptr[-1].item())
    page = torch.arange(total, device=seq_lens.device)  # [num_pages] flat page index
    owner = torch.searchsorted(indptr[1:], page, right=True)  # [num_pages] page -> batch_idx
    column = page - indptr[owner]  # [num_pages] its logical block within the request
    return PagedKVLayout(
        qo_indptr=batch.query_start_loc.to(INDPTR_DTYPE),
        paged_kv_indptr=indptr.to(INDPTR_DTYPE),
        paged_kv_indices=table[owner, column].to(INDPTR_DTYPE),
        paged_kv_last_page_len=(seq_lens.long() - (num_pages - 1) * block_size).to(INDPTR_DTYPE),
    )


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_pages_total, page_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_pages_total, page_size, num_kv_heads, head_dim]
    layout: PagedKVLayout,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_num_pages: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """spec.interop.flashinfer.paged_attention on torch. `max_num_pages` (the most pages of any request)
    sets the rebuilt table's width; without it the width is len(paged_kv_indices), always enough."""
    indptr = layout.paged_kv_indptr.long()  # [num_reqs + 1]
    indices = layout.paged_kv_indices  # [num_pages]
    last_page_len = layout.paged_kv_last_page_len.long()  # [num_reqs]
    num_reqs, page_size = last_page_len.shape[0], key_cache.shape[1]
    width = max(1, max_num_pages if max_num_pages is not None else indices.shape[0])
    # one spare row and column catch pages past indptr[-1] or past `width`, so no mask (and no sync) is needed
    table = torch.zeros(num_reqs + 1, width + 1, dtype=torch.int32, device=indices.device)  # [num_reqs + 1, W + 1]
    page = torch.arange(indices.shape[0], device=indices.device)  # [num_pages]
    owner = torch.searchsorted(indptr[1:], page, right=True)  # [num_pages] batch_idx, num_reqs past the end
    column = (page - indptr[owner]).clamp(max=width)  # [num_pages]
    table[owner, column] = indices.to(torch.int32)
    seq_lens = ((indptr[1:] - indptr[:-1] - 1) * page_size + last_page_len).to(torch.int32)  # [num_reqs]
    return block_table_attention(
        query, key_cache, value_cache, table[:num_reqs, :width], seq_lens, layout.qo_indptr,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
    )  # fmt: skip


def num_pages_np(host: HostCounts, block_size: int) -> np.ndarray:  # [num_reqs] int64
    """Pages per request on the host (e.g. for max_num_pages), from the scheduler output's counts."""
    return -(-host.seq_lens_np // block_size)
