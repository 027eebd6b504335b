"""Drive a backend through a schedule and collect one step's values in NumPy form (for demo and explain)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.backends import BackendHandle
from conformance.driving import draft_fields
from conformance.examples import worked_example
from spec.drafts import pad_accepted
from spec.types import KVCacheGroup, PoolSnapshot, SchedulerOutput, WorkerConfig

# Small enough to read in a terminal, rich enough to show chunked prefill, prefix sharing, a sliding
# window's null entries, preemption and padding within a few steps.
SEEDED_CONFIG = WorkerConfig(
    max_num_reqs=6,
    max_model_len=48,
    max_num_batched_tokens=24,
    vocab_size=1000,
    kv_groups=(KVCacheGroup(block_size=8, num_blocks=24), KVCacheGroup(block_size=4, num_blocks=40, sliding_window=8)),
)
SEEDED_DEFAULT_STEP = 4

# (batch req_ids, step number) -> one sampled token id per batch row
Sampler = Callable[[tuple[str, ...], int], list[int]]


@dataclass(frozen=True)
class StepView:
    """Everything `demo` and `explain` draw about one step, backend-neutral."""

    config: WorkerConfig
    snapshot: PoolSnapshot  # the pool after apply, which is what prepare reads
    batch: dict[str, Any]  # BatchInputs fields in NumPy form
    title: str = ""  # what this step is, for headings
    workload: Any = None  # a seeded run's conformance.scheduler.Workload (M-RoPE tables: slotmap/pictures/mrope.py)


def run_to_step(
    backend: BackendHandle,
    config: WorkerConfig,
    outputs: Iterable[SchedulerOutput],
    step: int,
    sample: Sampler,
    pad_to: int | None = None,
    title: str = "",
) -> StepView:
    """Runs steps 1..step-1 in full (apply, prepare, record_sampled), then applies and prepares `step`."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    pool = backend.make_pool(config)
    taken = 0
    for number, sched in enumerate(outputs, start=1):
        taken = number
        pool.apply(sched)
        if number == step:
            batch = pool.prepare(sched, pad_to)
            return StepView(config, pool.snapshot(), backend.batch_to_numpy(batch), title)
        batch = pool.prepare(sched)
        pool.record_sampled(batch, backend.asarray(np.array(sample(batch.req_ids, number), np.int64)))
    raise ValueError(f"step {step} requested but the schedule has only {taken} steps")


def worked_example_step(backend: BackendHandle, step: int = 2, pad_to: int | None = None) -> StepView:
    """The articles' example: step 1 prefills A and B, step 2 (the one the articles draw) runs B:1 and A:8."""
    ex = worked_example()
    return run_to_step(
        backend,
        ex.config,
        (ex.step1, ex.step2),
        step,
        lambda req_ids, _: ex.sampled_after_step1(req_ids),
        pad_to,
        title=f"worked example, step {step}",
    )


def seeded_step(
    backend: BackendHandle,
    seed: int,
    step: int | None = None,
    pad_to: int | None = None,
    spec_tokens: int = 0,
    async_scheduling: bool = False,
    encoder_decoder: bool = False,
    mrope: bool = False,
    hybrid: bool = False,
) -> StepView:
    """Step `step` of a random workload run by the reference scheduler (same seed, same step, any backend).

    The model is faked: each batch row "samples" a token drawn from a generator seeded by `seed`.
    `pad_to` overrides the scheduler's padding bucket for the explained step. With `spec_tokens` the
    scheduler drafts (random drafts, up to that many per request) and its rejection step keeps some. With
    `async_scheduling` each step is sent one ahead (spec/async_steps.py): the batch lists its pending tokens.
    With `encoder_decoder` the model has a cross-attention group (slotmap/pictures/cross.py); with `hybrid`
    a mamba state group (slotmap/pictures/mamba.py).
    """
    from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload

    step = SEEDED_DEFAULT_STEP if step is None else step
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    config = dataclasses.replace(SEEDED_CONFIG, async_scheduling=async_scheduling)
    workload = make_workload(seed, config, num_requests=6, max_arrival_step=3, max_new_tokens=8)
    if encoder_decoder:
        from conformance.scheduler.encoder import with_small_encoder

        config, workload = with_small_encoder(config, workload, random.Random(seed))
    if mrope:  # a multimodal model: position tables on most requests (slotmap/pictures/mrope.py shows them)
        from conformance.scheduler.mrope import with_position_tables

        config = dataclasses.replace(config, uses_mrope=True)
        workload = with_position_tables(workload, seed, share=0.8)
    if hybrid:  # a hybrid model: a mamba state group (slotmap/pictures/mamba.py)
        from conformance.scheduler.mamba import with_small_mamba_group

        config = with_small_mamba_group(config, spec_tokens)
    knobs = SchedulerKnobs(max_chunk=12, pad_buckets=(8, 16, 24), spec_tokens=spec_tokens)
    sched = ReferenceScheduler(config, workload, knobs, seed=seed)
    pool = backend.make_pool(config)
    sampler = random.Random(seed)
    for number in range(1, step + 1):
        if sched.done():
            raise ValueError(f"step {step} requested but seed {seed}'s workload finished after {number - 1} steps")
        out = sched.schedule()
        padded = sched.pad_to(out)
        pool.apply(out)
        if number == step:
            batch = pool.prepare(out, padded if pad_to is None else pad_to)
            drafts = sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
            title = (
                f"seed {seed}, step {step}: {batch.num_reqs} requests in the batch "
                f"(of {len(workload.requests)} in the workload), reference scheduler"
                + (f", {drafts} draft tokens" if spec_tokens else "")
            )
            numpy_batch = backend.batch_to_numpy(batch) | draft_fields(backend, batch)
            return StepView(config, pool.snapshot(), numpy_batch, title, workload)
        batch = pool.prepare(out, padded)
        tokens = [sampler.randrange(config.vocab_size) for _ in batch.req_ids]
        taking = set(sched.sampling_req_ids(out))
        kept = sched.rejection_step(out, {r: t for r, t in zip(batch.req_ids, tokens, strict=True) if r in taking})
        if out.scheduled_spec_decode_tokens:
            ids = pad_accepted([kept.get(r, (t,)) for r, t in zip(batch.req_ids, tokens, strict=True)])
        else:
            ids = np.array(tokens, np.int64)
        pool.record_sampled(batch, backend.asarray(ids))
        sched.update(out, kept)
    raise AssertionError("unreachable: the loop returns at `step`")
