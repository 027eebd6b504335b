"""Sparse top-k slot mapping (spec/sparse_topk.py, fast/sparse_topk.py): hand-derived slots, every refusal,
and spec == fast (exactly) on reference-scheduler runs with a random indexer, DCP ranks included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fast
import fast.runtime
import spec
from conformance.context_parallel import CP_KNOBS, cp_worker_config, owner_slot
from conformance.sparse_topk import random_topk, scheduled_batches
from spec.context_parallel import ContextParallel
from spec.sparse_topk import (
    DuplicateIndexError,
    FutureIndexError,
    InvalidIndexError,
    PaddingIndexError,
    ReleasedBlockIndexError,
    SparseIndexError,
    WindowIndexError,
)
from spec.types import BatchInputs, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

BACKENDS = ("spec", "fast")


def _batch(which: str, config: WorkerConfig, out: SchedulerOutput, pad_to: int | None) -> BatchInputs:
    pool = spec.RequestStatePool(config) if which == "spec" else fast.RequestStatePool(config)
    pool.apply(out)
    return pool.prepare(out, pad_to)


def _map(which: str, batch: BatchInputs, config: WorkerConfig, topk: np.ndarray, group: int = 0,
         cp: ContextParallel | None = None) -> np.ndarray:  # fmt: skip
    if which == "spec":
        return spec.sparse_slot_mapping(batch, config, topk, group, cp=cp)
    return fast.sparse_slot_mapping(batch, config, torch.from_numpy(topk), group, cp=cp).numpy()


# B (2 tokens, block 9) sorts before A (8 tokens, blocks 3 and 7); 10 tokens padded to 12; block size 4.
HAND_CONFIG = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 16),))
HAND_OUT = SchedulerOutput(
    new_requests=(NewRequest("A", tuple(range(1, 9)), ((3, 7),)), NewRequest("B", (5, 6), ((9,),))),
    num_scheduled_tokens={"A": 8, "B": 2},
)


def _hand_topk() -> np.ndarray:
    topk = np.full((12, 3), -1, np.int32)
    topk[0] = [0, -1, -1]  # B at position 0 reads itself
    topk[1] = [-1, 1, 0]  # B at position 1
    topk[2] = [-1, 0, -1]  # A at position 0
    topk[9] = [7, 4, 3]  # A at position 7: both of its blocks
    return topk


@pytest.mark.parametrize("which", BACKENDS)
def test_slots_by_hand(which: str) -> None:
    batch = _batch(which, HAND_CONFIG, HAND_OUT, 12)
    got = _map(which, batch, HAND_CONFIG, _hand_topk())
    expected = np.full((12, 3), -1, np.int64)
    expected[0] = [9 * 4 + 0, -1, -1]
    expected[1] = [-1, 9 * 4 + 1, 9 * 4 + 0]
    expected[2] = [-1, 3 * 4 + 0, -1]
    expected[9] = [7 * 4 + 3, 7 * 4 + 0, 3 * 4 + 3]
    assert got.dtype == np.int64
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("which", BACKENDS)
def test_dcp_slots_by_hand(which: str) -> None:
    """World 2, interleave 1, rank block 4 (the pool's virtual block 8): even positions live on rank 0, odd on 1;
    a rank's k-th entry of a virtual block is offset k of its own block of the same id."""
    config = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(8, 16),))
    out = SchedulerOutput(
        new_requests=(NewRequest("A", tuple(range(1, 11)), ((3, 7),)),), num_scheduled_tokens={"A": 10}
    )
    batch = _batch(which, config, out, None)
    topk = np.full((10, 3), -1, np.int32)
    topk[9] = [9, 6, 1]  # position 9: virtual block 7 offset 1; position 6: block 3 offset 6; 1: block 3 offset 1
    rank0 = _map(which, batch, config, topk, cp=ContextParallel(2, 0))
    rank1 = _map(which, batch, config, topk, cp=ContextParallel(2, 1))
    assert rank0[9].tolist() == [-1, 3 * 4 + 3, -1]
    assert rank1[9].tolist() == [7 * 4 + 0, -1, 3 * 4 + 0]
    assert (rank0[:9] == -1).all() and (rank1[:9] == -1).all()


