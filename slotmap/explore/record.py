"""Drive spec's pool through a run and keep what every step read and produced.

A source (slotmap.explore.sources) feeds scheduler outputs to a `Recorder`: `step` applies and prepares
one output through `spec.RequestStatePool`, `sampled` records the step's sampled tokens. Each step keeps
the pool before the step, the `StepView` that `slotmap explain` draws (pool after apply, the batch in
NumPy form) and the pool after record_sampled, so every number the page shows is spec's own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import spec
from conformance.backends import load_backend
from conformance.driving import draft_fields, sampled_array
from slotmap.pictures.explanation import Explanation, explain_step
from slotmap.pictures.steps import StepView
from spec.graphs import CapturedGraphs
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig


@dataclass(frozen=True)
class StepRecord:
    number: int  # from 1
    sched: SchedulerOutput
    pad_to: int | None  # the padding prepare was asked for (None: none)
    before: PoolSnapshot  # the pool before apply: after the previous step's record_sampled
    view: StepView  # the pool after apply and the batch prepare built from it
    after: PoolSnapshot  # the pool after record_sampled
    # requests the source's scheduler preempted in this step (it keeps its row and stale table); a source
    # that cannot tell (a recorded engine run) leaves it empty
    preempted: frozenset[str] = frozenset()

    @property
    def explanation(self) -> Explanation:
        return explain_step(self.view)


@dataclass(frozen=True)
class Run:
    config: WorkerConfig
    title: str
    steps: tuple[StepRecord, ...]
    start_step: int = 1  # the step the page opens at
    ubatch: bool = False  # the page marks each step's micro-batch split (spec/ubatch.py, default split point)


class Recorder:
    """spec's pool plus the record of every step driven through it."""

    def __init__(self, config: WorkerConfig, graphs: CapturedGraphs | None = None) -> None:
        self.config = config
        self.graphs = graphs  # every step prepared for the graph it dispatches to (then no pad_to)
        self.pool = spec.RequestStatePool(config)
        self.steps: list[StepRecord] = []
        self._numpy = load_backend("spec")
        self._open: tuple[SchedulerOutput, int | None, PoolSnapshot, StepView, BatchInputs, frozenset[str]] | None
        self._open = None

    def step(
        self, sched: SchedulerOutput, pad_to: int | None = None, preempted: Collection[str] = (), title: str = ""
    ) -> BatchInputs:
        """apply + prepare one output; the batch is returned so the source can sample for its rows."""
        if self._open is not None:
            raise RuntimeError("record the previous step's sampled tokens before the next step")
        before = self.pool.snapshot()
        self.pool.apply(sched)
        batch = self.pool.prepare(sched, pad_to, graphs=self.graphs)
        arrays = self._numpy.batch_to_numpy(batch) | draft_fields(self._numpy, batch)
        title = title or f"step {len(self.steps) + 1}"
        view = StepView(self.config, self.pool.snapshot(), arrays, title, inputs=batch)
        self._open = (sched, pad_to, before, view, batch, frozenset(preempted))
        return batch

    def sampled(self, tokens: np.ndarray | Sequence[int | Sequence[int]] | Mapping[str, int | Sequence[int]]) -> None:
        """The step's sampled tokens: per batch row, or by req_id (rows without one get a discarded 0).

        A row's entry is one token or, after drafts, the tokens the rejection sampler kept.
        """
        if self._open is None:
            raise RuntimeError("step() before recording sampled tokens")
        sched, pad_to, before, view, batch, preempted = self._open
        if isinstance(tokens, np.ndarray):
            ids = tokens
        elif isinstance(tokens, Mapping):
            ids = sampled_array([tokens.get(r, 0) for r in batch.req_ids])
        else:
            ids = sampled_array(list(tokens))
        self.pool.record_sampled(batch, ids)
        number = len(self.steps) + 1
        self.steps.append(StepRecord(number, sched, pad_to, before, view, self.pool.snapshot(), preempted))
        self._open = None

    def run(self, title: str, start_step: int = 1, ubatch: bool = False) -> Run:
        if self._open is not None:
            raise RuntimeError("the last step has no sampled tokens recorded")
        return Run(self.config, title, tuple(self.steps), start_step, ubatch)
