"""Kernel 1: apply one step's packed writes (fast.writes) to the pool's device state in one launch.

Programs [0, n_t) each write one (row, group) block-table range and its block count; programs
[n_t, n_t + n_p) each copy one run of token ids into its row (a new prompt from column 0, or a request's
drafts past its known tokens); the rest scatter num_computed_tokens, BLOCK pairs each. The host packed
final values only, so no two programs write the same entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fast.runtime import kernel

if TYPE_CHECKING:
    from fast.state import DeviceState

BLOCK = 256


def apply_writes_triton(
    dev: DeviceState,
    packed: torch.Tensor,  # [6 n_t + 4 n_p + 2 n_c + num_data] int64, fast.writes.StepWrites.packed()
    n_t: int,  # table ops
    n_p: int,  # token ops (prompts and drafts)
    n_c: int,  # num_computed_tokens pairs
    num_data: int,  # block ids, then prompt tokens, then drafts, after the ops
) -> None:
    token_base = 6 * n_t
    computed_base = token_base + 4 * n_p
    data_base = computed_base + 2 * n_c
    expected = (data_base + num_data,)
    if packed.dtype != torch.int64 or tuple(packed.shape) != expected or packed.stride(0) != 1:
        raise ValueError(f"apply_writes: packed must be a contiguous {list(expected)} int64 tensor, got "
                         f"{tuple(packed.shape)} {packed.dtype}")  # fmt: skip
    if packed.device != dev.device:
        raise ValueError(f"apply_writes: packed is on {packed.device}, the pool's state on {dev.device}")
    grid = (n_t + n_p + triton.cdiv(n_c, BLOCK),)
    _apply_writes_kernel[grid](
        packed,
        dev.token_ids,
        dev.tables,
        dev.num_blocks,
        dev.num_computed,
        dev.group_meta,
        n_t,
        n_p,
        n_c,
        token_base,
        computed_base,
        data_base,
        dev.config.max_num_reqs,
        dev.token_ids.stride(0),  # the token array grows with the longest request held (fast/state.py)
        len(dev.config.kv_groups),
        BLOCK=BLOCK,
    )


@kernel
def _apply_writes_kernel(
    packed_ptr,  # [packed_len] int64, layout in fast/writes.py
    token_ids_ptr,  # [R, token_stride] int32
    tables_ptr,  # [R * sum_g max_blocks_per_req(g)] int32, group g at R * table_offset(g)
    num_blocks_ptr,  # [G, R] int32
    num_computed_ptr,  # [R] int64
    group_meta_ptr,  # [3, G] int64 rows: block_size | max_blocks_per_req | table_offset (DeviceState.group_meta)
    num_table_ops,
    num_token_runs,
    num_computed,
    token_base,
    computed_base,
    data_base,
    max_num_reqs,
    token_stride,  # columns of token_ids: its capacity, not max_model_len
    num_groups,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    if pid < num_table_ops:
        op = packed_ptr + pid * 6
        row = tl.load(op)
        group = tl.load(op + 1)
        lo = tl.load(op + 2)
        hi = tl.load(op + 3)
        count = tl.load(op + 4)
        src = packed_ptr + data_base + tl.load(op + 5)
        width = tl.load(group_meta_ptr + num_groups + group)
        table_row = tables_ptr + max_num_reqs * tl.load(group_meta_ptr + 2 * num_groups + group) + row * width
        for start in range(lo, hi, BLOCK):
            cols = start + lanes
            mask = cols < hi
            ids = tl.load(src + (cols - lo), mask=mask)
            tl.store(table_row + cols, ids.to(tl.int32), mask=mask)
        tl.store(num_blocks_ptr + group * max_num_reqs + row, count.to(tl.int32))
    elif pid < num_table_ops + num_token_runs:
        op = packed_ptr + token_base + (pid - num_table_ops) * 4
        row = tl.load(op)
        column = tl.load(op + 1)
        length = tl.load(op + 2)
        src = packed_ptr + data_base + tl.load(op + 3)
        for start in range(0, length, BLOCK):
            cols = start + lanes
            mask = cols < length
            dst = token_ids_ptr + row * token_stride + column + cols
            tl.store(dst, tl.load(src + cols, mask=mask), mask=mask)
    else:
        pairs = (pid - num_table_ops - num_token_runs) * BLOCK + lanes
        mask = pairs < num_computed
        rows = tl.load(packed_ptr + computed_base + 2 * pairs, mask=mask, other=0)
        values = tl.load(packed_ptr + computed_base + 2 * pairs + 1, mask=mask, other=0)
        tl.store(num_computed_ptr + rows, values, mask=mask)
