"""Kernels of record_sampled under async scheduling (fast/async_steps.py): check, then append, on the device.

Two launches, one program per taking row each. The first checks the row's ids as spec.drafts.check_accepted
does and writes its token count and verdict; the second reads every verdict (a fault anywhere makes every row
append 1 + k placeholders instead, spec/async_steps.py rule 6) and appends. The split is the grid-wide barrier
between "any row faulty?" and the writes; nothing comes back to the host. The drafter's proposals (rule 8, a few
ids per row) are checked and kept with tensor operations around the two launches. Reductions are spelled with tl.reduce,
as in fast/kernels/paged_attention.py (the interpreter cannot call tl.max's own jitted function).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fast.runtime import kernel
from spec.types import PLACEHOLDER_TOKEN_ID

FAULTS_BLOCK = 1024  # verdicts read per iteration by each appending program


def record_ahead_triton(
    tokens: torch.Tensor,  # [n, w] int64 the caller's ids, each row's tokens then placeholders
    taking: torch.Tensor,  # [m] int64 batch_idx of the rows that take their tokens
    rows: torch.Tensor,  # [m] int64 their req_state_idx
    num_drafts: torch.Tensor,  # [m] int64 their drafts
    draft_starts: torch.Tensor,  # [m] int64 where each row's drafts begin in draft_ids
    draft_ids: torch.Tensor,  # [sum(num_drafts) + 1] int64 (one spare entry: never empty)
    num_known: torch.Tensor,  # [R] int64 the device's count of known tokens, advanced here
    num_rejected: torch.Tensor,  # [R] int64 out: drafts rejected per taking row
    token_ids: torch.Tensor,  # [R, capacity] int32 the token store (room reserved for 1 + k and w past known)
    one_per_row: bool,  # ids given as [n]: -1 is an id there (out of the vocabulary), not a placeholder
    max_drafts: int,  # the most drafts of any taking row
    vocab: int,
    max_len: int,
    drafter: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([n, P] int64 proposed, [R, >= P] int64 proposals)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [m] written, [m] known before, [m] int32 faults
    m, w = taking.shape[0], tokens.shape[1]
    for name, t in (("tokens", tokens), ("taking", taking), ("rows", rows), ("num_drafts", num_drafts),
                    ("draft_starts", draft_starts), ("draft_ids", draft_ids), ("num_known", num_known),
                    ("num_rejected", num_rejected)):  # fmt: skip
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device != token_ids.device:
            raise ValueError(f"record_ahead: {name} must be contiguous int64 on {token_ids.device}")
    if token_ids.dtype != torch.int32 or token_ids.stride(1) != 1:
        raise ValueError("record_ahead: token_ids must be int32 with contiguous rows")
    counts = torch.empty(m, dtype=torch.int64, device=tokens.device)
    known = torch.empty(m, dtype=torch.int64, device=tokens.device)
    faults = torch.empty(m, dtype=torch.int32, device=tokens.device)
    written = torch.empty(m, dtype=torch.int64, device=tokens.device)
    if m == 0:
        return written, known, faults
    block = triton.next_power_of_2(max(w, 1))
    _check_sampled_kernel[(m,)](
        tokens, taking, num_drafts, draft_starts, draft_ids, rows, num_known, counts, known, faults,
        w, vocab, max_len, ONE_PER_ROW=one_per_row, BLOCK=block,
    )  # fmt: skip
    if drafter is not None:  # rule 8: a proposal outside the vocabulary is the row's fault too (tensor ops: per row)
        proposed = drafter[0][taking]  # [m, P]
        faults |= ((proposed < 0) | (proposed >= vocab)).any(dim=1).to(torch.int32)
    append_block = triton.next_power_of_2(max(w, 1 + max_drafts))  # a row writes its ids, or 1 + k placeholders
    _append_sampled_kernel[(m,)](
        tokens, taking, rows, num_drafts, counts, known, faults, m, num_known, num_rejected, written, token_ids,
        token_ids.stride(0), w, max_len, PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK=append_block,
        FAULTS_BLOCK=FAULTS_BLOCK,
    )  # fmt: skip
    if drafter is not None:  # each taking row keeps them, or placeholders after a fault anywhere (rule 6)
        kept = torch.where(faults.amax() > 0, torch.full_like(proposed, PLACEHOLDER_TOKEN_ID), proposed)
        drafter[1][rows, : proposed.shape[1]] = kept
    return written, known, faults


@kernel
def _check_sampled_kernel(
    tokens_ptr,  # [n, w] int64
    taking_ptr,  # [m] int64 batch_idx
    num_drafts_ptr,  # [m] int64
    draft_starts_ptr,  # [m] int64
    draft_ids_ptr,  # [num_drafts + 1] int64
    rows_ptr,  # [m] int64 req_state_idx
    num_known_ptr,  # [R] int64
    counts_ptr,  # [m] int64 out: tokens before the row's first placeholder
    known_ptr,  # [m] int64 out: the row's known tokens before the record
    faults_ptr,  # [m] int32 out: 1 where spec's check_accepted refuses the row
    w,  # columns of tokens
    vocab,
    max_len,
    ONE_PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,  # >= w
):
    i = tl.program_id(0)
    b = tl.load(taking_ptr + i)
    cols = tl.arange(0, BLOCK)
    inside = cols < w
    t = tl.load(tokens_ptr + b * w + cols, mask=inside, other=-1)
    is_placeholder = (t == -1) & inside
    k = tl.load(num_drafts_ptr + i)
    if ONE_PER_ROW:
        count = k * 0 + 1
    else:
        count = tl.reduce(tl.where(is_placeholder, cols, w), 0, tl.standard._elementwise_min).to(tl.int64)
    start = tl.load(draft_starts_ptr + i)
    kept = cols < count
    draft = tl.load(draft_ids_ptr + start + cols, mask=cols < k, other=-2)
    known = tl.load(num_known_ptr + tl.load(rows_ptr + i))
    after_placeholder = tl.reduce((inside & ~kept & ~is_placeholder).to(tl.int32), 0, tl.standard._elementwise_max)
    out_of_vocab = tl.reduce((kept & ((t < 0) | (t >= vocab))).to(tl.int32), 0, tl.standard._elementwise_max)
    not_a_draft = tl.reduce((kept & (cols < count - 1) & (t != draft)).to(tl.int32), 0, tl.standard._elementwise_max)
    fault = (count == 0) | (after_placeholder > 0) | (count > 1 + k) | (out_of_vocab > 0) | (not_a_draft > 0)
    fault = fault | (known + count > max_len)
    tl.store(counts_ptr + i, count)
    tl.store(known_ptr + i, known)
    tl.store(faults_ptr + i, fault.to(tl.int32))


@kernel
def _append_sampled_kernel(
    tokens_ptr,  # [n, w] int64
    taking_ptr,  # [m] int64 batch_idx
    rows_ptr,  # [m] int64 req_state_idx
    num_drafts_ptr,  # [m] int64
    counts_ptr,  # [m] int64
    known_ptr,  # [m] int64 known before
    faults_ptr,  # [m] int32
    m,
    num_known_ptr,  # [R] int64, advanced
    num_rejected_ptr,  # [R] int64 out
    written_ptr,  # [m] int64 out
    token_ids_ptr,  # [R, capacity] int32
    token_stride,
    w,
    max_len,
    PLACEHOLDER: tl.constexpr,
    BLOCK: tl.constexpr,  # >= w and >= 1 + any row's drafts
    FAULTS_BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    any_fault = 0
    for first in range(0, m, FAULTS_BLOCK):
        j = first + tl.arange(0, FAULTS_BLOCK)
        verdicts = tl.load(faults_ptr + j, mask=j < m, other=0)
        any_fault = tl.maximum(any_fault, tl.reduce(verdicts, 0, tl.standard._elementwise_max))
    b = tl.load(taking_ptr + i)
    row = tl.load(rows_ptr + i)
    k = tl.load(num_drafts_ptr + i)
    known = tl.load(known_ptr + i)
    count = tl.load(counts_ptr + i)
    written = tl.where(any_fault > 0, 1 + k, count)
    cols = tl.arange(0, BLOCK)
    t = tl.load(tokens_ptr + b * w + cols, mask=cols < w, other=PLACEHOLDER)
    values = tl.where(any_fault > 0, PLACEHOLDER, t)
    positions = known + cols
    tl.store(token_ids_ptr + row * token_stride + positions, values.to(tl.int32),
             mask=(cols < written) & (positions < max_len))  # fmt: skip
    tl.store(num_known_ptr + row, known + written)
    tl.store(num_rejected_ptr + row, 1 + k - written)
    tl.store(written_ptr + i, written)
