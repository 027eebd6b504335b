"""`slotmap bench`: run the benchmark suites, save pytest-benchmark JSON per machine, render docs/performance.md.

The page is generated from the saved JSON only (`slotmap bench --render-only` re-renders without
running anything), so every number on it can be traced to a file in benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "img"

QUICK_ARGS = ["-m", "quick", "--benchmark-min-rounds=3", "--benchmark-max-time=0.05", "--bench-budget=0.05"]
FULL_ARGS = ["--benchmark-min-rounds=3", "--benchmark-max-time=0.5", "--bench-budget=0.5"]

STAGES = (  # (stage, what it times, the provider every ratio divides by)
    ("host_step", "apply + prepare + record_sampled: one whole host step, validation included", "numpy-vectorised"),
    ("apply", "apply alone: validate the scheduler output and update the pool", "numpy-vectorised"),
    ("prepare", "prepare alone: the whole BatchInputs of an applied step", "numpy-vectorised"),
    ("slot_mapping", "group 0's slot mapping alone, from token rows and positions", "numpy-vectorised"),
    ("write_kv", "write this step's keys and values to their slots (reshape_and_cache)", "spec"),
    ("paged_attention", "attention of this step's queries over their paged KV, one layer", "dense-sdpa"),
    ("layer_step", "apply + prepare + write_kv + paged_attention (+ record_sampled), one layer", "spec"),
)
PROVIDER_ORDER = ("fast", "fast-cuda", "spec", "numpy-vectorised", "python-lists", "dense-sdpa", "dense-sdpa-cuda")
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}  # HBM/GDDR peak, GB/s


@dataclass(frozen=True)
class Result:
    stage: str
    workload: str
    kind: str
    provider: str
    num_reqs: int
    num_tokens: int
    num_groups: int
    median: float  # seconds
    rounds: int
    nbytes: int
    flops: int
    launches: int | None = None  # Triton launches of one call (fast's prepare only)


def machine_name() -> str:
    """`<cpu or gpu model>-<cores>c`, filesystem-safe: the results file's name."""
    import torch

    if torch.cuda.is_available():
        model = torch.cuda.get_device_name(0)
    else:
        import cpuinfo  # a dependency of pytest-benchmark

        model = cpuinfo.get_cpu_info().get("brand_raw", "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{slug}-{os.cpu_count()}c"


def run(quick: bool, budget: float | None, json_path: Path, extra: list[str], threads: int | None = None) -> str:
    """Run the suites through pytest; returns the command line (recorded in the JSON and on the page)."""
    args = list(QUICK_ARGS if quick else FULL_ARGS)
    if budget is not None:
        args = [a for a in args if not a.startswith(("--benchmark-max-time", "--bench-budget"))]
        args += [f"--benchmark-max-time={budget}", f"--bench-budget={budget}"]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "benchmarks", "--benchmark-enable", f"--benchmark-json={json_path}",
           "-q", "-p", "no:cacheprovider", *args, *extra]  # fmt: skip
    env = dict(os.environ)
    prefix = ""
    if threads is not None:  # torch intra-op threads, and OpenMP/BLAS pools to match
        pinned = {"SLOTMAP_BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        env.update(pinned)
        prefix = " ".join(f"{k}={v}" for k, v in pinned.items()) + " "
    shown = prefix + " ".join(shlex.quote(c) for c in ["python", *cmd[1:]]).replace(str(ROOT) + "/", "")
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code not in (0, 5) or not json_path.exists():  # 5: nothing collected (e.g. a -k that matches nothing)
        raise SystemExit(f"benchmarks failed (pytest exit code {code})")
    data = json.loads(json_path.read_text())
    data["slotmap_command"] = shown
    for b in data["benchmarks"]:
        b["stats"].pop("data", None)  # every round's raw time: megabytes, and the page needs only the summary
    json_path.write_text(json.dumps(data, indent=1))
    return shown


def load(path: Path) -> tuple[dict[str, Any], list[Result]]:
    data = json.loads(path.read_text())
    results = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "stage" not in info:
            continue
        results.append(
            Result(
                info["stage"],
                info["workload"],
                info["kind"],
                info["provider"],
                int(info["num_reqs"]),
                int(info["num_tokens"]),
                int(info["num_groups"]),
                float(b["stats"]["median"]),
                int(b["stats"]["rounds"]),
                int(info.get("bytes", 0)),
                int(info.get("flops", 0)),
                info.get("launches"),
            )
        )
    return data, results


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}×"


