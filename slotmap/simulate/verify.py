"""Step-level verification against spec: the same scheduler outputs and sampled tokens go to a spec pool.

The spec pool follows every step (its state must keep up); every K-th step the verifier compares the
backend's `BatchInputs` with spec's exactly, and replays the model step through spec's kernels on a
copy of the backend's KV caches taken just before the step, in float32 and widened to float64. The
backend's logits must then satisfy conformance/tolerance.py's rule at the level of the whole model:
max|backend - spec64| <= 2 * max|spec32 - spec64| + floor(float32) * max(1, max|spec64|).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from conformance.backends import BackendHandle, load_backend
from conformance.tolerance import as_float64, tolerance
from shadow.compare import batch_differences
from slotmap.tiny.engine import Engine, StepResult
from slotmap.tiny.kv_caches import PagedKV
from spec.drafts import pad_accepted
from spec.types import BatchInputs, SchedulerOutput


@dataclass
class SpecVerifier:
    engine: Engine
    every: int  # compare every `every`-th step (0: never, the spec pool still follows)
    spec: BackendHandle = field(default_factory=lambda: load_backend("spec"))
    steps_checked: int = 0
    max_logit_error: float = 0.0  # max |backend - spec64| over checked logits
    worst_ratio: float = 0.0  # the largest error / bound seen
    mismatches: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pool = self.spec.make_pool(self.engine.config)
        self._step = 0
        self._spec_batch: BatchInputs | None = None
        self._spec_kv: tuple[PagedKV, PagedKV] | None = None  # float32 and float64 copies

    @property
    def all_matched(self) -> bool:
        return not self.mismatches

    def before_model(self, out: SchedulerOutput, pad_to: int | None) -> Any:
        """The engine's `before_model` hook for this step (spec applies and prepares the same output)."""
        self._step += 1
        self.pool.apply(out)
        self._spec_batch = self.pool.prepare(out, pad_to)
        verify = self.every > 0 and self._step % self.every == 0
        self._spec_kv = None

        def hook(batch: BatchInputs) -> None:
            if not verify:
                return
            self._compare_batches(batch)
            kv = self.engine.kv
            self._spec_kv = (kv.copy_to(self.spec), kv.copy_to(self.spec, dtype=torch.float64))

        return hook

    def idle(self, out: SchedulerOutput) -> None:
        self._step += 1
        self.pool.apply(out)

    def after_model(self, result: StepResult) -> None:
        spec_batch = self._spec_batch
        assert spec_batch is not None, "before_model must run first"
        if tuple(result.batch.req_ids) != tuple(spec_batch.req_ids):  # the batch order is part of the contract
            self.mismatches.append(f"step {self._step}: batch holds {result.batch.req_ids}, spec {spec_batch.req_ids}")
            raise RuntimeError(f"backend and spec diverged at step {self._step}: {self.mismatches[-1]}")
        if self._spec_kv is not None:
            self.steps_checked += 1
            low = self.engine.model.forward_paged(spec_batch, self._spec_kv[0]).numpy()
            ref64 = self.engine.model.forward_paged(spec_batch, self._spec_kv[1]).numpy()
            ours = as_float64(result.logits)  # same batch order, so the same logits rows (drafts included)
            err = float(np.abs(ours - ref64).max())
            tol = tolerance(ref64, low, "float32")
            self.max_logit_error = max(self.max_logit_error, err)
            self.worst_ratio = max(self.worst_ratio, err / tol)
            if not err <= tol:
                self.mismatches.append(f"step {self._step}: logits differ from spec by {err:.3g} > {tol:.3g}")
        self.pool.record_sampled(spec_batch, pad_accepted(result.kept))

    def _compare_batches(self, batch: BatchInputs) -> None:
        ours = self.engine.backend.batch_to_numpy(batch)
        theirs = self.spec.batch_to_numpy(self._spec_batch)  # type: ignore[arg-type]
        for problem in batch_differences(theirs, ours):
            self.mismatches.append(f"step {self._step}: BatchInputs differs from spec's: {problem}")
