"""Stage 4 on CPU tensors: flattening as spec/flatten.py, without a kernel.

CUDA tensors (and CPU tensors under the Triton interpreter) take fast.kernels.prepare, which computes
these arrays and the slot mappings in one launch. On plain CPU tensors the index arithmetic is done
where its inputs live, on the host, in NumPy (batch order, query_start_loc and num_computed_tokens
are all in the host mirror), and only the read of the device state, the token gather, is a torch op.
A handful of small torch ops costs several times the NumPy equivalents on CPU (dispatch overhead and
intra-op thread wake-ups), which is what the host-step target of the benchmarks measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spec.types import INDEX_DTYPE, TOKEN_DTYPE


@dataclass(frozen=True)
class FlatTokens:
    positions: torch.Tensor  # [T] int64
    input_ids: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [num_reqs] int32
    logits_indices: torch.Tensor  # [num_reqs] int32
    positions_np: np.ndarray  # [T] int64, the same values as `positions` (host memory)
    token_rows_np: np.ndarray  # [num_tokens] int64, flat token index -> req_state_idx (not padded)


def flatten(
    index_mapping_np: np.ndarray,  # [num_reqs] batch_idx -> req_state_idx
    num_scheduled_np: np.ndarray,  # [num_reqs]
    query_start_loc_np: np.ndarray,  # [num_reqs + 1]
    num_computed_np: np.ndarray,  # [R] req_state_idx -> num_computed_tokens (host mirror of the device's)
    token_ids: torch.Tensor,  # [R, max_model_len] int64, on the CPU
    num_tokens_padded: int,
) -> FlatTokens:
    rows = index_mapping_np.astype(np.int64)
    num_tokens = int(query_start_loc_np[-1])
    token_rows = np.repeat(rows, num_scheduled_np)
    computed = num_computed_np[rows]  # [num_reqs]
    positions = np.zeros(num_tokens_padded, TOKEN_DTYPE)
    # position = num_computed + (t - query_start_loc[b]): one repeat of (num_computed - start), plus t
    positions[:num_tokens] = np.repeat(computed - query_start_loc_np[:-1], num_scheduled_np) + np.arange(num_tokens)
    input_ids = torch.zeros(num_tokens_padded, dtype=torch.int64)
    flat_index = torch.from_numpy(token_rows * token_ids.shape[1] + positions[:num_tokens])
    torch.index_select(token_ids.view(-1), 0, flat_index, out=input_ids[:num_tokens])
    return FlatTokens(
        positions=torch.from_numpy(positions),
        input_ids=input_ids,
        seq_lens=torch.from_numpy((computed + num_scheduled_np).astype(INDEX_DTYPE)),
        logits_indices=torch.from_numpy((query_start_loc_np[1:] - 1).astype(INDEX_DTYPE)),
        positions_np=positions,
        token_rows_np=token_rows,
    )