def _reference_for(base: str, provider: str, present: set[str]) -> str | None:
    if provider.endswith("-cuda") and f"{base}-cuda" in present:
        return f"{base}-cuda"
    return base if base in present else None


def _ordered(providers: set[str]) -> list[str]:
    return sorted(providers, key=lambda p: (PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER else 99, p))


def _workload_key(r: Result) -> tuple[int, int, int, str]:
    return ({"decode": 0, "prefill": 1, "mixed": 2}.get(r.kind, 3), r.num_groups, r.num_reqs, r.workload)


def _stage_section(
    machine: str, stage: str, what: str, base: str, results: list[Result], img_dir: Path, page: Path
) -> list[str]:
    by_workload: dict[str, dict[str, Result]] = defaultdict(dict)
    for r in results:
        by_workload[r.workload][r.provider] = r
    workloads = sorted(by_workload, key=lambda w: _workload_key(next(iter(by_workload[w].values()))))
    present = {r.provider for r in results}
    providers = _ordered(present)
    out = [f"### {stage}", "", what + ".", ""]
    head = "| workload | reqs | tokens | " + " | ".join(providers) + " |"
    rule = "|---|---:|---:|" + "---:|" * len(providers)
    out += ["Median time per call:", "", head, rule]
    for w in workloads:
        row = by_workload[w]
        any_r = next(iter(row.values()))
        cells = [fmt_time(row[p].median) if p in row else "–" for p in providers]
        out.append(f"| {w} | {any_r.num_reqs} | {any_r.num_tokens} | " + " | ".join(cells) + " |")
    ratio_cols = [p for p in providers if _reference_for(base, p, present) not in (None, p)]
    if ratio_cols:
        out += ["", f"Time relative to `{base}` on the same device (below 1.00× is faster than `{base}`):", ""]
        out += ["| workload | " + " | ".join(ratio_cols) + " |", "|---|" + "---:|" * len(ratio_cols)]
        for w in workloads:
            row = by_workload[w]
            cells = []
            for p in ratio_cols:
                ref = _reference_for(base, p, present)
                ok = p in row and ref in row
                cells.append(fmt_ratio(row[p].median / row[ref].median) if ok else "–")  # type: ignore[index]
            out.append(f"| {w} | " + " | ".join(cells) + " |")
    flops = any(r.flops for r in results) and stage == "paged_attention"
    unit = "GFLOP/s" if flops else "GB/s"
    out += ["", f"Throughput ({unit}, from the work recorded in extra_info):", ""]
    out += ["| workload | " + " | ".join(providers) + " |", "|---|" + "---:|" * len(providers)]
    for w in workloads:
        row = by_workload[w]
        cells = [f"{getattr(row[p], 'flops' if flops else 'nbytes') / row[p].median / 1e9:.3g}" if p in row else "–"
                 for p in providers]  # fmt: skip
        out.append(f"| {w} | " + " | ".join(cells) + " |")
    plot = _plot(machine, stage, results, img_dir)
    if plot is not None:
        out += ["", f"![{stage}: time vs batch size]({os.path.relpath(plot, page.parent)})"]
    return [*out, ""]


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
    for provider in _ordered(set(series)):
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


def _median(results: list[Result], stage: str, workload: str, provider: str) -> float | None:
    for r in results:
        if (r.stage, r.workload, r.provider) == (stage, workload, provider):
            return r.median
    return None


