"""The `slotmap` command. Each subcommand lives in its own module; this file only wires them up."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="slotmap: how a paged-KV engine turns a scheduler's decision into GPU inputs.", no_args_is_help=True
)

BACKEND_HELP = "spec, fast, fast-interpret, or module:factory"


@app.callback()
def main() -> None:
    """Show, simulate, check and benchmark the paged-KV input pipeline."""


@app.command()
def demo(backend: str = typer.Option("spec", help=BACKEND_HELP)) -> None:
    """Print the articles' worked example: state rows, batch, flat tokens, slots."""
    from conformance.backends import load_backend
    from slotmap.pictures.demo import render_step
    from slotmap.pictures.steps import worked_example_step

    render_step(worked_example_step(load_backend(backend)), Console())
    from slotmap.simulate.run import SimulateOptions, simulate_command

    console = Console()
    console.rule("the same pipeline under a scheduler: a short `slotmap simulate`")
    if not simulate_command(SimulateOptions(backend=backend, requests=16, verify_every=4), console):
        raise typer.Exit(1)


@app.command()
def explain(
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "spec",
    seed: Annotated[int | None, typer.Option(help="a step of a random workload from the reference scheduler")] = None,
    step: Annotated[int | None, typer.Option(help="which step, from 1 (default: 2, or 4 with --seed)")] = None,
    pad_to: Annotated[int | None, typer.Option(help="pad the step's tokens to this count")] = None,
    svg: Annotated[Path | None, typer.Option(help="also draw the step as an SVG picture here")] = None,
    png: Annotated[Path | None, typer.Option(help="also draw the step as a PNG picture here")] = None,
) -> None:
    """Show one step in the four index spaces: state rows, batch, flat tokens, each token's path to its slot."""
    from slotmap.pictures.explanation import explain_command

    explain_command(backend, seed, step, pad_to, svg, png, Console())


@app.command()
def simulate(
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "fast",
    requests: Annotated[int, typer.Option(min=1, help="requests in the synthetic workload")] = 200,
    seed: Annotated[int, typer.Option(help="workload and scheduler seed")] = 0,
    verify_every: Annotated[int, typer.Option(min=0, help="replay every K-th step through spec (0: never)")] = 10,
    dense_check: Annotated[bool, typer.Option(help="recompute every finished request densely and compare")] = True,
    plot: Annotated[Path | None, typer.Option(help="save batch composition and KV block usage here")] = None,
) -> None:
    """Run a synthetic workload through scheduler -> pool -> a tiny decoder, verifying against spec as it goes."""
    from slotmap.simulate.run import SimulateOptions, simulate_command

    options = SimulateOptions(backend, requests, seed, verify_every, dense_check, plot)
    if not simulate_command(options, Console()):
        raise typer.Exit(1)


@app.command()
def check(
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "fast",
    steps: Annotated[int, typer.Option(min=1, help="scheduler steps to compare against spec")] = 2000,
    seed: Annotated[int, typer.Option(help="seed of the scenarios (configs, workloads, scheduler knobs)")] = 0,
    invalid_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="share of steps sent broken first")] = 0.2,
    repro: Annotated[Path | None, typer.Option(help="on a mismatch, also write the reproduction here")] = None,
) -> None:
    """Differential check of a backend against spec on seeded scheduler runs; exit status 1 on any difference."""
    from slotmap.cli.check import CheckOptions, check_command

    options = CheckOptions(backend=backend, steps=steps, seed=seed, invalid_share=invalid_share, repro=repro)
    if not check_command(options, Console()):
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option(help="the CI subset only; results go to a scratch folder")] = False,
    render_only: Annotated[bool, typer.Option(help="re-render docs/performance.md from saved JSON only")] = False,
    budget: Annotated[float | None, typer.Option(help="seconds of timing per benchmark (0.5; quick: 0.05)")] = None,
    machine: Annotated[str | None, typer.Option(help="results file name (default: CPU or GPU model and cores)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch/OpenMP threads (default: torch's choice)")] = None,
) -> None:
    """Benchmark spec, fast and the baselines; save benchmarks/results/<machine>.json; render docs/performance.md.

    Extra arguments go to pytest (e.g. `-k host_step`).
    """
    from slotmap.bench.run import main as bench_main

    bench_main(quick, render_only, budget, machine, threads, list(ctx.args))


if __name__ == "__main__":
    app()
