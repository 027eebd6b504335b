"""Sparse top-k attention through the differential suite, once per backend (conformance/sparse_compare.py): random
selections on the reference scheduler's steps, slots compared exactly, readers within tolerance, every
SparseIndexError rule refused identically. The Hypothesis suites run the same comparison on whatever scenarios
they draw; the seeds here make sure windowed groups, mla groups and fp8 caches run on every backend, and the
controls show the comparison fails on a backend whose sparse functions are wrong."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.differential import COUNTS, DifferentialRun, MismatchError, drive
from conformance.scenario import random_scenario
from spec.context_parallel import ContextParallel
from spec.sparse_topk import SPARSE_INDEX_ERRORS, ReleasedBlockIndexError, _rank_slots
from spec.types import BatchInputs, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py

# random_scenario(seed, spec_decode=True, mla=True): an mla group beside a windowed attention group (1: fp8 e4m3;
# 20: the window's group first; 40: fp8 e5m2), an mla group alone (36: a NoPE latent in float16), attention
# groups only (0, 3)
SEEDS = (0, 1, 3, 20, 36, 40)
SLOW_SEEDS = (20, 40)
BREAKABLE = {e.__name__ for e in SPARSE_INDEX_ERRORS if e is not ReleasedBlockIndexError}  # break_topk's five


def _drive(seeds: tuple[int, ...], handle: BackendHandle, max_steps: int) -> int:
    steps = 0
    for seed in seeds:
        run = DifferentialRun(random_scenario(seed, spec_decode=True, mla=True), handle)
        drive(run, max_steps)
        steps += run.steps
    return steps


def test_the_seeds_cover_windows_mla_groups_and_fp8() -> None:
    scenarios = [random_scenario(seed, spec_decode=True, mla=True) for seed in SEEDS]
    groups = [g for s in scenarios for g in s.config.kv_groups]
    assert any(g.kind == "mla" for g in groups) and any(g.sliding_window for g in groups)
    assert any(g.kind == "attention" and not g.sliding_window for g in groups)
    assert {s.attention.kv_cache_dtype for s in scenarios if s.attention} >= {"auto", "fp8_e4m3", "fp8_e5m2"}


def test_sparse_selections_agree_on_every_step(backend: BackendHandle) -> None:
    """Slots exactly, both readers by the rule, and (on the full budget) every rule break_topk draws refused by
    both backends naming the same request, token and field."""
    before = COUNTS.copy()
    steps = _drive(SLOW_SEEDS if backend.slow else SEEDS, backend, 6 if backend.slow else 200)
    compared = COUNTS["sparse steps"] - before["sparse steps"]
    prefix = "sparse refused["
    refused = {k[len(prefix) : -1] for k in COUNTS if k.startswith(prefix) and COUNTS[k] > before[k]}
    assert steps >= (6 if backend.slow else 100) and compared >= (3 if backend.slow else 100)
    if not backend.slow:
        assert refused == BREAKABLE, refused


def _broken(name: str, **kernels: Callable[..., Any]) -> BackendHandle:
    """spec with some sparse functions replaced."""
    names = ("RequestStatePool", "write_kv", "paged_attention", "write_mla_kv", "mla_decode_attention",
             "mla_prefill_attention", "sparse_slot_mapping", "sparse_paged_attention",
             "sparse_mla_attention")  # fmt: skip
    module = types.SimpleNamespace(**{n: getattr(spec, n) for n in names})
    for key, fn in kernels.items():
        setattr(module, key, fn)
    return BackendHandle(name, module)


def _previous_rows_table(batch: BatchInputs, config: WorkerConfig, topk: np.ndarray, group: int = 0,
                         **kw: Any) -> np.ndarray:  # fmt: skip
    """Checked as spec checks it, then each selection mapped through the previous batch row's table
    (req_id_per_token off by one)."""
    spec.sparse_slot_mapping(batch, config, topk, group)
    tables = list(batch.block_tables)
    tables[group] = np.roll(tables[group], 1, axis=0)
    rolled = BatchInputs(**{**vars(batch), "block_tables": tuple(tables)})
    return _rank_slots(rolled, topk, group, config.kv_groups[group].block_size, ContextParallel(1, 0))


def _no_causality(batch: BatchInputs, config: WorkerConfig, topk: np.ndarray, group: int = 0, **kw: Any
                  ) -> np.ndarray:  # fmt: skip
    """Future indices let through as the query's own position (a check that clamps instead of refusing)."""
    return spec.sparse_slot_mapping(batch, config, np.minimum(topk, np.asarray(batch.positions)[:, None]), group)


def _minus_one_read(q: np.ndarray, q_pe: np.ndarray, cache: np.ndarray, slots: np.ndarray, **kw: Any) -> np.ndarray:
    """The MLA reader with -1 read as the cache's last slot."""
    last = cache.shape[0] * cache.shape[1] - 1
    out = np.asarray(spec.sparse_mla_attention(q, q_pe, cache, np.where(slots < 0, last, slots), **kw))
    return out


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_broken("previous-row", sparse_slot_mapping=_previous_rows_table), r"sparse_slot_mapping\[\d\]: int64 slots"),
        (_broken("no-causality", sparse_slot_mapping=_no_causality), r"candidate accepted .*FutureIndexError"),
        (_broken("minus-one-read", sparse_mla_attention=_minus_one_read), r"sparse_mla_attention\[\d\]"),
    ],
    ids=["previous-row", "no-causality", "minus-one-read"],
)
def test_a_wrong_sparse_function_is_caught(broken: BackendHandle, message: str) -> None:
    """Controls on seed 1 (an mla group beside a windowed attention group)."""
    with pytest.raises(MismatchError, match=message):
        _drive((1, 20), broken, 200)