def _targets(results: list[Result]) -> list[str]:
    def m(stage: str, workload: str, provider: str) -> float | None:
        return _median(results, stage, workload, provider)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def line(what: str, value: float | None, goal: str, met: bool | None) -> str:
        shown = "not measured" if value is None else fmt_ratio(value)
        verdict = "–" if met is None else ("met" if met else "**not met**")
        return f"| {what} | {shown} | {goal} | {verdict} |"

    fast_256 = m("host_step", "decode-256", "fast")
    r1 = ratio(fast_256, m("host_step", "decode-256", "numpy-vectorised"))
    r2 = ratio(m("host_step", "decode-256", "python-lists"), fast_256)
    r3 = ratio(m("host_step", "decode-1024", "fast"), fast_256)
    out = ["| target (CPU) | measured | goal | |", "|---|---:|---:|---|"]
    out.append(
        line("host step, 256 decodes: fast / numpy-vectorised", r1, "≤ 0.70×", None if r1 is None else r1 <= 0.7)
    )
    out.append(line("host step, 256 decodes: python-lists / fast", r2, "≥ 10×", None if r2 is None else r2 >= 10))
    out.append(line("host step, fast: time(1024) / time(256)", r3, "≤ 4.5×", None if r3 is None else r3 <= 4.5))
    attention = sorted({r.workload for r in results if r.stage == "paged_attention"},
                       key=lambda w: _workload_key(next(r for r in results if r.workload == w)))  # fmt: skip
    for w in attention:
        r4 = ratio(m("paged_attention", w, "fast"), m("paged_attention", w, "dense-sdpa"))
        if r4 is not None:
            out.append(line(f"paged attention, {w}: fast / dense-sdpa", r4, "≤ 1.5×", r4 <= 1.5))
    return out


