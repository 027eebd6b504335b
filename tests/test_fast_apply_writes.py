"""Kernel 1 (fast.kernels.apply_writes) and its CPU torch twin: packed step writes land exactly where they say.

Two levels: random packed writes against a plain-loop NumPy reference, and whole scheduler runs where
the device state after every apply must equal spec's pool state (tables, counts, progress, tokens),
and every prepared batch spec's batch (so kernel 2 runs on real pool states too).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import fast
import spec
from conformance.backends import BackendHandle, to_numpy
from conformance.differential import one_torch_thread
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler
from fast.runtime import HAVE_TRITON, interpret
from fast.state import DeviceState
from fast.writes import StepWrites, apply_writes
from shadow.compare import batch_differences
from spec.types import KVCacheGroup, WorkerConfig

SPEC, FAST = BackendHandle("spec", spec), BackendHandle("fast", fast, to_numpy=to_numpy)
MODES = [pytest.param(True, marks=[pytest.mark.interpret], id="interpret"), pytest.param(False, id="host")]
if not HAVE_TRITON:
    MODES = MODES[1:]


def _random_state(rng: np.random.Generator) -> DeviceState:
    groups = tuple(KVCacheGroup(int(rng.choice([1, 2, 5])), 1000) for _ in range(rng.integers(1, 4)))
    config = WorkerConfig(int(rng.integers(1, 6)), int(rng.integers(1, 300)), 64, 1000, groups)
    dev = DeviceState(config, torch.device("cpu"))
    dev.reserve_tokens(config.max_model_len)  # the token array grows on demand: make all of it writable here
    dev.token_ids.copy_(torch.from_numpy(rng.integers(0, 1000, dev.token_ids.shape)))
    dev.tables.copy_(torch.from_numpy(rng.integers(0, 1000, dev.tables.shape, dtype=np.int32)))
    dev.num_blocks.copy_(torch.from_numpy(rng.integers(0, 50, dev.num_blocks.shape, dtype=np.int32)))
    dev.num_computed.copy_(torch.from_numpy(rng.integers(0, 1000, dev.num_computed.shape)))
    return dev


def _random_writes(dev: DeviceState, rng: np.random.Generator) -> StepWrites:
    config = dev.config
    rows, groups = config.max_num_reqs, len(config.kv_groups)
    data: list[int] = []
    table_ops = []
    for flat in rng.permutation(rows * groups)[: rng.integers(0, rows * groups + 1)]:  # distinct (row, group)
        row, g = divmod(int(flat), groups)
        width = int(dev.widths_np[g])
        lo = int(rng.integers(0, width + 1))
        hi = int(rng.integers(lo, width + 1))
        table_ops.append([row, g, lo, hi, int(rng.integers(0, width + 1)), len(data)])
        data += rng.integers(0, 1000, hi - lo).tolist()
    token_ops = []
    for row in rng.permutation(rows)[: rng.integers(0, rows + 1)]:  # one run per row: a prompt, or drafts past it
        column = int(rng.integers(0, config.max_model_len))
        length = int(rng.integers(1, config.max_model_len - column + 1))
        token_ops.append([int(row), column, length, len(data)])
        data += rng.integers(0, 1000, length).tolist()
    computed_rows = rng.permutation(rows)[: rng.integers(0, rows + 1)]
    computed = np.stack([computed_rows, rng.integers(0, 1000, computed_rows.size)], axis=1)
    return StepWrites(
        np.array(table_ops, np.int64).reshape(-1, 6),
        np.array(token_ops, np.int64).reshape(-1, 4),
        computed.astype(np.int64).reshape(-1, 2),
        np.array(data, np.int64),
    )


def _reference(dev: DeviceState, writes: StepWrites) -> dict[str, np.ndarray]:
    """The packed layout's meaning, one entry at a time."""
    tables = [dev.table(g).numpy().copy() for g in range(len(dev.config.kv_groups))]
    num_blocks = dev.num_blocks.numpy().copy()
    tokens = dev.token_ids.numpy().copy()
    computed = dev.num_computed.numpy().copy()
    for row, g, lo, hi, count, src in writes.table_ops.tolist():
        for col in range(lo, hi):
            tables[g][row, col] = writes.data[src + col - lo]
        num_blocks[g, row] = count
    for row, column, length, src in writes.token_ops.tolist():
        for col in range(length):
            tokens[row, column + col] = writes.data[src + col]
    for row, value in writes.computed.tolist():
        computed[row] = value
    return {"tables": np.concatenate([t.reshape(-1) for t in tables]), "num_blocks": num_blocks,
            "token_ids": tokens, "num_computed": computed}  # fmt: skip


@pytest.mark.interpret
@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")
@pytest.mark.parametrize("seed", range(12))
def test_packed_writes_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dev = _random_state(rng)
    writes = _random_writes(dev, rng)
    want = _reference(dev, writes)
    with interpret(True):  # kernel 1 runs only where device state is separate from the host mirror
        apply_writes(dev, writes)
    for name, expected in want.items():
        got = getattr(dev, name)
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=name)


def _assert_device_matches_spec(pool: fast.RequestStatePool, reference: spec.RequestStatePool) -> None:
    state, dev = reference.state, pool.dev
    for g, table in enumerate(state.block_tables):  # whole tables: stale tails must be zero too
        np.testing.assert_array_equal(dev.table(g).numpy(), table)
    np.testing.assert_array_equal(dev.num_blocks.numpy(), state.num_blocks)
    np.testing.assert_array_equal(dev.num_computed.numpy(), state.num_computed_tokens)
    for row, req_id in enumerate(state.req_ids):
        if req_id is not None:
            n = int(state.num_known_tokens[row])
            np.testing.assert_array_equal(dev.token_ids[row, :n].numpy(), reference.token_ids[row, :n])


def _assert_batches_equal(got: spec.BatchInputs, want: spec.BatchInputs) -> None:
    problems = batch_differences(SPEC.batch_to_numpy(want), FAST.batch_to_numpy(got))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_device_state_follows_spec_through_a_run(mode: bool, seed: int) -> None:
    scenario = random_scenario(seed)
    config = scenario.config
    scheduler = ReferenceScheduler(config, scenario.workload, scenario.knobs, scenario.seed)
    rng = random.Random(seed)
    with interpret(mode), one_torch_thread():
        reference, pool = spec.RequestStatePool(config), fast.RequestStatePool(config)  # the pool takes the mode
        assert pool.host_mode is not mode  # kernels: separate device state, so their writes are what is checked
        for _ in range(25):
            if scheduler.done():
                break
            out = scheduler.schedule()
            reference.apply(out)
            pool.apply(out)
            _assert_device_matches_spec(pool, reference)
            pad_to = scheduler.pad_to(out)
            batch_ref, batch = reference.prepare(out, pad_to), pool.prepare(out, pad_to)
            _assert_batches_equal(batch, batch_ref)
            sampled = np.array([rng.randrange(config.vocab_size) for _ in batch.req_ids], np.int64)
            reference.record_sampled(batch_ref, sampled)
            pool.record_sampled(batch, torch.from_numpy(sampled))
            takes = scheduler.sampling_req_ids(out)
            scheduler.update(out, {r: int(t) for r, t in zip(batch.req_ids, sampled, strict=True) if r in takes})
        _assert_device_matches_spec(pool, reference)
