"""Rows of several queries (prefill, chunks of a prompt, drafts) of CPU paged attention: register-tiled.

A work item (plan_items) is one batch row's run of tiles of queries for one KV head: a tile's rows are its
queries times the group's query heads, padded to a multiple of 16 (`rp`). Each tile keeps its queries
transposed, `qt[d, r]` (already times the logits' scale and log2(e): the softmax runs in powers of 2,
`exp2_nonpositive`), and for every block the item walks:
1. the item copies the block's keys and values for this KV head into two float32 buffers (`kbuf`, `vbuf`),
   widened from the cache dtype, once for all its tiles: rows next to each other instead of a KV-head stride
   apart, which keeps the tiles' loads in L1 (the values read where they lie took 1.4x the time); then each
   tile that sees some of the block's keys (`_tile_block`)
2. computes the logits `s[j, r]` 8 keys x 32 rows at a time (`_logits_8x32`): per step of head_dim, two
   vector loads of `qt`, a broadcast of each key's element and 16 FMAs into 16 vector registers;
3. runs the online softmax down the columns: soft-cap, the causal and window mask (only in blocks that
   cross a row's limits), the running max, the rescale factor `alpha` and the sum, 16 rows per vector;
4. adds P.V 8 rows x 32 dimensions at a time (`_weigh_8x32`): the accumulator tile is loaded once, scaled
   by `alpha`, and takes, per key, two vector loads of the value, a broadcast of each row's weight and 16
   FMAs.
The tiles are F32x16 values (fast.cpu.simd), so they stay in registers. Keys of a block outside the walked
range are never copied or read, so unwritten slots may hold anything. The kernel is serial and releases the
GIL: fast.cpu.threads hands its items out in shares.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fast.cpu import simd
from fast.cpu.lanes import FASTMATH, LOG2E, exp2_nonpositive, maximum, tanh, widen

LANES = simd.LANES
DIMS_PER_TILE = 2 * LANES  # head_dim is padded to a multiple of this in the value and accumulator buffers


@njit(cache=True, inline="always")
def window_start(pos: int, window: int) -> int:  # pragma: no cover - compiled
    """The first key position a query at `pos` sees (0: no sliding window)."""
    return 0 if window == 0 else max(0, pos - window + 1)


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def prefill_kernel(  # pragma: no cover - compiled; tested through its results
    out: np.ndarray,  # [T, num_heads, head_dim] float32, written for the items' query rows
    query: np.ndarray,  # [T, num_heads, head_dim] float32
    key: np.ndarray,  # [span] cache elements (float32, float16/bfloat16 bits, fp8 codes), addressed with strides
    value: np.ndarray,  # [span] the value cache, the same strides
    strides: np.ndarray,  # [3] int64: block, slot in block, KV head (elements)
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids (checked by plan_items)
    items: np.ndarray,  # [num_items, ITEM_FIELDS] int64: batch_idx, query tokens [t0, t1), first key position,
    #                     position of query t0, KV head
    tile: int,  # queries per tile: an item's queries are tiles of `tile` from t0 on, the last one shorter
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
    dp = (head_dim + DIMS_PER_TILE - 1) // DIMS_PER_TILE * DIMS_PER_TILE
    kbuf = np.empty(block_size * head_dim, np.float32)  # [block_size, head_dim] this block's keys
    vbuf = np.zeros(block_size * dp, np.float32)  # [block_size, dp] its values; the padding stays 0
    rp_max = (tile * group + LANES - 1) // LANES * LANES
    s = np.empty(block_size * rp_max, np.float32)  # [block_size, rp] a tile's logits in this block, then weights
    new_m = np.empty(rp_max, np.float32)  # [rp] a tile's max after this block, then the exp's offset
    block_sum = np.empty(rp_max, np.float32)  # [rp]
    alpha = np.empty(rp_max, np.float32)  # [rp] 2**(old max - new max): what acc and total are scaled by
    ss = strides[1]
    for it in range(items.shape[0]):
        b, t0, t1, k_lo, p0, h = items[it, 0], items[it, 1], items[it, 2], items[it, 3], items[it, 4], items[it, 5]
        num_tiles = (t1 - t0 + tile - 1) // tile
        ks = scale * k_scale[h] * LOG2E  # the logits in log2 units: the softmax takes powers of 2
        # per tile u: queries [t0 + u * tile, ...), rows (query, query head of h's group) padded to rps[u]
        qt = np.zeros((num_tiles, head_dim * rp_max), np.float32)  # [head_dim, rp] the rows transposed, times ks
        pos = np.empty((num_tiles, rp_max), np.int64)  # a row sees keys [lo, pos]; padding rows repeat the last's
        lo = np.zeros((num_tiles, rp_max), np.int64)
        acc = np.zeros((num_tiles, rp_max * dp), np.float32)  # [rp, dp] P.V, not yet divided by the sum
        m = np.full((num_tiles, rp_max), neg_inf, np.float32)  # running max of the logits
        total = np.zeros((num_tiles, rp_max), np.float32)  # running sum of exp(logit - m)
        rps, p0s = np.empty(num_tiles, np.int64), np.empty(num_tiles, np.int64)
        for u in range(num_tiles):
            q0, num_q = t0 + u * tile, min(tile, t1 - t0 - u * tile)
            rows = num_q * group
            rp = (rows + LANES - 1) // LANES * LANES
            rps[u], p0s[u] = rp, p0 + u * tile
            qtu = qt[u]
            for r in range(rows):
                qr = query[q0 + r // group, h * group + r % group]
                for d in range(head_dim):
                    qtu[d * rp + r] = qr[d] * ks
            for r in range(rp):
                pos[u, r] = p0s[u] + min(r // group, num_q - 1)
                if window != 0:
                    lo[u, r] = pos[u, r] - window + 1
        k_hi = p0 + t1 - t0  # one past the last query's position
        for blk in range(k_lo // block_size, (k_hi - 1) // block_size + 1):
            first = blk * block_size  # position of the block's slot 0
            j0, j1 = max(k_lo, first) - first, min(k_hi, first + block_size) - first
            at = block_table[b, blk] * strides[0] + h * strides[2]
            for j in range(j0, j1):  # copied once for all the item's tiles
                kr, kb = key[at + j * ss : at + j * ss + head_dim], kbuf[j * head_dim : j * head_dim + head_dim]
                for d in range(head_dim):
                    kb[d] = widen(kr[d])
                vr, vb = value[at + j * ss : at + j * ss + head_dim], vbuf[j * dp : j * dp + head_dim]
                for d in range(head_dim):
                    vb[d] = widen(vr[d])
            for u in range(num_tiles):
                tile_hi = min(p0s[u] + tile, k_hi)  # one past the tile's last query's position
                tile_lo = window_start(p0s[u], window)
                ju0, ju1 = max(tile_lo, first + j0) - first, min(tile_hi, first + j1) - first
                if ju1 > ju0:
                    _tile_block(s, qt[u], kbuf, vbuf, acc[u], m[u], total[u], new_m, block_sum, alpha, pos[u], lo[u],
                                rps[u], dp, head_dim, first, ju0, ju1, p0s[u], tile_hi, window, softcap)  # fmt: skip
        for u in range(num_tiles):
            q0, rows = t0 + u * tile, min(tile, t1 - t0 - u * tile) * group
            for r in range(rows):
                inv = v_scale[h] / total[u, r]
                o, ar = out[q0 + r // group, h * group + r % group], acc[u, r * dp : r * dp + head_dim]
                for d in range(head_dim):
                    o[d] = ar[d] * inv


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy", inline="always")
def _tile_block(  # pragma: no cover - compiled
    s: np.ndarray,  # [block_size, rp] float32 scratch: the logits, then the weights
    qt: np.ndarray,  # [head_dim, rp] float32 the tile's rows, transposed
    kbuf: np.ndarray,  # [block_size, head_dim] float32 the block's keys
    vbuf: np.ndarray,  # [block_size, dp] float32 its values
    acc: np.ndarray,  # [rp, dp] float32 the tile's P.V
    m: np.ndarray,  # [rp] float32 its running max
    total: np.ndarray,  # [rp] float32 its running sum
    new_m: np.ndarray,  # [rp] float32 scratch
    block_sum: np.ndarray,  # [rp] float32 scratch
    alpha: np.ndarray,  # [rp] float32 scratch
    pos: np.ndarray,  # [rp] int64 a row sees keys [lo, pos]
    lo: np.ndarray,  # [rp] int64
    rp: int,
    dp: int,
    head_dim: int,
    first: int,  # position of the block's slot 0
    j0: int,  # the tile's keys in this block: slots [j0, j1)
    j1: int,
    p0: int,  # position of the tile's first query
    k_hi: int,  # one past its last query's position
    window: int,
    softcap: np.float32,
) -> None:
    """One tile's step over one block: logits, the online softmax, and P.V added to acc."""
    neg_inf = np.float32(-np.inf)
    softcap2 = softcap * LOG2E
    for j in range(j0, j1, 8):
        # a partial group of keys repeats its last: the repeated logits are written twice, never summed
        last = j1 - 1
        ja, jb, jc, jd = j, min(j + 1, last), min(j + 2, last), min(j + 3, last)
        je, jf, jg, jh = min(j + 4, last), min(j + 5, last), min(j + 6, last), min(j + 7, last)
        for rv in range(0, rp, 2 * LANES):
            if rv + 2 * LANES <= rp:
                _logits_8x32(s, qt, kbuf, rp, rv, head_dim, ja, jb, jc, jd, je, jf, jg, jh)
            else:
                _logits_8x16(s, qt, kbuf, rp, rv, head_dim, ja, jb, jc, jd, je, jf, jg, jh)
    new_m[:rp] = m[:rp]
    # keys some row may not see: past the tile's first query (causal) or before its last one's window
    masked = first + j1 - 1 > p0 or (window != 0 and first + j0 < k_hi - window)
    for j in range(j0, j1):
        sj = s[j * rp : j * rp + rp]
        if softcap != 0:  # softcap * tanh(logit / softcap), in log2 units
            for r in range(rp):
                sj[r] = softcap2 * tanh(sj[r] / softcap2)
        if masked:
            for r in range(rp):
                x = sj[r] if (first + j <= pos[r] and first + j >= lo[r]) else neg_inf
                sj[r] = x
                new_m[r] = maximum(x, new_m[r])  # NaN-propagating: a NaN logit makes the row NaN
        else:
            for r in range(rp):
                new_m[r] = maximum(sj[r], new_m[r])
    for r in range(rp):
        # a row that has seen nothing yet keeps max -inf; its weights exp(-inf - 0) are 0
        offset = new_m[r] if new_m[r] != neg_inf else np.float32(0.0)
        alpha[r] = exp2_nonpositive(m[r] - offset)
        m[r] = new_m[r]
        new_m[r] = offset
        block_sum[r] = 0.0
    for j in range(j0, j1):
        sj = s[j * rp : j * rp + rp]
        for r in range(rp):
            p = exp2_nonpositive(sj[r] - new_m[r])
            sj[r] = p
            block_sum[r] += p
    for r in range(rp):
        total[r] = total[r] * alpha[r] + block_sum[r]
    for r in range(0, rp, 8):
        for dv in range(0, dp, DIMS_PER_TILE):
            _weigh_8x32(acc, s, vbuf, alpha, rp, dp, r, dv, j0, j1)


