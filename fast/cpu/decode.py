"""Decode rows of CPU paged attention (one query per batch row): a compiled kernel register-blocked over keys.

One work item is one batch row, all its KV heads (in fast's layout `[block, slot, kv_head, dim]` a slot's
keys for every head are one contiguous run, so the item streams each block front to back). Per block it
computes the logits of 4 keys x 4 query heads of a KV head at a time (`dots4x4`: 16 products per pass over
head_dim, each key and query row loaded once per pass, so LLVM keeps the 16 sums in vector registers), then
the online softmax of each query head over the block's keys (soft-cap, exp: vectorised loops over the
keys, no masks: a decode row sees every key of its walked range), then adds 4 weighted values at a time to
4 accumulator rows (`weigh4x4`: one load and one store of an accumulator row per 4 values). With fewer
than 4 query heads per KV head no key has rows to share it, and the quads would compute repeated rows while
reading 4 slots a slot-stride apart: such a row reads each block in memory order instead, slot by slot, one
dot product per query head and one weighted value per key (0.89x the time, MHA and group 2). There the
arithmetic per byte is too small to hide memory behind it: the row asks for the lines a fixed distance ahead in
what it reads (AHEAD_BYTES), its keys, then the block's values, then the next block's keys, as one stream.
The kernel is serial and releases the GIL: fast.cpu.threads hands its rows out in shares to as many threads as
torch uses.

Cache elements are widened as they are loaded (fast.cpu.lanes.widen: float32, bfloat16/float16 bits, fp8
codes), and fp8 scales apply per KV head (logits times scale * k_scale[h], output times v_scale[h]).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fast.cpu.lanes import FASTMATH, exp, maximum, prefetch, tanh, widen

# A row that reads its blocks in memory order (fewer than 4 query heads per KV head) asks for the cache lines this
# many bytes ahead of each key or value it reads. Measured on MHA 64 x 512 (1.07 GB of K and V) at one thread, against
# 8 KiB: 2 KiB 1.23x the time, 4 KiB 1.12x, 16 KiB 1.04x, 64 KiB 1.05x; asking for each next pass while this one runs
# (a block's 512 KiB of values while its keys are read, then the next block's keys) 1.13-1.21x
AHEAD_BYTES = 8192


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def decode_kernel(  # pragma: no cover - compiled; tested through its results
    out: np.ndarray,  # [T, num_heads, head_dim] float32, written for the rows' queries
    query: np.ndarray,  # [T, num_heads, head_dim] float32
    key: np.ndarray,  # [span] cache elements (float32, float16/bfloat16 bits, fp8 codes), addressed with strides
    value: np.ndarray,  # [span] the value cache, the same strides
    strides: np.ndarray,  # [3] int64: block, slot in block, KV head (elements)
    block_table: np.ndarray,  # [num_reqs, max_blocks] batch_idx -> physical block ids (checked by plan_items)
    seq_lens: np.ndarray,  # [num_reqs]
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    rows: np.ndarray,  # [n] int64 batch_idx of rows with exactly one query
    group: int,  # query heads per KV head
    head_dim: int,
    block_size: int,
    scale: np.float32,
    window: int,  # 0: no sliding window
    softcap: np.float32,  # 0: no soft-cap
    k_scale: np.ndarray,  # [num_kv_heads] float32: the logits of KV head h are scaled by scale * k_scale[h]
    v_scale: np.ndarray,  # [num_kv_heads] float32: its output rows by v_scale[h]
) -> None:
    num_heads = query.shape[1]
    num_kv_heads = num_heads // group
    neg_inf = np.float32(-np.inf)
    line = max(1, 64 // key.itemsize)  # cache elements per 64-byte cache line
    ahead = AHEAD_BYTES // key.itemsize  # how far ahead in its stream a memory-order row asks for lines
    for i in range(rows.shape[0]):
        b = rows[i]
        t = query_start_loc[b]
        pos = seq_lens[b] - 1  # the query's position: it sees keys [k_lo, pos]
        k_lo = 0 if window == 0 else max(0, pos - window + 1)
        q = query[t]  # [num_heads, head_dim]
        s = np.empty((num_heads, block_size), np.float32)  # [num_heads, block_size] logits, then weights
        acc = np.zeros((num_heads, head_dim), np.float32)  # [num_heads, head_dim] P.V, not yet divided by the sum
        m = np.full(num_heads, neg_inf, np.float32)  # [num_heads] running max of the logits
        total = np.zeros(num_heads, np.float32)  # [num_heads] running sum of exp(logit - m)
        for blk in range(k_lo // block_size, pos // block_size + 1):
            first = blk * block_size  # position of the block's slot 0
            j0, j1 = max(k_lo, first) - first, min(pos + 1, first + block_size) - first
            block_at = block_table[b, blk] * strides[0]
            if group < 4:  # too few query rows to share a key: read the block in memory order, slot by slot
                keys_end = block_at + j1 * strides[1]  # past the keys this pass reads; the values come next
                for j in range(j0, j1):
                    for h in range(num_kv_heads):
                        at = block_at + h * strides[2] + j * strides[1]
                        if at + ahead < keys_end:
                            for e in range(0, head_dim, line):
                                prefetch(key, at + ahead + e)
                        else:  # as far into the values, which the pass below reads from their first slot
                            for e in range(0, head_dim, line):
                                prefetch(value, at + ahead - keys_end + block_at + j0 * strides[1] + e)
                        for r in range(h * group, h * group + group):
                            s[r, j] = dot(q[r], key[at : at + head_dim]) * (scale * k_scale[h])
            else:
                for j in range(j0, j1, 4):
                    # a partial last quad repeats its last key: the repeated logits are written twice, never summed
                    ja, jb, jc, jd = j, min(j + 1, j1 - 1), min(j + 2, j1 - 1), min(j + 3, j1 - 1)
                    for h in range(num_kv_heads):
                        at = block_at + h * strides[2]
                        k0 = key[at + ja * strides[1] : at + ja * strides[1] + head_dim]
                        k1 = key[at + jb * strides[1] : at + jb * strides[1] + head_dim]
                        k2 = key[at + jc * strides[1] : at + jc * strides[1] + head_dim]
                        k3 = key[at + jd * strides[1] : at + jd * strides[1] + head_dim]
                        for jj in range(j, min(j + 4, j1)):  # the values these keys weigh, for the pass below
                            for e in range(0, head_dim, line):
                                prefetch(value, at + jj * strides[1] + e)
                        for g in range(0, group, 4):
                            r, last = h * group + g, h * group + group - 1  # a partial quad of rows repeats its last
                            rb, rc, rd = min(r + 1, last), min(r + 2, last), min(r + 3, last)
                            dots4x4(s, q[r], q[rb], q[rc], q[rd], k0, k1, k2, k3, r, rb, rc, rd, ja, jb, jc, jd,
                                    scale * k_scale[h])  # fmt: skip
            for r in range(num_heads):
                # a slice indexed by the loop variable from 0: Numba then knows the index is not negative and
                # drops its wraparound select, which would keep LLVM from vectorising the loop
                sr = s[r, j0:j1]
                if softcap != 0:
                    for j in range(sr.shape[0]):
                        sr[j] = softcap * tanh(sr[j] / softcap)
                row_max = m[r]
                for j in range(sr.shape[0]):
                    row_max = maximum(sr[j], row_max)  # NaN-propagating: a NaN logit makes the row NaN
                if row_max == neg_inf:  # every logit so far -inf: weights 0
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
            next_at = block_table[b, blk + 1] * strides[0] if blk < pos // block_size else -1
            if group < 4:
                values_end = block_at + j1 * strides[1]  # past the values this pass reads; the next block's keys next
                for j in range(j0, j1):
                    for h in range(num_kv_heads):
                        at = block_at + h * strides[2] + j * strides[1]
                        if at + ahead < values_end:
                            for e in range(0, head_dim, line):
                                prefetch(value, at + ahead + e)
                        elif next_at >= 0:  # as far into the next block's keys (from its slot 0)
                            for e in range(0, head_dim, line):
                                prefetch(key, at + ahead - values_end + next_at + e)
                        for r in range(h * group, h * group + group):
                            weigh1(acc[r], s[r, j], value[at : at + head_dim])
            else:
                j = j0
                while j < j1:
                    quad = j + 4 <= j1
                    for h in range(num_kv_heads):
                        at = block_at + h * strides[2]
                        if next_at >= 0:  # the next block's keys in the same slots, for its logits
                            for jj in range(j, min(j + 4, block_size)):
                                for e in range(0, head_dim, line):
                                    prefetch(key, next_at + h * strides[2] + jj * strides[1] + e)
                        for g in range(0, group, 4):
                            r = h * group + g
                            if quad and g + 4 <= group:
                                weigh4x4(acc, s, value, at, strides[1], r, j, head_dim)
                            else:
                                for rr in range(r, min(r + 4, h * group + group)):
                                    for jj in range(j, min(j + 4, j1)):
                                        weigh1(acc[rr], s[rr, jj], value[at + jj * strides[1] : at + jj * strides[1]
                                                                          + head_dim])  # fmt: skip
                    j += 4
        for r in range(num_heads):
            inv = v_scale[r // group] / total[r]
            o, ar = out[t, r], acc[r]
            for d in range(head_dim):
                o[d] = ar[d] * inv


@njit(cache=True, nogil=True, inline="always")
def dots4x4(  # pragma: no cover - compiled
    s: np.ndarray,  # [num_heads, block_size] float32, the 4 x 4 logits written
    qa: np.ndarray,  # [head_dim] float32, query rows ra..rd
    qb: np.ndarray,
    qc: np.ndarray,
    qd: np.ndarray,
    k0: np.ndarray,  # [head_dim] cache elements, keys j0..j3
    k1: np.ndarray,
    k2: np.ndarray,
    k3: np.ndarray,
    ra: int,
    rb: int,
    rc: int,
    rd: int,
    j0: int,
    j1: int,
    j2: int,
    j3: int,
    scale: np.float32,
) -> None:
    """s[r, j] = q_r . k_j * scale for 4 rows x 4 keys: one pass over head_dim, 16 sums held in registers."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0.0)
    for d in range(qa.shape[0]):
        x0, x1, x2, x3 = widen(k0[d]), widen(k1[d]), widen(k2[d]), widen(k3[d])
        y = qa[d]
        a00 += y * x0
        a01 += y * x1
        a02 += y * x2
        a03 += y * x3
        y = qb[d]
        a10 += y * x0
        a11 += y * x1
        a12 += y * x2
        a13 += y * x3
        y = qc[d]
        a20 += y * x0
        a21 += y * x1
        a22 += y * x2
        a23 += y * x3
        y = qd[d]
        a30 += y * x0
        a31 += y * x1
        a32 += y * x2
        a33 += y * x3
    # a repeated row or key (a partial quad) gets the same value twice
    s[rd, j3], s[rd, j2], s[rd, j1], s[rd, j0] = a33 * scale, a32 * scale, a31 * scale, a30 * scale
    s[rc, j3], s[rc, j2], s[rc, j1], s[rc, j0] = a23 * scale, a22 * scale, a21 * scale, a20 * scale
    s[rb, j3], s[rb, j2], s[rb, j1], s[rb, j0] = a13 * scale, a12 * scale, a11 * scale, a10 * scale
    s[ra, j3], s[ra, j2], s[ra, j1], s[ra, j0] = a03 * scale, a02 * scale, a01 * scale, a00 * scale


