"""A mismatch report names the differing entries only: a padded batch array is thousands of entries long."""

from __future__ import annotations

import numpy as np

from conformance.compare import array_difference


def test_only_the_differing_entries_are_shown() -> None:
    want = np.full(4096, -1, np.int64)  # a slot mapping padded far past its few real tokens
    want[:3] = [704, 705, 207]
    got = want.copy()
    got[2] = 208
    report = array_difference("slot_mappings[0]", want, got)
    assert report == "slot_mappings[0]: 1 of 4096 entries differ: (2,): got 208, expected 207"


def test_many_differences_are_counted_not_listed() -> None:
    want = np.arange(1000, dtype=np.int32)
    report = array_difference("positions", want, want + 1)
    assert report.startswith("positions: 1000 of 1000 entries differ: (0,): got 1, expected 0")
    assert report.endswith("(and 992 more)") and len(report) < 400


def test_equal_arrays_report_nothing() -> None:
    want = np.arange(5)
    assert array_difference("seq_lens", want, want.copy()) == ""