@njit(cache=True, nogil=True, inline="always")
def _logits_8x32(  # pragma: no cover - compiled
    s: np.ndarray,  # [block_size, rp] float32: s[j, rv : rv + 32] written for the 8 keys
    qt: np.ndarray,  # [head_dim, rp] float32 query rows, transposed
    kbuf: np.ndarray,  # [block_size, head_dim] float32 keys
    rp: int,
    rv: int,  # first of the 32 rows
    head_dim: int,
    ja: int,  # the 8 keys (slots in the block)
    jb: int,
    jc: int,
    jd: int,
    je: int,
    jf: int,
    jg: int,
    jh: int,
) -> None:
    """s[j, rv + i] = qt[:, rv + i] . kbuf[j] for 8 keys j x 32 rows: 16 vector sums over head_dim."""
    ka, kb, kc, kd = ja * head_dim, jb * head_dim, jc * head_dim, jd * head_dim
    ke, kf, kg, kh = je * head_dim, jf * head_dim, jg * head_dim, jh * head_dim
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = simd.zeros()  # rows rv .. rv + 15 of each key
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = simd.zeros()  # rows rv + 16 .. rv + 31
    for d in range(head_dim):
        qa, qb = simd.load(qt, d * rp + rv), simd.load(qt, d * rp + rv + LANES)
        x = simd.broadcast(kbuf, ka + d)
        a0, b0 = simd.fma(x, qa, a0), simd.fma(x, qb, b0)
        x = simd.broadcast(kbuf, kb + d)
        a1, b1 = simd.fma(x, qa, a1), simd.fma(x, qb, b1)
        x = simd.broadcast(kbuf, kc + d)
        a2, b2 = simd.fma(x, qa, a2), simd.fma(x, qb, b2)
        x = simd.broadcast(kbuf, kd + d)
        a3, b3 = simd.fma(x, qa, a3), simd.fma(x, qb, b3)
        x = simd.broadcast(kbuf, ke + d)
        a4, b4 = simd.fma(x, qa, a4), simd.fma(x, qb, b4)
        x = simd.broadcast(kbuf, kf + d)
        a5, b5 = simd.fma(x, qa, a5), simd.fma(x, qb, b5)
        x = simd.broadcast(kbuf, kg + d)
        a6, b6 = simd.fma(x, qa, a6), simd.fma(x, qb, b6)
        x = simd.broadcast(kbuf, kh + d)
        a7, b7 = simd.fma(x, qa, a7), simd.fma(x, qb, b7)
    # a repeated key (a partial group) gets the same values twice; the first key's are written last
    simd.store(s, jh * rp + rv, a7)
    simd.store(s, jh * rp + rv + LANES, b7)
    simd.store(s, jg * rp + rv, a6)
    simd.store(s, jg * rp + rv + LANES, b6)
    simd.store(s, jf * rp + rv, a5)
    simd.store(s, jf * rp + rv + LANES, b5)
    simd.store(s, je * rp + rv, a4)
    simd.store(s, je * rp + rv + LANES, b4)
    simd.store(s, jd * rp + rv, a3)
    simd.store(s, jd * rp + rv + LANES, b3)
    simd.store(s, jc * rp + rv, a2)
    simd.store(s, jc * rp + rv + LANES, b2)
    simd.store(s, jb * rp + rv, a1)
    simd.store(s, jb * rp + rv + LANES, b1)
    simd.store(s, ja * rp + rv, a0)
    simd.store(s, ja * rp + rv + LANES, b0)


