"""Every record_sampled fault of conformance.sampled_faults, made from real steps, refused by every backend as by spec.

Each fault is handed to spec and to the backend under test between prepare and the valid record of
the same step; both must raise the fault's class, change nothing, and then take the valid ids.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import spec
from conformance.backends import BackendHandle
from conformance.differential import one_torch_thread
from conformance.sampled_faults import SAMPLED_FAULTS, break_sampled, stale_batch
from conformance.seeded import Refusals, Sampled, run_seeded
from spec.drafts import pad_accepted
from spec.errors import InconsistentSchedulerOutputError
from spec.protocol import StatePool
from spec.types import BatchInputs, SchedulerOutput, WorkerConfig


def test_every_sampled_fault_is_refused_identically(backend: BackendHandle) -> None:
    made: collections.Counter[str] = collections.Counter()
    handles = [BackendHandle("spec", spec), backend]
    pools: list[StatePool] = []

    def keep_pools(out: SchedulerOutput, config: WorkerConfig, p: Sequence[StatePool], rng: random.Random) -> None:
        pools[:] = p

    def faults(sampled: Sampled, config: WorkerConfig, batches: Sequence[BatchInputs], rng: random.Random) -> None:
        refusals = Refusals(handles, pools)
        for name in SAMPLED_FAULTS:
            if made[name] >= 3:
                continue  # enough of this one: the interpreter backend is slow
            broken = break_sampled(name, sampled, config, rng)
            if broken is not None:
                refusals.record(batches, *broken)
                made[name] += 1
        if made["stale batch"] < 3:  # same request ids, other rows or lengths (issue 24's third case)
            stale = [stale_batch(b, h.to_numpy, h.asarray, random.Random(made["stale batch"]))
                     for b, h in zip(batches, handles, strict=True)]  # fmt: skip
            kept = [b for b in stale if b is not None]
            if len(kept) == len(stale):  # the same alteration of each backend's batch: one seeded choice each
                refusals.record(kept, pad_accepted(sampled.rows), InconsistentSchedulerOutputError)
                made["stale batch"] += 1

    with one_torch_thread():
        for seed in range(40):
            run_seeded(seed, handles, 8, keep_pools, faults)
            if all(made[name] >= 3 for name in (*SAMPLED_FAULTS, "stale batch")):
                break
    missing = [name for name in (*SAMPLED_FAULTS, "stale batch") if not made[name]]
    assert not missing, f"never made: {missing}"
