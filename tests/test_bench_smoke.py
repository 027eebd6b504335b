"""The benchmark baselines compute what spec computes, so no benchmark times a wrong answer.

Each baseline pool is driven through the same scheduler outputs as spec's pool (benchmark streams with
decodes, prefills, finished requests and three KV groups; the articles' worked example; a preemption
and resume) and every BatchInputs field and the snapshot are compared exactly. The dense SDPA baseline
is compared with spec's paged attention in float64. The results renderer is checked on a small
hand-made pytest-benchmark JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import spec
from benchmarks.baselines.dense_sdpa import contiguous_kv, dense_attention
from benchmarks.baselines.numpy_vectorised import NumpyVectorisedPool
from benchmarks.baselines.python_lists import PythonListPool
from benchmarks.providers import numpy_slot_mapping, python_slot_mapping
from benchmarks.workloads import StepStream, Workload
from conformance.backends import BackendHandle
from conformance.examples import worked_example
from shadow.compare import batch_differences
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

BASELINES = {"numpy-vectorised": NumpyVectorisedPool, "python-lists": PythonListPool}
SMALL = (
    Workload("small-mixed-g3", 5, 2, 40, num_groups=3, min_context=20, max_context=70),
    Workload("small-decode", 7, min_context=1, max_context=50),
    Workload("small-prefill", 0, 3, 33),
)


def _assert_same_batch(got: spec.BatchInputs, want: spec.BatchInputs) -> None:
    to_numpy = BackendHandle("baseline", spec).batch_to_numpy  # converts torch tensors and NumPy alike
    problems = batch_differences(to_numpy(want), to_numpy(got))
    assert not problems, "\n".join(problems)


def _drive(pools: dict[str, Any], steps: list[SchedulerOutput], pad: int = 0) -> None:
    for k, sched in enumerate(steps):
        batches = {}
        for name, pool in pools.items():
            pool.apply(sched)
            batches[name] = pool.prepare(sched, sched.total_num_scheduled_tokens + pad)
        for name in pools:
            _assert_same_batch(batches[name], batches["spec"])
        sampled = (np.arange(batches["spec"].num_reqs, dtype=np.int64) * 7 + k) % 100
        for name, pool in pools.items():
            pool.record_sampled(batches[name], sampled)
        for name, pool in pools.items():
            assert pool.snapshot() == pools["spec"].snapshot(), name


@pytest.mark.parametrize("workload", SMALL, ids=str)
def test_baselines_match_spec_on_benchmark_streams(workload: Workload) -> None:
    stream = StepStream(workload)
    pools = {"spec": spec.RequestStatePool(stream.config)} | {n: cls(stream.config) for n, cls in BASELINES.items()}
    _drive(pools, [stream.first()] + [stream.next() for _ in range(40)], pad=3)


def test_baselines_match_spec_on_worked_example_and_resume() -> None:
    ex = worked_example()
    pools = {"spec": spec.RequestStatePool(ex.config)} | {n: cls(ex.config) for n, cls in BASELINES.items()}
    _drive(pools, [ex.step1, ex.step2])
    config = WorkerConfig(4, 32, 64, 50, (KVCacheGroup(4, 32), KVCacheGroup(8, 16)))
    steps = [
        SchedulerOutput(
            new_requests=(
                NewRequest("a", tuple(range(10)), ((1, 2, 3), (1, 2))),
                NewRequest("b", (5,) * 6, ((4, 5), (3,))),
            ),
            num_scheduled_tokens={"a": 10, "b": 6},
        ),
        SchedulerOutput(  # b is preempted: keeps its row and tokens, not scheduled
            cached_requests=(CachedRequest("a", 10, ((6,), ())),), num_scheduled_tokens={"a": 1}
        ),
        SchedulerOutput(  # b resumes with new blocks replacing its tables, recomputing from 0
            cached_requests=(CachedRequest("b", 0, ((9, 10), (11,)), resumed=True), CachedRequest("a", 11)),
            num_scheduled_tokens={"b": 7, "a": 1},
            finished_req_ids=frozenset(),
        ),
        SchedulerOutput(
            new_requests=(NewRequest("c", (1, 2, 3), ((12,), (13,))),),
            cached_requests=(CachedRequest("b", 7),),
            num_scheduled_tokens={"c": 3, "b": 1},
            finished_req_ids=frozenset({"a"}),
        ),
    ]
    pools = {"spec": spec.RequestStatePool(config)} | {n: cls(config) for n, cls in BASELINES.items()}
    _drive(pools, steps)


def test_slot_mapping_baselines_match_spec() -> None:
    rng = np.random.default_rng(0)
    table = rng.permutation(np.arange(1, 4 * 9 + 1, dtype=np.int32)).reshape(4, 9)  # [R, max_blocks]
    token_rows = rng.integers(0, 4, 50).astype(np.int64)
    positions = rng.integers(0, 9 * 8, 50).astype(np.int64)
    expected = spec.slots.slot_mapping(table, token_rows, positions, 8)
    assert np.array_equal(numpy_slot_mapping(table, token_rows, positions, 8), expected)
    got = python_slot_mapping(table.tolist(), token_rows.tolist(), positions.tolist(), 8)
    assert np.array_equal(got.numpy(), expected)


def test_dense_sdpa_matches_spec_attention() -> None:
    """Decode rows, a whole prompt and a chunk in the middle of a prompt, with GQA, in float64."""
    rng = np.random.default_rng(1)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 4, 40, 6, 2, 8
    seq_lens = np.array([9, 1, 12, 7], np.int32)
    query_lens = np.array([1, 1, 12, 3], np.int32)  # decode, decode, whole prompt, a chunk ending at 7
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    ids = rng.permutation(np.arange(1, num_blocks))
    block_table = np.zeros((4, 4), np.int32)
    for b, n in enumerate(seq_lens):
        need = -(-int(n) // block_size)
        block_table[b, :need], ids = ids[:need], ids[need:]
    key_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim))
    value_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim))
    query = rng.standard_normal((int(query_start_loc[-1]), num_heads, head_dim))
    scale = head_dim**-0.5
    want = spec.paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale)
    kv = contiguous_kv(
        torch.from_numpy(key_cache), torch.from_numpy(value_cache), block_table, seq_lens, query_start_loc
    )
    got = dense_attention(torch.from_numpy(query), kv, query_start_loc.tolist(), scale=scale).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)  # float64 both sides: only rounding differs


def _fake_results(path: Path) -> None:
    """A pytest-benchmark JSON with hand-picked medians, in the shape the suites write."""

    def bench(stage: str, workload: str, num_reqs: int, provider: str, median: float, **extra: Any) -> dict[str, Any]:
        info = {"stage": stage, "workload": workload, "kind": "decode", "provider": provider, "num_reqs": num_reqs,
                "num_tokens": num_reqs, "num_groups": 1, "bytes": 1000, "flops": 0, **extra}  # fmt: skip
        return {"group": f"{stage}/{workload}", "name": f"test_{stage}[{workload}-{provider}]",
                "extra_info": info, "stats": {"median": median, "rounds": 5}}  # fmt: skip

    benchmarks = [
        bench("host_step", "decode-8", 8, "spec", 4e-3),
        bench("host_step", "decode-8", 8, "numpy-vectorised", 1e-3),
        bench("host_step", "decode-8", 8, "python-lists", 8e-3),
        bench("host_step", "decode-64", 64, "spec", 6e-3),
        bench("host_step", "decode-64", 64, "numpy-vectorised", 2e-3),
        # fast's rounds interleaved with the peer's: the peer's median rides in extra_info
        bench("host_step_interleaved", "decode-8", 8, "fast", 3e-3, reference_median=2e-3),
        bench("host_step_interleaved", "decode-64", 64, "fast", 1e-3, reference_median=2e-3),
    ]
    cpu = {"brand_raw": "Test CPU", "flags": ["sse2", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]}
    machine = {"node": "testbox", "processor": "x86_64", "cpu": cpu, "python_version": "3.11"}
    path.write_text(json.dumps({"machine_info": machine, "datetime": "2026-01-01T00:00:00", "benchmarks": benchmarks}))


def test_results_page_renders_medians_and_ratios(tmp_path: Path) -> None:
    from slotmap.bench.page import render

    results = tmp_path / "testbox.json"
    _fake_results(results)
    page = tmp_path / "performance.md"
    render([results], page, tmp_path / "img")
    text = page.read_text()
    assert "Test CPU" in text
    assert "CPU features: vector avx2, avx512f, avx512_bf16; matrix (AMX) amx_tile, amx_bf16" in text
    assert "4.00 ms" in text and "1.00 ms" in text  # medians of decode-8
    assert "4.00×" in text  # spec / numpy-vectorised at decode-8: 4e-3 / 1e-3
    assert "8.00×" in text  # python-lists / numpy-vectorised at decode-8
    assert "3.00×" in text  # spec / numpy-vectorised at decode-64: 6e-3 / 2e-3
    assert list((tmp_path / "img").glob("*host_step.png"))
    assert "### Targets" in text and "issue" not in text.lower()  # targets are named by what they measure


def test_cpu_features_state_amx_either_way() -> None:
    from slotmap.bench.page import cpu_features

    no_amx = cpu_features(["avx2", "fma", "avx512f", "avx512_vnni"])
    assert no_amx == "vector avx2, fma, avx512f, avx512_vnni; matrix (AMX) none"
    assert cpu_features(["sse2"]).startswith("vector none of avx2") and cpu_features([]) == "not recorded"


def test_a_stage_the_renderer_does_not_know_is_rendered_as_recorded(tmp_path: Path) -> None:
    from slotmap.bench.page import render

    results = tmp_path / "testbox.json"
    _fake_results(results)
    data = json.loads(results.read_text())
    for provider, median in (("spec", 9e-3), ("numpy-vectorised", 3e-3)):
        info = {
            "stage": "draft_step",
            "workload": "decode-8",
            "kind": "decode",
            "provider": provider,
            "num_reqs": 8,
            "num_tokens": 8,
            "num_groups": 1,
            "what": "a step with draft tokens",
            "reference": "numpy-vectorised",
        }
        data["benchmarks"].append({"extra_info": info, "stats": {"median": median, "rounds": 5}})  # fmt: skip
    results.write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    render([results], page, tmp_path / "img")
    section = page.read_text().split("### draft_step")[1]
    assert "a step with draft tokens." in section and "9.00 ms" in section
    assert "3.00×" in section  # spec / numpy-vectorised: 9e-3 / 3e-3


def _fast_and_spec(workload: str, fast: float, spec: float, fallbacks: dict[str, int]) -> dict[str, Any]:
    """benchmarks/test_feature_steps.py's form: fast's benchmark carrying spec's median, timed in its rounds."""
    info = {"stage": "feature_step_interleaved", "workload": workload, "kind": "decode", "provider": "fast",
            "num_reqs": 64, "num_tokens": 64, "num_groups": 2, "bytes": 0, "flops": 0, "reference": "spec",
            "what": "fast's host step with spec's between its rounds", "fallbacks": fallbacks, "counted_steps": 201,
            "fast_median": fast, "spec_median": spec, "fast_over_spec_median": fast / spec}  # fmt: skip
    return {"extra_info": info, "stats": {"median": fast, "rounds": 200}}


