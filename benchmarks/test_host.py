"""Host stages: apply, prepare, slot mapping alone, and the whole host step (apply + prepare + record_sampled).

Every pool provider sees the same stream of scheduler outputs (benchmarks.workloads.StepStream). The
pool is first brought to the workload's steady state (all requests present), untimed.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import spec
from benchmarks import providers
from benchmarks.gpu_probe import count_launches
from benchmarks.harness import param, record, record_fallbacks, run_stateful
from benchmarks.reference import reference, started
from benchmarks.workloads import ASYNC_WORKLOADS, HOST_WORKLOADS, StepStream, Workload
from spec.batch import batch_order
from spec.flatten import flatten
from spec.graphs import CapturedGraphs


def _cases(names: tuple[str, ...], workloads: tuple[Workload, ...] = HOST_WORKLOADS) -> list[Any]:
    return [param(w, p) for w in workloads for p in names]


def _batch_bytes(batch: spec.BatchInputs) -> int:
    arrays = [getattr(batch, f) for f in ("index_mapping", "num_scheduled_tokens", "query_start_loc", "positions",
                                          "input_ids", "seq_lens", "logits_indices")]  # fmt: skip
    return sum(a.nbytes for a in (*arrays, *batch.block_tables, *batch.slot_mappings))


def _apply_bytes(sched: spec.SchedulerOutput) -> int:
    """What apply writes to the pool: prompt tokens, progress, block ids (cleared rows not counted)."""
    tokens = sum(len(r.prompt_token_ids) for r in sched.new_requests)
    blocks = sum(len(ids) for r in sched.new_requests for ids in r.block_ids)
    blocks += sum(len(ids) for r in sched.cached_requests for ids in (r.new_block_ids or ()))
    return 8 * tokens + 8 * (len(sched.new_requests) + len(sched.cached_requests)) + 4 * blocks


@pytest.mark.parametrize(("workload", "provider_name"), _cases(providers.POOL_PROVIDERS))
def test_apply(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    provider = providers.get(provider_name)
    stream = StepStream(workload)
    pool = started(provider, stream)
    sampled = provider.asarray(stream.sampled(workload.num_reqs))
    pending: list[spec.SchedulerOutput] = []

    def setup() -> tuple[Any, ...]:
        if pending:  # finish the previous step so the next one is valid
            last = pending.pop()
            pool.record_sampled(pool.prepare(last), sampled)
        pending.append(stream.next())
        return (pending[-1],)

    def target(sched: spec.SchedulerOutput) -> None:
        pool.apply(sched)
        provider.sync()

    record(benchmark, "apply", workload, provider_name, nbytes=_apply_bytes(reference(workload)[1]))
    run_stateful(benchmark, target, setup, bench_budget)
    record_fallbacks(benchmark, pool)


@pytest.mark.parametrize(("workload", "provider_name"), _cases(providers.POOL_PROVIDERS))
def test_prepare(benchmark: Any, workload: Workload, provider_name: str) -> None:
    provider = providers.get(provider_name)
    stream = StepStream(workload)
    pool = started(provider, stream)
    sched = stream.next()
    pool.apply(sched)

    def target() -> None:
        pool.prepare(sched)  # reads the pool only: the same applied step can be prepared again and again
        provider.sync()

    record(benchmark, "prepare", workload, provider_name, nbytes=_batch_bytes(reference(workload)[2]))
    if provider.name.startswith("fast"):
        benchmark.extra_info["launches"] = sum(count_launches(lambda: pool.prepare(sched)).values())
    benchmark(target)


@pytest.mark.parametrize(("workload", "provider_name"), _cases(providers.SLOT_PROVIDERS))
def test_slot_mapping(benchmark: Any, workload: Workload, provider_name: str) -> None:
    """Group 0's slot mapping from the persistent block table, given token rows and positions."""
    provider = providers.get(provider_name)
    pool, sched, _ = reference(workload)
    _, index_mapping, num_scheduled = batch_order(list(sched.num_scheduled_tokens.items()), pool.state.row_of)
    flat = flatten(
        index_mapping, num_scheduled, pool.state.num_computed_tokens, pool.token_ids, sched.total_num_scheduled_tokens
    )
    table, block_size = pool.state.block_tables[0], pool.config.kv_groups[0].block_size
    fn = providers.slot_mapping_fn(provider)
    args: list[Any]
    if provider_name == "python-lists":
        args = [table.tolist(), flat.token_rows.tolist(), flat.positions.tolist(), block_size]
    else:  # each array in the form the function takes it: host NumPy where its parameter ends in `_np`
        names, on_host = list(inspect.signature(fn).parameters), providers.host_arguments(fn)
        arrays = (table, flat.token_rows, flat.positions)
        args = [a if name in on_host else provider.asarray(a) for name, a in zip(names, arrays, strict=False)]
        args.append(block_size)
    expected = spec.slots.slot_mapping(table, flat.token_rows, flat.positions, block_size)
    got = fn(*args)
    assert np.array_equal(np.asarray(got.cpu() if hasattr(got, "cpu") else got), expected)  # never time a wrong answer

    def target() -> None:
        fn(*args)
        provider.sync()

    num_tokens = flat.positions.shape[0]
    record(benchmark, "slot_mapping", workload, provider_name, nbytes=num_tokens * (8 + 8 + 4 + 8))
    benchmark(target)


