"""Small helpers to drive any backend through hand-written steps (used by the pipeline and error tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from conformance.backends import DRAFT_FIELDS, BackendHandle
from spec.drafts import pad_accepted
from spec.protocol import StatePool
from spec.types import BatchInputs, SchedulerOutput


def step(
    backend: BackendHandle,
    pool: StatePool,
    sched: SchedulerOutput,
    sampled: Mapping[str, int | Sequence[int]] | None = None,
    pad_to: int | None = None,
) -> dict[str, Any]:
    """apply + prepare (+ record_sampled with `sampled[req_id]`, default token 1); returns the batch as NumPy.

    A sequence for some request (its accepted tokens) makes the ids `[num_reqs, width]`, padded with -1.
    """
    pool.apply(sched)
    batch = pool.prepare(sched, pad_to)
    ids = sampled_array([(sampled or {}).get(r, 1) for r in batch.req_ids])
    pool.record_sampled(batch, backend.asarray(ids))
    return backend.batch_to_numpy(batch)


def sampled_array(per_row: Sequence[int | Sequence[int]]) -> np.ndarray:
    """One id per batch row as `[num_reqs]`; if any row has a sequence, `[num_reqs, longest]` padded with -1."""
    if all(isinstance(t, int) for t in per_row):
        return np.array(per_row, np.int64)
    return pad_accepted([[t] if isinstance(t, int) else list(t) for t in per_row])


def draft_fields(backend: BackendHandle, batch: BatchInputs) -> dict[str, Any]:
    """The speculative-decoding fields of a batch as NumPy (None where the step has no drafts)."""
    converted = backend.batch_to_numpy(batch)
    return {name: converted[name] for name in DRAFT_FIELDS}


def run(backend: BackendHandle, pool: StatePool, steps: Sequence[SchedulerOutput]) -> list[dict[str, Any]]:
    return [step(backend, pool, s) for s in steps]