def test_a_benchmark_timing_fast_and_spec_interleaved_renders_both_and_fast_s_fallbacks(tmp_path: Path) -> None:
    from slotmap.bench.page import render

    results = tmp_path / "testbox.json"
    _fake_results(results)
    data = json.loads(results.read_text())
    data["benchmarks"] += [
        _fast_and_spec("hybrid-64", 1e-4, 2.5e-3, {}),
        _fast_and_spec("hybrid-64-async", 2e-3, 2.5e-3, {"FEATURE": 201}),
        _fast_and_spec("window-64-async-drafts", 4e-3, 5e-3, {"ASYNC_DRAFTS": 190, "ASYNC_RULES": 11}),
    ]
    results.write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    render([results], page, tmp_path / "img")
    section = page.read_text().split("### feature_step_interleaved")[1]
    assert "fast's host step with spec's between its rounds." in section
    assert "| workload | reqs | tokens | fast | spec |" in section
    assert "| hybrid-64 | 64 | 64 | 100.0 µs | 2.50 ms |" in section
    assert "| hybrid-64 | 0.04× |" in section and "| window-64-async-drafts | 0.80× |" in section  # fast / spec
    assert "| workload | provider | steps | fell back | ASYNC_DRAFTS | ASYNC_RULES | FEATURE |" in section
    assert "| hybrid-64 | fast | 201 | 0 | 0 | 0 | 0 |" in section
    assert "| hybrid-64-async | fast | 201 | 201 | 0 | 0 | 201 |" in section
    assert "| window-64-async-drafts | fast | 201 | 201 | 190 | 11 | 0 |" in section
    assert "| spec |" not in section.split("fell back")[1]  # the counts are fast's pool's
    host_step = page.read_text().split("### host_step")[1].split("###")[0]
    assert "fell back" not in host_step  # no benchmark of that stage recorded fallbacks


