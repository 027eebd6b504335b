"""What a simulation measured and checked, and its summary tables."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from slotmap.simulate.dense_check import DenseCheck
from slotmap.simulate.speculative import SpeculativeComparison
from slotmap.simulate.verify import SpecVerifier
from slotmap.tiny.engine import STAGES, StepStats
from spec.types import WorkerConfig


@dataclass
class SimulationReport:
    backend: str
    config: WorkerConfig
    steps: int = 0
    seconds: float = 0.0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_stats: list[StepStats] = field(default_factory=list)
    block_usage: list[list[int]] = field(default_factory=list)  # per step: blocks in use per group
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    verifier: SpecVerifier | None = None
    dense: list[DenseCheck] = field(default_factory=list)
    speculative: SpeculativeComparison | None = None  # with --spec-tokens: drafts, acceptance, plain-run equality

    @property
    def all_matched(self) -> bool:
        checks = (self.verifier is None or self.verifier.all_matched) and all(c.ok for c in self.dense)
        return checks and (self.speculative is None or self.speculative.identical)


def render_report(report: SimulationReport, console: Console) -> None:
    table = Table(title=f"slotmap simulate --backend {report.backend}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    engine_seconds = sum(report.stage_seconds.get(s, 0.0) for s in STAGES if s != "verify")
    table.add_row("steps", str(report.steps))
    table.add_row("requests finished", str(report.finished))
    table.add_row("tokens scheduled / generated", f"{report.scheduled_tokens} / {report.generated_tokens}")
    table.add_row("wall time", f"{report.seconds:.2f} s")
    if engine_seconds > 0:
        rate = report.scheduled_tokens / engine_seconds
        table.add_row("tokens/s (scheduled, excluding verification)", f"{rate:,.0f}")
    padding = sum(s.padding_tokens for s in report.step_stats)
    table.add_row("padding tokens", str(padding))
    table.add_row("preemptions", str(report.preemptions))
    hit_rate = report.prefix_hit_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    table.add_row("prefix-cache hits", f"{report.prefix_hit_tokens} tokens ({hit_rate:.1%} of prompt tokens)")
    for g, group in enumerate(report.config.kv_groups):
        usage = [u[g] for u in report.block_usage] or [0]
        real = group.num_blocks - 1
        window = f", window {group.sliding_window}" if group.sliding_window else ""
        table.add_row(
            f"KV group {g} blocks in use (of {real}{window})",
            f"mean {sum(usage) / len(usage) / real:.0%}, peak {max(usage) / real:.0%}",
        )
    if report.verifier is not None:
        v = report.verifier
        table.add_row(
            f"verified against spec (every {v.every} steps)",
            f"{v.steps_checked} steps, worst logit error {v.worst_ratio:.2f} x bound: "
            + ("all matched" if v.all_matched else f"{len(v.mismatches)} MISMATCHES"),
        )
    if report.dense:
        bad = [c for c in report.dense if not c.ok]
        worst = max(c.max_error / c.tolerance for c in report.dense)
        table.add_row(
            "dense recompute (every request, every token)",
            f"{len(report.dense)} requests, worst error {worst:.1e} x tolerance: "
            + ("all matched" if not bad else f"{len(bad)} FAILED"),
        )
    if report.speculative is not None:
        sc = report.speculative
        table.add_row(
            f"speculative decoding (n-gram drafts, up to {sc.spec_tokens})",
            f"acceptance {sc.acceptance_rate:.1%} ({sc.accepted} of {sc.drafts} drafts), "
            f"{sc.speculative_steps} steps vs {sc.plain_steps} without drafts",
        )
        table.add_row(
            "tokens identical to plain greedy decoding",
            f"{sc.requests_compared} requests: "
            + ("all identical" if sc.identical else f"{len(sc.differences)} DIFFER"),
        )
    table.add_row("every checked step matched", "[green]yes[/]" if report.all_matched else "[red]NO[/]")
    console.print(table)

    split = Table(title="time per stage")
    for col in ("stage", "seconds", "share"):
        split.add_column(col, justify="right" if col != "stage" else "left")
    total = sum(report.stage_seconds.values()) or 1.0
    for stage in (*STAGES, "dense check"):
        seconds = report.stage_seconds.get(stage, 0.0)
        split.add_row(stage, f"{seconds:.3f}", f"{seconds / total:.1%}")
    console.print(split)
    problems = (report.verifier.mismatches if report.verifier else []) + [f for c in report.dense for f in c.failures]
    problems += report.speculative.differences if report.speculative else []
    for line in problems[:10]:
        console.print(f"[red]{line}[/]")
