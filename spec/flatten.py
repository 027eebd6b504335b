"""Stage 4, flattening: the batch's tokens laid end to end, with the arrays that undo it.

Token t of batch row b: position = num_computed[row] + (t - query_start_loc[b]),
input_id = token_ids[row, position]. Padding tokens (t >= num_tokens) have position 0 and input id 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec.types import INDEX_DTYPE, TOKEN_DTYPE


@dataclass(frozen=True)
class FlatTokens:
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    positions: np.ndarray  # [T] int64
    input_ids: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [num_reqs] int32
    logits_indices: np.ndarray  # [num_reqs] int32
    token_rows: np.ndarray  # [num_tokens] int64, flat token index -> req_state_idx (not padded)


def flatten(
    index_mapping: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    num_scheduled: np.ndarray,  # [num_reqs]
    num_computed_tokens: np.ndarray,  # [R] req_state_idx -> tokens already in the KV cache
    token_ids: np.ndarray,  # [R, max_model_len]
    num_tokens_padded: int,
) -> FlatTokens:
    query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)]).astype(INDEX_DTYPE)
    num_tokens = int(query_start_loc[-1])
    token_rows = np.repeat(index_mapping, num_scheduled).astype(np.int64)
    offset_in_request = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
    positions = np.zeros(num_tokens_padded, TOKEN_DTYPE)
    positions[:num_tokens] = num_computed_tokens[token_rows] + offset_in_request
    input_ids = np.zeros(num_tokens_padded, TOKEN_DTYPE)
    input_ids[:num_tokens] = token_ids[token_rows, positions[:num_tokens]]
    seq_lens = (num_computed_tokens[index_mapping] + num_scheduled).astype(INDEX_DTYPE)
    logits_indices = (query_start_loc[1:] - 1).astype(INDEX_DTYPE)
    return FlatTokens(query_start_loc, positions, input_ids, seq_lens, logits_indices, token_rows)