def test_both_forms_of_an_interleaved_benchmark_give_a_row_per_provider() -> None:
    from slotmap.bench.results import rows

    live = {"stage": "vllm_prep", "workload": "hybrid", "provider": "fast", "reference": "vllm", "num_requests": 48,
            "num_steps": 68, "fallbacks": {"CACHED_REQUESTS": 9}, "fast_median": 1e-4, "spec_median": 1e-3,
            "vllm_median": 3e-4, "fast_over_vllm_median": 1 / 3}  # fmt: skip
    got = rows({"benchmarks": [{"extra_info": live, "stats": {"rounds": 9}},
                               _fast_and_spec("encdec-64", 2e-3, 2.5e-3, {"FEATURE": 201})]})  # fmt: skip
    shown = [(r.workload, r.provider, r.kind, r.num_reqs, r.num_tokens, r.median, r.fallbacks, r.counted_steps)
             for r in got]  # fmt: skip
    assert shown == [
        ("hybrid", "fast", "live vLLM steps", 48, 68, 1e-4, (("CACHED_REQUESTS", 9),), None),
        ("hybrid", "spec", "live vLLM steps", 48, 68, 1e-3, (), None),
        ("hybrid", "vllm", "live vLLM steps", 48, 68, 3e-4, (), None),
        ("encdec-64", "fast", "decode", 64, 64, 2e-3, (("FEATURE", 201),), 201),
        ("encdec-64", "spec", "decode", 64, 64, 2.5e-3, (), None),
    ]
    assert {r.reference_median for r in got} == {3e-4, 2.5e-3}