def _window_case(backend: str) -> tuple[BatchInputs, WorkerConfig]:
    """Window 4, block 4: A resumes at position 8 with its first block released (the null placeholder)."""
    config = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 16, sliding_window=4),))
    out = SchedulerOutput(
        new_requests=(NewRequest("A", tuple(range(1, 13)), ((0, 5, 6),), num_computed_tokens=8),),
        num_scheduled_tokens={"A": 4},
    )
    return _batch(backend, config, out, 6), config


@pytest.mark.parametrize("which", BACKENDS)
def test_window_slots_by_hand(which: str) -> None:
    batch, config = _window_case(which)
    topk = np.full((6, 2), -1, np.int32)
    topk[0] = [5, 8]  # position 8 reads 5..8
    topk[3] = [11, 8]  # position 11 reads 8..11
    got = _map(which, batch, config, topk)
    assert got[0].tolist() == [5 * 4 + 1, 6 * 4 + 0] and got[3].tolist() == [6 * 4 + 3, 6 * 4 + 0]


# (rule's error, token, column, the index planted there, request or None) on the hand batch; each alone.
HAND_ERRORS = [
    (PaddingIndexError, 11, 2, 0, None),  # a padded token selects position 0
    (InvalidIndexError, 5, 1, -2, "A"),
    (FutureIndexError, 5, 0, 4, "A"),  # token 5 is A at position 3
    (FutureIndexError, 0, 2, 1, "B"),  # B at position 0 reads position 1
    (DuplicateIndexError, 9, 2, 7, "A"),  # row 9 already lists 7 in column 0
]


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize(("error", "token", "column", "index", "req_id"), HAND_ERRORS)
def test_each_rule_is_refused_naming_request_token_and_field(
    which: str, error: type[SparseIndexError], token: int, column: int, index: int, req_id: str | None
) -> None:
    batch = _batch(which, HAND_CONFIG, HAND_OUT, 12)
    topk = _hand_topk()
    topk[token, column] = index
    with pytest.raises(error) as caught:
        _map(which, batch, HAND_CONFIG, topk)
    e = caught.value
    assert type(e) is error and isinstance(e, ValueError)
    assert (e.req_id, e.token, e.field) == (req_id, token, f"topk_indices[{token}, {column}]")
    assert f"token {token}" in str(e) and f"topk_indices[{token}, {column}]" in str(e)
    if req_id is not None:
        assert repr(req_id) in str(e)


@pytest.mark.parametrize("which", BACKENDS)
def test_an_index_outside_the_window_is_refused(which: str) -> None:
    batch, config = _window_case(which)
    topk = np.full((6, 2), -1, np.int32)
    topk[1] = [9, 5]  # position 9 reads 6..9: 5 is outside (and its block is held: the window alone refuses it)
    with pytest.raises(WindowIndexError) as caught:
        _map(which, batch, config, topk)
    assert (caught.value.req_id, caught.value.token, caught.value.field) == ("A", 1, "topk_indices[1, 1]")
    topk[1] = [9, 3]  # in the released first block: outside the window first (rule order)
    with pytest.raises(WindowIndexError):
        _map(which, batch, config, topk)


@pytest.mark.parametrize("which", BACKENDS)
def test_an_index_on_a_block_the_request_does_not_hold_is_refused(which: str) -> None:
    """A batch whose table entry is the null block (or narrower than the index): the only rule that stands
    between the index and a read of the null block, or of a block past the table."""
    batch = _batch(which, HAND_CONFIG, HAND_OUT, 12)
    table = batch.block_tables[0]
    nulled = table.copy() if isinstance(table, np.ndarray) else table.clone()
    nulled[1, 1] = 0  # A's second block
    topk = _hand_topk()
    with pytest.raises(ReleasedBlockIndexError) as caught:
        _map(which, dataclasses.replace(batch, block_tables=(nulled,)), HAND_CONFIG, topk)
    assert (caught.value.req_id, caught.value.token, caught.value.field) == ("A", 9, "topk_indices[9, 0]")
    with pytest.raises(ReleasedBlockIndexError, match="past"):
        _map(which, dataclasses.replace(batch, block_tables=(table[:, :1],)), HAND_CONFIG, topk)


@pytest.mark.parametrize("which", BACKENDS)
def test_bad_arguments_are_refused(which: str) -> None:
    batch = _batch(which, HAND_CONFIG, HAND_OUT, 12)
    with pytest.raises(ValueError, match="topk_indices"):
        _map(which, batch, HAND_CONFIG, _hand_topk()[:10])  # a row per padded token too
    with pytest.raises(ValueError, match="int32 or int64"):
        _map(which, batch, HAND_CONFIG, _hand_topk().astype(np.int16))
    with pytest.raises(ValueError, match="group"):
        _map(which, batch, HAND_CONFIG, _hand_topk(), group=1)
    mamba = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 16), KVCacheGroup(4, 16, kind="mamba")))
    with pytest.raises(ValueError, match="mamba"):
        _map(which, batch, mamba, _hand_topk(), group=1)


