"""What every padding token and padding request row of a batch holds, for the descriptor it runs (spec/graphs.py).

A graph replays fixed shapes: T_pad tokens and, for a FULL graph, num_reqs_pad request rows. What sits past the
real tokens and rows is read by the captured kernels, so it is part of the contract:

  tokens t in [num_tokens, T_pad):  position 0, input id 0, slot PAD_SLOT_ID in every group. The slots past the
      REAL count are PAD, never left from an earlier, larger step (vLLM #36580; vllm-ascend #3482): write_kv
      skips them, so padding writes no cache byte.
  request rows b in [num_reqs, num_reqs_pad):
      index_mapping -1 (no req_state_idx: a padded row names no request, SGLang #26292)
      num_scheduled_tokens 0
      query_start_loc[b + 1] = num_tokens (the real count): non-decreasing, each padded row of query length 0,
          as vLLM's runner pads it ("kernels like FlashAttention require" it); the padded tokens belong to no row
      seq_lens the profile's pad value (spec/padding_profiles.py: 0, or 1 for FlashMLA's fp8 decode kernel)
      block_tables[g] rows all NULL_BLOCK_ID (0), whatever an earlier larger batch left in a reused buffer
  a model kind's record (spec/feature.py) pads its own rows through `Feature.pad`.

What does not grow: `req_ids` and `num_reqs` stay the real requests; `logits_indices`, the drafts' fields and the
async fields stay per real row (the sampler runs outside the graph, and record_sampled takes one row per real
request). `BatchInputs.num_reqs_padded` is the request rows of the padded arrays.

A batch prepared without graphs (or with a NONE descriptor) is padded in nothing but what pad_to asks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spec.feature import Feature
from spec.graphs import BatchDescriptor, check_descriptor
from spec.padding_profiles import PaddingProfile
from spec.types import NULL_BLOCK_ID, BatchInputs

NO_REQUEST = -1  # index_mapping of a padded request row

# (key, array [n, ...], rows, value) -> the array with rows [n, rows) set to value, [rows, ...]. `key` names the
# array (a backend that keeps a buffer per array, fast/padding.py, finds it by the key).
RowPadder = Callable[[str, Any, int, Any], Any]


def pad_rows(key: str, array: np.ndarray, rows: int, value: Any) -> np.ndarray:
    """spec's RowPadder: a new array of `rows` rows, the given ones first, then `value`."""
    out = np.full((rows, *array.shape[1:]), value, array.dtype)
    out[: array.shape[0]] = array
    return out


def pad_request_rows(
    batch: BatchInputs,  # its tokens already padded to descriptor.num_tokens, its request rows the real ones
    descriptor: BatchDescriptor,
    profile: PaddingProfile,
    features: Sequence[Feature],  # the pool's features, in the order of batch.features
    padder: RowPadder = pad_rows,
) -> BatchInputs:
    """The batch with its request rows padded to descriptor.num_reqs and the descriptor attached."""
    check_descriptor(descriptor, batch.num_tokens, batch.num_reqs)
    if descriptor.num_tokens != batch.num_tokens_padded:
        raise ValueError(f"descriptor.num_tokens {descriptor.num_tokens} != the batch's {batch.num_tokens_padded}")
    rows = descriptor.num_reqs
    records = tuple(f.pad(r, rows, padder) for f, r in zip(features, batch.features, strict=True))
    return dataclasses.replace(
        batch,
        index_mapping=padder("index_mapping", batch.index_mapping, rows, NO_REQUEST),
        num_scheduled_tokens=padder("num_scheduled_tokens", batch.num_scheduled_tokens, rows, 0),
        query_start_loc=padder("query_start_loc", batch.query_start_loc, rows + 1, batch.num_tokens),
        seq_lens=padder("seq_lens", batch.seq_lens, rows, profile.pad_seq_len),
        block_tables=tuple(
            padder(f"block_tables/{g}", t, rows, NULL_BLOCK_ID) for g, t in enumerate(batch.block_tables)
        ),
        features=records,
        descriptor=descriptor,
    )
