"""Paged attention on CPU tensors: compiled kernels that read K and V blocks where they lie.

Rows of one query (decode) take fast.cpu.decode's kernel; rows of several queries (prefill, drafts, chunks
of a prompt) take fast.cpu.prefill's, both in the same call, after plan_items' checks. A work item of the
latter is (batch row, KV head, up to TILES_PER_ITEM consecutive tiles of `query_tile(group)` of its queries):
a tile's queries for every query head of its KV head are the rows of one small matrix (GQA: each key is read
once for the whole group). The item walks the visible key positions block by block through the block table
(from the window start of its first query to its last query's position), copies each block's keys and values
once, and runs every tile that sees the block over the copy, with an online softmax per row in float32.
Items of one batch row and KV head are next to each other, so the items after the first find that head's
blocks in L2. Keys a row may not see inside the walked range (causal within the tile, the window of earlier
queries) get -inf before the softmax; keys outside the range are never read, so unwritten slots may hold
anything. The kernels are serial; fast.cpu.threads runs each kernel's rows or items in cost-balanced shares on
torch's OpenMP threads, as many as torch uses.

Cache elements are widened to float32 as they are loaded (fast.cpu.lanes), so a float16 or bfloat16 cache
is never converted in memory. Non-finite inputs follow IEEE arithmetic as spec does: a NaN in a row's
visible logits makes the row NaN.

fp8 caches are read in place too: their codes are widened to float32 as they are loaded (fast.cpu.lanes:
e4m3 read as uint8, e5m2 as int8), and the scales are applied per KV head as FlashInfer does: the logits'
scale times k_scale[h], the output times v_scale[h] (the kernel takes scales of 1 for other caches).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fast.cpu.decode import decode_kernel
from fast.cpu.lanes import widen
from fast.cpu.prefill import prefill_kernel, window_start
from fast.cpu.threads import SHARES_PER_THREAD, run_shares, team_threads
from spec.fp8 import Fp8Format

TILE_ROWS = 64  # query rows (tile queries x group) a tile aims for: its logits and P.V stay in L1 and L2
# tiles of queries an item takes at most: each block's K and V are copied once for all of them (8: 0.92x the time
# of 1 on the mixed benchmark's prompts, 0.78x with 512 queries on 8192 cached keys)
TILES_PER_ITEM = 8
ITEM_FIELDS = 6  # batch_idx, query tokens [t0, t1), first key position, position of query t0, KV head


def query_tile(group: int) -> int:
    """Queries per tile of a work item: enough rows to reuse each key and value loaded, few enough that a tile's
    buffers stay in L1 and L2 (64 rows: 0.82x the time of 32 on the mixed benchmark's prompts, measured with one
    tile per item; 128 rows, no faster)."""
    return max(1, TILE_ROWS // group)


def paged_attention_cpu(
    out: torch.Tensor,  # [T, num_heads, head_dim] float32, contiguous, every row written (padding 0)
    query: torch.Tensor,  # [T, num_heads, head_dim] float32, contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], the same strides
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    fmt: Fp8Format | None = None,  # caches of uint8 codes of this format, or None: a float dtype
    k_scale: np.ndarray | None = None,  # [num_kv_heads] float32, for an fp8 cache
    v_scale: np.ndarray | None = None,  # [num_kv_heads] float32, for an fp8 cache
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    ones = np.ones(num_kv_heads, np.float32)
    k_scales = ones if fmt is None or k_scale is None else np.ascontiguousarray(k_scale, np.float32)
    v_scales = ones if fmt is None or v_scale is None else np.ascontiguousarray(v_scale, np.float32)
    group = query.shape[1] // num_kv_heads
    strides = np.array(key_cache.stride()[:3], np.int64)  # block, slot in block, KV head (elements)
    table, lens, starts = (t.numpy() for t in (block_table, seq_lens, query_start_loc))
    tile = query_tile(group)
    items, item_costs, decode_rows, decode_costs = plan_items(
        lens, starts, table, query.shape[0], num_blocks, block_size, num_kv_heads, group, tile, sliding_window or 0,
        team_threads() * SHARES_PER_THREAD,
    )  # fmt: skip
    o, q = out.numpy(), query.numpy()
    first, last = int(starts[0]), int(starts[-1])
    if first > 0:  # padding rows before the first query and after the last are 0
        o[:first] = 0.0
    if last < o.shape[0]:
        o[last:] = 0.0
    if items.shape[0] == 0 and decode_rows.size == 0:
        return
    key, value = _elements(key_cache, fmt), _elements(value_cache, fmt)
    scale32, window, cap = np.float32(scale), sliding_window or 0, np.float32(softcap or 0.0)
    decode = (decode_kernel, (o, q, key, value, strides, table, lens, starts), decode_rows,
              (group, head_dim, block_size, scale32, window, cap, k_scales, v_scales), decode_costs)  # fmt: skip
    after = (tile, group, head_dim, block_size, scale32, window, cap, k_scales, v_scales)
    run_shares(decode, (prefill_kernel, (o, q, key, value, strides, table), items, after, item_costs))


def as_float32(query: torch.Tensor) -> torch.Tensor:
    """The query as the float32 rows the kernels read (a float32 query as it lies), widened exactly by a compiled
    loop on this thread: no torch parallel region, and no NumPy temporaries (astype and a shift took 0.9 ms for a
    64 x 32 x 128 bfloat16 query, between calls; the loop 0.03 ms)."""
    if query.dtype == torch.float32:
        return query.contiguous()
    bits = query.contiguous().view(torch.int16).numpy()  # float16 bits; bfloat16 as uint16, as fast.cpu.lanes reads
    flat = bits.reshape(-1).view(np.uint16) if query.dtype == torch.bfloat16 else bits.reshape(-1)
    return torch.from_numpy(_widened(flat).reshape(bits.shape))


def narrowed(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 rows (any strides) in `dtype`, rounded to nearest even as torch rounds (NaN stays NaN)."""
    if dtype == torch.float32:
        return out
    result = torch.empty(out.shape, dtype=dtype)
    narrow_into(out, result)
    return result


