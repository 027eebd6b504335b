"""One DCP rank as its own process: its own pool and caches, partial states exchanged over torch.distributed.

`run_ranks(world_size, ...)` starts `world_size` processes (gloo, a file:// rendezvous) running `rank_main`.
Rank 0 runs the reference scheduler and broadcasts each output with the tokens it samples (the engine's
scheduler process); every rank applies it to its own pool, prepares, writes its share of the sharded
group's KV at its own slots (and all of the replicated group's), computes its partial attention, and
all-gathers the partial outputs and LSEs; every rank merges them and checks the result against spec's
single-rank attention (conformance.context_parallel.check_attention). Rank 0 also gathers every rank's
slots and checks that together they partition the step's tokens as the round-robin definition says.
Partials travel as CPU tensors over gloo, on every platform: NCCL needs a GPU of its own per rank, which
the suite's machines (none, or one) do not have.

With `mla=True` the sharded group is an mla group (conformance/mla_context_parallel.py): each rank writes its
share of the latents and runs the partial absorbed decode, the merge is checked against spec's single-rank
mla_decode_attention, and rank 0 also gathers every rank's latent cache and checks that each position lies in
its owner's, bit for bit.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import spec
from conformance.backends import load_backend
from conformance.context_parallel import (
    CP_KNOBS,
    RankModel,
    SingleRank,
    TinyQKV,
    check_attention,
    check_rank_slots,
    cp_functions,
    cp_worker_config,
)
from conformance.mla_context_parallel import (
    MlaRankModel,
    MlaSingleRank,
    TinyLatent,
    check_latent_placement,
    check_mla_attention,
    mla_cp_worker_config,
)
from conformance.scheduler import ReferenceScheduler, make_workload
from spec.context_parallel import ContextParallel
from spec.types import NewRequest, SchedulerOutput, WorkerConfig


def run_ranks(world_size: int, interleave: int, *, backend: str = "fast", seed: int = 0, max_steps: int = 12,
              mla: bool = False) -> int:  # fmt: skip
    """Run the ranks as processes; returns the steps run (every rank's checks passed, or this raises)."""
    _warm(backend, _config(world_size, interleave, mla))
    with tempfile.TemporaryDirectory(prefix="slotmap-cp-") as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        # a fork server, not fork: a forked child of a process whose OpenMP pool has run can hang in its first
        # torch op; the server has only imported (once: later runs fork from it at no import cost)
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["fast.context_parallel", "conformance.cp_ranks"])
        steps = context.Queue()
        args = (world_size, interleave, init, backend, seed, max_steps, mla, steps)
        mp.start_processes(rank_main, args=args, nprocs=world_size, join=True, start_method="forkserver")
        return int(steps.get(timeout=5))


def _warm(backend: str, config: WorkerConfig) -> None:
    """One step of a pool here first: fast's Numba functions compile (and are cached on disk) once, in this
    process, instead of once in every rank (tens of seconds each on a cold cache)."""
    handle = load_backend(backend)
    pool = handle.make_pool(config)
    out = SchedulerOutput(new_requests=(NewRequest("warm", (1, 2), ((1,), (1,))),), num_scheduled_tokens={"warm": 2})
    pool.apply(out)
    pool.record_sampled(pool.prepare(out), handle.asarray(np.array([3], np.int64)))


def _config(world_size: int, interleave: int, mla: bool) -> WorkerConfig:
    return mla_cp_worker_config(world_size, interleave) if mla else cp_worker_config(world_size, interleave)


