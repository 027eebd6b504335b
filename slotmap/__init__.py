"""The `slotmap` command line: demo, explain, simulate, check, bench."""
