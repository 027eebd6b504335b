"""The `slotmap` command: each subcommand checks its options, then calls the part of slotmap that does the work.

Options are checked by the callbacks of slotmap/cli/options.py while typer parses them, so a misuse
ends in one line saying what to pass instead (exit status 2) before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from slotmap.cli import options

app = typer.Typer(
    help="slotmap: how a paged-KV engine turns a scheduler's decision into GPU inputs.", no_args_is_help=True
)

Backend = Annotated[str, typer.Option(help=options.BACKEND_HELP, callback=options.backend)]


def _version(show: bool) -> None:
    if show:
        from slotmap import __version__

        typer.echo(f"slotmap {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Show, simulate, check and benchmark the paged-KV input pipeline."""


@app.command()
def demo(backend: Backend = "spec") -> None:
    """Print the source article's worked example (state rows, batch, flat tokens, slots), then a short simulation."""
    from conformance.backends import load_backend
    from slotmap.pictures.demo import render_step
    from slotmap.pictures.steps import worked_example_step

    console = Console()
    render_step(worked_example_step(load_backend(backend)), console)
    console.rule("the same pipeline under a scheduler: a short `slotmap simulate`")
    _simulate(backend, requests=16, seed=0, verify_every=4, dense_check=True, plot=None, console=console)


