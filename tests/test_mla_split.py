"""MLA's decode/prefill split (spec/mla_split.py): which rows the absorbed decode kernel takes, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from spec.mla_split import MlaBatchSplit, decode_first_order, mla_decode_rows, split_mla_batch

K = 2  # drafts per step: reorder_batch_threshold = 1 + K
THRESHOLD = 1 + K


def test_decodes_are_short_rows_that_are_not_prefilling() -> None:
    # a plain decode, a verify row of 1 + K, a 1-token chunk tail still prefilling, a long prefill chunk
    lens = np.array([1, 3, 1, 9])
    prefilling = np.array([False, False, True, True])
    assert mla_decode_rows(lens, prefilling, THRESHOLD).tolist() == [True, True, False, False]
    assert split_mla_batch(lens, prefilling, THRESHOLD) == MlaBatchSplit(2, 2, 4, 10)


def test_a_short_prompt_is_a_prefill_not_a_decode() -> None:
    """vllm-ascend #5583: a prompt of <= 1 + K tokens (here "Hi", 2 tokens, and a 3-token one) is a prefill; only
    vLLM 0.32's non-CP default (treat_short_extends_as_decodes=True) takes it for a decode."""
    lens, prefilling = np.array([3, 2, 3]), np.array([False, True, True])
    assert split_mla_batch(lens, prefilling, THRESHOLD) == MlaBatchSplit(1, 2, 3, 5)
    loose = split_mla_batch(lens, prefilling, THRESHOLD, treat_short_extends_as_decodes=True)
    assert loose == MlaBatchSplit(3, 0, 8, 0)


def test_rows_past_the_threshold_are_prefills_even_when_decoding() -> None:
    # a decode row of 4 tokens under threshold 3 (more drafts than the backend's threshold) goes to prefill
    assert split_mla_batch(np.array([1, 4]), np.array([False, False]), THRESHOLD) == MlaBatchSplit(1, 1, 1, 4)
    assert split_mla_batch(np.array([1, 4]), np.array([False, False]), 4) == MlaBatchSplit(2, 0, 5, 0)


def test_split_needs_decode_first_order_and_decode_first_order_is_stable() -> None:
    lens = np.array([2, 1, 3, 5, 1])
    prefilling = np.array([True, False, False, True, False])
    with pytest.raises(ValueError, match="row 1 is a decode after prefill row 0"):
        split_mla_batch(lens, prefilling, THRESHOLD)
    order = decode_first_order(lens, prefilling, THRESHOLD)
    assert order.tolist() == [1, 2, 4, 0, 3]  # decodes, then prefills, each in the batch's order
    assert split_mla_batch(lens[order], prefilling[order], THRESHOLD) == MlaBatchSplit(3, 2, 5, 7)


def test_edge_batches() -> None:
    none = np.array([], np.int64)
    assert split_mla_batch(none, np.array([], bool), THRESHOLD) == MlaBatchSplit(0, 0, 0, 0)
    # a padding request of 0 tokens that is not prefilling is a decode, as in vLLM's padded uniform batches
    assert split_mla_batch(np.array([3, 0]), np.array([False, False]), THRESHOLD) == MlaBatchSplit(2, 0, 3, 0)
    assert split_mla_batch(np.array([5]), np.array([True]), THRESHOLD) == MlaBatchSplit(0, 1, 0, 5)


@pytest.mark.parametrize(
    ("lens", "prefilling", "threshold", "message"),
    [
        ([1], [False], 0, "reorder_batch_threshold must be an int >= 1"),
        ([1], [False], 2.0, "reorder_batch_threshold must be an int >= 1"),
        ([1], [False], True, "reorder_batch_threshold must be an int >= 1"),
        ([1.0], [False], 2, "query_lens must be"),
        ([[1]], [[False]], 2, "query_lens must be"),
        ([1, -1], [False, False], 2, r"query_lens\[1\] = -1"),
        ([1, 2], [False], 2, "is_prefilling must be"),
        ([1, 2], [0, 1], 2, "is_prefilling must be"),
    ],
)
def test_split_refusals(lens: list, prefilling: list, threshold: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_mla_batch(np.array(lens), np.array(prefilling), threshold)  # type: ignore[arg-type]
