"""Unified varlen paged attention: one kernel for mixed prefill/decode batches (vLLM's unified attention).

Grid: (query tiles across all requests, num_kv_heads). A program takes BLOCK_Q consecutive query tokens
of one request times every query head of one KV head (GQA), so each K/V tile it loads serves
BLOCK_Q * group rows. Request b's tiles are numbered from `query_start_loc[b] // BLOCK_Q + b`; this
numbering never overlaps between requests and never needs more than `T // BLOCK_Q + num_reqs` tiles, so
the launcher sizes the grid from shapes alone (no device->host sync) and each program finds its request
by a binary search over query_start_loc. Surplus programs exit at once.

K/V positions are walked in tiles of BLOCK_N tokens, each token's physical block looked up in the block
table. Only positions some row of the program may see are loaded (causal upper end, sliding-window lower
end): blocks wholly outside the window are never touched. Online softmax in float32.

Reductions are spelled `tl.reduce(x, axis, tl.standard._..._combine)` rather than tl.max/tl.sum: those are
themselves jitted functions, which the dual-flavour fast.runtime.Kernel cannot call from the interpreter
(the interpreter recognises these combine functions and reduces with NumPy).

fp8 caches (FP8_MANTISSA > 0): the caches are uint8 codes, decoded in the K/V loop by moving their bits
into a float16's (exact: every fp8 value is a float16, bfloat16 and float32 value; no float8 type, which
Triton compiles only for sm_89+ and its interpreter not at all), then cast to the query's dtype. The
scales are applied as FlashInfer does, not per element: the logits' scale is `scale * k_scale[kv_head]`
and the output is multiplied by `v_scale[kv_head]` (a program serves one KV head, so one value each).
Software pipelining is off for fp8 tiles (num_stages=1): pipelined, they took 150-255 registers a thread
on sm_80/sm_90 and spilled (tests/test_kernel_compile.py); unpipelined, 52-128.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import interpret_enabled, kernel
from spec.fp8 import Fp8Format

BLOCK_M_MIN = 16  # tl.dot needs >= 16 rows
BLOCK_N = 32  # key positions per inner tile
# float32 operands double the registers of a tile; at 4 warps ptxas spilled (8 bytes of stack on sm_80 and
# sm_90, see tests/test_kernel_compile.py), at 8 warps no configuration does
NUM_WARPS = 4
NUM_WARPS_FP32_DOT = 8


def query_tile(group: int) -> tuple[int, int, int]:
    """(HEADS_PAD, BLOCK_M, BLOCK_Q) for `group` query heads per KV head: BLOCK_Q tokens x HEADS_PAD heads."""
    heads_pad = triton.next_power_of_2(group)
    block_m = max(BLOCK_M_MIN, heads_pad)
    return heads_pad, block_m, block_m // heads_pad


def paged_attention_triton(
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
    fmt: Fp8Format | None = None,  # caches of uint8 codes of this format, or None: the query's dtype
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] float32, for an fp8 cache
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:  # nothing to attend; empty tensors' strides mean nothing
        return
    _check_launch(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, fmt, k_scale, v_scale)
    group = num_heads // num_kv_heads
    heads_pad, block_m, block_q = query_tile(group)
    fp32_dot = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and interpret_enabled())
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        query if k_scale is None else k_scale, query if v_scale is None else v_scale,  # unread without fp8
        num_reqs, group, head_dim, block_size,
        float(scale), float(softcap or 1.0), int(sliding_window or 1),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        BLOCK_Q=block_q, HEADS_PAD=heads_pad, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, FP32_DOT=fp32_dot,
        FP8_MANTISSA=0 if fmt is None else fmt.mantissa_bits,
        num_warps=NUM_WARPS_FP32_DOT if fp32_dot else NUM_WARPS,
        num_stages=3 if fmt is None else 1,  # pipelined uint8 tiles took 150-255 registers (and spilled)
    )  # fmt: skip


def _check_launch(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: Fp8Format | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """What the kernel's addressing assumes; fast.attention.paged_attention arranges all of it for its callers."""
    _, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"paged_attention: out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)}")
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: key_cache {tuple(key_cache.shape)} and value_cache must share a 4-d shape")
    if key_cache.stride() != value_cache.stride():  # one set of strides addresses both caches
        raise ValueError(f"paged_attention: value_cache strides {value_cache.stride()} differ from key_cache's")
    if num_heads % key_cache.shape[2] or key_cache.shape[3] != head_dim:
        raise ValueError(f"paged_attention: query {tuple(query.shape)} does not fit key_cache {tuple(key_cache.shape)}")
    cache_dtype = query.dtype if fmt is None else torch.uint8
    if not cache_dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(f"paged_attention: query {query.dtype} vs caches {key_cache.dtype}, {value_cache.dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fmt is not None and (
            scale is None or tuple(scale.shape) != (key_cache.shape[2],) or scale.dtype != torch.float32
        ):
            raise ValueError(f"paged_attention: {name} must be [{key_cache.shape[2]}] float32 for an fp8 cache")
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"paged_attention: block_table {tuple(block_table.shape)} must be [num_reqs={num_reqs}, max]")
    if tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(f"paged_attention: query_start_loc {tuple(query_start_loc.shape)} must be [{num_reqs + 1}]")
    # the head_dim axis is addressed without a stride (so loads vectorise), as are the rows of the small tensors
    for name, stride in (
        ("query", query.stride(2)), ("out", out.stride(2)), ("key_cache", key_cache.stride(3)),
        ("block_table", block_table.stride(1)), ("seq_lens", seq_lens.stride(0)),
        ("query_start_loc", query_start_loc.stride(0)),
    ):  # fmt: skip
        if stride != 1:
            raise ValueError(f"paged_attention: {name} must have stride 1 along its last axis, got {stride}")


