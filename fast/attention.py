"""Stage 7, paged attention on torch tensors: each query token attends to its request's keys via the block table.

Same contract as spec.attention.paged_attention (causal within the request, sliding window, soft-cap,
GQA, zero padding rows), but always accumulated in float32 whatever the input dtype, and the output is
in the input dtype. CUDA tensors (or CPU tensors with the Triton interpreter on) run the unified varlen
kernel of fast.kernels.paged_attention; other CPU tensors loop over requests, each one vectorised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from fast.runtime import use_triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
) -> torch.Tensor:  # [T, num_heads, head_dim]
    check_attention_inputs(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"paged_attention: softcap must be > 0, got {softcap}")
    out = torch.zeros_like(query)  # padding rows past query_start_loc[-1] stay zero
    if use_triton(query.device):
        from fast.kernels.paged_attention import paged_attention_triton  # lazily: the torch path needs no Triton

        paged_attention_triton(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    else:
        _paged_attention_torch(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    return out


def check_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices only: checking values would need a device->host sync."""
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: caches must share a 4-d shape, got {key_cache.shape}, {value_cache.shape}")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.ndim != 3 or query.shape[1] % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit cache {tuple(key_cache.shape)}")
    num_reqs = seq_lens.shape[0]
    if seq_lens.ndim != 1 or block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"paged_attention: block_table {tuple(block_table.shape)} must be [num_reqs={num_reqs}, max_blocks]"
        )
    if tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(f"paged_attention: query_start_loc {tuple(query_start_loc.shape)} must be [{num_reqs + 1}]")
    if not (query.dtype == key_cache.dtype == value_cache.dtype) or query.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"paged_attention: query and caches need one dtype of {_FLOAT_DTYPES}, got "
            f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    if any(t.dtype not in _INDEX_DTYPES for t in (block_table, seq_lens, query_start_loc)):
        raise ValueError("paged_attention: block_table, seq_lens and query_start_loc must be int32 or int64")
    tensors = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"paged_attention: tensors on several devices: {[str(t.device) for t in tensors]}")


def _paged_attention_torch(
    out: torch.Tensor,  # [T, num_heads, head_dim], zero-filled, written in place
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """One request at a time; only the key positions some query of the request may see are gathered."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()  # CPU tensors: no device sync
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        num_q = q_end - q_start
        if num_q == 0:
            continue
        first_q_pos = seq_len - num_q
        k_first = 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)
        k_pos = torch.arange(k_first, seq_len)  # [k]
        slots = block_table[b, k_pos // block_size].long() * block_size + k_pos % block_size
        # [num_kv_heads, k, head_dim]: one batch entry per KV head, shared by its `group` query heads
        keys = _gather(key_cache, slots).transpose(0, 1).float()
        values = _gather(value_cache, slots).transpose(0, 1).float()
        # [num_q, num_heads, D] -> [num_kv_heads, group * num_q, D]; query head h reads KV head h // group
        q = query[q_start:q_end].float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * num_q, head_dim)
        mask = None  # a single query sees every gathered position
        # a fresh prefill without a window is plain causal: SDPA's is_causal then spares building the mask
        plain_causal = num_q > 1 and first_q_pos == 0 and sliding_window is None and softcap is None
        if num_q > 1 and not plain_causal:
            q_pos = torch.arange(first_q_pos, seq_len)
            visible = k_pos[None, :] <= q_pos[:, None]  # [num_q, k]
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            mask = visible.repeat(group, 1)  # [group * num_q, k], rows ordered like q's
        if softcap is None:
            if plain_causal:  # rows are (head, query) pairs: causal per head needs the [group, num_q] split
                q4 = q.view(num_kv_heads, group, num_q, head_dim)
                o = F.scaled_dot_product_attention(q4, keys[:, None], values[:, None], is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        else:
            logits = torch.bmm(q, keys.transpose(1, 2)) * scale
            logits = softcap * torch.tanh(logits / softcap)
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            o = torch.bmm(torch.softmax(logits, dim=-1), values)
        # [num_kv_heads, group * num_q, D] -> [num_q, num_heads, D]
        o = o.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3).reshape(num_q, -1, head_dim)
        out[q_start:q_end] = o.to(out.dtype)


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slots: torch.Tensor,  # [k] int64
) -> torch.Tensor:  # [k, num_kv_heads, head_dim]
    """Rows of the cache by slot; index_select on the flat view is far faster than (block, offset) indexing."""
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]
