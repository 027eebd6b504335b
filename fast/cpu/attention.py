"""Paged attention on CPU tensors: compiled kernels that read K and V blocks where they lie.

Rows of one query (decode) take fast.cpu.decode's kernel; rows of several queries (prefill, drafts, chunks
of a prompt) take `_attention_kernel` here, both in the same call, after plan_items' checks. A work item of
the latter is (batch row, tile of up to `query_tile(group)` of its queries, KV head): it holds the tile's
queries for every query head of its KV head as the rows of one small matrix (GQA: each key is read once for
the whole group), walks the visible key positions block by block through the block table (from the window
start of its first query to its last query's position), and keeps an online softmax per row in float32:
per block, the logits of 4 rows x 4 keys per pass over head_dim (fast.cpu.decode.dots4x4), soft-cap, a
running max, the rescaled sum, and P.V added 4 values x 4 rows per pass (weigh4x4). Keys a row may not see
inside the walked range (causal within the tile, the window of earlier queries) get -inf before the
softmax; keys outside the range are never read, so unwritten slots may hold anything. The kernels are
serial and release the GIL; fast.cpu.threads hands each kernel's rows or items out in cost-balanced shares
to the calling thread and its pool, as many threads as torch uses.

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

from fast.cpu.decode import decode_kernel, dots4x4, weigh1, weigh4x4
from fast.cpu.lanes import exp, maximum, tanh
from fast.cpu.threads import run_shares
from spec.fp8 import Fp8Format

# reassociation lets LLVM vectorise the dot products and sums; no nnan/ninf, so NaN and inf stay IEEE
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
TILE_ROWS = 32  # query rows (tile queries x group) an item aims for: K and V are re-read once per tile
ITEM_FIELDS = 6  # batch_idx, query tokens [t0, t1), first key position, position of query t0, KV head


def query_tile(group: int) -> int:
    """Queries per work item: enough rows to reuse each key, few enough that the item's buffers stay in L1."""
    return max(1, TILE_ROWS // group)


def paged_attention_cpu(
    out: torch.Tensor,  # [T, num_heads, head_dim] float32, contiguous, zero-filled, written in place
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
    items = plan_items(lens, starts, table, query.shape[0], num_blocks, block_size, num_kv_heads, query_tile(group),
                       sliding_window or 0)  # fmt: skip
    decode_rows = np.flatnonzero(np.diff(starts.astype(np.int64)) == 1)  # [n] batch_idx: fast.cpu.decode's rows
    if items.shape[0] == 0 and decode_rows.size == 0:
        return
    key, value = _elements(key_cache, fmt), _elements(value_cache, fmt)
    o, q = out.numpy(), query.numpy()
    scale32, window, cap = np.float32(scale), sliding_window or 0, np.float32(softcap or 0.0)
    if decode_rows.size:
        keys = lens[decode_rows].astype(np.int64)  # a row reads the keys from its window start to its position
        costs = query.shape[1] * (keys if window == 0 else np.minimum(keys, window))  # query head x key products
        run_shares(lambda rows: decode_kernel(o, q, key, value, strides, table, lens, starts, rows, group, head_dim,
                                              block_size, scale32, window, cap, k_scales, v_scales),
                   decode_rows, costs)  # fmt: skip
    if items.shape[0]:
        num_q = items[:, 2] - items[:, 1]
        costs = num_q * group * (items[:, 4] + num_q - items[:, 3])  # an item's query heads x keys it walks
        run_shares(lambda share: _attention_kernel(o, q, key, value, strides, table, share, group, head_dim,
                                                   block_size, scale32, window, cap, k_scales, v_scales),
                   items, costs)  # fmt: skip


def as_float32(query: torch.Tensor) -> torch.Tensor:
    """The query as the float32 rows the kernels read (a float32 query as it lies), converted by NumPy on this
    thread: a torch conversion at two threads leaves libgomp's worker spinning for milliseconds on the core the
    kernel's second share needs (decode 64 x 1024 in bfloat16: 18.4 ms at two threads, 21.9 at one)."""
    if query.dtype == torch.float32:
        return query.contiguous()
    bits = query.contiguous().view(torch.int16).numpy()
    if query.dtype == torch.bfloat16:  # a bfloat16 is the top half of the float32 of the same value
        return torch.from_numpy((bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    return torch.from_numpy(bits.view(np.float16).astype(np.float32))


def narrowed(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 rows in `dtype`, rounded to nearest even as torch rounds (NaN stays NaN), by NumPy on this thread."""
    if dtype == torch.float32:
        return out
    values = out.numpy()
    if dtype == torch.float16:
        return torch.from_numpy(values.astype(np.float16))
    u = values.view(np.uint32)
    top = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    top[np.isnan(values)] = 0x7FC0  # the rounding carry can turn a NaN into an infinity or flip its sign
    return torch.from_numpy(top.view(np.int16)).view(torch.bfloat16)


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
    tile: int,  # queries per prefill item
    window: int,  # 0: no sliding window
) -> np.ndarray:  # [num_items, ITEM_FIELDS] int64, the fields below
    """The work items of one call, after the checks that keep every read inside the tensors.

    Every row is checked, decode rows too (fast.cpu.decode reads them, without items): every block id a
    row will read, so neither kernel needs bounds checks. A row with several queries is one item per tile
    of `tile` queries and KV head: the keys are reused by every query of the tile and stay in cache.
    """
    num_reqs = seq_lens.shape[0]
    count = 0
    for b in range(num_reqs):
        q_start, q_end, seq_len = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if q_start < 0 or q_end < q_start or q_end > num_query_rows:
            raise ValueError("paged_attention: query_start_loc must be non-decreasing within the query's rows")
        if q_end - q_start > seq_len:
            raise ValueError("paged_attention: a batch row has more queries than its seq_len")
        if q_end > q_start:
            k_first = 0 if window == 0 else max(0, seq_len - (q_end - q_start) - window + 1)
            last_block = (seq_len - 1) // block_size
            if last_block >= block_table.shape[1]:
                raise ValueError("paged_attention: seq_lens reach past the block table's width")
            for blk in range(k_first // block_size, last_block + 1):
                if block_table[b, blk] < 0 or block_table[b, blk] >= num_blocks:
                    raise ValueError("paged_attention: block_table holds a block id outside the cache")
        num_q = q_end - q_start
        count += 0 if num_q == 1 else num_kv_heads * ((num_q + tile - 1) // tile)
    items = np.empty((count, ITEM_FIELDS), np.int64)
    i = 0
    for b in range(num_reqs):
        q_start, q_end, seq_len = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if q_end - q_start == 1:
            continue
        first_pos = seq_len - (q_end - q_start)  # position of the row's first query
        for t0 in range(q_start, q_end, tile):
            pos = first_pos + (t0 - q_start)
            for h in range(num_kv_heads):
                items[i, 0] = b
                items[i, 1] = t0
                items[i, 2] = min(t0 + tile, q_end)
                items[i, 3] = 0 if window == 0 else max(0, pos - window + 1)
                items[i, 4] = pos
                items[i, 5] = h
                i += 1
    return items


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def _attention_kernel(  # pragma: no cover - compiled; tested through its results
    out: np.ndarray,  # [T, num_heads, head_dim] float32, written for the items' query rows
    query: np.ndarray,  # [T, num_heads, head_dim] float32
    key: np.ndarray,  # [span] cache elements (float32, float16/bfloat16 bits, fp8 codes), addressed with strides
    value: np.ndarray,  # [span] the value cache, the same strides
    strides: np.ndarray,  # [3] int64: block, slot in block, KV head (elements)
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids (checked by plan_items)
    items: np.ndarray,  # [num_items, ITEM_FIELDS] int64: batch_idx, query tokens [t0, t1), first key position,
    #                     position of query t0, KV head
    group: int,  # query heads per KV head
    head_dim: int,
    block_size: int,
    scale: np.float32,
    window: int,  # 0: no sliding window
    softcap: np.float32,  # 0: no soft-cap
    k_scale: np.ndarray,  # [num_kv_heads] float32: the logits of KV head h are scaled by scale * k_scale[h]
    v_scale: np.ndarray,  # [num_kv_heads] float32: its output rows by v_scale[h]
) -> None:
    neg_inf = np.float32(-np.inf)
    for it in range(items.shape[0]):
        b, t0, t1, k_lo, p0, h = items[it, 0], items[it, 1], items[it, 2], items[it, 3], items[it, 4], items[it, 5]
        rows = (t1 - t0) * group  # row r: query t0 + r // group, query head h * group + r % group
        k_hi = p0 + (t1 - t0)  # one past the last query's position
        q = np.empty((rows, head_dim), np.float32)  # [rows, head_dim]
        for r in range(rows):
            q[r, :] = query[t0 + r // group, h * group + r % group]
        s = np.empty((rows, block_size), np.float32)  # [rows, block_size] this block's logits, then weights
        acc = np.zeros((rows, head_dim), np.float32)  # [rows, head_dim] P.V, not yet divided by the sum
        m = np.full(rows, neg_inf, np.float32)  # [rows] running max of the logits
        total = np.zeros(rows, np.float32)  # [rows] running sum of exp(logit - m)
        ks = scale * k_scale[h]
        ss = strides[1]
        for blk in range(k_lo // block_size, (k_hi - 1) // block_size + 1):
            first = blk * block_size  # position of the block's slot 0
            j0, j1 = max(k_lo, first) - first, min(k_hi, first + block_size) - first
            at = block_table[b, blk] * strides[0] + h * strides[2]  # slot 0 of this block and KV head
            for j in range(j0, j1, 4):
                # a partial quad of keys or rows repeats its last: the repeated logits are written twice, never summed
                ja, jb, jc, jd = j, min(j + 1, j1 - 1), min(j + 2, j1 - 1), min(j + 3, j1 - 1)
                k0 = key[at + ja * ss : at + ja * ss + head_dim]
                k1 = key[at + jb * ss : at + jb * ss + head_dim]
                k2 = key[at + jc * ss : at + jc * ss + head_dim]
                k3 = key[at + jd * ss : at + jd * ss + head_dim]
                for r in range(0, rows, 4):
                    rb, rc, rd = min(r + 1, rows - 1), min(r + 2, rows - 1), min(r + 3, rows - 1)
                    dots4x4(s, q[r], q[rb], q[rc], q[rd], k0, k1, k2, k3, r, rb, rc, rd, ja, jb, jc, jd, ks)
            for r in range(rows):
                pos = p0 + r // group
                sr = s[r, j0:j1]
                if softcap != 0:
                    for j in range(sr.shape[0]):
                        sr[j] = softcap * tanh(sr[j] / softcap)
                # the walked range holds keys a row may not see: past its position (causal within the tile) and
                # before its window (for the tile's earlier queries); they get -inf
                lo = 0 if window == 0 else pos - window + 1 - (first + j0)
                hi = pos + 1 - (first + j0)
                row_max = m[r]
                for j in range(sr.shape[0]):
                    x = sr[j] if (j < hi and j >= lo) else neg_inf
                    sr[j] = x
                    row_max = maximum(x, row_max)  # NaN-propagating: a NaN logit makes the row NaN
                if row_max == neg_inf:  # nothing of this block visible to the row (yet): weights 0
                    sr[:] = 0.0
                    continue
                alpha = exp(m[r] - row_max)
                block_sum = np.float32(0.0)
                for j in range(sr.shape[0]):
                    p = exp(sr[j] - row_max)
                    sr[j] = p
                    block_sum += p
                total[r] = total[r] * alpha + block_sum
                m[r] = row_max
                if alpha != 1.0:
                    ar = acc[r]
                    for d in range(head_dim):
                        ar[d] *= alpha
            j = j0
            while j < j1:
                quad = j + 4 <= j1
                for r in range(0, rows, 4):
                    if quad and r + 4 <= rows:
                        weigh4x4(acc, s, value, at, ss, r, j, head_dim)
                    else:
                        for rr in range(r, min(r + 4, rows)):
                            for jj in range(j, min(j + 4, j1)):
                                weigh1(acc[rr], s[rr, jj], value[at + jj * ss : at + jj * ss + head_dim])
                j += 4
        for r in range(rows):
            inv = v_scale[h] / total[r]
            o, ar = out[t0 + r // group, h * group + r % group], acc[r]
            for d in range(head_dim):
                o[d] = ar[d] * inv
