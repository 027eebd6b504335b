"""Small helpers to drive any backend through hand-written steps (used by the pipeline and error tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from conformance.backends import BackendHandle
from spec.protocol import StatePool
from spec.types import SchedulerOutput


def step(
    backend: BackendHandle,
    pool: StatePool,
    sched: SchedulerOutput,
    sampled: dict[str, int] | None = None,
    pad_to: int | None = None,
) -> dict[str, Any]:
    """apply + prepare (+ record_sampled with `sampled[req_id]`, default token 1); returns the batch as NumPy."""
    pool.apply(sched)
    batch = pool.prepare(sched, pad_to)
    ids = [(sampled or {}).get(r, 1) for r in batch.req_ids]
    pool.record_sampled(batch, backend.asarray(np.array(ids, np.int64)))
    return backend.batch_to_numpy(batch)


def run(backend: BackendHandle, pool: StatePool, steps: Sequence[SchedulerOutput]) -> list[dict[str, Any]]:
    return [step(backend, pool, s) for s in steps]
