"""Captured graphs in fast: the dispatch is spec's (spec/graphs.py), a host decision on host counts.

Which graph a batch replays depends on its token count, its request count and its classification
(fast/classify.py), all on the host before anything is launched, so fast decides it with spec's code and no
device read; the padding it asks for is written into fast's reused buffers (fast/padding.py).
"""

from __future__ import annotations

from spec.graphs import GRAPH_MODES, RUNTIME_MODES, BatchDescriptor, CapturedGraphs, check_descriptor, dispatch

__all__ = ["GRAPH_MODES", "RUNTIME_MODES", "BatchDescriptor", "CapturedGraphs", "check_descriptor", "dispatch"]
