"""record_sampled's checks, compiled: spec/pool.py's rules over every batch row in one pass.

Each check returns the first faulty taking row (batch order) instead of raising: the pool then names
the error exactly as spec does (spec.drafts.check_accepted for accepted tokens), so the classes and
messages come from one place. A row takes its tokens when the step reached its last input token
(seq_len == known tokens, plus its drafts); rows still mid-prefill discard theirs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from spec.types import PLACEHOLDER_TOKEN_ID


@njit(cache=True, nogil=True)
def check_sampled(  # pragma: no cover - compiled; tested through record_sampled against spec
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx
    seq_lens: np.ndarray,  # [n] int64 as prepared
    num_known: np.ndarray,  # [R] int64 known tokens per row
    sampled: np.ndarray,  # [n] integer ids, one per batch row
    vocab: int,
    max_len: int,
    takes: np.ndarray,  # [n] int64 out: batch_idx of each row that takes its sample
) -> tuple[int, int, int]:
    """(first faulty taking batch row or -1, rows that take their sample, the longest of them before)."""
    count, longest = 0, 0
    for b in range(rows.shape[0]):
        known = num_known[rows[b]]
        if seq_lens[b] != known:
            continue  # still mid-prefill: its sample is discarded
        if sampled[b] < 0 or sampled[b] >= vocab or known >= max_len:
            return b, count, longest
        takes[count] = b
        count += 1
        longest = max(longest, known)
    return -1, count, longest


@njit(cache=True, nogil=True)
def append_sampled(  # pragma: no cover - compiled; tested through record_sampled against spec
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx
    takes: np.ndarray,  # [k] int64 batch_idx of the rows taking their sample
    num_known: np.ndarray,  # [R] int64, advanced here
    sampled: np.ndarray,  # [n] validated ids
    token_ids: np.ndarray,  # [R, capacity] int32 (room reserved)
) -> None:
    for b in takes:
        row = rows[b]
        token_ids[row, num_known[row]] = sampled[b]
        num_known[row] += 1


def as_int64_ids(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Integer ids as int64 for the compiled checks, each id's verdict kept: unsigned values past the
    vocabulary become `vocab` (still out of it, never the placeholder -1, never equal to a draft)."""
    if tokens.dtype.kind == "u":
        return np.minimum(tokens, vocab).astype(np.int64)
    return tokens.astype(np.int64, copy=False)


@njit(cache=True, nogil=True)
def check_accepted(  # pragma: no cover - compiled; tested through record_sampled against spec
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx
    seq_lens: np.ndarray,  # [n] int64 as prepared
    num_known: np.ndarray,  # [R] int64 known tokens per row
    num_drafts: np.ndarray,  # [n] int64 drafts of each batch row
    draft_ids: np.ndarray,  # [sum(num_drafts)] the rows' drafts, batch order
    tokens: np.ndarray,  # [n, width] int64 each row's tokens, then PLACEHOLDER_TOKEN_ID
    counts: np.ndarray,  # [n] int64 each row's tokens before its first placeholder
    vocab: int,
    max_len: int,
    takes: np.ndarray,  # [n] int64 out: batch_idx of each row that takes its tokens
) -> tuple[int, int, int]:
    """spec.drafts.check_accepted for every taking row: (first faulty taking row or -1, taking rows, the
    longest known length of them after the step)."""
    count, longest, start = 0, 0, 0
    for b in range(rows.shape[0]):
        known, k, c = num_known[rows[b]], num_drafts[b], counts[b]
        first_draft = start
        start += k
        if seq_lens[b] != known + k:
            continue  # still mid-prefill
        if c == 0 or c > 1 + k or known + c > max_len:
            return b, count, longest
        for j in range(c, tokens.shape[1]):
            if tokens[b, j] != PLACEHOLDER_TOKEN_ID:
                return b, count, longest  # a token after the placeholder
        for j in range(c):
            if tokens[b, j] < 0 or tokens[b, j] >= vocab:
                return b, count, longest
        for j in range(c - 1):
            if tokens[b, j] != draft_ids[first_draft + j]:
                return b, count, longest  # a sampler keeps drafts only verbatim
        takes[count] = b
        count += 1
        longest = max(longest, known + c)
    return -1, count, longest


@njit(cache=True, nogil=True)
def append_accepted(  # pragma: no cover - compiled; tested through record_sampled against spec
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx
    takes: np.ndarray,  # [k] int64 batch_idx of the taking rows
    tokens: np.ndarray,  # [n, width] int64 validated
    counts: np.ndarray,  # [n] int64 tokens each row takes
    num_known: np.ndarray,  # [R] int64, advanced here
    token_ids: np.ndarray,  # [R, capacity] int32 (room reserved)
) -> None:
    for b in takes:
        row = rows[b]
        for j in range(counts[b]):
            token_ids[row, num_known[row] + j] = tokens[b, j]
        num_known[row] += counts[b]