@njit(cache=True, nogil=True, inline="always")
def weigh4x4(  # pragma: no cover - compiled
    acc: np.ndarray,  # [num_heads, head_dim] float32, rows r..r+3 updated
    p: np.ndarray,  # [num_heads, block_size] float32 weights
    value: np.ndarray,  # [span] cache elements
    at: int,  # element offset of slot 0 of this block and KV head
    slot_stride: int,
    r: int,
    j: int,
    head_dim: int,
) -> None:
    """acc[r + i] += sum over 4 keys j.. of p[r + i, key] * v_key, for 4 rows: 16 products per accumulator pass."""
    v0 = value[at + j * slot_stride : at + j * slot_stride + head_dim]
    v1 = value[at + (j + 1) * slot_stride : at + (j + 1) * slot_stride + head_dim]
    v2 = value[at + (j + 2) * slot_stride : at + (j + 2) * slot_stride + head_dim]
    v3 = value[at + (j + 3) * slot_stride : at + (j + 3) * slot_stride + head_dim]
    pa, pb, pc, pd = p[r], p[r + 1], p[r + 2], p[r + 3]
    p00, p01, p02, p03 = pa[j], pa[j + 1], pa[j + 2], pa[j + 3]
    p10, p11, p12, p13 = pb[j], pb[j + 1], pb[j + 2], pb[j + 3]
    p20, p21, p22, p23 = pc[j], pc[j + 1], pc[j + 2], pc[j + 3]
    p30, p31, p32, p33 = pd[j], pd[j + 1], pd[j + 2], pd[j + 3]
    aa, ab, ac, ad = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
    for d in range(head_dim):
        x0, x1, x2, x3 = widen(v0[d]), widen(v1[d]), widen(v2[d]), widen(v3[d])
        aa[d] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
        ab[d] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
        ac[d] += p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
        ad[d] += p30 * x0 + p31 * x1 + p32 * x2 + p33 * x3


@njit(cache=True, nogil=True, inline="always")
def weigh1(  # pragma: no cover - compiled
    acc_row: np.ndarray,  # [head_dim] float32, updated
    p: np.float32,
    v_row: np.ndarray,  # [head_dim] cache elements
) -> None:
    for d in range(acc_row.shape[0]):
        acc_row[d] += p * widen(v_row[d])


@njit(cache=True, nogil=True, inline="always")
def dot(  # pragma: no cover - compiled
    q_row: np.ndarray,  # [head_dim] float32
    k_row: np.ndarray,  # [head_dim] cache elements
) -> np.float32:
    total = np.float32(0.0)
    for d in range(q_row.shape[0]):
        total += q_row[d] * widen(k_row[d])
    return total