def narrow_into(out: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (contiguous bfloat16 or float16, out's shape) = out's float32 rows rounded to nearest even, on this
    thread: a bfloat16 by a compiled loop (NumPy's five passes with temporaries took 1.0 ms for 64 x 32 x 128
    rows, between calls; the loop 0.06 ms), a float16 by NumPy's conversion."""
    values = out.numpy()
    if dst.dtype == torch.bfloat16:
        _to_bfloat16(values, values.view(np.uint32), dst.view(torch.int16).numpy().view(np.uint16))
    else:
        np.copyto(dst.numpy(), values.astype(np.float16))


@njit(cache=True, nogil=True)
def _widened(bits: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled; bits: [n] bfloat16 or float16 bits
    wide = np.empty(bits.shape[0], np.float32)  # [n]
    for i in range(bits.shape[0]):
        wide[i] = widen(bits[i])
    return wide


@njit(cache=True, nogil=True)
def _to_bfloat16(  # pragma: no cover - compiled
    values: np.ndarray,  # [T, rows, dim] float32, any strides
    bits: np.ndarray,  # [T, rows, dim] uint32: values' bits, the same memory
    dst: np.ndarray,  # [T, rows, dim] uint16, bfloat16 bits
) -> None:
    for t in range(values.shape[0]):
        for r in range(values.shape[1]):
            for d in range(values.shape[2]):
                x, u = values[t, r, d], bits[t, r, d]
                top = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                # the rounding carry can turn a NaN into an infinity or flip its sign
                dst[t, r, d] = np.uint16(0x7FC0) if x != x else np.uint16(top)


def _elements(cache: torch.Tensor, fmt: Fp8Format | None) -> np.ndarray:
    """The cache's memory as one flat array of its elements (bfloat16 as uint16, float16 as int16 bits; fp8
    codes as uint8 for e4m3 and int8 for e5m2: the element type tells fast.cpu.lanes.widen the format).

    Flat from the first element to the last, whatever the strides (padded blocks included), so the kernel
    addresses block, slot, head and dim with the cache's own strides and its innermost loop is contiguous.
    """
    if fmt is not None:
        bits = cache.numpy() if fmt.name == "e4m3" else cache.numpy().view(np.int8)
    elif cache.dtype == torch.bfloat16:
        bits = cache.view(torch.int16).numpy().view(np.uint16)
    elif cache.dtype == torch.float16:
        bits = cache.view(torch.int16).numpy()
    else:
        bits = cache.numpy()
    if bits.flags.c_contiguous:
        return bits.reshape(-1)
    span = 1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True)) if cache.numel() else 0
    return np.lib.stride_tricks.as_strided(bits, shape=(span,), strides=(bits.itemsize,))


@njit(cache=True, nogil=True)
def plan_items(  # pragma: no cover - compiled; tested through its results
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    num_query_rows: int,  # T: query rows the tensors hold
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    group: int,  # query heads per KV head
    tile: int,  # queries per tile of a prefill item
    window: int,  # 0: no sliding window
    min_items: int,  # items wanted for the threads' shares: fewer tiles per item (down to 1) until there are as many
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The work items of one call ([num_items, ITEM_FIELDS] int64, the fields below) and its decode rows ([n]
    batch_idx: rows of one query, fast.cpu.decode's), each with its cost ([num_items], [n] int64: the query head
    x key products it computes, for fast.cpu.threads' shares), after the checks that keep every read inside the
    tensors.

    Every row is checked, decode rows too (fast.cpu.decode reads them, without items): every block id a
    row will read, so neither kernel needs bounds checks. A row with several queries is, per KV head, items
    of up to TILES_PER_ITEM consecutive tiles of `tile` queries (fewer per item when there would be fewer items
    than `min_items`; each row's arithmetic is the same either way), the items of one KV head next to each other.
    """
    num_reqs = seq_lens.shape[0]
    count = num_decode = 0
    item_counts = np.zeros(TILES_PER_ITEM + 1, np.int64)  # [n] the items of n tiles each, for n a power of 2
    for b in range(num_reqs):
        q_start, q_end, seq_len = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if q_start < 0 or q_end < q_start or q_end > num_query_rows:
            raise ValueError("paged_attention: query_start_loc must be non-decreasing within the query's rows")
        if q_end - q_start > seq_len:
            raise ValueError("paged_attention: a batch row has more queries than its seq_len")
        if q_end > q_start:
            k_first = window_start(seq_len - (q_end - q_start), window)
            last_block = (seq_len - 1) // block_size
            if last_block >= block_table.shape[1]:
                raise ValueError("paged_attention: seq_lens reach past the block table's width")
            for blk in range(k_first // block_size, last_block + 1):
                if block_table[b, blk] < 0 or block_table[b, blk] >= num_blocks:
                    raise ValueError("paged_attention: block_table holds a block id outside the cache")
        num_q = q_end - q_start
        num_decode += num_q == 1
        if num_q > 1:
            n = 1
            while n <= TILES_PER_ITEM:
                item_counts[n] += num_kv_heads * ((num_q + n * tile - 1) // (n * tile))
                n *= 2
    per_item = TILES_PER_ITEM
    while per_item > 1 and item_counts[per_item] < min_items:
        per_item //= 2
    span = per_item * tile  # queries per item
    count = item_counts[per_item]
    items, item_costs = np.empty((count, ITEM_FIELDS), np.int64), np.empty(count, np.int64)
    decode_rows, decode_costs = np.empty(num_decode, np.int64), np.empty(num_decode, np.int64)
    i = d = 0
    for b in range(num_reqs):
        q_start, q_end, seq_len = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if q_end - q_start == 1:  # it reads the keys from its window start to its position
            decode_rows[d] = b
            decode_costs[d] = group * num_kv_heads * (seq_len if window == 0 else min(seq_len, window))
            d += 1
            continue
        first_pos = seq_len - (q_end - q_start)  # position of the row's first query
        for h in range(num_kv_heads):
            for t0 in range(q_start, q_end, span):
                pos = first_pos + (t0 - q_start)
                items[i, 0] = b
                items[i, 1] = t0
                items[i, 2] = min(t0 + span, q_end)
                items[i, 3] = window_start(pos, window)
                items[i, 4] = pos
                items[i, 5] = h
                item_costs[i] = 0
                for u0 in range(t0, items[i, 2], tile):  # each tile's rows x the keys it walks
                    num_q, p = min(tile, items[i, 2] - u0), pos + (u0 - t0)
                    item_costs[i] += num_q * group * (p + num_q - window_start(p, window))
                i += 1
    return items, item_costs, decode_rows, decode_costs
