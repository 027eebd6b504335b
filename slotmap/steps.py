"""Drive a backend through the worked example and collect one step's values in NumPy form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.backends import BackendHandle
from conformance.examples import worked_example
from spec.types import PoolSnapshot, WorkerConfig


@dataclass(frozen=True)
class StepView:
    """Everything `demo` and `explain` draw about one step, backend-neutral."""

    config: WorkerConfig
    snapshot: PoolSnapshot  # the pool after apply
    batch: dict[str, Any]  # BatchInputs fields in NumPy form


def worked_example_step(backend: BackendHandle) -> StepView:
    ex = worked_example()
    pool = backend.make_pool(ex.config)
    pool.apply(ex.step1)
    first = pool.prepare(ex.step1)
    pool.record_sampled(first, backend.asarray(np.array(ex.sampled_after_step1(first.req_ids))))
    pool.apply(ex.step2)
    return StepView(ex.config, pool.snapshot(), backend.batch_to_numpy(pool.prepare(ex.step2)))
