"""Speculative decoding: draft tokens in the batch, the logits a rejection sampler reads, and what it returns.

A request with k drafts (`SchedulerOutput.scheduled_spec_decode_tokens`) is scheduled through its last
known token and then the k drafts: `num_computed + num_scheduled == known + k` and `num_scheduled >= 1 + k`
(spec/validate.py, checks 1 and 8). This holds for a request in prefill as well: drafts may ride on the
chunk that reaches the end of its prompt, never on an earlier one. The drafts are the step's last k input
tokens of that request, at positions known .. known + k - 1; slots and block tables cover them like any
other token, but they are not tokens of the request (`snapshot()`, `UnknownTokenError`) until accepted.

Logits, as vLLM's SpecDecodeMetadata. A drafting request needs logits at each of its last 1 + k tokens
(the last known token verifies draft 0, draft i verifies draft i + 1, the last draft yields the bonus
token); every other request at its last token, as without drafts. `logits_indices` lists them in batch
order, so `logits = hidden[logits_indices]` has num_reqs + num_drafts rows, and in those rows
`target_logits_indices` verify the drafts and `bonus_logits_indices` hold each request's last one:

    batch rows        0       1 (mid-prefill)   2 (2 drafts)
    num_scheduled     1       5                 3
    flat tokens       0       1 2 3 4 5         6 7 8     (7 and 8 are the drafts)
    logits_indices    [0, 5, 6, 7, 8]
    target_logits_indices [2, 3]   bonus_logits_indices [0, 1, 4]
    num_draft_tokens [0, 0, 2]   cu_num_draft_tokens [0, 0, 2]   draft_token_ids = input_ids[[7, 8]]

A step in which no request drafts leaves every draft field None and logits_indices as it always was.

Accepted tokens (record_sampled): per batch row, the tokens the rejection sampler kept, 1 .. k + 1 of
them: the accepted drafts, then one token sampled from the target (a correction, or the bonus when every
draft was accepted). Either `[num_reqs]` (one token per row, the form of a step without drafts) or
`[num_reqs, width]`, each row's tokens first and PLACEHOLDER_TOKEN_ID (-1) after them, as vLLM's
rejection sampler outputs.

Rollback: the accepted tokens become known tokens; the rejected drafts' positions are simply not. The
scheduler's next num_computed_tokens for the request is `known after the step - 1` (it drops back past
the rejected drafts), so its next step writes those positions again. Until then their KV slots hold
stale keys and values, which no query reads (a query at position p reads keys <= p, all rewritten by
then); the blocks allocated for the drafts stay in the request's table, as the scheduler sent them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, TokenIdError
from spec.types import INDEX_DTYPE, PLACEHOLDER_TOKEN_ID, TOKEN_DTYPE, WorkerConfig


@dataclass(frozen=True)
class DraftLogits:
    """The sampler's indices for a step with drafts (the BatchInputs fields of the same names)."""

    logits_indices: np.ndarray  # [num_reqs + num_drafts] int32 flat token indices
    num_draft_tokens: np.ndarray  # [num_reqs] int32
    cu_num_draft_tokens: np.ndarray  # [num_reqs] int32
    draft_token_ids: np.ndarray  # [num_drafts] int64
    target_logits_indices: np.ndarray  # [num_drafts] int32 rows of logits[logits_indices]
    bonus_logits_indices: np.ndarray  # [num_reqs] int32 rows of logits[logits_indices]


def draft_token_indices(query_start_loc: np.ndarray, num_draft_tokens: np.ndarray) -> np.ndarray:
    """[num_drafts] flat indices of the draft tokens: the last num_draft_tokens[b] tokens of each batch row b."""
    ends = np.repeat(query_start_loc[1:], num_draft_tokens)  # [num_drafts] end of each draft's row
    from_end = _arange_per_row(num_draft_tokens) - np.repeat(num_draft_tokens, num_draft_tokens)  # -k .. -1
    return (ends + from_end).astype(np.int64)


def draft_logits(
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    num_draft_tokens: np.ndarray,  # [num_reqs] drafts of each batch row
    draft_token_ids: np.ndarray,  # [num_drafts] the rows' drafts end to end, in batch order
) -> DraftLogits:
    """The sampler's indices, and the draft ids as the sampler reads them."""
    num_sampled = num_draft_tokens + 1  # [num_reqs] logits rows of each batch row
    cu_num_sampled = np.cumsum(num_sampled)  # [num_reqs]
    ends = np.repeat(query_start_loc[1:], num_sampled)  # [num_reqs + num_drafts]
    logits_indices = ends - np.repeat(num_sampled, num_sampled) + _arange_per_row(num_sampled)
    first_row = np.repeat(cu_num_sampled - num_sampled, num_draft_tokens)  # [num_drafts] row's first logits row
    target = first_row + _arange_per_row(num_draft_tokens)
    return DraftLogits(
        logits_indices=logits_indices.astype(INDEX_DTYPE),
        num_draft_tokens=num_draft_tokens.astype(INDEX_DTYPE),
        cu_num_draft_tokens=np.cumsum(num_draft_tokens).astype(INDEX_DTYPE),
        draft_token_ids=draft_token_ids.astype(TOKEN_DTYPE),
        target_logits_indices=target.astype(INDEX_DTYPE),
        bonus_logits_indices=(cu_num_sampled - 1).astype(INDEX_DTYPE),
    )


