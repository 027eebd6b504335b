"""Where a run comes from: the articles' worked example, a seeded reference-scheduler workload, an engine's run.

Each source drives a `Recorder` (spec's pool) and returns the `Run`. The seeded run is the workload of
`slotmap explain --seed` (same config, workload recipe, knobs and fake sampler), so its step k holds the
numbers `slotmap explain --seed S --step k` prints; `requests` only changes how many requests arrive.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from conformance.examples import worked_example
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from conformance.scheduler.request import Status
from shadow.checker import ShadowStep
from slotmap.explore.record import Recorder, Run
from slotmap.pictures.steps import SEEDED_CONFIG, with_mla_group
from spec.drafts import pad_accepted
from spec.graphs import CapturedGraphs
from spec.types import PLACEHOLDER_TOKEN_ID, SchedulerOutput, WorkerConfig

SEEDED_REQUESTS = 6  # `slotmap explain --seed`'s workload


def worked_example_run(graphs: CapturedGraphs | None = None, ubatch: bool = False, mla: bool = False) -> Run:
    """Step 1 prefills A and B (B samples 777), step 2 is the articles' step: B decodes 1 token, A prefills 8.

    `graphs`: each step prepared for its captured graph; `ubatch`: the page marks the micro-batch split;
    `mla`: the one group an mla group of the same block size (the same blocks and slots)."""
    ex = worked_example()
    recorder = Recorder(with_mla_group(ex.config) if mla else ex.config, graphs)
    for number, sched in enumerate((ex.step1, ex.step2), start=1):
        batch = recorder.step(sched, title=f"worked example, step {number}")
        recorder.sampled(ex.sampled_after_step1(batch.req_ids))
    return recorder.run("the articles' worked example" + (", an MLA model" if mla else ""), 2, ubatch)


def seeded_run(
    seed: int,
    requests: int = SEEDED_REQUESTS,
    spec_tokens: int = 0,
    reuse_freed_first: bool = False,
    max_steps: int | None = None,
    graphs: CapturedGraphs | None = None,
    ubatch: bool = False,
    mla: bool = False,
) -> Run:
    """The reference scheduler's run of seed `seed`'s workload, to its end (or `max_steps`).

    `reuse_freed_first` hands out freed blocks before fresh ones, as vLLM's allocator does: a block a
    window released comes back at once, to another request or to the same one. `graphs`, `ubatch` and `mla`
    as worked_example_run's (with graphs, the scheduler's padding buckets are not used).
    """
    config = with_mla_group(SEEDED_CONFIG) if mla else SEEDED_CONFIG
    workload = make_workload(
        seed, config, num_requests=requests, max_arrival_step=max(3, requests // 2), max_new_tokens=8
    )
    knobs = SchedulerKnobs(
        max_chunk=12, pad_buckets=(8, 16, 24), spec_tokens=spec_tokens, reuse_freed_first=reuse_freed_first
    )
    sched = ReferenceScheduler(config, workload, knobs, seed=seed)
    recorder = Recorder(config, graphs)
    sampler = random.Random(seed)
    while not sched.done() and (max_steps is None or len(recorder.steps) < max_steps):
        running = [r.req_id for r in sched.running]
        out = sched.schedule()
        preempted = [r for r in running if sched.requests[r].status is Status.PREEMPTED]
        pad_to = None if graphs is not None else sched.pad_to(out)
        batch = recorder.step(out, pad_to, preempted, title=f"seed {seed}, step {len(recorder.steps) + 1}")
        tokens = [sampler.randrange(config.vocab_size) for _ in batch.req_ids]
        taking = set(sched.sampling_req_ids(out))
        kept = sched.rejection_step(out, {r: t for r, t in zip(batch.req_ids, tokens, strict=True) if r in taking})
        if out.scheduled_spec_decode_tokens:
            recorder.sampled(pad_accepted([kept.get(r, (t,)) for r, t in zip(batch.req_ids, tokens, strict=True)]))
        else:
            recorder.sampled(np.array(tokens, np.int64))
        sched.update(out, kept)
    drafts = f", up to {spec_tokens} drafts per request" if spec_tokens else ""
    reuse = ", freed blocks reused first" if reuse_freed_first else ""
    mla_model = ", an MLA model" if mla else ""
    return recorder.run(
        f"seed {seed}: {requests} requests through the reference scheduler{drafts}{reuse}{mla_model}", ubatch=ubatch
    )


def shadow_run(config: WorkerConfig, steps: Sequence[ShadowStep], title: str = "an engine's run") -> Run:
    """An engine's steps as the shadow checker recorded them (`checker.config`, `checker.steps`).

    spec runs each recorded scheduler output again; the checker has already compared the engine's
    arrays with spec's on every one of these steps, so the page shows the values both agreed on. A
    step's sampled tokens are req_id -> token(s), or rows in the engine's batch order (`step.req_ids`)
    padded with PLACEHOLDER_TOKEN_ID. The outputs must be slotmap's SchedulerOutput: a step recorded in
    vLLM's form is refused (convert it with spec.interop first, or record with a `Recorder` directly).
    """
    recorder = Recorder(config)
    for number, step in enumerate(steps, start=1):
        if not isinstance(step.sched, SchedulerOutput):
            kind = type(step.sched).__name__
            raise ValueError(f"shadow step {number - 1}: sched is a {kind}, not slotmap's SchedulerOutput")
        recorder.step(step.sched, title=f"{title}, step {number}")
        recorder.sampled(_sampled_by_request(step))
    return recorder.run(title)


def _sampled_by_request(step: ShadowStep) -> dict[str, tuple[int, ...]]:
    sampled: Any = step.sampled
    if sampled is None:
        return {}
    if isinstance(sampled, Mapping):
        return {r: (int(t),) if np.ndim(t) == 0 else tuple(int(x) for x in t) for r, t in sampled.items()}
    if not step.req_ids:
        return {}
    rows = np.asarray(sampled).reshape(len(step.req_ids), -1)  # [num_reqs, width] in the engine's order
    kept = (row[row != PLACEHOLDER_TOKEN_ID] for row in rows)
    return {r: tuple(int(x) for x in tokens) for r, tokens in zip(step.req_ids, kept, strict=True)}
