"""MLA's absorbed decode over the paged latent cache: multi-query attention whose key is the latent entry itself.

Grid: (query tiles across all requests, head blocks). A program takes BLOCK_Q consecutive query tokens of one
request times HEADS_PAD query heads (rows of one [BLOCK_M, ...] tile, BLOCK_M >= 16 for tl.dot), so every latent
entry it loads serves BLOCK_M rows: all heads read the same cache (one KV head), which is why MLA decode is
compute-bound where multi-head decode is not. Request b's tiles are numbered from `query_start_loc[b] // BLOCK_Q
+ b`, the numbering of fast.kernels.paged_attention (the grid sized from shapes alone, each program finding its
request by a binary search), so decode rows, 1 + K verify rows and prefill chunks share one launch.

Per tile of BLOCK_N key positions the entry [c, k_pe] is loaded once, row by position ([BLOCK_N, BLOCK_L] and
[BLOCK_N, BLOCK_R]): the logits are `q_latent . c + q_pe . k_pe` (two dots, the first against c transposed),
masked causally, then an online softmax in float32 and `acc += p . c`, the same tile of c as the value. The
output stays in latent space [T, H, kv_lora_rank]; the model applies W_UV.

Under decode context parallelism (DCP: a `ContextParallel`, spec/context_parallel.py) the cache is one rank's
share: its entry j holds position `(j // I) * (CP*I) + r*I + j % I`, so the key loop walks the rank's own entries
(those below the local length of the tile's visible range) and masks by those positions; with `lse` the kernel
also stores each row's log-sum-exp (-inf for a row that saw no key: an empty state, output 0), the partial state
spec.context_parallel.partial_mla_decode_attention returns. Without DCP entry j is position j, as before.

fp8 caches (FP8_MANTISSA > 0): uint8 codes decoded as fast.kernels.paged_attention decodes them (bits moved into
a float16, exact), then cast to the query's dtype. The one scale of the cache applies as FlashInfer's do: the
logits' scale times k_scale, the output times k_scale (the value is the same entry).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import interpret_enabled, kernel
from spec.context_parallel import ContextParallel
from spec.fp8 import Fp8Format

BLOCK_M_MIN = 16  # tl.dot needs >= 16 rows
HEADS_MAX = 16  # query heads per program: more heads get more programs (DeepSeek's 128: 8 head blocks)
BLOCK_N = 16  # key positions per tile
# the [16, 512] float32 accumulator and the query's [16, 512] tile are live across the whole key loop: at 4 warps
# 16-bit tiles took 188-196 registers a thread, 255 with fp8 decoding, which spilled (sm_80, sm_90); at 8 warps
# 101-176 and no spill (tests/test_kernel_compile.py). Float32 tiles at 8 warps: 102-108.
NUM_WARPS = 8


def query_tile(num_heads: int) -> tuple[int, int, int]:
    """(HEADS_PAD, BLOCK_M, BLOCK_Q): BLOCK_Q tokens x HEADS_PAD heads of one head block."""
    heads_pad = min(HEADS_MAX, triton.next_power_of_2(num_heads))
    block_m = max(BLOCK_M_MIN, heads_pad)
    return heads_pad, block_m, block_m // heads_pad


def mla_decode_triton(
    out: torch.Tensor,  # [T, num_heads, kv_lora_rank] of the query's dtype, zero-filled, written in place
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank], last axis stride 1
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim], last axis stride 1
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]: the query's dtype, or uint8 codes
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    fmt: Fp8Format | None = None,  # a cache of uint8 codes of this format, or None: the query's dtype
    k_scale: float = 1.0,  # the cache's one scale, for an fp8 cache
    cp: ContextParallel | None = None,  # kv_cache is rank cp.rank's share; seq_lens stay the full lengths
    lse: torch.Tensor | None = None,  # [T, num_heads] float32, -inf-filled, written in place: each row's LSE
) -> None:
    num_tokens, num_heads, rank = q_latent.shape
    _, block_size, width = kv_cache.shape
    rope_dim = width - rank
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:  # nothing to attend; empty tensors' strides mean nothing
        return
    _check_launch(out, q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc, fmt)
    if lse is not None and (lse.shape != q_latent.shape[:2] or lse.dtype != torch.float32 or lse.stride(1) != 1):
        raise ValueError(f"mla_decode_attention: lse {tuple(lse.shape)} {lse.dtype} must be [T, H] float32, "
                         "stride 1 along its heads")  # fmt: skip
    world, rank_of_cp, interleave = (1, 0, 1) if cp is None else (cp.world_size, cp.rank, cp.interleave)
    heads_pad, block_m, block_q = query_tile(num_heads)
    fp32_dot = q_latent.dtype == torch.float32 or (q_latent.dtype == torch.bfloat16 and interpret_enabled())
    grid = (num_tokens // block_q + num_reqs, triton.cdiv(num_heads, heads_pad))
    _mla_decode_kernel[grid](
        out, q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc, out if lse is None else lse,
        num_reqs, num_heads, rank, rope_dim, block_size, float(scale), float(k_scale), world, rank_of_cp, interleave,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), 0 if lse is None else lse.stride(0),
        DCP=cp is not None, STORE_LSE=lse is not None,
        BLOCK_Q=block_q, HEADS_PAD=heads_pad, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_L=max(16, triton.next_power_of_2(rank)), BLOCK_R=max(16, triton.next_power_of_2(max(rope_dim, 1))),
        HAS_ROPE=rope_dim > 0, FP32_DOT=fp32_dot, FP8_MANTISSA=0 if fmt is None else fmt.mantissa_bits,
        num_warps=NUM_WARPS, num_stages=1,  # software pipelining not measured here: off, as for fp8 attention
    )  # fmt: skip


def _check_launch(
    out: torch.Tensor,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: Fp8Format | None,
) -> None:
    """What the kernel's addressing assumes; fast.mla_attention.mla_decode_attention arranges it for its callers."""
    num_reqs = seq_lens.shape[0]
    if out.shape != q_latent.shape or out.dtype != q_latent.dtype:
        raise ValueError(f"mla_decode_attention: out {tuple(out.shape)} {out.dtype} must match q_latent "
                         f"{tuple(q_latent.shape)} {q_latent.dtype}")  # fmt: skip
    if kv_cache.ndim != 3 or kv_cache.shape[2] - q_pe.shape[2] != q_latent.shape[2]:
        raise ValueError(f"mla_decode_attention: kv_cache {tuple(kv_cache.shape)} must be [blocks, block_size, "
                         f"{q_latent.shape[2]} + {q_pe.shape[2]}]")  # fmt: skip
    cache_dtype = q_latent.dtype if fmt is None else torch.uint8
    if kv_cache.dtype != cache_dtype or q_pe.dtype != q_latent.dtype:
        raise ValueError(f"mla_decode_attention: q_latent {q_latent.dtype}, q_pe {q_pe.dtype}, kv_cache "
                         f"{kv_cache.dtype}: want {q_latent.dtype}, {q_latent.dtype}, {cache_dtype}")  # fmt: skip
    if block_table.ndim != 2 or block_table.shape[0] != num_reqs or tuple(query_start_loc.shape) != (num_reqs + 1,):
        raise ValueError(
            f"mla_decode_attention: block_table {tuple(block_table.shape)} and query_start_loc "
            f"{tuple(query_start_loc.shape)} must be [num_reqs={num_reqs}, max], [{num_reqs + 1}]"
        )
    # the feature axis and the small tensors' rows are addressed without a stride (so loads vectorise)
    for name, t in (
        ("q_latent", q_latent), ("q_pe", q_pe), ("out", out), ("kv_cache", kv_cache),
        ("block_table", block_table), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc),
    ):  # fmt: skip
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"mla_decode_attention: {name} must have stride 1 along its last axis, got {t.stride()}")