def _arange_per_row(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)]: 0 .. counts[b] - 1 for each b, laid end to end."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum())) - starts


def accepted_rows(sampled: np.ndarray, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """record_sampled's ids as ([num_reqs, width] tokens, [num_reqs] count of each row's tokens before a placeholder).

    `[num_reqs]` (or a scalar for one row) is one token per row; `[num_reqs, width]` holds each row's tokens,
    then PLACEHOLDER_TOKEN_ID. The count stops at the first placeholder; whether anything follows it (a gap)
    is for the caller to judge, row by row, with the row's drafts.
    """
    rows = token_rows(sampled, num_reqs)
    if sampled.ndim < 2:  # one token per row: no placeholders in this form, -1 is an id (and out of range)
        return rows, np.ones(num_reqs, np.int64)
    is_placeholder = np.concatenate([rows == PLACEHOLDER_TOKEN_ID, np.ones((num_reqs, 1), bool)], axis=1)
    return rows, is_placeholder.argmax(axis=1).astype(np.int64)  # first placeholder (or the width)


def token_rows(sampled: np.ndarray, num_reqs: int) -> np.ndarray:
    """The ids as [num_reqs, width] rows (a view), after the checks of their shape."""
    if sampled.ndim > 2:
        detail = f"shape {sampled.shape}: needs [num_reqs] or [num_reqs, max_drafts + 1]"
        raise InconsistentSchedulerOutputError(None, "sampled_token_ids", detail)
    rows = sampled.reshape(-1, 1) if sampled.ndim < 2 else sampled
    if rows.shape[0] != num_reqs:
        raise InconsistentSchedulerOutputError(
            None, "sampled_token_ids", f"{rows.shape[0]} rows of ids for {num_reqs} batch rows"
        )
    return rows


def proposed_ids(next_draft_ids: object, num_reqs: int, config: WorkerConfig) -> np.ndarray | None:
    """record_sampled's `next_draft_ids` (spec/async_steps.py, rule 8) as [num_reqs, P] ids, after the checks the
    host makes without reading values: async scheduling, an integer dtype, one row per batch row. None: none."""
    if next_draft_ids is None:
        return None
    field = "next_draft_ids"
    if not config.async_scheduling:
        synchronous = "drafts proposed on the device need WorkerConfig.async_scheduling (the scheduler sends the ids)"
        raise InconsistentSchedulerOutputError(None, field, synchronous)
    proposed = np.asarray(next_draft_ids)
    if proposed.size and proposed.dtype.kind not in "iu":
        raise InconsistentSchedulerOutputError(None, field, f"dtype {proposed.dtype}: needs integer ids")
    if proposed.ndim != 2 or proposed.shape[0] != num_reqs:
        shape = f"shape {proposed.shape}: needs [num_reqs={num_reqs}, num_proposed]"
        raise InconsistentSchedulerOutputError(None, field, shape)
    return proposed.astype(np.int64)


def check_accepted(
    req_id: str,
    tokens: np.ndarray,  # [width] the row of accepted_rows
    count: int,  # its tokens before the first placeholder
    drafts: np.ndarray,  # [k] the row's drafts
    known: int,  # tokens the request knew before the step
    config: WorkerConfig,
) -> None:
    """One taking row's accepted tokens, in record_sampled's order of checks; raises at the first fault."""
    field = "sampled_token_ids"
    if count == 0:
        raise InconsistentSchedulerOutputError(req_id, field, "no token for a row that samples")
    if (tokens[count:] != PLACEHOLDER_TOKEN_ID).any():
        raise InconsistentSchedulerOutputError(req_id, field, f"a token after the placeholder at {count}")
    if count > 1 + drafts.size:
        detail = f"{count} tokens for {drafts.size} drafts: at most 1 + {drafts.size}"
        raise InconsistentSchedulerOutputError(req_id, field, detail)
    kept = tokens[:count]
    bad = kept[(kept < 0) | (kept >= config.vocab_size)]
    if bad.size:
        raise TokenIdError(req_id, field, f"{bad[0]} not in [0, {config.vocab_size})")
    if not np.array_equal(kept[:-1], drafts[: count - 1]):  # a sampler keeps drafts only verbatim
        detail = f"accepted {kept[:-1].tolist()} but the drafts were {drafts.tolist()}"
        raise InconsistentSchedulerOutputError(req_id, field, detail)
    if known + count > config.max_model_len:
        raise ModelLengthError(req_id, field, f"{known} + {count} tokens: no room past max_model_len")


def pad_accepted(rows: list[tuple[int, ...]] | list[list[int]]) -> np.ndarray:
    """Each batch row's accepted tokens as record_sampled's `[num_reqs, longest]`, padded with PLACEHOLDER_TOKEN_ID."""
    width = max((len(r) for r in rows), default=1)
    out = np.full((len(rows), width), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, tokens in enumerate(rows):
        out[b, : len(tokens)] = tokens
    return out
