"""Decode context parallelism on torch tensors: spec.context_parallel's functions, same contract and errors.

The slot transform runs fast.kernels.context_parallel on CUDA (and on CPU under the Triton interpreter),
vectorised torch ops on plain CPU tensors. Local sequence lengths and the merge are elementwise torch ops
on any device. Partial attention is a torch loop over the batch's requests, accumulated in float32 (one
host read of seq_lens and query_start_loc): the rank-local view of spec's reference, not a tuned kernel.
Unlike spec (which computes in its input dtype), LSEs are float32 on every path, as vLLM keeps them.

MLA's partial absorbed decode takes the paths fast.mla_attention's decode takes: on CUDA (and on CPU under the
Triton interpreter) fast.kernels.mla_attention with DCP's positions and the LSE stored (one kernel, the
non-DCP launch unchanged); on plain CPU tensors partial_paged_attention above over the latent cache viewed with
one KV head (spec's statement of it), fp8 codes decoded to float32 first.
"""

from __future__ import annotations

import torch

from fast.attention import check_attention_tensors
from fast.fp8 import codes, torch_dtype
from fast.mla_attention import check_mla_tensors, rows_contiguous
from fast.runtime import use_triton
from spec import context_parallel as spec_cp
from spec.attention import check_attention_inputs
from spec.context_parallel import (
    ContextParallel,
    RankInputs,
    check_merge_inputs,
    check_slot_inputs,
)
from spec.mla_attention import check_mla_attention_inputs
from spec.mla_cache import mla_scale
from spec.types import PAD_SLOT_ID, BatchInputs, WorkerConfig

__all__ = [
    "ContextParallel",
    "RankInputs",
    "cp_slot_mapping",
    "local_kv_positions",
    "local_seq_lens",
    "merge_attention_states",
    "partial_mla_decode_attention",
    "partial_paged_attention",
    "rank_inputs",
]


def rank_inputs(batch: BatchInputs, config: WorkerConfig, cp: ContextParallel) -> RankInputs:
    """Rank `cp.rank`'s slots and lengths for a batch prepared by the (rank-agnostic) pool: spec's, on tensors."""
    return spec_cp.rank_inputs(batch, config, cp, cp_slot_mapping, local_seq_lens)


