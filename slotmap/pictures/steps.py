"""Drive a backend through a schedule and collect one step's values in NumPy form (for demo and explain)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.backends import BATCH_ARRAY_FIELDS, BackendHandle
from conformance.driving import draft_fields
from conformance.examples import worked_example
from spec.drafts import pad_accepted
from spec.graphs import CapturedGraphs
from spec.padding_profiles import PROFILES
from spec.types import BatchInputs, KVCacheGroup, PoolSnapshot, SchedulerOutput, WorkerConfig

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
    inputs: Any = None  # the backend's own BatchInputs (its feature records: spec_inputs, slotmap/pictures/ubatch.py)
    seed: int = 0  # the seed of its workload (0 for the worked example): what a picture's random choices draw from


def spec_inputs(view: StepView) -> BatchInputs:
    """The step's batch as spec's BatchInputs over the backend's values in NumPy form, for the spec stages a picture
    applies to it (split_batch, sparse_slot_mapping); its feature records are the backend's."""
    if view.inputs is None:
        raise ValueError("spec_inputs: the view keeps no BatchInputs (build it with run_to_step or seeded_step)")
    b = view.batch
    return dataclasses.replace(
        view.inputs,
        **{name: b[name] for name in (*BATCH_ARRAY_FIELDS, "block_tables", "slot_mappings")},
    )


def captured_graphs(
    config: WorkerConfig,
    capture_sizes: tuple[int, ...],
    mode: str = "FULL_AND_PIECEWISE",
    profile: str = "flash_attn",
    spec_tokens: int = 0,
) -> CapturedGraphs:
    """The capture configuration `explain --graphs` prepares with: up to max_num_reqs requests, 1 + K tokens per
    uniform decode row (K the drafts the scheduler may propose)."""
    return CapturedGraphs(capture_sizes, config.max_num_reqs, mode, 1 + spec_tokens, PROFILES[profile])


def run_to_step(
    backend: BackendHandle,
    config: WorkerConfig,
    outputs: Iterable[SchedulerOutput],
    step: int,
    sample: Sampler,
    pad_to: int | None = None,
    title: str = "",
    graphs: CapturedGraphs | None = None,
) -> StepView:
    """Runs steps 1..step-1 in full (apply, prepare, record_sampled), then applies and prepares `step`.

    With `graphs` every step is prepared for the captured graph it dispatches to (spec/graphs.py), as an engine
    that captured them prepares each step; `pad_to` then must be None (prepare refuses both)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    pool = backend.make_pool(config)
    with_graphs: dict[str, Any] = {} if graphs is None else {"graphs": graphs}  # a backend may predate graphs
    taken = 0
    for number, sched in enumerate(outputs, start=1):
        taken = number
        pool.apply(sched)
        if number == step:
            batch = pool.prepare(sched, pad_to, **with_graphs)
            return StepView(config, pool.snapshot(), backend.batch_to_numpy(batch), title, inputs=batch)
        batch = pool.prepare(sched, **with_graphs)
        pool.record_sampled(batch, backend.asarray(np.array(sample(batch.req_ids, number), np.int64)))
    raise ValueError(f"step {step} requested but the schedule has only {taken} steps")


def worked_example_step(
    backend: BackendHandle,
    step: int = 2,
    pad_to: int | None = None,
    graphs: CapturedGraphs | None = None,
    mla: bool = False,
) -> StepView:
    """The articles' example: step 1 prefills A and B, step 2 (the one the articles draw) runs B:1 and A:8.

    With `mla` its one group is an mla group of the same block size (slotmap/pictures/mla.py): the same blocks
    and slots, each slot holding one latent vector."""
    ex = worked_example()
    config = with_mla_group(ex.config) if mla else ex.config
    return run_to_step(
        backend,
        config,
        (ex.step1, ex.step2),
        step,
        lambda req_ids, _: ex.sampled_after_step1(req_ids),
        pad_to,
        title=f"worked example, step {step}" + (", an MLA model" if mla else ""),
        graphs=graphs,
    )


# DeepSeek-V3's latent widths: what a slot of an mla group holds (nothing here allocates the cache)
MLA_KV_LORA_RANK, MLA_ROPE_DIM = 512, 64


def with_mla_group(config: WorkerConfig) -> WorkerConfig:
    """`config` with its first group, a full-attention group, made an mla group of the same block size and blocks:
    its table and slots are the attention group's (spec/mla_cache.py), so every block and slot stays the same."""
    first = config.kv_groups[0]
    if first.kind != "attention" or first.sliding_window is not None:
        raise ValueError(f"with_mla_group: the first group must be a full-attention group, got {first}")
    mla = KVCacheGroup(
        first.block_size, first.num_blocks, kind="mla", kv_lora_rank=MLA_KV_LORA_RANK, qk_rope_head_dim=MLA_ROPE_DIM
    )
    return dataclasses.replace(config, kv_groups=(mla, *config.kv_groups[1:]))


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
    graphs: CapturedGraphs | None = None,
    mla: bool = False,
) -> StepView:
    """Step `step` of a random workload run by the reference scheduler (same seed, same step, any backend).

    The model is faked: each batch row "samples" a token drawn from a generator seeded by `seed`.
    `pad_to` overrides the scheduler's padding bucket for the explained step. With `spec_tokens` the
    scheduler drafts (random drafts, up to that many per request) and its rejection step keeps some. With
    `async_scheduling` each step is sent one ahead (spec/async_steps.py): the batch lists its pending tokens.
    With `encoder_decoder` the model has a cross-attention group (slotmap/pictures/cross.py); with `hybrid`
    a mamba state group (slotmap/pictures/mamba.py); with `mla` its full-attention group is an mla group
    (a DeepSeek-V3.2-style hybrid beside the windowed group, slotmap/pictures/mla.py). With `graphs` every
    step is prepared for its captured graph instead of the scheduler's padding bucket (and `pad_to` is None).
    """
    from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload

    step = SEEDED_DEFAULT_STEP if step is None else step
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    config = dataclasses.replace(SEEDED_CONFIG, async_scheduling=async_scheduling)
    if mla:
        config = with_mla_group(config)
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
    with_graphs: dict[str, Any] = {} if graphs is None else {"graphs": graphs}  # a backend may predate graphs
    sampler = random.Random(seed)
    for number in range(1, step + 1):
        if sched.done():
            raise ValueError(f"step {step} requested but seed {seed}'s workload finished after {number - 1} steps")
        out = sched.schedule()
        padded = None if graphs is not None else sched.pad_to(out)
        pool.apply(out)
        if number == step:
            batch = pool.prepare(out, padded if pad_to is None else pad_to, **with_graphs)
            drafts = sum(len(d) for d in out.scheduled_spec_decode_tokens.values())
            title = (
                f"seed {seed}, step {step}: {batch.num_reqs} requests in the batch "
                f"(of {len(workload.requests)} in the workload), reference scheduler"
                + (f", {drafts} draft tokens" if spec_tokens else "")
            )
            numpy_batch = backend.batch_to_numpy(batch) | draft_fields(backend, batch)
            return StepView(config, pool.snapshot(), numpy_batch, title, workload, batch, seed)
        batch = pool.prepare(out, padded, **with_graphs)
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