@app.command()
def explain(
    backend: Backend = "spec",
    seed: Annotated[int | None, typer.Option(help="a step of a random workload from the reference scheduler")] = None,
    step: Annotated[int | None, typer.Option(min=1, help="which step, from 1 (default: 2, or 4 with --seed)")] = None,
    pad_to: Annotated[int | None, typer.Option(min=1, help="pad the step's tokens to this count")] = None,
    svg: Annotated[
        Path | None, typer.Option(callback=options.suffix("svg"), help="also draw the step as an SVG picture here")
    ] = None,
    png: Annotated[
        Path | None, typer.Option(callback=options.suffix("png"), help="also draw the step as a PNG picture here")
    ] = None,
    spec_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="with --seed: the scheduler drafts up to K tokens per request (speculative "
            "decoding); the step shows which tokens are drafts, their slots and logits rows",
        ),
    ] = 0,
    cp: Annotated[
        int,
        typer.Option(
            min=1,
            help="also show each rank's slots under decode context parallelism over N ranks (the "
            "pool's block of a group without a sliding window is the virtual block of N ranks' blocks)",
        ),
    ] = 1,
    interleave: Annotated[int, typer.Option(min=1, help="with --cp: consecutive positions per rank's turn")] = 1,
    async_scheduling: Annotated[
        bool,
        typer.Option(
            "--async",
            help="with --seed: steps scheduled one ahead of the samples; shows the step's "
            "pending tokens, whose input id is the previous step's sample",
        ),
    ] = False,
    encoder_decoder: Annotated[
        bool,
        typer.Option(
            help="with --seed: an encoder-decoder model; shows each request's encoder length and the "
            "cross-attention slots its encoder output is written to on its first step"
        ),
    ] = False,
    mrope: Annotated[
        bool,
        typer.Option(
            "--mrope",
            help="with --seed: a multimodal model with M-RoPE; shows each token's three "
            "position rows (temporal, height, width) and whether they come from its table or p + delta",
        ),
    ] = False,
    hybrid: Annotated[
        bool,
        typer.Option(
            "--hybrid",
            help="with --seed: a hybrid model with a Mamba state group; shows the state block "
            "each request starts from and the ones it writes (its drafts' too)",
        ),
    ] = False,
    graphs: Annotated[
        str | None,
        typer.Option(
            "--graphs",
            callback=options.graph_sizes,
            help="prepare with captured graphs of these token counts (e.g. 1,2,4,8,16): shows the descriptor the "
            "step replays, each row's class, and the padding rows and tokens",
        ),
    ] = None,
    graph_mode: Annotated[
        str | None,
        typer.Option(callback=options.graph_mode, help="with --graphs: the cudagraph mode (FULL_AND_PIECEWISE)"),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            callback=options.profile,
            help="with --graphs: what padded request rows hold: flashattention (default), flashinfer, flashmla",
        ),
    ] = None,
    ubatch: Annotated[
        bool, typer.Option("--ubatch", help="also show the step split into two micro-batches (dual-batch overlap)")
    ] = False,
    split_at: Annotated[
        int | None,
        typer.Option(help="with --ubatch: the first flat token of the second half (default: padded tokens // 2)"),
    ] = None,
    mla: Annotated[
        bool,
        typer.Option(
            "--mla",
            help="an MLA model (its full-attention group an mla group): shows the latent blocks and the MLA "
            "decode/prefill split",
        ),
    ] = False,
    topk: Annotated[
        int,
        typer.Option(min=0, help="with --mla: the batch's last token selects K positions (seeded), shown with slots"),
    ] = 0,
) -> None:
    """Show one step in the four index spaces: state rows, batch, flat tokens, each token's path to its slot."""
    from conformance.backends import load_backend
    from slotmap.pictures import steps
    from slotmap.pictures.cross import explain_cross, render_cross
    from slotmap.pictures.explanation import explain_step
    from slotmap.pictures.mamba import explain_mamba, render_mamba
    from slotmap.pictures.mrope import explain_mrope, render_mrope
    from slotmap.pictures.terminal import render

    for flag, given, why in (
        ("--async", async_scheduling, "is synchronous"),
        ("--spec-tokens", spec_tokens, "has no drafts"),
        ("--encoder-decoder", encoder_decoder, "is decoder-only"),
        ("--mrope", mrope, "has no position tables"),
        ("--hybrid", hybrid, "has no mamba group"),
    ):
        if given and seed is None:
            raise typer.BadParameter(f"{flag} needs --seed (the worked example {why})")
    for flag, given, needs in (
        ("--graph-mode", graph_mode is not None, "--graphs"),
        ("--profile", profile is not None, "--graphs"),
        ("--split-at", split_at is not None, "--ubatch"),
        ("--topk", topk, "--mla"),
    ):
        if given and not {"--graphs": graphs, "--ubatch": ubatch, "--mla": mla}[needs]:
            raise typer.BadParameter(f"{flag} needs {needs}")
    if graphs is not None and pad_to is not None:
        raise typer.BadParameter("--pad-to and --graphs are two answers to how far to pad: give one")
    handle = load_backend(backend)
    config = steps.SEEDED_CONFIG if seed is not None else steps.worked_example().config
    captured = None
    if graphs is not None:
        captured = steps.captured_graphs(
            config, options.sizes_of(graphs), graph_mode or "FULL_AND_PIECEWISE",
            options.PROFILE_NAMES[profile or "flashattention"], spec_tokens,
        )  # fmt: skip
    try:
        if seed is None:
            view = steps.worked_example_step(handle, 2 if step is None else step, pad_to, captured, mla)
        else:
            view = steps.seeded_step(
                handle, seed, step, pad_to, spec_tokens, async_scheduling, encoder_decoder, mrope=mrope, hybrid=hybrid,
                graphs=captured, mla=mla,
            )  # fmt: skip
    except ValueError as e:  # a step past the schedule, or a pad_to below the step's tokens
        raise typer.BadParameter(str(e)) from e
    split = mla_view = None
    if ubatch:
        from slotmap.pictures.ubatch import explain_ubatch

        try:
            split = explain_ubatch(view, split_at)
        except ValueError as e:  # spec's UbatchSplitError: a split point past the batch, a record it cannot split
            raise typer.BadParameter(str(e), param_hint="--split-at" if split_at is not None else "--ubatch") from e
    if mla:
        from slotmap.pictures.mla import explain_mla

        mla_view = explain_mla(view, topk)
    ex = explain_step(view)
    console = Console()
    render(ex, console)
    if captured is not None:
        from slotmap.pictures.graphs import render_graphs

        render_graphs(ex, console, captured.profile.pad_seq_len)
    families: list[tuple[bool, Callable[[steps.StepView], Any], Callable[[Any, Console], None]]] = [
        (encoder_decoder, explain_cross, render_cross),
        (mrope, explain_mrope, render_mrope),
        (hybrid, explain_mamba, render_mamba),
    ]
    for wanted, explain_family, render_family in families:
        found = explain_family(view) if wanted else None
        if found is not None:  # None: the step has nothing of the family to show
            render_family(found, console)
    if async_scheduling:
        from slotmap.pictures.terminal import render_pending

        render_pending(view, console)
    if cp > 1 or interleave > 1:
        from slotmap.pictures.ranks import explain_ranks, render_ranks

        try:
            ranks = explain_ranks(view, cp, interleave)
        except ValueError as e:  # a block size the ranks cannot split
            raise typer.BadParameter(str(e)) from e
        render_ranks(ranks, console)
    if split is not None:
        from slotmap.pictures.ubatch import render_ubatch

        render_ubatch(split, console)
    if mla_view is not None:
        from slotmap.pictures.mla import render_mla

        render_mla(mla_view, console)
    for path, fmt in ((svg, "svg"), (png, "png")):
        if path is not None:
            from slotmap.pictures.drawing import save_picture

            save_picture(ex, path, fmt, ubatch=split, mla=mla_view)
            console.print(f"wrote {path}")


