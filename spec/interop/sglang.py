"""SGLang's layout: a token-level map per pool row instead of block tables, and extend lengths.

SGLang's `req_to_token_pool.req_to_token[req_pool_idx, position]` is the KV cache index of that
token; slotmap's equivalent is the slot (block * block_size + offset), so `req_pool_indices` are
slotmap's rows (req_state_idx) and `out_cache_loc` the slots the step writes. The ForwardBatch fields:
`seq_lens`, `extend_prefix_lens` (tokens already cached: num_computed_tokens) and `extend_seq_lens`
(tokens this step: num_scheduled_tokens).

Differences from SGLang, by decision: slots are int64 (SGLang's req_to_token is int32; slots may pass
2**31 here), and `req_to_token` is defined only on the positions the step's requests hold (< seq_len)
and not under a null block (a window-released placeholder holds no KV); every other entry is
PAD_SLOT_ID. Rows of requests not in the batch are PAD_SLOT_ID too: a BatchInputs says nothing of them.

Encoder-decoder models (spec/cross_attention.py): SGLang puts a request's encoder KV at the front of its
req_to_token row, so the row is [max_encoder_len + max_model_len] wide: columns 0..L-1 hold the encoder
tokens' slots (the cross group's, block_ids[:cdiv(L, bs)] * bs + arange cut to L) and decoder position p
is at column L + p. `last_loc` (each row's last token of the step) reads column L + seq_len - 1: reading
`row[seq_len - 1]` lands L columns early, in the encoder's part (SGLang PR #39040). The ForwardBatch
fields `encoder_lens`, `encoder_cached` (its encoder does not run this step) and `encoder_out_cache_loc`
(the slots of the encoders that run, in batch order: BatchInputs.cross_slot_mapping) come with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.cross_attention import cross_group, encoder_slots
from spec.interop.kinds import refuse_state_group
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, SLOT_DTYPE, BatchInputs, WorkerConfig

INDEX_DTYPE = "int64"  # SGLang's req_pool_indices and seq_lens are int64
EXTEND_DTYPE = "int32"  # extend_prefix_lens, extend_seq_lens


@dataclass(frozen=True)
class SGLangLayout:
    """Arrays are NumPy from spec.interop, torch tensors on the batch's device from fast.interop."""

    req_to_token: Any  # [max_num_reqs, max_encoder_len + max_model_len] int64, (req_state_idx, column) -> slot
    req_pool_indices: Any  # [num_reqs] int64, batch_idx -> req_state_idx
    out_cache_loc: Any  # [num_tokens] int64, flat token index -> slot written (no padding)
    seq_lens: Any  # [num_reqs] int64
    extend_prefix_lens: Any  # [num_reqs] int32, num_computed_tokens
    extend_seq_lens: Any  # [num_reqs] int32, num_scheduled_tokens
    last_loc: Any = None  # [num_reqs] int64, req_to_token[row, encoder_len + seq_len - 1]: each row's last token
    # encoder-decoder models only (None otherwise)
    encoder_lens: Any = None  # [num_reqs] int64, L of each row
    encoder_cached: Any = None  # [num_reqs] bool, its encoder's KV is in the cache already (does not run now)
    encoder_out_cache_loc: Any = None  # [sum of the running encoders' L] int64, their tokens' slots


def sglang_layout(batch: BatchInputs, config: WorkerConfig, group: int = 0) -> SGLangLayout:
    cross = cross_group(config)
    if group == cross:
        raise ValueError(f"sglang_layout: group {group} is the cross group; its KV leads every decoder group's rows")
    refuse_state_group(config, group, "sglang_layout")
    block_size = config.kv_groups[group].block_size
    rows = np.asarray(batch.index_mapping, np.int64)  # [num_reqs]
    seq_lens = np.asarray(batch.seq_lens, np.int64)  # [num_reqs]
    num_scheduled = np.asarray(batch.num_scheduled_tokens, np.int64)  # [num_reqs]
    table = np.asarray(batch.block_tables[group], np.int64)  # [num_reqs, max_blocks]
    encoder_lens = np.zeros(rows.size, np.int64) if cross is None else np.asarray(batch.encoder_seq_lens, np.int64)
    width = config.max_encoder_len + config.max_model_len
    req_to_token = np.full((config.max_num_reqs, width), PAD_SLOT_ID, SLOT_DTYPE)
    for b, row in enumerate(rows):
        start = int(encoder_lens[b])  # the decoder's position 0
        if cross is not None and start:
            cross_table = np.asarray(batch.block_tables[cross], np.int64)[b]  # [max_blocks] its cross blocks
            req_to_token[row, :start] = encoder_slots(cross_table, start, config.kv_groups[cross].block_size)
        positions = np.arange(seq_lens[b])  # [seq_len]
        blocks = table[b, positions // block_size]
        slots = blocks * block_size + positions % block_size
        req_to_token[row, start : start + seq_lens[b]] = np.where(blocks == NULL_BLOCK_ID, PAD_SLOT_ID, slots)
    return SGLangLayout(
        req_to_token=req_to_token,
        req_pool_indices=rows.astype(INDEX_DTYPE),
        out_cache_loc=np.asarray(batch.slot_mappings[group])[: batch.num_tokens].astype(SLOT_DTYPE),
        seq_lens=seq_lens.astype(INDEX_DTYPE),
        extend_prefix_lens=(seq_lens - num_scheduled).astype(EXTEND_DTYPE),
        extend_seq_lens=num_scheduled.astype(EXTEND_DTYPE),
        last_loc=req_to_token[rows, encoder_lens + seq_lens - 1],
        **({} if cross is None else _encoder_fields(batch, encoder_lens)),
    )


def _encoder_fields(batch: BatchInputs, encoder_lens: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "encoder_lens": encoder_lens.astype(INDEX_DTYPE),
        "encoder_cached": np.asarray(batch.scheduled_encoder_lens) == 0,
        "encoder_out_cache_loc": np.asarray(batch.cross_slot_mapping, np.int64),
    }
