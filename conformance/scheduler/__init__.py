"""A reference scheduler model that produces realistic, valid SchedulerOutputs from a seed.

Usage (every output is valid for the spec pool; `expected_snapshot()` says what the pool must hold):

    from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, as_vllm, make_workload

    workload = make_workload(seed, config, num_requests=8, max_arrival_step=8, num_prefixes=2)
    sched = ReferenceScheduler(config, workload, knobs=SchedulerKnobs(pad_buckets=(8, 32, 128)), seed=seed)
    while not sched.done():
        out = sched.schedule()                      # may schedule nothing (e.g. before the first arrival)
        vllm_out = as_vllm(out, sched)              # the same output as vLLM 0.32 sends it (vllm_form.py)
        pad_to = sched.pad_to(out)                  # None, or a bucket >= out.total_num_scheduled_tokens
        pool.apply(out)
        batch = pool.prepare(out, pad_to)
        takes = sched.sampling_req_ids(out)         # the requests whose step reaches their last known token
        sampled = [token_for(r) for r in batch.req_ids]  # one per batch row; rows not in `takes` are discarded
        kept = sched.rejection_step(out, {r: t for r, t in zip(batch.req_ids, sampled) if r in takes})
        pool.record_sampled(batch, sampled_array([kept.get(r, t) for r, t in zip(batch.req_ids, sampled)]))
        sched.update(out, kept)                     # with knobs.spec_tokens > 0, outputs carry drafts
        assert pool.snapshot() == sched.expected_snapshot()
    sched.stats  # preemptions, prefix_hit_tokens, window_releases, drafts_accepted, block_usage, ...

(`sampled_array` is conformance.driving's: ids per row, padded with -1 into [num_reqs, width] when a row has several.)

Finishing: a request finishes when it samples one of its stop tokens or reaches max_new_tokens (or
max_model_len); its row is released in the next output's finished_req_ids. The abort knob finishes
a live request in the current output. Hypothesis strategies for all of these live in
conformance.strategies; the differential driver in conformance.differential.
"""

from conformance.scheduler.allocator import BlockAllocator
from conformance.scheduler.drafter import Drafter
from conformance.scheduler.knobs import SchedulerKnobs
from conformance.scheduler.scheduler import ReferenceScheduler
from conformance.scheduler.stats import SchedulerStats
from conformance.scheduler.vllm_form import VllmFormError, as_vllm
from conformance.scheduler.workload import (
    RequestShape,
    Workload,
    WorkloadRequest,
    WorkloadShape,
    build_workload,
    make_workload,
)

__all__ = [
    "BlockAllocator",
    "Drafter",
    "ReferenceScheduler",
    "RequestShape",
    "SchedulerKnobs",
    "SchedulerStats",
    "VllmFormError",
    "Workload",
    "WorkloadRequest",
    "WorkloadShape",
    "as_vllm",
    "build_workload",
    "make_workload",
]
