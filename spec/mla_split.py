"""MLA's batch split: which rows the absorbed decode kernel takes and which the prefill path (spec/mla_attention.py).

vLLM's MLA metadata builder runs `split_decodes_and_prefills` over a batch its runner has reordered decodes
first (`reorder_batch_to_split_decodes_and_prefills`), with `decode_threshold = reorder_batch_threshold`,
1 + K with K drafts per step (a verification row of 1 + K tokens is a decode) or a backend's own (FlashMLA
128, to take short prefills too). The first num_decodes rows, num_decode_tokens tokens, go to the decode
kernel; the rest to the prefill path.

The rule here, per batch row b, is spec/classify.py's `decode_rows`: **a decode is a row with query_lens[b] <=
threshold that is not prefilling** (is_prefilling[b]: some of its scheduled tokens are prompt tokens, spec/classify.py's
flag).
A prompt chunk is a prefill whatever its length: a 1 + K-token (or shorter) prompt is not taken for a
decode (vllm-ascend #5583: its decode kernel then read a short prompt as a spec-decode row). This is vLLM's
`treat_short_extends_as_decodes=False` (its context-parallel path, and vllm-ascend's fix #10580). vLLM 0.32's
default MLA builder passes True outside context parallelism, which ignores is_prefilling and takes every
row up to the threshold, prompts included, for a decode: `treat_short_extends_as_decodes=True` models it.
On a backend whose decode kernel is causal over any query length the two forms agree (spec/mla_attention.py),
so the choice decides which kernel runs, not the result.

split_mla_batch needs the batch in decode-first order, as vLLM's kernels slice `[:num_decode_tokens]`: a
decode row after a prefill row is refused (ValueError naming the row). decode_first_order gives a stable
order that satisfies it (decodes, then prefills, each in the batch's order); vLLM's V1 reorder swaps rows
instead (not stable), and further orders the prefills (short extends, long extends, first chunks).
A row of 0 tokens (a padding request) that is not prefilling counts as a decode, as vLLM's padded uniform
batches do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.classify import decode_rows
from spec.types import is_integral


@dataclass(frozen=True)
class MlaBatchSplit:
    num_decodes: int  # rows [0, num_decodes) are decodes
    num_prefills: int  # rows [num_decodes, num_reqs)
    num_decode_tokens: int  # flat tokens [0, num_decode_tokens) go to the decode kernel
    num_prefill_tokens: int  # the rest of the real tokens


def mla_decode_rows(
    query_lens: Any,  # [num_reqs] tokens scheduled per batch row
    is_prefilling: Any,  # [num_reqs] bool, the row's scheduled tokens include prompt tokens
    reorder_batch_threshold: int,  # 1 + K with K drafts per step, or a backend's own
    *,
    treat_short_extends_as_decodes: bool = False,  # vLLM 0.32's default outside context parallelism: True
) -> np.ndarray:  # [num_reqs] bool, batch_idx -> the row is a decode
    lens, prefilling = _check_split_inputs(query_lens, is_prefilling, reorder_batch_threshold)
    return decode_rows(
        lens, prefilling, reorder_batch_threshold, treat_short_extends_as_decodes=treat_short_extends_as_decodes
    )


def split_mla_batch(
    query_lens: Any,  # [num_reqs] in batch order, decodes first
    is_prefilling: Any,  # [num_reqs] bool
    reorder_batch_threshold: int,
    *,
    treat_short_extends_as_decodes: bool = False,
) -> MlaBatchSplit:
    decode = mla_decode_rows(
        query_lens,
        is_prefilling,
        reorder_batch_threshold,
        treat_short_extends_as_decodes=treat_short_extends_as_decodes,
    )  # [num_reqs]
    num_decodes = int(np.argmin(decode)) if not decode.all() else decode.size  # the first prefill row
    late = np.flatnonzero(decode[num_decodes:])
    if late.size:
        raise ValueError(
            f"split_mla_batch: row {num_decodes + int(late[0])} is a decode after prefill row {num_decodes}; "
            "the batch must be in decode-first order (decode_first_order)"
        )
    lens = np.asarray(query_lens, np.int64)
    num_decode_tokens = int(lens[:num_decodes].sum())
    return MlaBatchSplit(num_decodes, decode.size - num_decodes, num_decode_tokens, int(lens.sum()) - num_decode_tokens)


def decode_first_order(
    query_lens: Any,  # [num_reqs] in batch order
    is_prefilling: Any,  # [num_reqs] bool
    reorder_batch_threshold: int,
    *,
    treat_short_extends_as_decodes: bool = False,
) -> np.ndarray:  # [num_reqs] int64, new batch_idx -> old batch_idx
    decode = mla_decode_rows(
        query_lens,
        is_prefilling,
        reorder_batch_threshold,
        treat_short_extends_as_decodes=treat_short_extends_as_decodes,
    )
    return np.concatenate([np.flatnonzero(decode), np.flatnonzero(~decode)]).astype(np.int64)


def _check_split_inputs(query_lens: Any, is_prefilling: Any, threshold: Any) -> tuple[np.ndarray, np.ndarray]:
    if not is_integral(threshold) or threshold < 1:
        raise ValueError(f"split_mla_batch: reorder_batch_threshold must be an int >= 1, got {threshold!r}")
    lens, prefilling = np.asarray(query_lens), np.asarray(is_prefilling)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise ValueError(f"split_mla_batch: query_lens must be [num_reqs] integers, got {lens.dtype} {lens.shape}")
    if lens.size and int(lens.min()) < 0:
        raise ValueError(f"split_mla_batch: query_lens[{int(np.argmin(lens))}] = {int(lens.min())} is negative")
    if prefilling.shape != lens.shape or (prefilling.size and prefilling.dtype != np.bool_):
        raise ValueError(
            f"split_mla_batch: is_prefilling must be [{lens.size}] bools, got {prefilling.dtype} {prefilling.shape}"
        )
    return lens.astype(np.int64), prefilling.astype(bool)
