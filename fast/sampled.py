"""record_sampled's checks, compiled: spec/pool.py's rules over every batch row in one pass.

Each check returns the first faulty taking row (batch order) instead of raising: the pool then names
the error exactly as spec does (spec.drafts.check_accepted for accepted tokens), so the classes and
messages come from one place. A row takes its tokens when the step reached its last input token
(seq_len == known tokens, plus its drafts); rows still mid-prefill discard theirs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fast.state import DeviceState
from spec import drafts as spec_drafts
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError
from spec.state import PoolState, ranges
from spec.types import PLACEHOLDER_TOKEN_ID

_NO_DRAFTS = np.zeros(0, np.int32)


def record_one_per_row(
    dev: DeviceState,
    state: PoolState,
    req_ids: tuple[str, ...],  # [n] batch order
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
    seq_lens: np.ndarray,  # [n] int64 as prepared
    sampled: np.ndarray,  # the caller's ids, integer
) -> None:
    """One id per batch row, in a step without drafts."""
    sampled = sampled.reshape(-1)
    if sampled.shape[0] != rows.size:
        detail = f"{sampled.shape[0]} rows of ids for {rows.size} batch rows"
        raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
    num_known, config = state.num_known_tokens, state.config
    takes = np.empty(rows.size, np.int64)  # [k] batch_idx of the rows that reached their last token
    vocab, max_len = config.vocab_size, config.max_model_len
    bad, count, longest = _check_sampled(rows, seq_lens, num_known, sampled, vocab, max_len, takes)
    if bad >= 0:  # spec's order: the first taking row with a fault, the id checked before the length
        req_id, token = req_ids[bad], int(sampled[bad])
        if not 0 <= token < vocab:
            raise TokenIdError(req_id, "sampled_token_ids", f"{token} not in [0, {vocab})")
        raise ModelLengthError(req_id, "sampled_token_ids", "no room past max_model_len")
    if not count:
        return
    dev.reserve_tokens(longest + 1)
    if dev.token_ids_np is not None:
        _append_sampled(rows, takes[:count], num_known, sampled, dev.token_ids_np)
    else:
        taking_rows = rows[takes[:count]]
        dev.store_tokens(taking_rows, num_known[taking_rows], sampled[takes[:count]])
        num_known[taking_rows] += 1


def record_accepted(
    dev: DeviceState,
    state: PoolState,
    req_ids: tuple[str, ...],  # [n] batch order
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
    seq_lens: np.ndarray,  # [n] int64 as prepared
    drafts: tuple[np.ndarray, np.ndarray] | None,  # (num_drafts [n], draft ids) batch order; None: none
    sampled: np.ndarray,  # the caller's ids, integer: [n] or [n, width]
) -> None:
    """The accepted tokens of a step with drafts (or ids given as [num_reqs, width]): spec/drafts.py's rules.

    Every taking row is checked in one compiled pass; the first faulty one then goes through spec's own
    check, which raises the class spec raises for it.
    """
    config, num_known = state.config, state.num_known_tokens
    tokens_in = spec_drafts.token_rows(sampled, rows.size)  # [n, width]
    vocab, max_len = config.vocab_size, config.max_model_len
    tokens = _as_int64_ids(tokens_in, vocab)
    counts = placeholder_counts(tokens, sampled.ndim < 2)  # [n] as spec.drafts.accepted_rows counts them
    num_drafts, draft_ids = drafts or (np.zeros(rows.size, np.int64), _NO_DRAFTS)
    takes = np.empty(rows.size, np.int64)  # [k] batch_idx of the taking rows
    checks = (num_drafts, draft_ids, tokens, counts, vocab, max_len, takes)
    bad, count, longest = _check_accepted(rows, seq_lens, num_known, *checks)
    if bad >= 0:
        first = int(num_drafts[:bad].sum())
        own = draft_ids[first : first + num_drafts[bad]]
        known = int(num_known[rows[bad]])
        spec_drafts.check_accepted(req_ids[bad], tokens_in[bad], int(counts[bad]), own, known, config)
        raise AssertionError(f"record_sampled: row {bad} looked faulty but spec's check accepts it")
    if not count:
        return
    dev.reserve_tokens(longest)
    taking = takes[:count]
    if dev.token_ids_np is not None:
        _append_accepted(rows, taking, tokens, counts, num_known, dev.token_ids_np)
    else:
        which, within = ranges(counts[taking])
        taking_rows = rows[taking]
        dev.store_tokens(taking_rows[which], num_known[taking_rows][which] + within, tokens[taking[which], within])
        num_known[taking_rows] += counts[taking]


@njit(cache=True, nogil=True)
def _check_sampled(  # pragma: no cover - compiled; tested through record_sampled against spec
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
def _append_sampled(  # pragma: no cover - compiled; tested through record_sampled against spec
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


def _as_int64_ids(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Integer ids as int64 for the compiled checks, each id's verdict kept: unsigned values past the
    vocabulary become `vocab` (still out of it, never the placeholder -1, never equal to a draft)."""
    if tokens.dtype.kind == "u":
        return np.minimum(tokens, vocab).astype(np.int64)
    return tokens.astype(np.int64, copy=False)


@njit(cache=True, nogil=True)
def _check_accepted(  # pragma: no cover - compiled; tested through record_sampled against spec
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
def _append_accepted(  # pragma: no cover - compiled; tested through record_sampled against spec
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


@njit(cache=True, nogil=True)
def placeholder_counts(tokens: np.ndarray, one_per_row: bool) -> np.ndarray:  # pragma: no cover - compiled
    """[n] each row's tokens before its first PLACEHOLDER_TOKEN_ID (the width if none; 1 for ids given as [n]):
    spec.drafts.accepted_rows's counts, in one pass."""
    n, width = tokens.shape
    counts = np.full(n, 1 if one_per_row else width, np.int64)
    if not one_per_row:
        for b in range(n):
            for j in range(width):
                if tokens[b, j] == PLACEHOLDER_TOKEN_ID:
                    counts[b] = j
                    break
    return counts