@pytest.mark.parametrize(("workload", "provider_name"), _cases(providers.POOL_PROVIDERS))
def test_host_step(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    """One whole host step, validation included where the provider validates: the issue's CPU target."""
    provider = providers.get(provider_name)
    stream = StepStream(workload)
    pool = started(provider, stream)
    sampled = provider.asarray(stream.sampled(workload.num_reqs))

    def target(sched: spec.SchedulerOutput) -> None:
        pool.apply(sched)
        pool.record_sampled(pool.prepare(sched), sampled)
        provider.sync()

    _, sched, batch = reference(workload)
    nbytes = _apply_bytes(sched) + _batch_bytes(batch) + 8 * workload.num_reqs
    record(benchmark, "host_step", workload, provider_name, nbytes=nbytes)
    run_stateful(benchmark, target, lambda: (stream.next(),), bench_budget)
    record_fallbacks(benchmark, pool)


@pytest.mark.parametrize(("workload", "provider_name"), _cases(("fast",)))
def test_host_step_interleaved(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    """fast's host step with numpy-vectorised's run between its rounds: the ratio targets divide these two.

    Separate benchmarks run seconds apart, and on a shared machine the load between them moves a ratio by
    tens of percent. Here every timed round of fast follows one step of the peer on the same workload,
    timed by the same clock (pytest-benchmark's), so both medians see the same machine.
    """
    what = "apply + prepare + record_sampled, fast's rounds interleaved with numpy-vectorised's"
    _interleaved(benchmark, bench_budget, workload, provider_name, "numpy-vectorised", "host_step_interleaved", what)


@pytest.mark.parametrize(("workload", "provider_name"), _cases(("fast-async",), ASYNC_WORKLOADS))
def test_async_step_interleaved(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    """The cost of async scheduling (spec/async_steps.py): fast's async host step, rounds interleaved with fast's
    synchronous one on the same workload: the device-side record and its bookkeeping, and on the drafting workload
    drafts proposed on the device (rule 8) against drafts the scheduler sends."""
    what = "apply + prepare + record_sampled under async scheduling, rounds interleaved with fast's synchronous step"
    _interleaved(benchmark, bench_budget, workload, provider_name, "fast", "async_step_interleaved", what)


# vLLM 0.32's default capture sizes (CompilationConfig: 1, 2, 4, then every 8 to 256, every 16 to 512)
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


@pytest.mark.parametrize(("workload", "provider_name"), _cases(("fast",)))
def test_graphs_step_interleaved(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    """The cost of captured graphs (spec/graphs.py, spec/padding.py): fast's host step prepared with vLLM's default
    capture sizes (FULL_AND_PIECEWISE: a uniform decode batch dispatched to a FULL graph, its tokens and request rows
    padded), rounds interleaved with fast's step prepared without graphs on the same workload."""
    graphs = CapturedGraphs(DEFAULT_CAPTURE_SIZES, max_num_reqs=StepStream(workload).config.max_num_reqs)
    what = "apply + prepare(graphs=vLLM's default sizes) + record_sampled, rounds interleaved with fast's plain step"
    _interleaved(benchmark, bench_budget, workload, provider_name, "fast", "graphs_step_interleaved", what,
                 prepare_kwargs={"graphs": graphs})  # fmt: skip


def _interleaved(
    benchmark: Any,
    bench_budget: float,
    workload: Workload,
    provider_name: str,
    peer_name: str,
    stage: str,
    what: str,
    prepare_kwargs: dict[str, Any] | None = None,
) -> None:
    """`provider_name`'s host step timed, with one step of `peer_name` between its rounds, timed by the same clock;
    `prepare_kwargs` go to the timed provider's prepare only."""
    kwargs = prepare_kwargs or {}
    fast_provider, peer_provider = providers.get(provider_name), providers.get(peer_name)
    # async scheduling's drafts are proposed on the device (rule 8): placeholders in the outputs, the ids recorded
    fast_stream = StepStream(workload, on_device=provider_name.endswith("-async"))
    peer_stream = StepStream(workload, on_device=peer_name.endswith("-async"))
    fast_pool, peer_pool = started(fast_provider, fast_stream), started(peer_provider, peer_stream)
    fast_sampled = fast_provider.asarray(fast_stream.sampled(workload.num_reqs))
    peer_sampled = peer_provider.asarray(peer_stream.sampled(workload.num_reqs))
    proposed = fast_stream.next_drafts(workload.num_reqs)
    fast_extra = () if proposed is None else (fast_provider.asarray(proposed),)
    timer, peer_times = benchmark._timer, []

    def target(sched: spec.SchedulerOutput) -> None:
        fast_pool.apply(sched)
        fast_pool.record_sampled(fast_pool.prepare(sched, **kwargs), fast_sampled, *fast_extra)

    def setup() -> tuple[Any, ...]:
        sched = peer_stream.next()
        start = timer()
        peer_pool.apply(sched)
        peer_pool.record_sampled(peer_pool.prepare(sched), peer_sampled)
        peer_times.append(timer() - start)
        return (fast_stream.next(),)

    _, sched, batch = reference(workload)
    nbytes = _apply_bytes(sched) + _batch_bytes(batch) + 8 * workload.num_reqs
    record(benchmark, stage, workload, provider_name, nbytes=nbytes, reference=peer_name, what=what)
    run_stateful(benchmark, target, setup, bench_budget)
    record_fallbacks(benchmark, fast_pool)
    if peer_times:
        benchmark.extra_info["reference_median"] = float(np.median(peer_times[1:] or peer_times))