def rank_main(rank: int, world_size: int, interleave: int, init: str, backend: str, seed: int, max_steps: int,
              mla: bool, steps_out: mp.Queue) -> None:  # fmt: skip
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        steps = _run(rank, world_size, interleave, backend, seed, max_steps, mla)
        if rank == 0:
            steps_out.put(steps)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world_size: int, interleave: int, backend: str, seed: int, max_steps: int, mla: bool) -> int:
    handle = load_backend(backend)
    functions = cp_functions(handle)
    if functions is None:
        raise ValueError(f"backend {backend!r} offers no context_parallel functions")
    config = _config(world_size, interleave, mla)
    cp = ContextParallel(world_size, rank, interleave)
    pool, spec_pool = handle.make_pool(config), spec.RequestStatePool(config)
    model: RankModel | MlaRankModel
    single: SingleRank | MlaSingleRank  # this rank's reference
    if mla:
        latent = TinyLatent(config.vocab_size, seed)
        model, single = MlaRankModel(handle, functions, config, cp, latent), MlaSingleRank(config, latent)
    else:
        qkv = TinyQKV(config.vocab_size, seed)
        model, single = RankModel(handle, functions, config, cp, qkv), SingleRank(config, qkv)
    sched = ReferenceScheduler(config, make_workload(seed, config, num_requests=4, max_arrival_step=3,
                                                     max_new_tokens=8), CP_KNOBS, seed=seed)  # fmt: skip
    rng = np.random.default_rng(seed)
    for step in range(max_steps):
        message: list[tuple[SchedulerOutput, int | None, dict[str, int]] | None] = [None]
        if rank == 0 and not sched.done():
            scheduled = sched.schedule()
            sampled = {r: int(rng.integers(config.vocab_size)) for r in sched.sampling_req_ids(scheduled)}
            message = [(scheduled, sched.pad_to(scheduled), sampled)]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return step
        out, pad_to, targets = message[0]
        pool.apply(out)
        spec_pool.apply(out)
        batch, spec_batch = pool.prepare(out, pad_to), spec_pool.prepare(out, pad_to)
        if isinstance(model, MlaRankModel):
            ranked, *state = model.step(batch)
        else:
            ranked, partial = model.step(batch)
            state = [partial.output, partial.lse]
        output, lse = (torch.as_tensor(handle.to_numpy(x)) for x in state)
        outputs = [torch.empty_like(output) for _ in range(world_size)]
        lses = [torch.empty_like(lse) for _ in range(world_size)]
        dist.all_gather(outputs, output)
        dist.all_gather(lses, lse)
        merged, merged_lse = functions.merge_attention_states(handle.asarray(torch.stack(outputs).numpy()),
                                                              handle.asarray(torch.stack(lses).numpy()))  # fmt: skip
        if isinstance(model, MlaRankModel):
            assert isinstance(single, MlaSingleRank)
            check_mla_attention(handle.to_numpy(merged), handle.to_numpy(merged_lse), single.step(spec_batch),
                                spec_batch.num_tokens)  # fmt: skip
            caches: list[object] = [None] * world_size
            dist.gather_object(handle.to_numpy(model.cache), caches if rank == 0 else None, dst=0)
            if rank == 0:
                check_latent_placement(caches, single.caches[np.float32], handle.batch_to_numpy(batch),  # type: ignore[arg-type]
                                       world_size, interleave)  # fmt: skip
        else:
            assert isinstance(single, SingleRank)
            check_attention(handle.to_numpy(merged), handle.to_numpy(merged_lse),
                            [handle.to_numpy(partial.replicated)], single.step(spec_batch),
                            spec_batch.num_tokens)  # fmt: skip
        slots = [[handle.to_numpy(s) for s in ranked.slot_mappings], [handle.to_numpy(s) for s in ranked.seq_lens]]
        gathered: list[object] = [None] * world_size
        dist.gather_object(slots, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            per_rank = [_Ranked(*g) for g in gathered]  # type: ignore[misc]
            check_rank_slots(handle.batch_to_numpy(batch), per_rank, config, world_size, interleave, np.asarray)
        ids = np.array([targets.get(r, 0) for r in spec_batch.req_ids], np.int64)
        pool.record_sampled(batch, handle.asarray(ids))
        spec_pool.record_sampled(spec_batch, ids)
        if rank == 0:
            sched.update(out, targets)
    return max_steps


class _Ranked:
    """A rank's gathered slots and lengths, in the shape check_rank_slots reads."""

    def __init__(self, slot_mappings: list[np.ndarray], seq_lens: list[np.ndarray]) -> None:
        self.slot_mappings, self.seq_lens = slot_mappings, seq_lens