def _gpu_lines(machine: str, results: list[Result]) -> list[str]:
    gpu = [r for r in results if r.provider == "fast-cuda"]
    if not gpu:
        return [
            "No CUDA device in this run: the GPU targets (prepare launches and time, attention and KV-write "
            "bandwidth as a fraction of peak) are measured by running `slotmap bench` on a GPU machine."
        ]
    peak = next((v for k, v in PEAK_GBPS.items() if k.lower() in machine.split("-")), None)
    out = [
        "| stage | workload | median | launches | GB/s | fraction of peak |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in sorted(gpu, key=lambda r: (r.stage, _workload_key(r))):
        if r.stage in ("prepare", "paged_attention", "write_kv"):
            gbps = r.nbytes / r.median / 1e9
            frac = f"{gbps / peak:.0%}" if peak else "peak unknown"
            launches = "" if r.launches is None else str(r.launches)
            out.append(f"| {r.stage} | {r.workload} | {fmt_time(r.median)} | {launches} | {gbps:.1f} | {frac} |")
    return out


def render(json_paths: list[Path], page: Path = PAGE, img_dir: Path = IMAGES) -> None:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `slotmap bench` (slotmap/bench.py) from benchmarks/results/*.json. Do not edit by hand: "
        "re-render with `slotmap bench --render-only`. -->",
        "",
        "Every number below is the median of a pytest-benchmark run saved under `benchmarks/results/`. The suites are "
        "in `benchmarks/`; the baselines are in `benchmarks/baselines/` and are checked against spec by "
        "`tests/test_bench_smoke.py`, so no benchmark times a wrong answer.",
        "",
        "## Commands",
        "",
        "```bash",
        ".venv/bin/slotmap bench                # full sweep: benchmarks/results/<machine>.json, then this page",
        ".venv/bin/slotmap bench --quick        # the CI subset only (same suites, fewer sizes, short timing)",
        ".venv/bin/slotmap bench --render-only  # re-render this page from the saved JSON",
        ".venv/bin/slotmap bench --threads 1    # pin torch/OpenMP to one thread (a shared or busy machine)",
        "# plain pytest (pyproject's addopts disable benchmarks; --benchmark-enable turns them back on):",
        ".venv/bin/python -m pytest benchmarks --benchmark-enable --benchmark-json=benchmarks/results/mine.json",
        "```",
        "",
        "## What is measured",
        "",
        "- **Providers.** `spec`: the NumPy reference. `fast`: the torch implementation on CPU tensors (vectorised "
        "torch ops). `fast-cuda`: the same on a CUDA device (Triton kernels), when one is present. `numpy-vectorised`: "
        "persistent NumPy arrays and `np.repeat`/`cumsum` index arithmetic with flat gathers and no validation, as "
        "vLLM v1's CPU input preparation does: the strongest CPU peer. `python-lists`: per-token Python lists turned "
        "into tensors, as small educational engines (nano-vllm) do. `dense-sdpa`: "
        "`torch.nn.functional.scaled_dot_product_attention` once per request on the same tokens laid out "
        "contiguously (no paging, no padding waste; the contiguous copy is made before timing).",
        "- **Workloads.** `decode-N`: N running requests, one token each, contexts uniform in 1k–4k tokens. "
        "`prefill-PxL`: P new prompts of L tokens each step (last step's finish). `mixed-N+PxL`: both. `-g3`: three KV "
        "cache groups (block sizes 16 and 32, and a sliding-window group of 16) instead of one. Block ids are a "
        "shuffled free list, as an allocator hands them out. Every provider sees the same stream of steps.",
        "- **Stateful stages** (`apply`, `host_step`, `layer_step`) time one step per round, each round a new valid "
        "step (built untimed), so the pool stays in steady state. CUDA work is synchronised inside every timed call.",
        "- **Ratios** divide a provider's median by the reference provider's median on the same workload: "
        "`numpy-vectorised` for host stages, `dense-sdpa` for attention, `spec` for write_kv and the layer step. "
        "0.50× means half the reference's time (twice as fast); 10× means ten times slower.",
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
        if data.get("slotmap_command"):
            lines.append(f"- command: `{data['slotmap_command']}`")
        lines += [
            "",
            "### Targets of issue 5",
            "",
            *_targets(results),
            "",
            "GPU:",
            "",
            *_gpu_lines(machine, results),
            "",
        ]
        trims = _trims(data)
        if trims:
            lines += ["Sizes left out of this CPU run:", ""] + [f"- {t}" for t in trims] + [""]
        for stage, what, base in STAGES:
            stage_results = [r for r in results if r.stage == stage]
            if stage_results:
                lines += _stage_section(machine, stage, what, base, stage_results, img_dir, page)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines).rstrip() + "\n")


def _trims(data: dict[str, Any]) -> list[str]:
    out = []
    for trim in data.get("slotmap_trims", []):
        provider, _, stage = trim["who"].partition("@")
        scope = f"`{provider}`" + (f" in `{stage}`" if stage else "")
        if provider == "*":
            scope = "every provider of the kernel stages"
        out.append(f"`{trim['workload']}`, {scope}: {trim['why']}")
    return out


def main(
    quick: bool,
    render_only: bool,
    budget: float | None,
    machine: str | None,
    threads: int | None,
    pytest_args: list[str],
) -> None:
    name = machine or machine_name()
    if quick:  # a quick run goes to a scratch folder, never over the committed results and page
        scratch = Path(tempfile.gettempdir()) / "slotmap-bench-quick"
        json_path = scratch / f"{name}.json"
        if not render_only:
            run(True, budget, json_path, pytest_args, threads)
        render([json_path], scratch / "performance.md", scratch / "img")
        print(f"rendered {scratch / 'performance.md'}")
        return
    if not render_only:
        run(False, budget, RESULTS / f"{name}.json", pytest_args, threads)
    paths = sorted(RESULTS.glob("*.json"))
    if not paths:
        raise SystemExit(f"no results in {RESULTS}: run `slotmap bench` first")
    render(paths)
    print(f"rendered {PAGE} from {', '.join(p.name for p in paths)}")
