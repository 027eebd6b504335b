"""`slotmap bench`: run the benchmark suites, keep their JSON, render docs/performance.md and the targets table."""