def test_a_party_timed_alone_divides_by_the_reference_timed_alone(tmp_path: Path) -> None:
    from slotmap.bench.page import render

    results = tmp_path / "testbox.json"
    _fake_results(results)
    data = json.loads(results.read_text())
    live = {"stage": "vllm_prep", "workload": "plain", "provider": "fast", "reference": "vllm", "num_requests": 48,
            "num_steps": 68, "fast_median": 6e-5, "spec_median": 6e-4, "vllm_median": 1.6e-4,
            "fast-alone_median": 4e-5, "vllm-alone_median": 1e-4, "fast_over_vllm_alone_median": 0.4}  # fmt: skip
    data["benchmarks"].append({"extra_info": live, "stats": {"rounds": 9, "median": 6e-5}})
    results.write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    render([results], page, tmp_path / "img")
    section = page.read_text().split("### vllm_prep")[1].split("###")[0]
    relative = section.split("Time relative to")[1]
    lines = relative.splitlines()
    header, plain = (next(line for line in lines if line.startswith(start)) for start in ("| workload", "| plain"))
    cells = {k.strip(): v.strip() for k, v in zip(header.split("|")[2:-1], plain.split("|")[2:-1], strict=True)}
    assert cells == {"fast": "0.38×", "fast-alone": "0.40×", "spec": "3.75×"}
    targets = page.read_text().split("### Targets")[1].split("###")[0]
    assert "| vLLM prep, plain: fast / vLLM's own (interleaved) | 0.38× | ≤ 0.25× | **not met** |" in targets


def test_fallbacks_recorded_since_a_warm_up_count_only_the_steps_after_it() -> None:
    import collections
    import types

    from benchmarks.harness import record_fallbacks
    from fast.fallback import Fallback

    pool = types.SimpleNamespace(fallbacks=collections.Counter({Fallback.FEATURE: 3, Fallback.CACHED_REQUESTS: 1}))
    warm = collections.Counter(pool.fallbacks)
    pool.fallbacks[Fallback.FEATURE] += 5
    bench = types.SimpleNamespace(extra_info={})
    record_fallbacks(bench, pool, since=warm, steps=6)
    assert bench.extra_info == {"fallbacks": {"FEATURE": 5}, "counted_steps": 6}
    record_fallbacks(bench, pool)  # the pool's whole life, as the host benchmarks record it
    assert bench.extra_info["fallbacks"] == {"FEATURE": 8, "CACHED_REQUESTS": 1}


