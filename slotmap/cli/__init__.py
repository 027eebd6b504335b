"""The `slotmap` command line (typer): only option parsing, checking and printing; the work lives beside it."""

from slotmap.cli.app import app

__all__ = ["app"]
