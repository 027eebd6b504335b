"""The shadow checker's padding comparison: an engine's padded request rows and chosen graph against spec's.

For a step the engine ran on a captured graph (`ShadowChecker.check(..., graphs=, descriptor=)`), spec prepares
the same step for the same capture configuration (spec/graphs.py, spec/padding.py) and the engine's arrays past
its real requests must hold what spec's padded rows hold: `query_start_loc` repeating the real token count,
`seq_lens` the profile's pad value, block-table rows all NULL_BLOCK_ID (checked across the engine's whole row).
The engine's descriptor, when it exposes one, must be spec's: mode, padded tokens, padded request rows and
uniform (a uniform-decode graph by progress: a 1 + K-token prompt chunk is not one). Padding tokens' slots are
compare_steps.py's (PAD_SLOT_ID past the real tokens). Each divergence is (None, field, detail): a padded row
belongs to no request, so the report names the batch and the padded row.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shadow.compare import entries_difference
from spec.graphs import BatchDescriptor, CapturedGraphs
from spec.types import NULL_BLOCK_ID, BatchInputs

Difference = tuple[str | None, str, str]
DESCRIPTOR_FIELDS = ("mode", "num_tokens", "num_reqs", "uniform")


@dataclass(frozen=True)
class EnginePadding:
    """What the engine ran a step on: the capture configuration, and the descriptor it chose (None: not exposed)."""

    graphs: CapturedGraphs
    descriptor: BatchDescriptor | None = None


def padding_differences(
    batch: BatchInputs,  # spec's, prepared with the engine's graphs
    arrays: Mapping[str, np.ndarray],  # the engine's, in its conventions (real rows first, then padded ones)
    num_groups: int,
    descriptor: Any,  # the engine's: anything with DESCRIPTOR_FIELDS, or None
) -> Iterator[Difference]:
    want = batch.descriptor
    if descriptor is not None and want is not None:
        for name in DESCRIPTOR_FIELDS:
            got_value, want_value = getattr(descriptor, name, None), getattr(want, name)
            if got_value != want_value:
                yield None, "descriptor", f"{name} {got_value!r}, spec {want_value!r} (spec dispatches {want})"
    n, padded = batch.num_reqs, batch.num_reqs_padded
    if padded == n:
        return
    for name, offset in (("query_start_loc", 1), ("seq_lens", 0)):
        if name not in arrays:
            continue
        got = np.asarray(arrays[name]).astype(np.int64)
        spec_rows = np.asarray(getattr(batch, name))[n + offset : padded + offset].astype(np.int64)
        if got.shape[0] < padded + offset:
            yield None, name, f"{got.shape[0]} entries, spec pads the request rows to {padded}"
        elif detail := entries_difference(spec_rows, got[n + offset : padded + offset], "padded entry", "spec"):
            yield None, name, f"rows {n}..{padded - 1} padded: {detail}"
    for g in range(num_groups):
        name = "block_table" if f"block_table[{g}]" not in arrays and g == 0 else f"block_table[{g}]"
        if name not in arrays:
            continue
        table = np.asarray(arrays[name])
        if table.ndim != 2 or table.shape[0] < padded:
            yield None, name, f"shape {table.shape}, spec pads the request rows to {padded}"
            continue
        rows = table[n:padded]
        if np.any(rows != NULL_BLOCK_ID):
            b, j = (int(i) for i in np.argwhere(rows != NULL_BLOCK_ID)[0])
            yield None, name, f"padded row {n + b}: entry {j} holds block {int(rows[b, j])}, spec NULL_BLOCK_ID"