@kernel
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    query_ptr,  # [T, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens_ptr,  # [num_reqs]
    query_start_loc_ptr,  # [num_reqs + 1]
    k_scale_ptr,  # [num_kv_heads] float32, read only for an fp8 cache
    v_scale_ptr,  # [num_kv_heads] float32, read only for an fp8 cache
    num_reqs,
    group,  # query heads per KV head
    head_dim,
    block_size,
    scale,
    softcap,  # read only if USE_SOFTCAP
    sliding_window,  # read only if USE_WINDOW
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_b,  # per physical block (shared by both caches)
    cache_stride_o,  # per offset within a block
    cache_stride_h,  # per KV head
    block_table_stride,  # per batch row
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEADS_PAD: tl.constexpr,  # next_power_of_2(group)
    BLOCK_M: tl.constexpr,  # BLOCK_Q * HEADS_PAD rows: row m is token m // HEADS_PAD, head m % HEADS_PAD
    BLOCK_N: tl.constexpr,  # key positions per tile
    BLOCK_D: tl.constexpr,  # padded head_dim (>= 16 for tl.dot); lanes past head_dim are masked
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    # dots in full float32 (not TF32): for float32 inputs, and for bfloat16 under Triton's interpreter, whose
    # tl.dot multiplies bfloat16's raw uint16 storage (Triton 3.x); compiled bfloat16 dots are native
    FP32_DOT: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: caches of the query's dtype; 3 (e4m3) or 2 (e5m2): uint8 codes
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # the request owning this tile: the last b with query_start_loc[b] // BLOCK_Q + b <= q_tile
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_tile = q_tile - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= query_len:  # surplus program, or past the request's queries
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // HEADS_PAD  # [BLOCK_M] query index within the request
    head_in_group = rows % HEADS_PAD
    row_mask = (q_idx < query_len) & (head_in_group < group)
    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] flat token index
    head = kv_head * group + head_in_group  # [BLOCK_M] query head
    q_pos = context_len + q_idx  # [BLOCK_M] position of each row's query
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(
        query_ptr + token[:, None] * query_stride_t + head[:, None] * query_stride_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # key positions any row here may see: causal up to the last query, window down from the first
    first_q_pos = context_len + local_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_q_pos - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    logit_scale = scale
    if FP8_MANTISSA > 0:  # FlashInfer's dequantization: the key scale joins the logits' scale
        logit_scale = scale * tl.load(k_scale_ptr + kv_head)
    table_row = block_table_ptr + tl.cast(req, tl.int64) * block_table_stride
    cols = tl.arange(0, BLOCK_N)
    for tile_start in range((kv_begin // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        k_pos = tile_start + cols  # [BLOCK_N]
        k_mask = (k_pos >= kv_begin) & (k_pos < kv_end)  # never read outside the visible range
        phys = tl.load(table_row + k_pos // block_size, mask=k_mask, other=0).to(tl.int64)
        kv_off = phys * cache_stride_b + (k_pos % block_size) * cache_stride_o + kv_head * cache_stride_h
        k_mask_t = k_mask[None, :] & dim_mask[:, None]  # [BLOCK_D, BLOCK_N]
        k = tl.load(key_cache_ptr + kv_off[None, :] + dims[:, None], mask=k_mask_t, other=0.0)  # [BLOCK_D, BLOCK_N]
        v_mask = k_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + kv_off[:, None] + dims[None, :], mask=v_mask, other=0.0)
        if FP8_MANTISSA > 0:
            # codes -> the values they spell (spec.fp8.decode), exactly, written out twice (K, then V): the
            # dual-flavour kernel cannot call a jitted helper under the interpreter. An e5m2 code is the top
            # byte of the float16 of its value; an e4m3 code's magnitude bits moved 7 up are the float16 of
            # value / 256 (subnormals included), and its all-ones magnitude is NaN.
            k16 = k.to(tl.int16)
            v16 = v.to(tl.int16)
            if FP8_MANTISSA == 2:
                k = (k16 << 8).to(tl.float16, bitcast=True)
                v = (v16 << 8).to(tl.float16, bitcast=True)
            else:
                k_half = (((k16 & 0x7F) << 7) | ((k16 & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
                v_half = (((v16 & 0x7F) << 7) | ((v16 & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
                k = tl.where((k16 & 0x7F) == 0x7F, float("nan"), k_half)
                v = tl.where((v16 & 0x7F) == 0x7F, float("nan"), v_half)
            k = k.to(query_ptr.dtype.element_ty)
            v = v.to(query_ptr.dtype.element_ty)
        if FP32_DOT:  # noqa: SIM108 - a statement, so both branches read alike with the second dot's
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * logit_scale  # [BLOCK_M, BLOCK_N] float32
        if USE_SOFTCAP:
            # softcap * tanh(s / softcap), written with exp(-2|x|) <= 1 so it cannot overflow
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t)
        visible = k_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that saw nothing yet: avoid inf - inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8_MANTISSA > 0:  # FlashInfer's dequantization: the value scale multiplies the output
        acc = acc * tl.load(v_scale_ptr + kv_head)
    tl.store(
        out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
