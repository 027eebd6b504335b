"""Stage 7, paged attention on torch tensors: each query token attends to its request's keys via the block table.

Same contract as spec.attention.paged_attention (causal within the request, sliding window, soft-cap,
GQA, zero padding rows, the same inputs accepted and refused: spec.attention.check_attention_inputs plus one
device and a dtype torch computes in), but always accumulated in float32 whatever the input dtype, and the
output is in the input dtype. CUDA tensors (or CPU tensors with the Triton interpreter on) run the unified
varlen kernel of fast.kernels.paged_attention; other CPU tensors loop over requests:

- a lone query (decode) reads its keys where they lie: each run of consecutive physical blocks of its table
  is one strided view of the cache, and its logits come from one batched matmul per run (no copy of the
  KV, which cost 60% of the time when every visible block was gathered first); a table too fragmented for
  that (short runs) gathers its blocks instead;
- several queries gather the blocks they may see into a reused buffer and make one fused SDPA call.

Non-finite inputs give spec's answer: torch's fused CPU SDPA turns a NaN logit row into zeros, so a request
whose queries are not all finite, or a NaN or infinite scale, takes the explicit matmul/softmax path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from fast.runtime import use_triton
from spec.attention import check_attention_inputs

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_RUN_BLOCKS = 4  # decode reads runs of at least this many blocks in place (on average), else gathers
_EXPLICIT_LOGITS = 1 << 24  # float32 logits one explicit-path chunk may hold (64 MiB)


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
    check_attention_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=sliding_window, softcap=softcap,
    )  # fmt: skip
    check_attention_tensors(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)
    out = torch.zeros_like(query)  # padding rows past query_start_loc[-1] stay zero
    if use_triton(query.device):
        from fast.kernels.paged_attention import paged_attention_triton  # lazily: the torch path needs no Triton

        # the kernel reads head_dim and the index arrays without strides; spec takes any layout of these
        query = query if query.stride(2) == 1 else query.contiguous()
        block_table, seq_lens, query_start_loc = (
            t if t.stride(-1) == 1 else t.contiguous() for t in (block_table, seq_lens, query_start_loc)
        )
        paged_attention_triton(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=float(scale), sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    else:
        _paged_attention_torch(
            out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
            scale=float(scale), sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    return out


def check_attention_tensors(*tensors: torch.Tensor) -> None:
    """What torch adds to spec's contract: one device, and a float dtype torch computes attention in."""
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"paged_attention: tensors on several devices: {[str(t.device) for t in tensors]}")
    if tensors[0].dtype not in _FLOAT_DTYPES:
        raise ValueError(f"paged_attention: query must be one of {_FLOAT_DTYPES}, got {tensors[0].dtype}")


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
    """One request at a time; only key positions some query of the request may see are read.

    SDPA gets 4-d tensors throughout: with 3-d ones torch takes its unfused math path (3x slower on CPU).
    """
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()  # CPU tensors: no device sync
    table = block_table.numpy()  # [num_reqs, max_blocks]
    k_firsts = [_first_key(seq_len, starts[b + 1] - starts[b], sliding_window) for b, seq_len in enumerate(lens)]
    finite_scale = math.isfinite(scale)
    # token indices whose query is not finite, found once for the batch (SDPA would turn their rows into zeros)
    not_finite = torch.nonzero(~torch.isfinite(query[: starts[-1]]).flatten(1).all(dim=1)).flatten().tolist()
    # per request, the runs of consecutive block ids among the blocks it reads: breaks counted once for all rows
    breaks = np.zeros((table.shape[0], table.shape[1]), np.int64)  # [num_reqs, max_blocks] breaks before column
    if table.shape[1] > 1:
        np.cumsum(table[:, 1:].astype(np.int64) != table[:, :-1].astype(np.int64) + 1, axis=1, out=breaks[:, 1:])
    flat_k, flat_v = _flat_slots(key_cache), _flat_slots(value_cache)  # [num_slots, kvh, D] views, or None
    key_buffer = value_buffer = None  # gather buffers, made on first use and sized for the widest request
    max_span = max((-(-s // block_size) - k // block_size for s, k in zip(lens, k_firsts, strict=True)), default=0)
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        num_q = q_end - q_start
        if num_q == 0:
            continue
        first_q_pos, k_first = seq_len - num_q, k_firsts[b]
        first_block, end_block = k_first // block_size, -(-seq_len // block_size)
        q_rows = query[q_start:q_end].float()  # [num_q, num_heads, D]
        explicit = softcap is not None or not finite_scale or any(q_start <= t < q_end for t in not_finite)
        num_runs = 1 + int(breaks[b, end_block - 1] - breaks[b, first_block]) if end_block > first_block else 0
        long_runs = num_runs * MIN_RUN_BLOCKS <= end_block - first_block or num_runs == 1
        if num_q == 1 and long_runs and flat_k is not None and flat_v is not None:
            runs = _runs(table[b, first_block:end_block])
            q = q_rows.view(num_kv_heads, group, head_dim)
            o = _decode_in_place(q, flat_k, flat_v, runs, first_block, k_first, seq_len, block_size,
                                 scale=scale, softcap=softcap)  # fmt: skip
            out[q_start] = o.view(num_heads, head_dim).to(out.dtype)
            continue
        if key_buffer is None or value_buffer is None:
            # one buffer per cache for the whole call: fresh memory per request made decode 1.7x slower (its
            # pages are faulted in, and cold in cache, on every request)
            key_buffer = key_cache.new_empty((max_span, *key_cache.shape[1:]))
            value_buffer = value_cache.new_empty((max_span, *value_cache.shape[1:]))
        blocks = block_table[b, first_block:end_block]
        # [k, num_kv_heads, head_dim]: whole blocks, then the slots before k_first and from seq_len on are cut off
        # before any arithmetic (they may hold anything, NaN included)
        cut = slice(k_first - first_block * block_size, seq_len - first_block * block_size)
        keys = _gather_blocks(key_cache, blocks, key_buffer)[cut].float()
        values = _gather_blocks(value_cache, blocks, value_buffer)[cut].float()
        if num_q == 1 and not explicit:
            # a lone query sees every gathered position: the heads sharing a KV head are the rows of one
            # [group, k] problem, so each KV head is read once
            q1 = q_rows.view(1, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q1, _heads_first(keys)[None], _heads_first(values)[None], scale=scale)
            out[q_start] = o.view(num_heads, head_dim).to(out.dtype)
            continue
        # [num_q, num_heads, D] -> [num_kv_heads, group, num_q, D] (a view); query head h reads KV head h // group
        q = q_rows.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        # [num_kv_heads, group, k, D]: a stride-0 broadcast over the group, no copy
        k4 = _heads_first(keys)[:, None].expand(num_kv_heads, group, -1, head_dim)
        v4 = _heads_first(values)[:, None].expand(num_kv_heads, group, -1, head_dim)
        plain_causal = num_q > 1 and first_q_pos == 0 and sliding_window is None
        if explicit:
            o = _explicit_attention(q, k4, v4, first_q_pos, k_first, scale=scale, sliding_window=sliding_window,
                                    softcap=softcap)  # fmt: skip
        else:
            mask = None  # [num_q, k], broadcast over heads; None where plain causal (or a lone query) needs none
            if num_q > 1 and not plain_causal:
                mask = _visible(first_q_pos, num_q, k_first, seq_len, sliding_window)
            o = F.scaled_dot_product_attention(q, k4, v4, attn_mask=mask, is_causal=plain_causal, scale=scale)
        # [num_kv_heads, group, num_q, D] -> [num_q, num_heads, D]
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim).to(out.dtype)


def _decode_in_place(
    q: torch.Tensor,  # [num_kv_heads, group, D] float32
    flat_k: torch.Tensor,  # [num_slots, num_kv_heads, D], a view of the key cache
    flat_v: torch.Tensor,  # [num_slots, num_kv_heads, D]
    runs: list[tuple[int, int]],  # (first table column, physical block id) of each run, columns relative
    first_block: int,  # logical block of column 0
    k_first: int,  # first visible key position
    seq_len: int,
    block_size: int,
    *,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [num_kv_heads, group, D] float32
    """One query over runs of consecutive blocks, each read through a strided view (no copy for float32)."""
    spans = []  # per run: [n, num_kv_heads, D] key and value views, in position order
    ends = [col for col, _ in runs[1:]] + [None]
    for (col, phys), end_col in zip(runs, ends, strict=True):
        lo = max(k_first, (first_block + col) * block_size)  # first position of the run that is visible
        hi = seq_len if end_col is None else (first_block + end_col) * block_size
        base = phys * block_size - (first_block + col) * block_size  # slot of position p is base + p
        spans.append((flat_k[base + lo : base + hi], flat_v[base + lo : base + hi]))
    # [num_kv_heads, group, k]: logits of every run side by side, then one softmax over all of them
    logits = torch.cat([torch.matmul(q, k.float().permute(1, 2, 0)) for k, _ in spans], dim=-1) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    weights = torch.softmax(logits, dim=-1)
    o = torch.zeros_like(q)
    start = 0
    for _, v in spans:
        n = v.shape[0]
        o += torch.matmul(weights[..., start : start + n], v.float().transpose(0, 1))  # [num_kv_heads, group, D]
        start += n
    return o


def _explicit_attention(
    q: torch.Tensor,  # [num_kv_heads, group, num_q, D] float32
    k4: torch.Tensor,  # [num_kv_heads, group, k, D]
    v4: torch.Tensor,  # [num_kv_heads, group, k, D]
    first_q_pos: int,
    k_first: int,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [num_kv_heads, group, num_q, D]
    """Matmul, soft-cap, mask, softmax, matmul, in IEEE arithmetic (NaN stays NaN); chunked over queries."""
    num_kv_heads, group, num_q, _ = q.shape
    k = k4.shape[2]
    chunk = max(1, _EXPLICIT_LOGITS // max(1, num_kv_heads * group * k))
    parts = []
    for c in range(0, num_q, chunk):
        qc = q[:, :, c : c + chunk]
        logits = torch.matmul(qc, k4.transpose(-1, -2)) * scale  # [num_kv_heads, group, chunk, k]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        seq_len = k_first + k
        mask = _visible(first_q_pos + c, qc.shape[2], k_first, seq_len, sliding_window)
        logits = logits.masked_fill(~mask, float("-inf"))
        parts.append(torch.matmul(torch.softmax(logits, dim=-1), v4))
    return torch.cat(parts, dim=2)


def _visible(
    first_q_pos: int, num_q: int, k_first: int, seq_len: int, sliding_window: int | None
) -> torch.Tensor:  # [num_q, seq_len - k_first] bool
    k_pos = torch.arange(k_first, seq_len)
    q_pos = torch.arange(first_q_pos, first_q_pos + num_q)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def _runs(blocks: np.ndarray) -> list[tuple[int, int]]:
    """(column, physical block id) where each run of consecutive block ids starts."""
    starts = np.flatnonzero(np.diff(blocks.astype(np.int64)) != 1) + 1
    cols = [0, *starts.tolist()]
    return [(c, int(blocks[c])) for c in cols] if blocks.shape[0] else []


def _flat_slots(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_slots, num_kv_heads, D] view where the block and offset axes merge (slot s at row s), else None."""
    num_blocks, block_size = cache.shape[:2]
    if num_blocks > 1 and cache.stride(0) != block_size * cache.stride(1):
        return None
    return cache.flatten(0, 1)  # a view: the two axes merge


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
