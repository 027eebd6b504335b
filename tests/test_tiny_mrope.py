"""The tiny decoder with M-RoPE (spec/mrope.py): greedy output through the pipeline equals the dense recompute.

The rotary embedding reads the three position rows (mrope_section (2, 3, 3) of the 8 frequency pairs); the
dense recompute rotates the whole sequence by its table and then p + delta (sequence_mrope_positions), so
a chunk cut at the wrong column, a delta that changed between chunks or a decode row given plain positions
moves the logits far past the tolerance (the control test shows it does).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conformance.backends import BackendHandle, load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, Workload, WorkloadRequest
from conformance.scheduler.mrope import position_table
from slotmap.simulate.dense_check import check_request
from slotmap.tiny.engine import Engine, RequestRecord, drive
from slotmap.tiny.model import ModelConfig
from spec.types import BatchInputs, KVCacheGroup, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


CONFIG = WorkerConfig(4, 48, 16, 512, (KVCacheGroup(4, 48),), uses_mrope=True)
MODEL = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, layer_groups=(0, 0), mrope_section=(2, 3, 3))
KNOBS = SchedulerKnobs(max_chunk=5)  # every prompt of more than 5 tokens is prefilled in chunks


def _workload() -> Workload:
    rng = random.Random(5)  # a seed whose three tables all hold a grid
    requests = []
    for i, (prompt_len, image) in enumerate(((18, True), (13, True), (6, False), (11, True))):
        table, delta = position_table(prompt_len, rng) if image else (None, 0)
        prompt = tuple(rng.randrange(CONFIG.vocab_size) for _ in range(prompt_len))
        requests.append(WorkloadRequest(f"r{i}", i // 2, prompt, 6, mrope_positions=table, mrope_position_delta=delta))
    return Workload(tuple(requests))


def _run(backend: BackendHandle) -> tuple[Engine, list[RequestRecord], list[SchedulerOutput]]:
    engine = Engine(backend, CONFIG, MODEL)
    records: list[RequestRecord] = []
    outs: list[SchedulerOutput] = []
    drive(engine, ReferenceScheduler(CONFIG, _workload(), KNOBS, seed=0), on_step=lambda out, _: outs.append(out),
          on_finished=records.append)  # fmt: skip
    return engine, records + engine.finish(set(engine.requests)), outs


def test_the_workload_has_grids_chunks_and_mixed_steps() -> None:
    """What the dense test below relies on: tables that are not plain positions, chunked prefill, and decode
    rows of multimodal requests beside prefill rows."""
    tables = [r.mrope_positions for r in _workload().requests if r.mrope_positions is not None]
    assert all(np.asarray(t).tolist() != [list(range(len(t[0])))] * 3 for t in tables)
    _, records, outs = _run(load_backend("spec"))
    multimodal = {r.req_id for r in records if r.mrope_positions is not None}
    chunked = {r.req_id for r in records for entry in r.logits if entry.sampled is None}
    assert multimodal & chunked == multimodal
    prompt_len = {r.req_id: len(r.prompt) for r in records}
    mixed = [
        out for out in outs
        if any(c.req_id in multimodal and c.num_computed_tokens >= prompt_len[c.req_id] for c in out.cached_requests)
        and any(n > 1 for n in out.num_scheduled_tokens.values())
    ]  # fmt: skip
    assert mixed


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: conformance/test_mrope.py runs the kernel")
def test_multimodal_requests_under_chunked_prefill_match_dense(backend: BackendHandle) -> None:
    engine, records, _ = _run(backend)
    assert len(records) == 4
    for record in records:
        check = check_request(engine.model, record)
        assert check.ok, check.failures
        assert check.tokens_checked == len(record.tokens) - len(record.prompt) > 0


def test_the_dense_check_catches_plain_positions_on_a_decode_row() -> None:
    """Control: a multimodal request's decode row given plain positions (SGLang PR #11330's bug) fails the check."""
    engine = Engine(load_backend("spec"), CONFIG, MODEL)
    real_prepare = engine.pool.prepare

    def plain_decode_rows(sched: SchedulerOutput, pad: int | None = None) -> BatchInputs:
        batch = real_prepare(sched, pad)
        for b, req_id in enumerate(batch.req_ids):
            start, end = batch.query_start_loc[b], batch.query_start_loc[b + 1]
            if req_id == "r0" and batch.positions[start] >= 18:  # r0's decode rows: positions past its prompt
                batch.mrope_positions[:, start:end] = batch.positions[start:end]
        return batch

    engine.pool.prepare = plain_decode_rows  # type: ignore[method-assign,assignment]
    records: list[RequestRecord] = []
    drive(engine, ReferenceScheduler(CONFIG, _workload(), KNOBS, seed=0), on_finished=records.append)
    checks = {r.req_id: check_request(engine.model, r) for r in records + engine.finish(set(engine.requests))}
    assert not checks["r0"].ok and checks["r0"].max_error > 1000 * checks["r0"].tolerance
    assert checks["r2"].ok  # the text request is untouched
