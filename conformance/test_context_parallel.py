"""Decode context parallelism through a backend: every rank of reference-scheduler workloads, in one process.

Each step: the backend's pool prepares the batch once (ranks hold identical pools); for every rank, its
slots and local seq_lens equal spec's, and together they satisfy the round-robin definition
(conformance.context_parallel.check_rank_slots); every rank writes its KV and attends over it, and the
merged partials equal spec's single-rank attention (tolerance.py's rule). The real multi-process run is
conformance/test_context_parallel_ranks.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import spec
import spec.context_parallel as spec_cp
from conformance.backends import BackendHandle
from conformance.context_parallel import (
    CP_KNOBS,
    RankModel,
    SingleRank,
    TinyQKV,
    check_attention,
    check_rank_slots,
    cp_functions,
    cp_worker_config,
    merge_partials,
)
from conformance.scheduler import ReferenceScheduler, make_workload
from spec.context_parallel import ContextParallel
from spec.drafts import pad_accepted

MAX_STEPS = 14
# The Triton interpreter runs every rank's prepare, write_kv and paged_attention kernels ~1000x slower than
# compiled: it takes 8 steps (past the prefills into decodes) of the two workloads that cover both world
# sizes and both interleaves, and the first 3 steps of the other two.
MAX_STEPS_INTERPRETED = {(2, 2): 8, (4, 1): 8, (2, 1): 3, (4, 2): 3}


@pytest.mark.parametrize(("world_size", "interleave", "seed"), [(2, 1, 0), (2, 2, 1), (4, 1, 2), (4, 2, 3)])
def test_every_rank_matches_spec_and_merges_to_single_rank(
    backend: BackendHandle, world_size: int, interleave: int, seed: int
) -> None:
    functions = cp_functions(backend)
    if functions is None:
        pytest.skip(f"{backend.name} offers no context_parallel functions (an optional part of a backend)")
    config = cp_worker_config(world_size, interleave)
    workload = make_workload(seed, config, num_requests=4, max_arrival_step=3, max_new_tokens=8)
    sched = ReferenceScheduler(config, workload, CP_KNOBS, seed=seed)
    pool, spec_pool = backend.make_pool(config), spec.RequestStatePool(config)
    qkv = TinyQKV(config.vocab_size, seed)
    cps = [ContextParallel(world_size, rank, interleave) for rank in range(world_size)]
    ranks = [RankModel(backend, functions, config, cp, qkv) for cp in cps]
    single = SingleRank(config, qkv)
    rng = np.random.default_rng(seed)
    interpreted = backend.slow
    steps, max_steps = 0, MAX_STEPS_INTERPRETED[world_size, interleave] if interpreted else MAX_STEPS
    while not sched.done() and steps < max_steps:
        out = sched.schedule()
        pad_to = sched.pad_to(out)
        pool.apply(out)
        spec_pool.apply(out)
        batch, spec_batch = pool.prepare(out, pad_to), spec_pool.prepare(out, pad_to)
        results = [rank.step(batch) for rank in ranks]
        for cp, (ranked, _) in zip(cps, results, strict=True):
            expected = spec_cp.rank_inputs(spec_batch, config, cp)
            for g in range(len(config.kv_groups)):
                got_slots, got_lens = backend.to_numpy(ranked.slot_mappings[g]), backend.to_numpy(ranked.seq_lens[g])
                assert np.array_equal(got_slots, expected.slot_mappings[g]), f"step {steps} rank {cp.rank} group {g}"
                assert np.array_equal(got_lens, expected.seq_lens[g]), f"step {steps} rank {cp.rank} group {g}"
                assert got_slots.dtype == np.int64 and got_lens.dtype == np.int32
        check_rank_slots(backend.batch_to_numpy(batch), [r for r, _ in results], config, world_size, interleave,
                         backend.to_numpy)  # fmt: skip
        partials = [p for _, p in results]
        merged, merged_lse = merge_partials(backend, functions, [p.output for p in partials], [p.lse for p in partials])
        replicated = [backend.to_numpy(p.replicated) for p in partials]
        check_attention(merged, merged_lse, replicated, single.step(spec_batch), spec_batch.num_tokens)
        targets = {r: int(rng.integers(config.vocab_size)) for r in sched.sampling_req_ids(out)}
        ids = np.array([targets.get(r, 0) for r in spec_batch.req_ids], np.int64)
        pool.record_sampled(batch, backend.asarray(ids))
        spec_pool.record_sampled(spec_batch, ids)
        sched.update(out, targets)
        steps += 1
    assert steps >= min(6, max_steps), "the workload ran too few steps to mean anything"


@pytest.mark.parametrize(("world_size", "interleave", "seed", "on_device"), [(2, 1, 4, False), (2, 2, 5, True)])
def test_under_async_scheduling_each_rank_reads_the_corrected_counts(
    backend: BackendHandle, world_size: int, interleave: int, seed: int, on_device: bool
) -> None:
    """vllm-ascend #10032: with async scheduling and drafts, each rank's slots and local lengths come from the
    counts corrected by the rejected drafts (spec/async_steps.py rule 2), never from the scheduler's optimistic
    ones: every rank of the backend's batch equals spec's and merges to spec's single-rank attention, on steps
    the scheduler sent counting drafts the sampler had rejected; drafts sent by the scheduler, or proposed on the
    device (spec/async_steps.py rule 8), back to back."""
    functions = cp_functions(backend)
    if functions is None:
        pytest.skip(f"{backend.name} offers no context_parallel functions (an optional part of a backend)")
    config = dataclasses.replace(cp_worker_config(world_size, interleave), async_scheduling=True)
    workload = make_workload(seed, config, num_requests=3, max_arrival_step=2, max_new_tokens=10)
    knobs = dataclasses.replace(CP_KNOBS, spec_tokens=2, acceptance_rate=0.3, drafts_on_device=on_device)
    sched = ReferenceScheduler(config, workload, knobs, seed=seed)
    pool, spec_pool = backend.make_pool(config), spec.RequestStatePool(config)
    qkv = TinyQKV(config.vocab_size, seed)
    cps = [ContextParallel(world_size, rank, interleave) for rank in range(world_size)]
    ranks = [RankModel(backend, functions, config, cp, qkv) for cp in cps]
    single = SingleRank(config, qkv)
    rng = np.random.default_rng(seed)
    steps, max_steps = 0, 8 if backend.slow else 24
    while not sched.done() and steps < max_steps:
        out = sched.schedule()
        pool.apply(out)
        spec_pool.apply(out)
        batch, spec_batch = pool.prepare(out), spec_pool.prepare(out)
        results = [rank.step(batch) for rank in ranks]
        for cp, (ranked, _) in zip(cps, results, strict=True):
            expected = spec_cp.rank_inputs(spec_batch, config, cp)
            got_slots, got_lens = backend.to_numpy(ranked.slot_mappings[0]), backend.to_numpy(ranked.seq_lens[0])
            assert np.array_equal(got_slots, expected.slot_mappings[0]), f"step {steps} rank {cp.rank}"
            assert np.array_equal(got_lens, expected.seq_lens[0]), f"step {steps} rank {cp.rank}"
        partials = [p for _, p in results]
        merged, merged_lse = merge_partials(backend, functions, [p.output for p in partials], [p.lse for p in partials])
        replicated = [backend.to_numpy(p.replicated) for p in partials]
        check_attention(merged, merged_lse, replicated, single.step(spec_batch), spec_batch.num_tokens)
        takes = set(sched.sampling_req_ids(out))
        targets = {r: int(rng.integers(config.vocab_size)) for r in takes}
        kept = sched.rejection_step(out, targets)
        ids = pad_accepted([list(kept.get(r, (0,))) for r in spec_batch.req_ids])
        if on_device:  # the drafter's ids for the next step's placeholders
            proposals = sched.device_proposals(out)
            proposed = np.array([proposals.get(r, (0, 0)) for r in spec_batch.req_ids], np.int64).reshape(-1, 2)
            pool.record_sampled(batch, backend.asarray(ids), backend.asarray(proposed))
            spec_pool.record_sampled(spec_batch, ids, proposed)
        else:
            pool.record_sampled(batch, backend.asarray(ids))
            spec_pool.record_sampled(spec_batch, ids)
        sched.update(out, kept)
        steps += 1
    assert sched.stats.optimistic_counts > 0, "no step was sent with an optimistic count"
    assert not on_device or sched.stats.drafts_after_unverified > 0, "no drafts right after unverified drafts"