@app.command()
def explore(
    out: Annotated[
        Path, typer.Option("--out", "-o", callback=options.suffix("html"), help="write the page here (.html)")
    ] = Path("explore.html"),
    seed: Annotated[
        int | None, typer.Option(min=0, help="a reference-scheduler workload (default: the articles' worked example)")
    ] = None,
    requests: Annotated[int, typer.Option(min=1, help="with --seed: requests in the workload")] = 6,
    spec_tokens: Annotated[
        int, typer.Option(min=0, help="with --seed: the scheduler drafts up to K tokens per request")
    ] = 0,
    reuse_freed_first: Annotated[
        bool,
        typer.Option(
            help="with --seed: freed blocks are handed out first, as vLLM's allocator does (a block a "
            "window released comes straight back, even to the same request)"
        ),
    ] = False,
    step: Annotated[int | None, typer.Option(min=1, help="the step the page opens at (default: the first)")] = None,
    graphs: Annotated[
        str | None,
        typer.Option(
            "--graphs",
            callback=options.graph_sizes,
            help="prepare every step with captured graphs of these token counts (e.g. 4,8,16,32): the page draws "
            "the padding tokens and padded request rows",
        ),
    ] = None,
    graph_mode: Annotated[
        str | None,
        typer.Option(callback=options.graph_mode, help="with --graphs: the cudagraph mode (FULL_AND_PIECEWISE)"),
    ] = None,
    ubatch: Annotated[bool, typer.Option("--ubatch", help="mark each step's micro-batch split")] = False,
    mla: Annotated[bool, typer.Option("--mla", help="an MLA model: its full-attention group an mla group")] = False,
    screenshot: Annotated[
        Path | None,
        typer.Option(callback=options.suffix("png"), help="also save a picture of the page as it opens (Chromium)"),
    ] = None,
) -> None:
    """Write one self-contained HTML page that walks a run step by step: pick any token, see its path to its slot."""
    from dataclasses import replace

    from slotmap.explore import seeded_run, worked_example_run, write_page

    if seed is None and (spec_tokens or requests != 6 or reuse_freed_first):
        raise typer.BadParameter(
            "--requests, --spec-tokens and --reuse-freed-first need --seed (the worked example is fixed)"
        )
    if graph_mode is not None and graphs is None:
        raise typer.BadParameter("--graph-mode needs --graphs")
    captured = None
    if graphs is not None:
        from slotmap.pictures.steps import SEEDED_CONFIG, captured_graphs, worked_example

        config = SEEDED_CONFIG if seed is not None else worked_example().config
        mode = graph_mode or "FULL_AND_PIECEWISE"
        captured = captured_graphs(config, options.sizes_of(graphs), mode, spec_tokens=spec_tokens)
    if seed is None:
        run = worked_example_run(captured, ubatch, mla)
    else:
        run = seeded_run(seed, requests, spec_tokens, reuse_freed_first, graphs=captured, ubatch=ubatch, mla=mla)
    if step is not None:
        if step > len(run.steps):
            raise typer.BadParameter(f"the run has {len(run.steps)} steps, got --step {step}", param_hint="--step")
        run = replace(run, start_step=step)
    if screenshot is not None:
        from slotmap.explore.browser import BrowserUnavailableError, find_browser

        try:
            find_browser()
        except BrowserUnavailableError as e:
            raise typer.BadParameter(str(e), param_hint="--screenshot") from e
    size = write_page(run, out)
    console = Console()
    console.print(f"wrote {out}: {len(run.steps)} steps, {size / 1024:.0f} KiB; open it in a browser")
    if screenshot is not None:
        from slotmap.explore.browser import screenshot as take_screenshot

        take_screenshot(out, screenshot)
        console.print(f"wrote {screenshot}")