SEEDS = [(0, None), (1, 2), (2, 1), (3, 2)]  # (seed, interleave with world 2, or None: no DCP)


@pytest.mark.parametrize(("seed", "interleave"), SEEDS)
def test_spec_and_fast_agree_on_scheduled_runs(seed: int, interleave: int | None) -> None:
    """Both groups of cp_worker_config (a sharded full-attention group and a replicated window group), every rank,
    random selections within each query's reach: the slots are equal, int64, and (an independent derivation)
    each selected position's owner rank holds it at conformance.context_parallel.owner_slot's slot, the other
    ranks -1."""
    config = cp_worker_config(2, interleave or 1)
    rng = np.random.default_rng(seed)
    cps = [None] if interleave is None else [ContextParallel(2, r, interleave) for r in range(2)]
    pools = [spec.RequestStatePool(config), fast.RequestStatePool(config)]
    steps = 0
    for spec_batch, fast_batch in scheduled_batches(config, seed, pools, 10, CP_KNOBS):
        for g, kv_group in enumerate(config.kv_groups):
            topk = random_topk(spec_batch.positions, spec_batch.num_tokens, 5, kv_group.sliding_window, rng)
            per_rank = []
            for cp in cps:
                want = spec.sparse_slot_mapping(spec_batch, config, topk, g, cp=cp)
                got = fast.sparse_slot_mapping(fast_batch, config, torch.from_numpy(topk), g, cp=cp)
                assert got.dtype == torch.int64 and np.array_equal(got.numpy(), want), (steps, g, cp)
                per_rank.append(want)
            _check_owners(spec_batch, config, g, topk, per_rank, cps)
        steps += 1
    assert steps >= 6


def _check_owners(batch: BatchInputs, config: WorkerConfig, g: int, topk: np.ndarray, per_rank: list[np.ndarray],
                  cps: list[ContextParallel | None]) -> None:  # fmt: skip
    qsl = np.asarray(batch.query_start_loc)
    block_size = config.kv_groups[g].block_size
    for t in range(topk.shape[0]):
        b = int(np.searchsorted(qsl[1:], t, side="right"))
        for j, idx in enumerate(topk[t]):
            slots = [int(s[t, j]) for s in per_rank]
            if idx < 0:
                assert slots == [-1] * len(slots)
                continue
            row = np.asarray(batch.block_tables[g])[b]
            cp = cps[0]
            if cp is None or not cp.is_sharded(g):
                assert slots == [int(row[idx // block_size]) * block_size + idx % block_size] * len(slots)
                continue
            owner, slot = owner_slot(int(idx), row, block_size // cp.world_size, cp)
            assert slots == [slot if r == owner else -1 for r in range(cp.world_size)], (t, j, int(idx))


def test_the_triton_kernel_maps_a_tiny_batch_as_spec() -> None:
    """fast's index conversion through Triton's interpreter (the DCP slot kernel on the selected positions)."""
    batch = _batch("fast", HAND_CONFIG, HAND_OUT, 12)
    with fast.runtime.interpret(True):
        got = fast.sparse_slot_mapping(batch, HAND_CONFIG, torch.from_numpy(_hand_topk()))
    want = spec.sparse_slot_mapping(_batch("spec", HAND_CONFIG, HAND_OUT, 12), HAND_CONFIG, _hand_topk())
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("which", BACKENDS)
def test_an_mla_group_maps_as_an_attention_group(which: str) -> None:
    """The slots do not depend on what a slot holds: an mla group (a latent per slot) maps like HAND_CONFIG's."""
    mla = WorkerConfig(4, 32, 32, 100, (KVCacheGroup(4, 16, kind="mla", kv_lora_rank=8, qk_rope_head_dim=2),))
    got = _map(which, _batch(which, mla, HAND_OUT, 12), mla, _hand_topk())
    want = _map(which, _batch(which, HAND_CONFIG, HAND_OUT, 12), HAND_CONFIG, _hand_topk())
    assert np.array_equal(got, want) and (got >= 0).sum() == 7
