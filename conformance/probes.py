"""Misuse between the calls of a step: stale batches and outputs mutated after apply.

`ProbedPool` wraps a pool under test and, on the side of the calls a driver makes, tries what the
input policy says must change nothing (spec/pool.py's docstring, docs/semantics.md "Input policy"):
- mutated outputs: before prepare, the output's `num_scheduled_tokens` dict is edited (a count changed,
  a request dropped, a ghost added, the tie order changed, or cleared) and prepare must return exactly
  the batch of the unmutated output (the dict is restored before the driver sees anything);
- stale batches: before record_sampled takes the current batch, the previous step's batch is offered
  (if it differs from the current one in req_ids, index_mapping or seq_lens), and after it, the current
  batch again (recorded already); each must raise InconsistentSchedulerOutputError and leave the
  snapshot unchanged.
A failed probe raises MismatchError naming the backend. The driver's own calls go through unchanged, so
the wrapped pools of conformance.differential.Pair keep being compared as usual.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.backends import BackendHandle
from conformance.compare import copy_batch, differing_fields
from conformance.differential import MismatchError
from spec.errors import InconsistentSchedulerOutputError, ScheduleError
from spec.protocol import StatePool
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput


def _count_changed(counts: dict[str, Any], rng: random.Random) -> None:
    req_id = rng.choice(list(counts))
    counts[req_id] += 1 if counts[req_id] == 1 or rng.random() < 0.5 else -1


def _dropped(counts: dict[str, Any], rng: random.Random) -> None:
    del counts[rng.choice(list(counts))]


def _ghost_added(counts: dict[str, Any], rng: random.Random) -> None:
    counts["probe-ghost"] = rng.randint(1, 4)


def _first_moved_last(counts: dict[str, Any], rng: random.Random) -> None:
    first = next(iter(counts))
    counts[first] = counts.pop(first)  # changes the batch order where it ties with a later request


EDITS: dict[str, Callable[[dict[str, Any], random.Random], None]] = {
    "count changed": _count_changed,
    "request dropped": _dropped,
    "ghost added": _ghost_added,
    "tie order changed": _first_moved_last,
    "cleared": lambda counts, rng: counts.clear(),
}


class ProbedPool:
    def __init__(self, pool: StatePool, handle: BackendHandle, rng: random.Random, rate: float = 0.5) -> None:
        self.pool, self.handle, self.rng, self.rate = pool, handle, rng, rate
        self.last_recorded: BatchInputs | None = None
        self.counts = {"mutated": 0, "stale": 0}

    def apply(self, sched: SchedulerOutput) -> None:
        self.pool.apply(sched)

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        counts = sched.num_scheduled_tokens
        if isinstance(counts, dict) and counts and self.rng.random() < self.rate:
            self._probe_mutation(sched, counts, pad_to)
        return self.pool.prepare(sched, pad_to)

    def _probe_mutation(self, sched: SchedulerOutput, counts: dict[str, Any], pad_to: int | None) -> None:
        saved = dict(counts)
        edit = self.rng.choice(sorted(EDITS))
        EDITS[edit](counts, self.rng)
        try:
            mutated = copy_batch(self.handle.batch_to_numpy(self.pool.prepare(sched, pad_to)))
        except Exception as exc:
            detail = f"prepare after the output was mutated ({edit}) raised {exc!r}"
            raise MismatchError(f"{self.handle.name}: {detail}") from exc
        finally:
            counts.clear()
            counts.update(saved)
        want = self.handle.batch_to_numpy(self.pool.prepare(sched, pad_to))
        differ = differing_fields(want, mutated)
        if differ:
            raise MismatchError(f"{self.handle.name}: mutating the output after apply ({edit}) changed {differ}")
        self.counts["mutated"] += 1

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any) -> None:
        old = self.last_recorded
        if old is not None and self.rng.random() < self.rate and not self._same_rows(old, batch):
            self._expect_refusal("an earlier step's batch", old)
        self.pool.record_sampled(batch, sampled_token_ids)
        self.last_recorded = batch
        if self.rng.random() < self.rate:
            self._expect_refusal("the batch recorded already", batch)

    def _same_rows(self, a: BatchInputs, b: BatchInputs) -> bool:
        to = self.handle.to_numpy
        return tuple(a.req_ids) == tuple(b.req_ids) and all(
            np.array_equal(to(getattr(a, f)), to(getattr(b, f))) for f in ("index_mapping", "seq_lens")
        )

    def _expect_refusal(self, what: str, batch: BatchInputs) -> None:
        before = self.pool.snapshot()
        ids = self.handle.asarray(np.zeros(batch.num_reqs, np.int64))  # valid ids: only the batch is wrong
        try:
            self.pool.record_sampled(batch, ids)
        except ScheduleError as exc:
            if type(exc) is not InconsistentSchedulerOutputError:
                raise MismatchError(f"{self.handle.name}: record_sampled({what}) raised {exc!r}") from exc
        except Exception as exc:
            detail = f"record_sampled({what}) raised {exc!r}, not a ScheduleError"
            raise MismatchError(f"{self.handle.name}: {detail}") from exc
        else:
            raise MismatchError(f"{self.handle.name}: record_sampled accepted {what}")
        if self.pool.snapshot() != before:
            raise MismatchError(f"{self.handle.name}: the refused record_sampled({what}) changed the pool")
        self.counts["stale"] += 1

    def row_of(self, req_id: str) -> int:
        return self.pool.row_of(req_id)

    def snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()
