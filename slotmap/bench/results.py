"""The saved pytest-benchmark JSON as rows the pages and the targets table read, and how they print them:
numbers, and tables in Markdown (the pages) or on the console (one table renderer for both performance pages).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

PROVIDER_ORDER = ("fast", "fast-cuda", "spec", "numpy-vectorised", "python-lists", "dense-sdpa", "dense-sdpa-cuda")


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
    what: str = ""  # the stage's description, when the benchmark recorded one
    reference: str | None = None  # the provider its ratios divide by, when recorded
    reference_median: float | None = None  # seconds: the reference's median timed interleaved with this one
    fallbacks: tuple[tuple[str, int], ...] = ()  # (reason, steps) fast's bulk planner left to plan_step, by name
    counted_steps: int | None = None  # the steps those counts are of, where the benchmark recorded it


def load(path: Path) -> tuple[dict[str, Any], list[Result]]:
    data = json.loads(path.read_text())
    return data, rows(data)


def rows(data: dict[str, Any]) -> list[Result]:
    """The benchmarks of one pytest-benchmark JSON that recorded a stage (harness.record), one row per provider."""
    results = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "stage" not in info:
            continue
        # one benchmark timing several providers interleaved: "<provider>_median" each, its own provider's among them
        if "kind" not in info or f"{info.get('provider')}_median" in info:
            results += _interleaved_rows(info, int(b["stats"]["rounds"]))
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
                info.get("what", ""),
                info.get("reference"),
                info.get("reference_median"),
                _fallbacks(info),
                info.get("counted_steps"),
            )
        )
    return results


def _fallbacks(info: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((reason, int(count)) for reason, count in info.get("fallbacks", {}).items()))


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}×"


def markdown_table(header: Sequence[str], align: str, body: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines; `align` has one letter per column: l (left) or r (right)."""

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return [line(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align), *map(line, body)]


def console_table(title: str, header: Sequence[str], align: str, body: Iterable[Sequence[str]]) -> Table:
    """The same table for the terminal (cells may carry rich markup)."""
    table = Table(title=title)
    for col, a in zip(header, align, strict=True):
        table.add_column(col, justify="right" if a == "r" else "left")
    for cells in body:
        table.add_row(*cells)
    return table


TWIN_SUFFIXES = ("-cuda", "-alone")  # a CUDA provider; a party timed over passes of its own (test_vllm_prep)


def reference_for(base: str, provider: str, present: set[str]) -> str | None:
    """The provider a ratio of `provider` divides by: `base`, or its twin of the same suffix (`TWIN_SUFFIXES`)."""
    for suffix in TWIN_SUFFIXES:
        if provider.endswith(suffix) and f"{base}{suffix}" in present:
            return f"{base}{suffix}"
    return base if base in present else None


def ordered(providers: set[str]) -> list[str]:
    return sorted(providers, key=lambda p: (PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER else 99, p))


def workload_key(r: Result) -> tuple[int, int, int, str]:
    return ({"decode": 0, "prefill": 1, "mixed": 2}.get(r.kind, 3), r.num_groups, r.num_reqs, r.workload)


def _interleaved_rows(info: dict[str, Any], rounds: int) -> list[Result]:
    """The rows of a benchmark that times each provider in alternating rounds and records their medians
    (benchmarks/test_vllm_prep.py: fast, spec and vLLM on the same live steps, its shape as requests and steps
    replayed; benchmarks/test_feature_steps.py: fast and spec, its shape as harness.record states it). The
    fallbacks are the benchmark's own provider's."""
    providers = [k[: -len("_median")] for k in info if k.endswith("_median") and "_over_" not in k]
    providers = [p for p in providers if p != "reference"]
    reference = info.get("reference")
    reference_median = info.get(f"{reference}_median")
    return [
        Result(
            stage=info["stage"],
            workload=info["workload"],
            kind=info.get("kind", "live vLLM steps"),
            provider=p,
            num_reqs=int(info.get("num_reqs", info.get("num_requests", 0))),
            num_tokens=int(info.get("num_tokens", info.get("num_steps", 0))),
            num_groups=int(info.get("num_groups", 0)),
            median=float(info[f"{p}_median"]),
            rounds=rounds,
            nbytes=0,
            flops=0,
            what=info.get("what", ""),
            reference=reference,
            reference_median=None if reference_median is None else float(reference_median),
            fallbacks=_fallbacks(info) if p == info.get("provider") else (),
            counted_steps=info.get("counted_steps") if p == info.get("provider") else None,
        )
        for p in providers
    ]
