"""The feature workloads are the shapes they are named for: benchmarks/test_feature_steps.py times what they hold.

A recording that drifted (no drafts rejected, no encoder output, no mamba group) would time a plain step under the
feature's name; the benchmark itself checks only that fast and spec end in the same state.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.feature_trace import Trace, record_trace
from benchmarks.feature_workloads import FEATURE_WORKLOADS, FeatureWorkload
from spec.types import PLACEHOLDER_TOKEN_ID

QUICK = [w for w in FEATURE_WORKLOADS if w.quick]
STEPS = 12


@pytest.fixture(scope="module", params=QUICK, ids=lambda w: w.name)
def trace(request: pytest.FixtureRequest) -> Trace:
    workload: FeatureWorkload = request.param
    return record_trace(workload, STEPS)


def test_every_steady_step_runs_every_decode_and_the_warm_up_prefills(trace: Trace) -> None:
    w = trace.workload
    assert len(trace.steady) == STEPS and trace.warmup
    for step in trace.steady:
        out = step.out
        assert (len(out.new_requests), len(out.cached_requests), len(out.finished_req_ids)) == w.steady_shape
        assert all(1 <= out.num_scheduled_tokens[c.req_id] <= 1 + w.drafts for c in out.cached_requests)
        assert step.sampled.shape[0] == len(out.num_scheduled_tokens)
    assert any(len(s.out.new_requests) for s in trace.warmup)


def test_the_config_has_the_feature_the_workload_is_named_for(trace: Trace) -> None:
    w, config = trace.workload, trace.config
    kinds = [g.kind for g in config.kv_groups]
    assert config.async_scheduling == w.name.endswith(("-async", "-async-drafts"))
    if w.model == "hybrid":
        assert kinds == ["attention", "mamba"]
    if w.model == "window":
        assert config.one_block_pool and [g.sliding_window for g in config.kv_groups] == [None, 1024]
    if w.model == "encdec":
        assert kinds == ["attention", "cross_attention"]
        assert all(r.encoder_len > 0 for s in trace.steady for r in s.out.new_requests)
    assert config.uses_mrope == (w.model == "mm")
    if w.model == "mm":
        assert all(r.mrope_positions is not None for s in trace.steady for r in s.out.new_requests)


def test_drafts_are_placeholders_and_some_are_rejected() -> None:
    (w,) = [w for w in QUICK if w.drafts]
    trace = record_trace(w, 40)
    drafted = kept = 0
    for step in trace.steady:
        drafts = step.out.scheduled_spec_decode_tokens
        assert all(set(d) == {PLACEHOLDER_TOKEN_ID} for d in drafts.values())  # proposed on the device
        assert step.proposed is not None and step.proposed.shape == (len(step.out.num_scheduled_tokens), w.drafts)
        drafted += sum(map(len, drafts.values()))
        kept += int(np.count_nonzero(step.sampled != PLACEHOLDER_TOKEN_ID)) - step.sampled.shape[0]
    assert 0 < kept < drafted  # some drafts kept, some rejected: the next step's counts are corrected