@njit(cache=True, nogil=True, inline="always")
def _logits_8x16(  # pragma: no cover - compiled
    s: np.ndarray,  # [block_size, rp] float32: s[j, rv : rv + 16] written for the 8 keys
    qt: np.ndarray,  # [head_dim, rp] float32 query rows, transposed
    kbuf: np.ndarray,  # [block_size, head_dim] float32 keys
    rp: int,
    rv: int,  # first of the 16 rows (the last 16 of rp)
    head_dim: int,
    ja: int,  # the 8 keys (slots in the block)
    jb: int,
    jc: int,
    jd: int,
    je: int,
    jf: int,
    jg: int,
    jh: int,
) -> None:
    """_logits_8x32 for the last 16 rows when rp is an odd number of vectors: 8 vector sums."""
    ka, kb, kc, kd = ja * head_dim, jb * head_dim, jc * head_dim, jd * head_dim
    ke, kf, kg, kh = je * head_dim, jf * head_dim, jg * head_dim, jh * head_dim
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = simd.zeros()
    for d in range(head_dim):
        qa = simd.load(qt, d * rp + rv)
        a0 = simd.fma(simd.broadcast(kbuf, ka + d), qa, a0)
        a1 = simd.fma(simd.broadcast(kbuf, kb + d), qa, a1)
        a2 = simd.fma(simd.broadcast(kbuf, kc + d), qa, a2)
        a3 = simd.fma(simd.broadcast(kbuf, kd + d), qa, a3)
        a4 = simd.fma(simd.broadcast(kbuf, ke + d), qa, a4)
        a5 = simd.fma(simd.broadcast(kbuf, kf + d), qa, a5)
        a6 = simd.fma(simd.broadcast(kbuf, kg + d), qa, a6)
        a7 = simd.fma(simd.broadcast(kbuf, kh + d), qa, a7)
    simd.store(s, jh * rp + rv, a7)
    simd.store(s, jg * rp + rv, a6)
    simd.store(s, jf * rp + rv, a5)
    simd.store(s, je * rp + rv, a4)
    simd.store(s, jd * rp + rv, a3)
    simd.store(s, jc * rp + rv, a2)
    simd.store(s, jb * rp + rv, a1)
    simd.store(s, ja * rp + rv, a0)


