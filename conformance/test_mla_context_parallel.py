"""MLA under decode context parallelism through a backend: every rank of reference-scheduler workloads with an
mla group sharded (and a replicated sliding-window group beside it), in one process.

Each step: the backend's pool prepares the batch once; for every rank, its slots and local seq_lens equal spec's
and together they partition the step's tokens as the round-robin definition says
(conformance.context_parallel.check_rank_slots); every rank writes its latents with the backend's write_mla_kv
and each position lands in its owner's cache, bit for bit (check_latent_placement); the ranks' partial absorbed
decodes, merged with the backend's merge, equal spec's single-rank mla_decode_attention (tolerance.py's rule).
"""

from __future__ import annotations

import numpy as np
import pytest

import spec
import spec.context_parallel as spec_cp
from conformance.backends import BackendHandle
from conformance.context_parallel import CP_KNOBS, check_rank_slots, cp_functions, merge_partials
from conformance.mla_context_parallel import (
    MlaRankModel,
    MlaSingleRank,
    TinyLatent,
    check_latent_placement,
    check_mla_attention,
    mla_cp_available,
    mla_cp_worker_config,
)
from conformance.scheduler import ReferenceScheduler, make_workload
from spec.context_parallel import ContextParallel

MAX_STEPS = 14
# Under the Triton interpreter every rank's prepare, write and decode kernels run ~1000x slower: the two workloads
# covering both world sizes and both interleaves run past their prefills into decodes, the other two 3 steps.
MAX_STEPS_INTERPRETED = {(2, 2): 8, (4, 1): 8, (2, 1): 3, (4, 2): 3}


@pytest.mark.parametrize(("world_size", "interleave", "seed"), [(2, 1, 10), (2, 2, 11), (4, 1, 12), (4, 2, 13)])
def test_mla_ranks_hold_their_latents_and_merge_to_single_rank_decode(
    backend: BackendHandle, world_size: int, interleave: int, seed: int
) -> None:
    functions = cp_functions(backend)
    if not mla_cp_available(backend, functions):
        pytest.skip(f"{backend.name} offers no MLA reader under context parallelism (an optional part)")
    assert functions is not None
    config = mla_cp_worker_config(world_size, interleave)
    workload = make_workload(seed, config, num_requests=4, max_arrival_step=3, max_new_tokens=8)
    sched = ReferenceScheduler(config, workload, CP_KNOBS, seed=seed)
    pool, spec_pool = backend.make_pool(config), spec.RequestStatePool(config)
    latent = TinyLatent(config.vocab_size, seed)
    cps = [ContextParallel(world_size, rank, interleave) for rank in range(world_size)]
    ranks = [MlaRankModel(backend, functions, config, cp, latent) for cp in cps]
    single = MlaSingleRank(config, latent)
    rng = np.random.default_rng(seed)
    steps, max_steps = 0, MAX_STEPS_INTERPRETED[world_size, interleave] if backend.slow else MAX_STEPS
    decodes = 0
    while not sched.done() and steps < max_steps:
        out = sched.schedule()
        pad_to = sched.pad_to(out)
        pool.apply(out)
        spec_pool.apply(out)
        batch, spec_batch = pool.prepare(out, pad_to), spec_pool.prepare(out, pad_to)
        results = [rank.step(batch) for rank in ranks]
        for cp, (ranked, _, _) in zip(cps, results, strict=True):
            expected = spec_cp.rank_inputs(spec_batch, config, cp)
            for g in range(len(config.kv_groups)):
                got_slots, got_lens = backend.to_numpy(ranked.slot_mappings[g]), backend.to_numpy(ranked.seq_lens[g])
                assert np.array_equal(got_slots, expected.slot_mappings[g]), f"step {steps} rank {cp.rank} group {g}"
                assert np.array_equal(got_lens, expected.seq_lens[g]), f"step {steps} rank {cp.rank} group {g}"
        batch_np = backend.batch_to_numpy(batch)
        check_rank_slots(batch_np, [r for r, _, _ in results], config, world_size, interleave, backend.to_numpy)
        reference = single.step(spec_batch)
        check_latent_placement([backend.to_numpy(r.cache) for r in ranks], single.caches[np.float32], batch_np,
                               world_size, interleave)  # fmt: skip
        merged, merged_lse = merge_partials(backend, functions, [o for _, o, _ in results], [x for _, _, x in results])
        try:
            check_mla_attention(merged, merged_lse, reference, spec_batch.num_tokens)
        except AssertionError as e:
            raise AssertionError(f"step {steps}: {e}") from e
        decodes += int(np.sum(np.diff(spec_batch.query_start_loc) == 1))
        targets = {r: int(rng.integers(config.vocab_size)) for r in sched.sampling_req_ids(out)}
        ids = np.array([targets.get(r, 0) for r in spec_batch.req_ids], np.int64)
        pool.record_sampled(batch, backend.asarray(ids))
        spec_pool.record_sampled(spec_batch, ids)
        sched.update(out, targets)
        steps += 1
    assert steps >= min(6, max_steps), "the workload ran too few steps to mean anything"
    assert max_steps < 6 or decodes > 0, "no decode row was run"
