"""`python -m slotmap`: the same command line as the `slotmap` script."""

from slotmap.cli import app

app(prog_name="slotmap")
