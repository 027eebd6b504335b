"""A mismatch report names the differing entries only: a padded batch array is thousands of entries long."""

from __future__ import annotations

import dataclasses

import numpy as np

import spec
from conformance.backends import BackendHandle
from conformance.examples import worked_example
from shadow.compare import array_difference, entries_difference
from spec.classify import RowClasses
from spec.types import FEATURE_FIELDS


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


def test_the_shadow_checker_names_its_entries_and_its_reference() -> None:
    """shadow_compare's per-request details: `its token 1`, spec as the reference, both heads on a shape."""
    want = np.array([5, 6, 7])
    assert entries_difference(want, np.array([5, 9, 7]), "its token", "spec") == (
        "1 of 3 entries differ: its token 1: got 9, spec 6"
    )
    assert entries_difference(want, np.array([5, 6]), "its token", "spec") == "shape (2,) [5, 6], spec (3,) [5, 6, 7]"


def test_equal_arrays_report_nothing() -> None:
    want = np.arange(5)
    assert array_difference("seq_lens", want, want.copy()) == ""


def test_the_compared_form_holds_every_batch_field() -> None:
    """batch_to_numpy is what every comparer reads: a BatchInputs field it leaves out is never compared."""
    ex = worked_example()
    pool = spec.RequestStatePool(ex.config)
    pool.apply(ex.step1)
    compared = BackendHandle("spec", spec).batch_to_numpy(pool.prepare(ex.step1))
    core = {f.name for f in dataclasses.fields(spec.BatchInputs)} - {"features", "row_classes"}  # records, by name:
    core |= {f"row_classes.{f.name}" for f in dataclasses.fields(RowClasses)}  # the classification, field by field
    assert set(compared) == core | FEATURE_FIELDS
