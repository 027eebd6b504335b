"""pytest-benchmark suites: spec vs fast vs the baselines a user would otherwise pick, per stage and size.

Run `slotmap bench` (or the pytest commands in docs/performance.md); results go to benchmarks/results/.
"""
