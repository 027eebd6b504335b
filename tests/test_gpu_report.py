"""slotmap/bench/gpu.py: the GPU page and summary from saved JSON (renderable and checkable on CPU).

The JSON here is written by the test, not measured: it checks the arithmetic (bandwidth as a fraction of
the device's peak, FLOP/s against dense SDPA), the device look-up, and that a run without a GPU is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from slotmap.bench import gpu


def _bench(device: str | None) -> dict:
    def entry(stage: str, workload: str, kind: str, provider: str, num_reqs: int, median: float, nbytes: int,
              flops: int) -> dict:  # fmt: skip
        info = {"stage": stage, "workload": workload, "kind": kind, "provider": provider, "num_reqs": num_reqs,
                "num_tokens": num_reqs, "num_groups": 1, "bytes": nbytes, "flops": flops}  # fmt: skip
        return {"extra_info": info, "stats": {"median": median, "rounds": 5}}

    machine = {"cuda_device": device} if device else {}
    return {
        "machine_info": machine,
        "benchmarks": [
            entry("write_kv", "decode-64", "decode", "fast-cuda", 64, 1e-5, 24_000_000, 0),
            entry("paged_attention", "decode-64", "decode", "fast-cuda", 64, 1e-3, 3_000_000_000, 0),
            entry("paged_attention", "decode-8", "decode", "fast-cuda", 8, 1e-3, 1_000_000_000, 0),
            entry("paged_attention", "prefill-4x512", "prefill", "fast-cuda", 4, 2e-3, 0, 4_000_000_000),
            entry("paged_attention", "prefill-4x512", "prefill", "dense-sdpa-cuda", 4, 1e-3, 0, 4_000_000_000),
            entry("prepare", "decode-256", "decode", "fast-cuda", 256, 5e-5, 1000, 0),
            entry("prepare", "decode-256", "decode", "fast", 256, 5e-4, 1000, 0),  # CPU rows are not on the page
        ],
    }


PROBE = {"device": "NVIDIA H200", "steps": {"decode-256": {"apply_launches": 1, "prepare_launches": 1,
                                                            "host_syncs": 0, "cuda_kernels": 3}}}  # fmt: skip


def _rows(summary: gpu.Summary) -> dict[str, dict]:
    return {r["quantity"]: r for r in summary.rows}


def test_fractions_of_peak_and_sdpa_ratio() -> None:
    rows = _rows(gpu.summarize(_bench("NVIDIA H200"), PROBE))
    peak = gpu.PEAK_BANDWIDTH["H200"]
    assert rows["write_kv bandwidth, decode-64"]["value"] == pytest.approx(24e6 / 1e-5 / peak * 100)
    decode = rows["decode attention bandwidth, decode-64"]
    assert decode["value"] == pytest.approx(3e9 / 1e-3 / peak * 100) and decode["met"] is False  # 62.5% < 70%
    assert rows["decode attention bandwidth, decode-8"]["met"] is None  # batch < 64: outside the target
    assert rows["prefill attention, prefill-4x512"]["value"] == pytest.approx(4e9 / 2e-3 / 1e12)
    ratio = rows["prefill vs torch SDPA (dense), prefill-4x512"]
    assert ratio["value"] == pytest.approx(0.5) and ratio["met"] is False
    assert rows["prepare time, decode-256"]["value"] == pytest.approx(50.0)
    assert rows["prepare launches, decode-256"]["met"] is True and rows["host syncs in apply + prepare, decode-256"][
        "met"] is True  # fmt: skip
    assert not any("fast," in q or q.endswith(", fast") for q in rows)


@pytest.mark.parametrize(
    ("name", "key"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
     ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"), ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA L40S", "L40S")],
)  # fmt: skip
def test_peak_bandwidth_by_device_name(name: str, key: str) -> None:
    assert gpu.peak_bandwidth(name) == gpu.PEAK_BANDWIDTH[key]


def test_unknown_device_reports_no_fraction() -> None:
    summary = gpu.summarize(_bench("Some Future GPU"), PROBE)
    assert summary.peak_bw is None
    assert not any("bandwidth" in r["quantity"] for r in summary.rows)
    assert "unknown" in gpu.render_markdown(summary)


def test_a_run_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="only from a GPU run"):
        gpu.summarize(_bench(None), {"steps": {}})


def test_page_and_summary(tmp_path: Path) -> None:
    bench, probe = tmp_path / "bench.json", tmp_path / "probe.json"
    bench.write_text(json.dumps(_bench("NVIDIA H200")))
    probe.write_text(json.dumps(PROBE))
    page = tmp_path / "performance-gpu.md"
    assert gpu.main([str(bench), str(probe), "--out", str(page)]) == 0
    text = page.read_text()
    assert "NVIDIA H200" in text and "never written without one" in text and gpu.PEAK_SOURCE in text
    assert "| decode attention bandwidth, decode-64 | 62.5 | % of peak | >= 70% | **no** |" in text
    console = Console(record=True, width=120)
    gpu.print_summary(gpu.summarize(_bench("NVIDIA H200"), PROBE), console)
    assert "decode attention bandwidth, decode-64" in console.export_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the probe measures CUDA steps; no CUDA device here")
def test_probe_counts_a_cuda_step() -> None:
    from benchmarks import gpu_probe

    counts = gpu_probe.probe_step("decode-256")
    assert counts["prepare_launches"] >= 1 and counts["cuda_kernels"] >= counts["prepare_launches"]