@app.command()
def simulate(
    backend: Backend = "fast",
    requests: Annotated[int, typer.Option(min=1, help="requests in the synthetic workload")] = 200,
    seed: Annotated[int, typer.Option(min=0, help="workload and scheduler seed")] = 0,
    verify_every: Annotated[int, typer.Option(min=0, help="replay every K-th step through spec (0: never)")] = 10,
    dense_check: Annotated[bool, typer.Option(help="recompute every finished request densely and compare")] = True,
    plot: Annotated[
        Path | None,
        typer.Option(callback=options.figure, help="save batch composition and KV block usage here (.png, .svg, ...)"),
    ] = None,
    spec_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="speculative decoding: up to K n-gram drafts per request per step, checked to "
            "generate exactly the tokens of plain greedy decoding (0: off)",
        ),
    ] = 0,
) -> None:
    """Run a synthetic workload through scheduler -> pool -> a tiny decoder, verifying against spec as it goes."""
    _simulate(backend, requests, seed, verify_every, dense_check, plot, Console(), spec_tokens)


def _simulate(
    backend: str,
    requests: int,
    seed: int,
    verify_every: int,
    dense_check: bool,
    plot: Path | None,
    console: Console,
    spec_tokens: int = 0,
) -> None:
    from slotmap.simulate.report import render_report
    from slotmap.simulate.run import SimulateOptions, run_simulation

    options = SimulateOptions(backend, requests, seed, verify_every, dense_check, spec_tokens=spec_tokens)
    report = run_simulation(options, console)
    render_report(report, console)
    if plot is not None:
        from slotmap.simulate.plot import save_plot

        save_plot(report, plot)
        console.print(f"plot saved to {plot}")
    if not report.all_matched:
        raise typer.Exit(1)


@app.command()
def check(
    backend: Backend = "fast",
    steps: Annotated[int, typer.Option(min=1, help="scheduler steps to compare against spec")] = 2000,
    seed: Annotated[int, typer.Option(min=0, help="seed of the scenarios (configs, workloads, scheduler knobs)")] = 0,
    invalid_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="share of steps sent broken first")] = 0.2,
    repro: Annotated[
        Path | None,
        typer.Option(callback=options.new_file, help="on a mismatch, also write the reproduction to this new file"),
    ] = None,
) -> None:
    """Differential check of a backend against spec on seeded scheduler runs; exit status 1 on any difference."""
    from slotmap.cli.check import CheckOptions, check_command

    run = CheckOptions(backend=backend, steps=steps, seed=seed, invalid_share=invalid_share, repro=repro)
    if not check_command(run, Console()):
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option(help="the CI subset only (fewer sizes, short timing)")] = False,
    save: Annotated[
        bool,
        typer.Option(help="publish: pin threads, keep the JSON in benchmarks/results/, re-render docs/performance.md"),
    ] = False,
    render_only: Annotated[bool, typer.Option(help="run nothing: re-render the page from the kept JSON")] = False,
    budget: Annotated[
        float | None, typer.Option(callback=options.positive, help="seconds of timing per benchmark (0.5; quick: 0.05)")
    ] = None,
    machine: Annotated[
        str | None, typer.Option(callback=options.machine, help="results file name (default: CPU or GPU model, cores)")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch/OpenMP threads (default: torch's choice; with --save: 1)")
    ] = None,
) -> None:
    """Benchmark spec, fast and the baselines into a scratch folder and print the targets table.

    Nothing in the repository changes unless --save is given. Extra arguments go to pytest (e.g. `-k host_step`).
    """
    from slotmap.bench.run import BenchOptions
    from slotmap.bench.run import main as bench_main

    if save and quick:
        raise typer.BadParameter("a published run is the full sweep: drop --quick", param_hint="--save")

    bench_main(BenchOptions(quick, save, render_only, budget, machine, threads, list(ctx.args)), Console())