@kernel
def _mla_decode_kernel(
    out_ptr,  # [T, num_heads, kv_lora_rank]
    q_latent_ptr,  # [T, num_heads, kv_lora_rank]
    q_pe_ptr,  # [T, num_heads, rope_dim]
    kv_cache_ptr,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table_ptr,  # [num_reqs, max_blocks] batch_idx -> physical block ids
    seq_lens_ptr,  # [num_reqs]
    query_start_loc_ptr,  # [num_reqs + 1]
    lse_ptr,  # [T, num_heads] float32, read only with STORE_LSE
    num_reqs,
    num_heads,
    rank,  # kv_lora_rank
    rope_dim,
    block_size,
    scale,
    k_scale,  # read only for an fp8 cache
    cp_world,  # DCP: ranks the cache is spread over (read only with DCP)
    cp_rank,  # DCP: the rank whose share kv_cache is
    cp_interleave,  # DCP: consecutive positions a rank holds before the next rank's turn
    q_latent_stride_t,
    q_latent_stride_h,
    q_pe_stride_t,
    q_pe_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_b,  # per physical block
    cache_stride_o,  # per offset within a block
    block_table_stride,  # per batch row
    lse_stride_t,  # per query token of lse
    DCP: tl.constexpr,  # kv_cache holds rank cp_rank's share of each request's positions (spec/context_parallel.py)
    STORE_LSE: tl.constexpr,  # store each row's log-sum-exp: the partial state the DCP merge weighs
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEADS_PAD: tl.constexpr,  # query heads per program (a power of 2)
    BLOCK_M: tl.constexpr,  # BLOCK_Q * HEADS_PAD rows: row m is token m // HEADS_PAD, head m % HEADS_PAD
    BLOCK_N: tl.constexpr,  # key positions per tile
    BLOCK_L: tl.constexpr,  # padded kv_lora_rank (>= 16 for tl.dot); lanes past it are masked
    BLOCK_R: tl.constexpr,  # padded rope_dim (>= 16)
    HAS_ROPE: tl.constexpr,  # rope_dim > 0 (a NoPE latent has none)
    # dots in full float32: for float32 inputs, and for bfloat16 under Triton's interpreter, whose tl.dot multiplies
    # bfloat16's raw uint16 storage (see fast.kernels.paged_attention)
    FP32_DOT: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: a cache of the query's dtype; 3 (e4m3) or 2 (e5m2): uint8 codes
):
    q_tile = tl.program_id(0)
    head_block = tl.program_id(1)

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
    head = head_block * HEADS_PAD + rows % HEADS_PAD  # [BLOCK_M] query head
    row_mask = (q_idx < query_len) & (head < num_heads)
    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] flat token index
    q_pos = context_len + q_idx  # [BLOCK_M] position of each row's query
    lat = tl.arange(0, BLOCK_L)
    lat_mask = lat < rank
    q_lat = tl.load(
        q_latent_ptr + token[:, None] * q_latent_stride_t + head[:, None] * q_latent_stride_h + lat[None, :],
        mask=row_mask[:, None] & lat_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_L]
    rope = tl.arange(0, BLOCK_R)
    rope_mask = rope < rope_dim
    if HAS_ROPE:
        q_rope = tl.load(
            q_pe_ptr + token[:, None] * q_pe_stride_t + head[:, None] * q_pe_stride_h + rope[None, :],
            mask=row_mask[:, None] & rope_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]

    kv_end = tl.minimum(seq_len, context_len + local_tile * BLOCK_Q + BLOCK_Q)  # causal: up to the last query
    turn = cp_world * cp_interleave
    if DCP:  # the entries this rank holds of positions [0, kv_end): spec.context_parallel.local_seq_lens
        rest = tl.minimum(tl.maximum(kv_end % turn - cp_rank * cp_interleave, 0), cp_interleave)
        kv_end = kv_end // turn * cp_interleave + rest
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_L], 0.0, tl.float32)
    logit_scale = scale
    if FP8_MANTISSA > 0:  # FlashInfer's dequantization: the cache's scale joins the logits' scale
        logit_scale = scale * k_scale
    table_row = block_table_ptr + tl.cast(req, tl.int64) * block_table_stride
    cols = tl.arange(0, BLOCK_N)
    for tile_start in range(0, kv_end, BLOCK_N):
        k_idx = tile_start + cols  # [BLOCK_N] entries of the cache's paged sequence
        k_mask = k_idx < kv_end  # never read past the visible range
        phys = tl.load(table_row + k_idx // block_size, mask=k_mask, other=0).to(tl.int64)
        entry = kv_cache_ptr + phys * cache_stride_b + (k_idx % block_size) * cache_stride_o  # [BLOCK_N]
        if DCP:  # noqa: SIM108 - the position entry j of this rank holds (spec.context_parallel.local_kv_positions)
            k_pos = (k_idx // cp_interleave) * turn + cp_rank * cp_interleave + k_idx % cp_interleave
        else:
            k_pos = k_idx
        c = tl.load(entry[:, None] + lat[None, :], mask=k_mask[:, None] & lat_mask[None, :], other=0.0)
        if HAS_ROPE:
            pe = tl.load(entry[:, None] + rank + rope[None, :], mask=k_mask[:, None] & rope_mask[None, :], other=0.0)
        if FP8_MANTISSA > 0:
            # codes -> the values they spell (spec.fp8.decode), exactly, as fast.kernels.paged_attention does
            c16 = c.to(tl.int16)
            if FP8_MANTISSA == 2:
                c = (c16 << 8).to(tl.float16, bitcast=True)
            else:
                c_half = (((c16 & 0x7F) << 7) | ((c16 & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
                c = tl.where((c16 & 0x7F) == 0x7F, float("nan"), c_half)
            c = c.to(q_latent_ptr.dtype.element_ty)
            if HAS_ROPE:
                pe16 = pe.to(tl.int16)
                if FP8_MANTISSA == 2:
                    pe = (pe16 << 8).to(tl.float16, bitcast=True)
                else:
                    pe_half = (((pe16 & 0x7F) << 7) | ((pe16 & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
                    pe = tl.where((pe16 & 0x7F) == 0x7F, float("nan"), pe_half)
                pe = pe.to(q_latent_ptr.dtype.element_ty)
        if FP32_DOT:
            s = tl.dot(q_lat.to(tl.float32), tl.trans(c.to(tl.float32)), input_precision="ieee")
            if HAS_ROPE:
                s += tl.dot(q_rope.to(tl.float32), tl.trans(pe.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c))
            if HAS_ROPE:
                s += tl.dot(q_rope, tl.trans(pe))
        s = s * logit_scale  # [BLOCK_M, BLOCK_N] float32
        visible = k_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that saw nothing yet: avoid inf - inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, c.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key keeps 0: the empty state
    if STORE_LSE:  # m_i is the row's largest logit (times scale, and k_scale for fp8) and l_i its sum of exp past it
        row_lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
        tl.store(lse_ptr + token * lse_stride_t + head, row_lse, mask=row_mask)
    if FP8_MANTISSA > 0:  # the value is the same scaled entry: its scale multiplies the output
        acc = acc * k_scale
    tl.store(
        out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h + lat[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & lat_mask[None, :],
    )
