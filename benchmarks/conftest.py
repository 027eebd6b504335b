"""Options and markers of the benchmark suites (pytest runs benchmarks/ only when it is named)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

THREADS_ENV = "SLOTMAP_BENCH_THREADS"  # torch intra-op threads for the run (`slotmap bench --threads`)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--bench-budget",
        type=float,
        default=1.0,
        help="seconds of timed rounds per stateful benchmark (apply, host_step, layer_step); rounds = budget / a step",
    )


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(THREADS_ENV):
        torch.set_num_threads(int(os.environ[THREADS_ENV]))
    config.addinivalue_line("markers", "quick: the CI subset of the benchmarks (`-m quick`, < 2 minutes on 2 cores)")


@pytest.fixture
def bench_budget(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--bench-budget"))


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """What the results page states about the run besides the CPU: threads, load, library versions, GPU."""
    import numpy

    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["loadavg_at_start"] = list(os.getloadavg())
    machine_info["torch_version"] = torch.__version__
    machine_info["numpy_version"] = numpy.__version__
    if torch.cuda.is_available():
        machine_info["cuda_device"] = torch.cuda.get_device_name(0)


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: list[Any], output_json: dict[str, Any]) -> None:
    """Summaries only (every round's raw time is megabytes), and the sizes a CPU run leaves out, so the page can
    say so without importing the suites."""
    from benchmarks.workloads import CPU_TRIMS

    for bench in output_json.get("benchmarks", []):
        bench.get("stats", {}).pop("data", None)

    if not torch.cuda.is_available():
        output_json["slotmap_trims"] = [
            {"workload": workload, "who": who, "why": why} for (workload, who), why in CPU_TRIMS.items()
        ]
