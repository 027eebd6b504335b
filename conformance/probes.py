"""Misuse between the calls of a step: stale batches and outputs mutated after apply.

`ProbedPool` wraps a pool under test and, on the side of the calls a driver makes, tries what the
input policy says must change nothing (spec/pool.py's docstring, docs/semantics.md "Input policy"):
- mutated outputs: before prepare, the output's `num_scheduled_tokens` dict is edited (a count changed,
  a request dropped, a ghost added, the tie order changed, or cleared) and prepare must return exactly
  the batch of the unmutated output (the dict is restored before the driver sees anything);
- stale batches: before record_sampled takes the current batch, the previous step's batch is offered
  (if it differs from the current one in req_ids, index_mapping or seq_lens), and after it, the current
  batch again (recorded already); each must raise InconsistentSchedulerOutputError and leave the
  snapshot unchanged;
- misused calls (`call_faults`): after prepare, an earlier output prepared, a pad_to that is no integer or
  is below the step's tokens, row_of a request that holds no row; each must raise its class, leave the
  snapshot unchanged and leave the batch just prepared as it was (a refused prepare is no "next prepare").
A failed probe raises MismatchError naming the backend. The driver's own calls go through unchanged, so
the wrapped pools of conformance.differential.Pair keep being compared as usual.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from conformance.backends import BackendHandle
from conformance.differential import MismatchError
from shadow.compare import copy_batch, differing_fields
from spec.errors import InconsistentSchedulerOutputError, ScheduleError, UnknownRequestError
from spec.graphs import CapturedGraphs
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


CallFault = tuple[str, Callable[[StatePool], object], type[ScheduleError]]  # (what, the call, its class)


def call_faults(
    sched: SchedulerOutput, earlier: SchedulerOutput | None, num_tokens: int, held: Collection[str], rng: random.Random
) -> list[CallFault]:
    """The misused calls of spec/pool.py's prepare and row_of, for a pool that applied `sched` last (`earlier`
    before it) with `num_tokens` scheduled tokens and holding rows for `held`."""
    refused = InconsistentSchedulerOutputError
    not_integer: Any = rng.choice((float(num_tokens), str(num_tokens), num_tokens + 0.5, True, "all"))
    faults: list[CallFault] = [("pad_to not an integer", lambda pool: pool.prepare(sched, not_integer), refused)]
    if num_tokens:
        below = rng.choice((rng.randrange(num_tokens), -1))
        faults.append(("pad_to below the tokens", lambda pool: pool.prepare(sched, below), refused))
    if earlier is not None and earlier != sched:
        faults.append(("an earlier output prepared", lambda pool: pool.prepare(earlier), refused))
    ghost = rng.choice([*sorted(set(sched.finished_req_ids) - set(held)), "probe-ghost"])
    faults.append(("row_of a request that holds no row", lambda pool: pool.row_of(ghost), UnknownRequestError))
    return faults


class ProbedPool:
    def __init__(self, pool: StatePool, handle: BackendHandle, rng: random.Random, rate: float = 0.5) -> None:
        self.pool, self.handle, self.rng, self.rate = pool, handle, rng, rate
        self.last_recorded: BatchInputs | None = None
        self.applied: list[SchedulerOutput] = []  # the last two applied outputs, oldest first
        self.counts = {"mutated": 0, "stale": 0, "misused": 0}

    def apply(self, sched: SchedulerOutput) -> None:
        self.pool.apply(sched)
        self.applied = [*self.applied[-1:], sched]

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        counts = sched.num_scheduled_tokens
        if isinstance(counts, dict) and counts and self.rng.random() < self.rate:
            self._probe_mutation(sched, counts, pad_to)
        batch = self.pool.prepare(sched, pad_to, graphs=graphs)
        if self.rng.random() < self.rate:
            self._probe_misuse(sched, batch)
        return batch

    def _probe_misuse(self, sched: SchedulerOutput, batch: BatchInputs) -> None:
        earlier = self.applied[0] if len(self.applied) == 2 else None
        held = [row.req_id for row in self.pool.snapshot()]
        want = copy_batch(self.handle.batch_to_numpy(batch))
        for what, call, cls in call_faults(sched, earlier, batch.num_tokens, held, self.rng):
            self._expect(what, functools.partial(call, self.pool), cls)
            differ = differing_fields(want, self.handle.batch_to_numpy(batch))
            if differ:
                raise MismatchError(f"{self.handle.name}: the refused {what} changed the prepared batch's {differ}")
            self.counts["misused"] += 1

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

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any, next_draft_ids: Any = None) -> None:
        old = self.last_recorded
        if old is not None and self.rng.random() < self.rate and not self._same_rows(old, batch):
            self._expect_refusal("an earlier step's batch", old)
        if next_draft_ids is None:  # a backend written before rule 8 takes two arguments
            self.pool.record_sampled(batch, sampled_token_ids)
        else:
            self.pool.record_sampled(batch, sampled_token_ids, next_draft_ids)
        self.last_recorded = batch
        if self.rng.random() < self.rate:
            self._expect_refusal("the batch recorded already", batch)

    def _same_rows(self, a: BatchInputs, b: BatchInputs) -> bool:
        to = self.handle.to_numpy
        return tuple(a.req_ids) == tuple(b.req_ids) and all(
            np.array_equal(to(getattr(a, f)), to(getattr(b, f))) for f in ("index_mapping", "seq_lens")
        )

    def _expect_refusal(self, what: str, batch: BatchInputs) -> None:
        ids = self.handle.asarray(np.zeros(batch.num_reqs, np.int64))  # valid ids: only the batch is wrong
        self._expect(f"record_sampled({what})", lambda: self.pool.record_sampled(batch, ids),
                     InconsistentSchedulerOutputError)  # fmt: skip
        self.counts["stale"] += 1

    def _expect(self, what: str, call: Callable[[], object], cls: type[ScheduleError]) -> None:
        """`call()` raises exactly `cls` and leaves the snapshot as it was."""
        before = self.pool.snapshot()
        try:
            call()
        except ScheduleError as exc:
            if type(exc) is not cls:
                raise MismatchError(f"{self.handle.name}: {what} raised {exc!r}, expected {cls.__name__}") from exc
        except Exception as exc:
            raise MismatchError(f"{self.handle.name}: {what} raised {exc!r}, not a ScheduleError") from exc
        else:
            raise MismatchError(f"{self.handle.name}: {what} was accepted")
        if self.pool.snapshot() != before:
            raise MismatchError(f"{self.handle.name}: the refused {what} changed the pool")

    def row_of(self, req_id: str) -> int:
        return self.pool.row_of(req_id)

    def snapshot(self) -> PoolSnapshot:
        return self.pool.snapshot()
