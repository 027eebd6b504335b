"""docs/performance-gpu.md from a GPU run: the pytest-benchmark JSON of the kernel and host benchmarks plus
the probe's JSON (benchmarks/gpu_probe.py), and a one-screen summary printed last; and the devices' peak
bandwidths, which docs/performance.md's GPU section divides by too.

Every number on the page comes from those two files, written by `scripts/gpu-check` on a machine with an
NVIDIA GPU; nothing here measures anything, and a run without a CUDA device is refused rather than rendered.
The JSON is read and the tables are drawn as for docs/performance.md (slotmap/bench/results.py).

    python -m slotmap.bench.gpu BENCH_JSON PROBE_JSON [--out docs/performance-gpu.md]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from slotmap.bench.results import console_table, markdown_table, rows

# HBM bandwidth per device, in bytes/s, matched by substring of torch.cuda.get_device_name() (longest first).
# Source: NVIDIA's data sheets (H200: "NVIDIA H200 Tensor Core GPU" datasheet, 4.8 TB/s; H100 SXM 3.35 TB/s,
# H100 PCIe 2.0 TB/s, H100 NVL 3.9 TB/s: "NVIDIA H100 Tensor Core GPU" datasheet; A100 80GB SXM 2.039 TB/s,
# A100 80GB PCIe 1.935 TB/s, A100 40GB 1.555 TB/s: "NVIDIA A100 Tensor Core GPU" datasheet; L40S 864 GB/s,
# L4 300 GB/s, A10 600 GB/s: their product pages).
PEAK_BANDWIDTH: dict[str, float] = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM5
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100-PCIE-80GB": 1.935e12,
    "A100": 1.555e12,  # 40 GB
    "L40S": 0.864e12,
    "L4": 0.300e12,
    "A10": 0.600e12,
}
PEAK_SOURCE = "NVIDIA data sheets (H200, H100, A100, L40S, L4, A10), HBM/GDDR bandwidth"

# Targets of the GPU issue, checked against the measurements (never asserted in tests)
DECODE_BW_TARGET = 0.70  # decode attention, batch >= 64, context >= 2k, bf16
KV_WRITE_BW_TARGET = 0.50
PREFILL_VS_SDPA_TARGET = 0.60  # fast's prefill FLOP/s / torch SDPA's on dense data
MAX_PREPARE_LAUNCHES = 1  # prepare is one launch (docs/architecture.md)


def peak_bandwidth(device_name: str) -> float | None:
    for key in sorted(PEAK_BANDWIDTH, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_BANDWIDTH[key]
    return None


@dataclass
class Summary:
    device: str
    peak_bw: float | None
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per reported quantity
    probe: dict[str, Any] = field(default_factory=dict)


def summarize(bench: dict[str, Any], probe: dict[str, Any]) -> Summary:
    device = bench.get("machine_info", {}).get("cuda_device") or probe.get("device")
    if not device:
        raise ValueError("no CUDA device recorded in the benchmark JSON: the GPU page is written only from a GPU run")
    summary = Summary(device, peak_bandwidth(device), probe=probe)
    found = {(m.stage, m.workload, m.provider): m for m in rows(bench)}

    def add(quantity: str, value: float | None, unit: str, target: str = "", met: bool | None = None) -> None:
        summary.rows.append({"quantity": quantity, "value": value, "unit": unit, "target": target, "met": met})

    for step, counts in probe.get("steps", {}).items():
        launches = int(counts["prepare_launches"])
        add(f"prepare launches, {step}", launches, "launches", f"<= {MAX_PREPARE_LAUNCHES}",
            launches <= MAX_PREPARE_LAUNCHES)  # fmt: skip
        add(f"apply launches, {step}", int(counts["apply_launches"]), "launches")
        syncs = int(counts["host_syncs"])
        add(f"host syncs in apply + prepare, {step}", syncs, "syncs", "0", syncs == 0)
        add(f"CUDA kernels in apply + prepare, {step}", int(counts["cuda_kernels"]), "kernels")
    for (stage, workload, provider), m in sorted(found.items()):
        if provider != "fast-cuda":
            continue
        if stage == "prepare":
            add(f"prepare time, {workload}", m.median * 1e6, "µs")
        elif stage == "write_kv" and summary.peak_bw:
            frac = m.nbytes / m.median / summary.peak_bw
            add(f"write_kv bandwidth, {workload}", frac * 100, "% of peak", f">= {KV_WRITE_BW_TARGET:.0%}",
                frac >= KV_WRITE_BW_TARGET)  # fmt: skip
        elif stage == "paged_attention" and m.kind == "decode" and summary.peak_bw:
            frac = m.nbytes / m.median / summary.peak_bw
            big = m.num_reqs >= 64  # decode workloads draw contexts from 1k-4k tokens (mean 2.5k)
            add(f"decode attention bandwidth, {workload}", frac * 100, "% of peak",
                f">= {DECODE_BW_TARGET:.0%}" if big else "", (frac >= DECODE_BW_TARGET) if big else None)  # fmt: skip
        elif stage == "paged_attention" and m.kind == "prefill":
            dense = found.get((stage, workload, "dense-sdpa-cuda"))
            add(f"prefill attention, {workload}", m.flops / m.median / 1e12, "TFLOP/s")
            if dense is not None:
                ratio = dense.median / m.median  # FLOP/s ratio: same work on both sides
                add(f"prefill vs torch SDPA (dense), {workload}", ratio, "x SDPA's FLOP/s",
                    f">= {PREFILL_VS_SDPA_TARGET}", ratio >= PREFILL_VS_SDPA_TARGET)  # fmt: skip
    return summary


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


def render_markdown(summary: Summary) -> str:
    peak = f"{summary.peak_bw / 1e12:.3g} TB/s" if summary.peak_bw else "unknown (not in the table)"
    lines = [
        "# Performance on GPU",
        "",
        "Generated by `scripts/gpu-check` (slotmap/bench/gpu.py) from the saved output of one run on",
        f"**{summary.device}**. Every number below was measured on that GPU; the page is never written without one.",
        "",
        f"- Peak memory bandwidth used for fractions: {peak} ({PEAK_SOURCE}).",
        "- Launches and host syncs: one decode step and one mixed step of the benchmark streams, counted by",
        "  wrapping fast's kernel launches and by `torch.cuda.set_sync_debug_mode` (benchmarks/gpu_probe.py).",
        "- Bandwidth: bytes recorded by each benchmark (K/V read once per request, q and out; for write_kv the",
        "  key/value read and written) over its median time.",
        "",
        *markdown_table(COLUMNS, "lllll", _cells(summary, {True: "yes", False: "**no**"})),
    ]
    if summary.probe.get("versions"):
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in summary.probe["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def print_summary(summary: Summary, console: Console | None = None) -> None:
    body = _cells(summary, {True: "[green]yes", False: "[red]no"})
    (console or Console()).print(console_table(f"slotmap on {summary.device}", COLUMNS, "lllll", body))


COLUMNS = ("quantity", "value", "unit", "target", "met")


def _cells(summary: Summary, verdicts: dict[bool, str]) -> list[tuple[str, ...]]:
    return [
        (r["quantity"], _fmt(r["value"]), r["unit"], r["target"], "" if r["met"] is None else verdicts[r["met"]])
        for r in summary.rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("probe_json", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/performance-gpu.md"))
    args = parser.parse_args(argv)
    summary = summarize(json.loads(args.bench_json.read_text()), json.loads(args.probe_json.read_text()))
    args.out.write_text(render_markdown(summary))
    print_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
