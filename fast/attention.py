"""Stage 7, paged attention on torch tensors: each query token attends to its request's keys via the block table.

Same contract as spec.attention.paged_attention (causal within the request, sliding window, soft-cap,
GQA, zero padding rows), but always accumulated in float32 whatever the input dtype, and the output is
in the input dtype. CUDA tensors (or CPU tensors with the Triton interpreter on) run the unified varlen
kernel of fast.kernels.paged_attention; other CPU tensors loop over requests: each gathers the whole blocks
holding its visible keys into a reused buffer and makes one fused SDPA call.
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
    """One request at a time; only the blocks holding key positions some query of the request may see are gathered.

    SDPA gets 4-d tensors throughout: with 3-d ones torch takes its unfused math path (3x slower on CPU).
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()  # CPU tensors: no device sync
    k_firsts = [_first_key(seq_len, starts[b + 1] - starts[b], sliding_window) for b, seq_len in enumerate(lens)]
    # one gather buffer per cache for the whole call, sized for the request spanning the most blocks: fresh
    # memory per request made decode 1.7x slower (its pages are faulted in, and cold in cache, on every request)
    max_span = max((-(-s // block_size) - k // block_size for s, k in zip(lens, k_firsts, strict=True)), default=0)
    key_buffer = key_cache.new_empty((max_span, *key_cache.shape[1:]))
    value_buffer = value_cache.new_empty((max_span, *value_cache.shape[1:]))
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        num_q = q_end - q_start
        if num_q == 0:
            continue
        first_q_pos, k_first = seq_len - num_q, k_firsts[b]
        first_block = k_first // block_size
        blocks = block_table[b, first_block : -(-seq_len // block_size)]
        # [k, num_kv_heads, head_dim]: whole blocks, then the slots before k_first and from seq_len on are cut off
        # before any arithmetic (they may hold anything, NaN included)
        cut = slice(k_first - first_block * block_size, seq_len - first_block * block_size)
        keys = _gather_blocks(key_cache, blocks, key_buffer)[cut].float()
        values = _gather_blocks(value_cache, blocks, value_buffer)[cut].float()
        if num_q == 1 and softcap is None:
            # a lone query sees every gathered position: the heads sharing a KV head are the rows of one
            # [group, k] problem, so each KV head is read once
            q = query[q_start].float().view(1, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, _heads_first(keys)[None], _heads_first(values)[None], scale=scale)
            out[q_start] = o.view(num_heads, head_dim).to(out.dtype)
            continue
        # [num_q, num_heads, D] -> [num_kv_heads, group, num_q, D] (a view); query head h reads KV head h // group
        q = query[q_start:q_end].float().view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        # [num_kv_heads, group, k, D]: a stride-0 broadcast over the group, no copy
        k4 = _heads_first(keys)[:, None].expand(num_kv_heads, group, -1, head_dim)
        v4 = _heads_first(values)[:, None].expand(num_kv_heads, group, -1, head_dim)
        mask = None  # [num_q, k], broadcast over heads; None where plain causal (or a lone query) needs none
        plain_causal = num_q > 1 and first_q_pos == 0 and sliding_window is None
        if num_q > 1 and not plain_causal:
            k_pos = torch.arange(k_first, seq_len)
            q_pos = torch.arange(first_q_pos, seq_len)
            mask = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if softcap is None:
            o = F.scaled_dot_product_attention(q, k4, v4, attn_mask=mask, is_causal=plain_causal, scale=scale)
        else:
            logits = torch.matmul(q, k4.transpose(-1, -2)) * scale  # [num_kv_heads, group, num_q, k]
            logits = softcap * torch.tanh(logits / softcap)
            if plain_causal:
                mask = torch.ones(num_q, num_q, dtype=torch.bool).tril()
            if mask is not None:
                logits = logits.masked_fill(~mask, float("-inf"))
            o = torch.matmul(torch.softmax(logits, dim=-1), v4)
        # [num_kv_heads, group, num_q, D] -> [num_q, num_heads, D]
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim).to(out.dtype)


def _first_key(seq_len: int, num_q: int, sliding_window: int | None) -> int:
    """The first key position any of a request's queries (positions seq_len - num_q .. seq_len - 1) may see."""
    return 0 if sliding_window is None else max(0, seq_len - num_q - sliding_window + 1)


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    blocks: torch.Tensor,  # [n] physical block ids (int32 or int64)
    buffer: torch.Tensor,  # [>= n, block_size, num_kv_heads, head_dim], contiguous, overwritten
) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim], a view of buffer
    """Whole blocks: one contiguous copy per block, much cheaper than one index per slot."""
    num_blocks, _, num_kv_heads, head_dim = cache.shape
    n = blocks.shape[0]
    if cache.is_contiguous():  # 2-d views take index_select's plain row-copy path
        torch.index_select(cache.view(num_blocks, -1), 0, blocks, out=buffer[:n].view(n, -1))
    else:
        torch.index_select(cache, 0, blocks, out=buffer[:n])
    return buffer[:n].view(-1, num_kv_heads, head_dim)


def _heads_first(x: torch.Tensor) -> torch.Tensor:  # [k, num_kv_heads, D] -> [num_kv_heads, k, D], a view
    return x.transpose(0, 1)
