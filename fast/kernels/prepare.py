"""Kernels 2 and 3 fused: one launch builds the whole BatchInputs from the device state.

Program b < num_reqs handles batch row b: seq_len, logits index, its tokens' positions and input ids,
their slots in every KV group, and its gathered block-table rows. Program num_reqs writes the padding
tail (position 0, input id 0, PAD_SLOT_ID in every group). Positions, token offsets and slots are int64:
a slot can exceed 2**31.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton.language as tl

from fast.runtime import kernel
from spec.types import PAD_SLOT_ID

if TYPE_CHECKING:
    from fast.state import DeviceState

BLOCK_TOKENS = 128
BLOCK_COLS = 128


@dataclass(frozen=True)
class PreparedArrays:
    positions: torch.Tensor  # [T] int64
    input_ids: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [num_reqs] int32
    logits_indices: torch.Tensor  # [num_reqs] int32
    block_tables: tuple[torch.Tensor, ...]  # per group [num_reqs, max_blocks_per_req(g)] int32
    slot_mappings: tuple[torch.Tensor, ...]  # per group [T] int64


def output_sizes(dev: DeviceState, num_reqs: int, num_tokens_padded: int) -> tuple[int, int]:
    """Entries of prepare's int64 and int32 outputs for a step of this shape (prepare_triton's layout)."""
    return (2 + len(dev.config.kv_groups)) * num_tokens_padded, num_reqs * (2 + dev.total_width)


def prepare_triton(
    dev: DeviceState,
    batch_host: torch.Tensor,  # [3 num_reqs + 1] int32 on the device: index_mapping | num_scheduled | query_start_loc
    num_reqs: int,
    num_tokens: int,
    num_tokens_padded: int,
    out64: torch.Tensor,  # [>= (2 + G) T] int64, reused: positions | input_ids | slot mapping per group
    out32: torch.Tensor,  # [>= num_reqs (2 + total_width)] int32, reused: seq_lens | logits_indices | tables
) -> PreparedArrays:
    """The batch's arrays, written into the front of `out64` and `out32` (every entry of the step's part
    written: nothing stale shows) and returned as views of them."""
    if batch_host.dtype != torch.int32 or tuple(batch_host.shape) != (3 * num_reqs + 1,):
        raise ValueError(f"prepare: batch_host must be [{3 * num_reqs + 1}] int32, got {tuple(batch_host.shape)} "
                         f"{batch_host.dtype}")  # fmt: skip
    if batch_host.device != dev.device:
        raise ValueError(f"prepare: batch_host is on {batch_host.device}, the pool's state on {dev.device}")
    if not 0 <= num_tokens <= num_tokens_padded:
        raise ValueError(f"prepare: num_tokens {num_tokens} must be in [0, num_tokens_padded={num_tokens_padded}]")
    groups = len(dev.config.kv_groups)
    size64, size32 = output_sizes(dev, num_reqs, num_tokens_padded)
    for name, out, dtype, size in (("out64", out64, torch.int64, size64), ("out32", out32, torch.int32, size32)):
        if out.dtype != dtype or out.dim() != 1 or out.numel() < size or out.device != dev.device:
            raise ValueError(f"prepare: {name} must be [>= {size}] {dtype} on {dev.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    out64, out32 = out64[:size64], out32[:size32]  # contiguous per-array views of their fronts
    _prepare_kernel[(num_reqs + 1,)](
        batch_host,
        dev.token_ids,
        dev.tables,
        dev.num_computed,
        dev.group_meta,
        out64,
        out32,
        num_reqs,
        num_tokens,
        num_tokens_padded,
        dev.config.max_num_reqs,
        dev.token_ids.stride(0),  # the token array grows with the longest request held (fast/state.py)
        groups,
        dev.total_width,
        PAD_SLOT_ID,
        BLOCK_TOKENS=BLOCK_TOKENS,
        BLOCK_COLS=BLOCK_COLS,
    )
    t, n = num_tokens_padded, num_reqs
    tables_out = out32[2 * n :]
    return PreparedArrays(
        positions=out64[:t],
        input_ids=out64[t : 2 * t],
        seq_lens=out32[:n],
        logits_indices=out32[n : 2 * n],
        block_tables=tuple(
            tables_out[n * int(off) : n * int(off + width)].view(n, int(width))
            for off, width in zip(dev.offsets_np, dev.widths_np, strict=True)
        ),
        slot_mappings=tuple(out64[(2 + g) * t : (3 + g) * t] for g in range(groups)),
    )


@kernel
def _prepare_kernel(
    batch_ptr,  # [3 num_reqs + 1] int32: index_mapping (batch_idx -> req_state_idx) | num_scheduled | query_start_loc
    token_ids_ptr,  # [R, token_stride] int32
    tables_ptr,  # [R * total_width] int32, group g's [R, width_g] table at R * table_offset(g)
    num_computed_ptr,  # [R] int64, req_state_idx -> num_computed_tokens
    group_meta_ptr,  # [3, G] int64 rows: block_size | max_blocks_per_req | table_offset (DeviceState.group_meta)
    out64_ptr,  # [(2 + G) T] int64: positions | input_ids | slot_mapping per group
    out32_ptr,  # [num_reqs (2 + total_width)] int32: seq_lens | logits_indices | block table per group
    num_reqs,
    num_tokens,
    num_tokens_padded,
    max_num_reqs,
    token_stride,  # columns of token_ids: its capacity, not max_model_len
    num_groups,
    total_width,
    pad_slot_id,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    b = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_TOKENS)
    if b == num_reqs:  # the padding tail
        for start in range(num_tokens, num_tokens_padded, BLOCK_TOKENS):
            t = start + tokens
            mask = t < num_tokens_padded
            zeros = tl.full([BLOCK_TOKENS], 0, tl.int64)
            tl.store(out64_ptr + t, zeros, mask=mask)
            tl.store(out64_ptr + num_tokens_padded + t, zeros, mask=mask)
            for g in range(num_groups):
                tl.store(out64_ptr + (2 + g) * num_tokens_padded + t, zeros + pad_slot_id, mask=mask)
    else:
        row = tl.load(batch_ptr + b).to(tl.int64)  # req_state_idx
        num_scheduled = tl.load(batch_ptr + num_reqs + b)
        start_loc = tl.load(batch_ptr + 2 * num_reqs + b)
        computed = tl.load(num_computed_ptr + row)  # int64
        tl.store(out32_ptr + b, (computed + num_scheduled).to(tl.int32))
        tl.store(out32_ptr + num_reqs + b, start_loc + num_scheduled - 1)
        for off in range(0, num_scheduled, BLOCK_TOKENS):
            i = off + tokens
            mask = i < num_scheduled
            flat = start_loc + i  # flat token index
            position = computed + i  # int64
            tl.store(out64_ptr + flat, position, mask=mask)
            ids = tl.load(token_ids_ptr + row * token_stride + position, mask=mask, other=0)
            tl.store(out64_ptr + num_tokens_padded + flat, ids, mask=mask)
            for g in range(num_groups):
                block_size = tl.load(group_meta_ptr + g)
                width = tl.load(group_meta_ptr + num_groups + g)
                table_row = tables_ptr + max_num_reqs * tl.load(group_meta_ptr + 2 * num_groups + g) + row * width
                logical = position // block_size
                physical = tl.load(table_row + logical, mask=mask, other=0).to(tl.int64)
                slot = physical * block_size + (position - logical * block_size)
                tl.store(out64_ptr + (2 + g) * num_tokens_padded + flat, slot, mask=mask)
        cols = tl.arange(0, BLOCK_COLS)
        tables_out = out32_ptr + 2 * num_reqs
        for g in range(num_groups):
            width = tl.load(group_meta_ptr + num_groups + g)
            offset = tl.load(group_meta_ptr + 2 * num_groups + g)
            table_row = tables_ptr + max_num_reqs * offset + row * width
            out_row = tables_out + num_reqs * offset + b * width
            for c in range(0, width, BLOCK_COLS):
                mask = c + cols < width
                tl.store(out_row + c + cols, tl.load(table_row + c + cols, mask=mask), mask=mask)