@njit(cache=True, nogil=True, inline="always")
def _weigh_8x32(  # pragma: no cover - compiled
    acc: np.ndarray,  # [rp, dp] float32: rows r .. r + 7, dims dv .. dv + 31 scaled by alpha, then added to
    p: np.ndarray,  # [block_size, rp] float32 weights
    vbuf: np.ndarray,  # [block_size, dp] float32 values
    alpha: np.ndarray,  # [rp] float32
    rp: int,
    dp: int,
    r: int,
    dv: int,
    j0: int,  # the block's walked keys [j0, j1)
    j1: int,
) -> None:
    """acc[r + i, dv : dv + 32] = alpha[r + i] * acc[...] + sum over keys j of p[j, r + i] * vbuf[j, dv : dv + 32]."""
    o0, o1, o2, o3 = r * dp + dv, (r + 1) * dp + dv, (r + 2) * dp + dv, (r + 3) * dp + dv
    o4, o5, o6, o7 = (r + 4) * dp + dv, (r + 5) * dp + dv, (r + 6) * dp + dv, (r + 7) * dp + dv
    x = simd.broadcast(alpha, r)
    a0, b0 = simd.mul(simd.load(acc, o0), x), simd.mul(simd.load(acc, o0 + LANES), x)
    x = simd.broadcast(alpha, r + 1)
    a1, b1 = simd.mul(simd.load(acc, o1), x), simd.mul(simd.load(acc, o1 + LANES), x)
    x = simd.broadcast(alpha, r + 2)
    a2, b2 = simd.mul(simd.load(acc, o2), x), simd.mul(simd.load(acc, o2 + LANES), x)
    x = simd.broadcast(alpha, r + 3)
    a3, b3 = simd.mul(simd.load(acc, o3), x), simd.mul(simd.load(acc, o3 + LANES), x)
    x = simd.broadcast(alpha, r + 4)
    a4, b4 = simd.mul(simd.load(acc, o4), x), simd.mul(simd.load(acc, o4 + LANES), x)
    x = simd.broadcast(alpha, r + 5)
    a5, b5 = simd.mul(simd.load(acc, o5), x), simd.mul(simd.load(acc, o5 + LANES), x)
    x = simd.broadcast(alpha, r + 6)
    a6, b6 = simd.mul(simd.load(acc, o6), x), simd.mul(simd.load(acc, o6 + LANES), x)
    x = simd.broadcast(alpha, r + 7)
    a7, b7 = simd.mul(simd.load(acc, o7), x), simd.mul(simd.load(acc, o7 + LANES), x)
    for j in range(j0, j1):
        va, vb = simd.load(vbuf, j * dp + dv), simd.load(vbuf, j * dp + dv + LANES)
        at = j * rp + r
        x = simd.broadcast(p, at)
        a0, b0 = simd.fma(x, va, a0), simd.fma(x, vb, b0)
        x = simd.broadcast(p, at + 1)
        a1, b1 = simd.fma(x, va, a1), simd.fma(x, vb, b1)
        x = simd.broadcast(p, at + 2)
        a2, b2 = simd.fma(x, va, a2), simd.fma(x, vb, b2)
        x = simd.broadcast(p, at + 3)
        a3, b3 = simd.fma(x, va, a3), simd.fma(x, vb, b3)
        x = simd.broadcast(p, at + 4)
        a4, b4 = simd.fma(x, va, a4), simd.fma(x, vb, b4)
        x = simd.broadcast(p, at + 5)
        a5, b5 = simd.fma(x, va, a5), simd.fma(x, vb, b5)
        x = simd.broadcast(p, at + 6)
        a6, b6 = simd.fma(x, va, a6), simd.fma(x, vb, b6)
        x = simd.broadcast(p, at + 7)
        a7, b7 = simd.fma(x, va, a7), simd.fma(x, vb, b7)
    simd.store(acc, o0, a0)
    simd.store(acc, o0 + LANES, b0)
    simd.store(acc, o1, a1)
    simd.store(acc, o1 + LANES, b1)
    simd.store(acc, o2, a2)
    simd.store(acc, o2 + LANES, b2)
    simd.store(acc, o3, a3)
    simd.store(acc, o3 + LANES, b3)
    simd.store(acc, o4, a4)
    simd.store(acc, o4 + LANES, b4)
    simd.store(acc, o5, a5)
    simd.store(acc, o5 + LANES, b5)
    simd.store(acc, o6, a6)
    simd.store(acc, o6 + LANES, b6)
    simd.store(acc, o7, a7)
    simd.store(acc, o7 + LANES, b7)
