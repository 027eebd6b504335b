"""`slotmap simulate --plot PATH`: batch composition and KV block usage over the run, one picture."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display

import matplotlib.pyplot as plt

from slotmap.simulate.report import SimulationReport


def save_plot(report: SimulationReport, path: Path) -> None:
    steps = list(range(1, len(report.step_stats) + 1))
    fig, (tokens_ax, blocks_ax) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    tokens_ax.stackplot(
        steps,
        [s.decode_tokens for s in report.step_stats],
        [s.prefill_tokens for s in report.step_stats],
        [s.padding_tokens for s in report.step_stats],
        labels=["decode tokens", "prefill / recompute tokens", "padding"],
        colors=["#4c72b0", "#dd8452", "#c7c7c7"],
    )
    tokens_ax.axhline(report.config.max_num_batched_tokens, color="black", lw=0.8, ls="--", label="token budget")
    tokens_ax.set_ylabel("tokens per step")
    tokens_ax.set_title(f"batch composition ({report.backend}, {report.steps} steps)")
    tokens_ax.legend(loc="upper right", fontsize="small")

    usage_steps = list(range(1, len(report.block_usage) + 1))
    for g, group in enumerate(report.config.kv_groups):
        window = f", window {group.sliding_window}" if group.sliding_window else ""
        blocks_ax.plot(
            usage_steps,
            [u[g] / (group.num_blocks - 1) for u in report.block_usage],
            label=f"group {g} (block size {group.block_size}{window})",
        )
    blocks_ax.set_ylim(0, 1.05)
    blocks_ax.set_ylabel("KV blocks in use (fraction)")
    blocks_ax.set_xlabel("step")
    blocks_ax.set_title(f"KV block usage ({report.preemptions} preemptions)")
    blocks_ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
