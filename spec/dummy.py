"""Dummy batches: a data-parallel rank with no request this step still runs the model, padded to a peer's count.

vLLM's DP ranks run their forward passes in lockstep (MoE layers all-to-all across ranks), so a rank with nothing
scheduled runs a dummy step (`_dummy_run`), its token count the one `coordinate_batch_across_dp` agreed on: the
largest padded count among the ranks. What such a step may touch:

  writes: nothing. Every token is padding: position 0, input id 0, slot PAD_SLOT_ID in every group, so write_kv
      stores no byte. The slot mapping is PAD from the moment the batch exists: vllm-ascend #15417 cleared it
      only after the backend had copied it, and the dummy step wrote NaN into blocks a sliding window had just
      released to other requests.
  reads: no block of any request. Request rows (a FULL graph's padded rows, spec/padding.py) have index_mapping
      -1, query length 0, the profile's seq_len, block-table rows of the null block only.

A rank WITH requests whose peer has more tokens pads its real batch to the peer's count: `prepare(sched,
pad_to=peer_count)` (its tokens past the real ones are padding as above; its real tokens' slots unchanged).

The model kinds' records (spec/feature.py) are not part of a dummy batch: it is built without a pool, and a kind's
dummy inputs (a Mamba model's state indices, all NO_STATE) are its model's to make.
"""

from __future__ import annotations

import numpy as np

from spec.classify import classify
from spec.graphs import CapturedGraphs, dispatch
from spec.padding import pad_request_rows
from spec.types import (
    BLOCK_ID_DTYPE,
    INDEX_DTYPE,
    PAD_SLOT_ID,
    SLOT_DTYPE,
    TOKEN_DTYPE,
    BatchInputs,
    WorkerConfig,
    is_integral,
)


def dummy_batch(config: WorkerConfig, num_tokens: int, graphs: CapturedGraphs | None = None) -> BatchInputs:
    """A batch of no request and `num_tokens` padding tokens (a peer's count); with graphs, padded for the graph
    that count dispatches to (never a uniform decode: it has no decode row)."""
    if not is_integral(num_tokens) or num_tokens < 0:
        raise ValueError(f"dummy_batch: num_tokens must be an integer >= 0, got {num_tokens!r}")
    if graphs is not None and not isinstance(graphs, CapturedGraphs):
        raise ValueError(f"dummy_batch: graphs must be a CapturedGraphs, got {type(graphs).__name__}")
    none = np.zeros(0, np.int64)
    classes = classify(none, none, none, 1 if graphs is None else graphs.uniform_decode_query_len)
    descriptor = None if graphs is None else dispatch(graphs, int(num_tokens), 0, classes)
    padded = int(num_tokens) if descriptor is None else descriptor.num_tokens
    groups = range(len(config.kv_groups))
    batch = BatchInputs(
        req_ids=(),
        index_mapping=np.zeros(0, INDEX_DTYPE),
        num_scheduled_tokens=np.zeros(0, INDEX_DTYPE),
        query_start_loc=np.zeros(1, INDEX_DTYPE),
        positions=np.zeros(padded, TOKEN_DTYPE),
        input_ids=np.zeros(padded, TOKEN_DTYPE),
        seq_lens=np.zeros(0, INDEX_DTYPE),
        logits_indices=np.zeros(0, INDEX_DTYPE),
        block_tables=tuple(np.zeros((0, config.max_blocks_per_req(g)), BLOCK_ID_DTYPE) for g in groups),
        slot_mappings=tuple(np.full(padded, PAD_SLOT_ID, SLOT_DTYPE) for _ in groups),
        num_tokens=0,
        num_tokens_padded=padded,
        row_classes=classes,
    )
    if graphs is None or descriptor is None:
        return batch
    return pad_request_rows(batch, descriptor, graphs.profile, ())
