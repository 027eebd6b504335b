"""The `slotmap` command. Each subcommand lives in its own module; this file only wires them up."""

from __future__ import annotations

import typer
from rich.console import Console

app = typer.Typer(help="slotmap: how a paged-KV engine turns a scheduler's decision into GPU inputs.", no_args_is_help=True)

BACKEND_HELP = "spec, fast, fast-interpret, or module:factory"


@app.callback()
def main() -> None:
    """Show, simulate, check and benchmark the paged-KV input pipeline."""


@app.command()
def demo(backend: str = typer.Option("spec", help=BACKEND_HELP)) -> None:
    """Print the articles' worked example: state rows, batch, flat tokens, slots."""
    from conformance.backends import load_backend
    from slotmap.demo import render_step
    from slotmap.steps import worked_example_step

    render_step(worked_example_step(load_backend(backend)), Console())


if __name__ == "__main__":
    app()
