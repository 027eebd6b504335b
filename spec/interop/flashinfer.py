"""FlashInfer's paged-KV layout (what `BatchPrefillWithPagedKVCacheWrapper.plan` takes), and attention over it.

FlashInfer describes one KV cache group of a batch in CSR form instead of a padded block table:
request b's pages are `paged_kv_indices[paged_kv_indptr[b] : paged_kv_indptr[b + 1]]`, the first
ceil(seq_len / page_size) entries of its block-table row, and only `paged_kv_last_page_len[b]` tokens
of its last page are filled (1..page_size). Its queries are `qo_indptr[b] : qo_indptr[b + 1]` of the
flat tokens, which is slotmap's query_start_loc. A page here is a block: page_size = block_size.

Sliding-window groups keep their null-block placeholders in the page list, as in the block table:
FlashInfer's `window_left` (and this attention) never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.interop.host import HostCounts, check_host_counts
from spec.types import BatchInputs

INDPTR_DTYPE = "int32"  # FlashInfer's indptr, indices and last_page_len are int32


@dataclass(frozen=True)
class PagedKVLayout:
    """Arrays are NumPy from spec.interop, torch tensors on the batch's device from fast.interop."""

    qo_indptr: Any  # [num_reqs + 1] int32, flat query offsets (= query_start_loc)
    paged_kv_indptr: Any  # [num_reqs + 1] int32, offsets into paged_kv_indices
    paged_kv_indices: Any  # [num_pages] int32, physical block ids, request after request
    paged_kv_last_page_len: Any  # [num_reqs] int32, tokens in each request's last page, 1..page_size


def paged_kv_layout(batch: BatchInputs, group: int, block_size: int, host: HostCounts | None = None) -> PagedKVLayout:
    """Group `group` of `batch` in FlashInfer's form. `host` (optional) is checked against the batch."""
    seq_lens = np.asarray(batch.seq_lens, np.int64)  # [num_reqs]
    check_host_counts(host, np.asarray(batch.num_scheduled_tokens, np.int64), seq_lens)
    table = np.asarray(batch.block_tables[group])  # [num_reqs, max_blocks] batch_idx -> block ids
    num_pages = -(-seq_lens // block_size)  # [num_reqs] ceil: pages holding positions 0..seq_len-1
    indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(INDPTR_DTYPE)
    indices = np.concatenate([table[b, : num_pages[b]] for b in range(len(seq_lens))] or [np.zeros(0)])
    last_page_len = seq_lens - (num_pages - 1) * block_size
    return PagedKVLayout(
        qo_indptr=np.asarray(batch.query_start_loc).astype(INDPTR_DTYPE),
        paged_kv_indptr=indptr,
        paged_kv_indices=indices.astype(INDPTR_DTYPE),
        paged_kv_last_page_len=last_page_len.astype(INDPTR_DTYPE),
    )


def paged_attention(
    query: np.ndarray,  # [T, num_heads, head_dim]
    key_cache: np.ndarray,  # [num_pages_total, page_size, num_kv_heads, head_dim] (FlashInfer's NHD layout)
    value_cache: np.ndarray,  # [num_pages_total, page_size, num_kv_heads, head_dim]
    layout: PagedKVLayout,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_num_pages: int | None = None,
) -> np.ndarray:  # [T, num_heads, head_dim]
    """Paged attention reading FlashInfer's layout; the same contract as spec.paged_attention.

    `max_num_pages` bounds any one request's page count: backends that rebuild a table need it
    (fast/interop/flashinfer.py); here it is only checked.
    """
    _, page_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if num_heads % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"paged_attention: query {query.shape} does not fit cache {key_cache.shape}")
    dtype = query.dtype.type
    group = num_heads // num_kv_heads
    out = np.zeros_like(query)
    qo, kv_indptr = layout.qo_indptr, layout.paged_kv_indptr
    for b in range(len(layout.paged_kv_last_page_len)):
        pages = layout.paged_kv_indices[kv_indptr[b] : kv_indptr[b + 1]]  # [n] this request's blocks
        if max_num_pages is not None and len(pages) > max_num_pages:
            raise ValueError(f"max_num_pages: request {b} has {len(pages)} pages, more than {max_num_pages}")
        seq_len = (len(pages) - 1) * page_size + int(layout.paged_kv_last_page_len[b])
        q_start, q_end = int(qo[b]), int(qo[b + 1])
        q_pos = np.arange(seq_len - (q_end - q_start), seq_len)  # [q] positions of its queries
        k_pos = np.arange(seq_len)  # [k] every position of its pages that holds a token
        visible = k_pos[None, :] <= q_pos[:, None]  # [q, k]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        seen = visible.any(axis=0)  # only keys some query sees are read: window-released pages are null
        k_pos, visible = k_pos[seen], visible[:, seen]
        keys = key_cache[pages[k_pos // page_size], k_pos % page_size]  # [k, num_kv_heads, head_dim]
        values = value_cache[pages[k_pos // page_size], k_pos % page_size]
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # [k, H, D]
        logits = np.einsum("qhd,khd->hqk", query[q_start:q_end], keys) * dtype(scale)
        if softcap is not None:
            logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
        logits = np.where(visible[None], logits, dtype(-np.inf))
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[q_start:q_end] = np.einsum("hqk,khd->qhd", weights, values)
    return out