def cp_slot_mapping(
    positions: torch.Tensor,  # [T] flat token index -> position (0 for padding)
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> virtual block ids
    block_size: int,  # bs: tokens per physical block of a rank
    cp: ContextParallel,
) -> torch.Tensor:  # [T] int64, flat token index -> slot in rank cp.rank's cache, PAD_SLOT_ID if not local
    check_slot_inputs(positions, query_start_loc, block_table, block_size)
    num_reqs, width = block_table.shape
    flat = torch.arange(positions.shape[0], device=positions.device)
    real = flat < query_start_loc[-1]
    virtual = block_size * cp.world_size
    # a check of values, as write_kv's: the one host read of this call
    if bool((real & (positions // virtual >= width)).any()):
        worst = int(torch.where(real, positions, 0).max())
        raise ValueError(f"cp_slot_mapping: positions hold {worst}, past block_table's {width} blocks")
    out = torch.empty(positions.shape[0], dtype=torch.int64, device=positions.device)
    if use_triton(positions.device):
        from fast.kernels.context_parallel import cp_slot_mapping_triton  # lazily: the CPU path needs no Triton

        cp_slot_mapping_triton(
            out, positions.contiguous(), query_start_loc.contiguous(), block_table, block_size,
            cp.world_size, cp.rank, cp.interleave,
        )  # fmt: skip
        return out
    rows = torch.searchsorted(query_start_loc[1:].contiguous(), flat, right=True).clamp(max=max(num_reqs - 1, 0))
    pos = positions.to(torch.int64)
    offset, block_index = pos % virtual, (pos // virtual).clamp(max=width - 1)
    local = real & ((offset // cp.interleave) % cp.world_size == cp.rank)
    blocks = block_table[rows, block_index].to(torch.int64) if num_reqs else torch.zeros_like(pos)
    inter = cp.interleave
    slots = blocks * block_size + (offset // (inter * cp.world_size)) * inter + offset % inter
    return torch.where(local, slots, torch.full_like(slots, PAD_SLOT_ID), out=out)


def local_seq_lens(seq_lens: torch.Tensor, cp: ContextParallel) -> torch.Tensor:  # [num_reqs] int32
    """KV entries rank cp.rank holds of requests of these lengths (vLLM's dcp_local_seq_lens)."""
    if seq_lens.ndim != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"local_seq_lens: seq_lens must be [num_reqs] int32 or int64, got {seq_lens.dtype}")
    lens = seq_lens.to(torch.int64)
    turn = cp.world_size * cp.interleave
    rest = (lens % turn - cp.rank * cp.interleave).clamp(0, cp.interleave)
    return (lens // turn * cp.interleave + rest).to(torch.int32)


def local_kv_positions(num_local: int, cp: ContextParallel, device: torch.device | str = "cpu") -> torch.Tensor:
    """The position in its request of each of a rank's first `num_local` KV entries, in slot order."""
    j = torch.arange(num_local, dtype=torch.int64, device=device)
    return (j // cp.interleave) * (cp.world_size * cp.interleave) + cp.rank * cp.interleave + j % cp.interleave


def partial_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim], every query of the batch
    key_cache: torch.Tensor,  # [num_blocks, bs, num_kv_heads, head_dim], this rank's cache
    value_cache: torch.Tensor,  # [num_blocks, bs, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> block ids
    seq_lens: torch.Tensor,  # [num_reqs] the requests' full lengths
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    cp: ContextParallel,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, num_heads, head_dim] query dtype, [T, num_heads] float32)
    check_attention_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, sliding_window=None, softcap=softcap,
    )  # fmt: skip
    check_attention_tensors(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)  # as fast's own
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_heads = query.shape[1]
    device = query.device
    out = torch.zeros(query.shape, dtype=torch.float32, device=device)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=device)
    local = local_seq_lens(seq_lens, cp).tolist()
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=device)  # [q]
        j = torch.arange(local[b], device=device)  # [k] this rank's KV entries of the row
        k_pos = local_kv_positions(local[b], cp, device)  # [k]
        blocks = block_table[b, j // block_size].to(torch.int64)
        keys = key_cache[blocks, j % block_size].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = value_cache[blocks, j % block_size].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        logits = torch.einsum("qhd,khd->hqk", query[q_start:q_end].float(), keys) * float(scale)
        if softcap is not None:
            logits = float(softcap) * torch.tanh(logits / float(softcap))
        logits = logits.masked_fill(~(k_pos[None, :] <= q_pos[:, None])[None], float("-inf"))
        peak = (
            logits.amax(dim=-1, keepdim=True)
            if logits.shape[-1]
            else logits.new_full((*logits.shape[:2], 1), float("-inf"))
        )
        shift = torch.where(peak == float("-inf"), 0.0, peak)
        weights = torch.exp(logits - shift)
        total = weights.sum(dim=-1, keepdim=True)
        safe = torch.where(total > 0, total, 1.0)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", weights / safe, values)
        lse[q_start:q_end] = torch.where(total > 0, shift + torch.log(safe), float("-inf"))[..., 0].T
    return out.to(query.dtype), lse


def partial_mla_decode_attention(
    q_latent: torch.Tensor,  # [T, num_heads, kv_lora_rank] every query of the batch, q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, num_heads, rope_dim] already rotated
    kv_cache: torch.Tensor,  # [num_blocks, bs, kv_lora_rank + rope_dim], this rank's latent cache
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> block ids (the pool's gathered table)
    seq_lens: torch.Tensor,  # [num_reqs] the requests' full lengths
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    cp: ContextParallel,
    scale: float,
    kv_cache_dtype: str = "auto",
    k_scale: float | torch.Tensor = 1.0,  # one value (per tensor)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, num_heads, kv_lora_rank] query dtype, [T, num_heads] float32)
    fmt = check_mla_attention_inputs(
        "partial_mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    rank = kv_cache.shape[2] - q_pe.shape[2]
    if q_latent.shape[2] != rank:
        raise ValueError(
            f"partial_mla_decode_attention: q_latent {tuple(q_latent.shape)} must be [T, H, kv_lora_rank={rank}]"
        )
    k_scale32 = float(mla_scale("partial_mla_decode_attention", fmt, k_scale))
    check_mla_tensors("partial_mla_decode_attention", q_latent, q_pe, kv_cache, block_table, seq_lens, query_start_loc)
    if use_triton(q_latent.device):
        from fast.kernels.mla_attention import mla_decode_triton  # lazily: the CPU path needs no Triton

        out = torch.zeros_like(q_latent)  # rows no program stores (padding) stay empty states: 0 and -inf
        lse = torch.full(q_latent.shape[:2], float("-inf"), dtype=torch.float32, device=q_latent.device)
        mla_decode_triton(
            out, rows_contiguous(q_latent), rows_contiguous(q_pe), codes(kv_cache) if fmt is not None else kv_cache,
            *(t if t.stride(-1) == 1 else t.contiguous() for t in (block_table, seq_lens, query_start_loc)),
            scale=float(scale), fmt=fmt, k_scale=k_scale32, cp=cp, lse=lse,
        )  # fmt: skip
        return out, lse
    query = torch.cat((q_latent, q_pe), dim=2)  # [T, H, L + R]
    entries = kv_cache  # [num_blocks, bs, L + R]
    if fmt is not None:  # codes -> decode(code) * k_scale in float32: spec's values, the query widened to match
        entries = codes(kv_cache).view(torch_dtype(fmt)).float() * k_scale32
        query = query.float()
    out, lse = partial_paged_attention(
        query, entries[:, :, None], entries[:, :, None], block_table, seq_lens, query_start_loc, cp=cp, scale=scale
    )  # one KV head: the entry is the key and the value
    return out[:, :, :rank].to(q_latent.dtype).contiguous(), lse


def merge_attention_states(
    outputs: torch.Tensor,  # [N, T, num_heads, head_dim] the partial outputs of N ranks
    lses: torch.Tensor,  # [N, T, num_heads] their log-sum-exps (-inf: empty state)
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, num_heads, head_dim] outputs' dtype, [T, num_heads] float32 or wider)
    check_merge_inputs(outputs, lses)
    acc = torch.promote_types(outputs.dtype, torch.float32)  # float32, or float64 for float64 partials
    lses_acc = lses.to(acc)
    peak = lses_acc.amax(dim=0)  # [T, H]
    shift = torch.where(peak == float("-inf"), 0.0, peak)
    weights = torch.exp(lses_acc - shift[None])  # [N, T, H]: 0 for an empty state
    total = weights.sum(dim=0)
    empty = total == 0  # every partial empty: output 0, LSE -inf (0/0 would be NaN)
    safe = torch.where(empty, 1.0, total)
    out = (weights[..., None] * outputs.to(acc)).sum(dim=0) / safe[..., None]
    merged_lse = torch.where(empty, float("-inf"), shift + torch.log(safe))
    return out.to(outputs.dtype), merged_lse.to(torch.promote_types(lses.dtype, torch.float32))
