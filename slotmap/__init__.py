"""The `slotmap` command line and what it shows: the tiny model and engine (`tiny/`), one step as tables
and pictures (`pictures/`), the simulation (`simulate/`), the benchmark pages (`bench/`), and the
typer app itself (`cli/`)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("slotmap")
except PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"