def test_targets_expand_per_workload_and_compare_with_their_goal(tmp_path: Path) -> None:
    from slotmap.bench.results import load
    from slotmap.bench.targets import EachWorkload, Interleaved, Ratio, target_rows

    results = tmp_path / "testbox.json"
    _fake_results(results)
    _, rows = load(results)
    targets = (
        Ratio("spec at 64 / spec at 8", "host_step", ("decode-64", "spec"), ("decode-8", "spec"), 1.4),
        EachWorkload("{workload}: spec / numpy-vectorised", "host_step", "spec", "numpy-vectorised", 3.5),
        Ratio("absent", "host_step", ("decode-1024", "spec"), ("decode-8", "spec"), 1.0),
        Interleaved("{workload}: fast / peer, interleaved", "host_step_interleaved", "fast", None, 1.0),
        Interleaved("at 64 only", "host_step_interleaved", "fast", "decode-64", 0.7),
        Interleaved("not run", "host_step_interleaved", "fast", "decode-1024", 0.7),
    )
    got = [(r.what, None if r.measured is None else round(r.measured, 6), r.met) for r in target_rows(rows, targets)]
    assert got == [
        ("spec at 64 / spec at 8", 1.5, False),  # 6e-3 / 4e-3
        ("decode-8: spec / numpy-vectorised", 4.0, False),  # 4e-3 / 1e-3
        ("decode-64: spec / numpy-vectorised", 3.0, True),  # 6e-3 / 2e-3
        ("absent", None, None),
        ("decode-8: fast / peer, interleaved", 1.5, False),  # 3e-3 / 2e-3, both from one benchmark
        ("decode-64: fast / peer, interleaved", 0.5, True),
        ("at 64 only", 0.5, True),
        ("not run", None, None),
    ]


def _fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int | None]]:
    """slotmap.bench.run with its folders under tmp_path and pytest replaced by the hand-made JSON."""
    from slotmap.bench import run as bench_run

    for name in ("RESULTS", "SCRATCH", "IMAGES"):
        monkeypatch.setattr(bench_run, name, tmp_path / name.lower())
    monkeypatch.setattr(bench_run, "ROOT", tmp_path)
    monkeypatch.setattr(bench_run, "PAGE", tmp_path / "docs" / "performance.md")
    threads: list[int | None] = []

    def fake_run(quick: bool, budget: float | None, json_path: Path, extra: list[str], pinned: int | None) -> str:
        threads.append(pinned)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        _fake_results(json_path)
        data = json.loads(json_path.read_text())
        json_path.write_text(json.dumps({**data, "slotmap_command": "python -m pytest benchmarks"}))
        return "python -m pytest benchmarks"

    monkeypatch.setattr(bench_run, "run", fake_run)
    return bench_run, threads


def test_bench_writes_only_to_scratch_unless_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    bench_run, threads = _fake_bench(tmp_path, monkeypatch)
    console = Console(record=True, width=200)
    bench_run.main(bench_run.BenchOptions(machine="testbox"), console)
    assert (tmp_path / "scratch" / "testbox.json").exists() and (tmp_path / "scratch" / "performance.md").exists()
    assert not (tmp_path / "results").exists() and not (tmp_path / "docs").exists()
    assert threads == [None]
    printed = console.export_text()
    assert "targets on testbox" in printed and "host step, 256 decodes: fast / numpy-vectorised" in printed

    bench_run.main(bench_run.BenchOptions(save=True, machine="testbox"), console)
    assert (tmp_path / "results" / "testbox.json").exists() and (tmp_path / "docs" / "performance.md").exists()
    assert threads == [None, bench_run.PUBLISH_THREADS]  # publishing pins the threads
    assert json.loads((tmp_path / "results" / "testbox.json").read_text())["slotmap_command"]


def test_published_page_ignores_json_not_written_by_bench_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench_run, _ = _fake_bench(tmp_path, monkeypatch)
    (tmp_path / "results").mkdir()
    _fake_results(tmp_path / "results" / "mine.json")  # a plain pytest-benchmark run left here by hand
    with pytest.raises(SystemExit, match="no results"):
        bench_run.main(bench_run.BenchOptions(save=True, render_only=True), _quiet())
    assert bench_run.published() == []


def _quiet() -> Any:
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))
