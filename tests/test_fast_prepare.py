"""Kernels 2+3 (fast.kernels.prepare) and the compiled CPU path (fast.flatten, fast.slots) against spec, exactly.

Device state is random (the kernel does not care whether tables are valid), so every index path is hit:
several groups with block sizes that are not powers of two, unsorted index_mapping, padding. The int64
case puts slots past 2**31 without allocating any KV cache (the pool holds only tables).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fast
import spec.flatten
import spec.slots
from fast.flatten import flatten
from fast.kernels.prepare import output_sizes, prepare_triton
from fast.records import new_batch, new_plan, record_maker
from fast.runtime import HAVE_TRITON, interpret
from fast.slots import tables_and_slots
from fast.state import DeviceState
from spec.state import StepPlan
from spec.types import KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")


def _random_case(seed: int) -> tuple[DeviceState, dict[str, np.ndarray], int]:
    rng = np.random.default_rng(seed)
    groups = tuple(
        KVCacheGroup(int(rng.choice([1, 3, 4, 5, 16])), int(rng.integers(2, 1000))) for _ in range(rng.integers(1, 4))
    )
    rows, max_model_len = int(rng.integers(1, 6)), int(rng.integers(1, 40))
    config = WorkerConfig(rows, max_model_len, 10_000, 1000, groups)
    dev = DeviceState(config, torch.device("cpu"))
    dev.reserve_tokens(config.max_model_len)  # the token array grows on demand: make all of it writable here
    dev.token_ids.copy_(torch.from_numpy(rng.integers(0, 1000, (rows, max_model_len))))
    for g, group in enumerate(groups):
        _fill_table(dev, g, rng.integers(0, group.num_blocks, dev.table(g).shape, dtype=np.int32), rng)
    num_reqs = int(rng.integers(0, rows + 1))
    index_mapping = rng.permutation(rows)[:num_reqs].astype(np.int32)  # batch_idx -> req_state_idx
    num_scheduled = rng.integers(1, max_model_len + 1, num_reqs).astype(np.int32)
    num_computed = np.zeros(rows, np.int64)
    num_computed[index_mapping] = rng.integers(0, max_model_len - num_scheduled + 1)
    dev.num_computed.copy_(torch.from_numpy(num_computed))
    padded = int(num_scheduled.sum()) + int(rng.integers(0, 6))
    return dev, {"index_mapping": index_mapping, "num_scheduled": num_scheduled}, padded


def _fill_table(dev: DeviceState, g: int, ids: np.ndarray, rng: np.random.Generator) -> None:
    """Group g's table [R, width] from `ids`, each row filled to a random count and null past it, as the pool keeps
    every table (spec/state.py's commit): the host path copies only the filled entries."""
    counts = rng.integers(0, ids.shape[1] + 1, ids.shape[0])
    ids = np.where(np.arange(ids.shape[1]) < counts[:, None], ids, 0).astype(np.int32)
    dev.table(g).copy_(torch.from_numpy(ids))
    dev.num_blocks[g].copy_(torch.from_numpy(counts.astype(np.int64)))


def _expected(dev: DeviceState, index_mapping: np.ndarray, num_scheduled: np.ndarray, padded: int) -> dict:
    flat = spec.flatten.flatten(index_mapping, num_scheduled, dev.num_computed.numpy(), dev.token_ids.numpy(), padded)
    tables = [dev.table(g).numpy() for g in range(len(dev.config.kv_groups))]
    return {
        "positions": flat.positions,
        "input_ids": flat.input_ids,
        "seq_lens": flat.seq_lens,
        "logits_indices": flat.logits_indices,
        "block_tables": [spec.slots.gather_block_tables(t, index_mapping) for t in tables],
        "slot_mappings": [
            spec.slots.slot_mapping(t, flat.token_rows, flat.positions, g.block_size)
            for t, g in zip(tables, dev.config.kv_groups, strict=True)
        ],
    }


def _assert_same(name: str, got: torch.Tensor, want: np.ndarray) -> None:
    assert str(got.dtype).removeprefix("torch.") == str(want.dtype), name
    np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def _batch_tensor(index_mapping: np.ndarray, num_scheduled: np.ndarray) -> torch.Tensor:
    query_start_loc = np.concatenate([[0], np.cumsum(num_scheduled)])
    return torch.from_numpy(np.concatenate([index_mapping, num_scheduled, query_start_loc]).astype(np.int32))


@needs_triton
@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(10))
def test_prepare_kernel_matches_spec(seed: int) -> None:
    dev, arrays, padded = _random_case(seed)
    index_mapping, num_scheduled = arrays["index_mapping"], arrays["num_scheduled"]
    want = _expected(dev, index_mapping, num_scheduled, padded)
    n = len(index_mapping)
    size64, size32 = output_sizes(dev, n, padded)
    # reused buffers, longer than the step needs and stale everywhere: every entry of the step's part is written
    out64, out32 = torch.full((size64 + 5,), -7, dtype=torch.int64), torch.full((size32 + 3,), -7, dtype=torch.int32)
    with interpret(True):
        out = prepare_triton(
            dev, _batch_tensor(index_mapping, num_scheduled), n, int(num_scheduled.sum()), padded, out64, out32
        )
    for name in ("positions", "input_ids", "seq_lens", "logits_indices"):
        _assert_same(name, getattr(out, name), want[name])
    for g in range(len(dev.config.kv_groups)):
        _assert_same(f"block_tables[{g}]", out.block_tables[g], want["block_tables"][g])
        _assert_same(f"slot_mappings[{g}]", out.slot_mappings[g], want["slot_mappings"][g])


@pytest.mark.parametrize("seed", range(10))
def test_cpu_path_matches_spec(seed: int) -> None:
    dev, arrays, padded = _random_case(seed)
    index_mapping, num_scheduled = arrays["index_mapping"], arrays["num_scheduled"]
    want = _expected(dev, index_mapping, num_scheduled, padded)
    rows, counts = index_mapping.astype(np.int64), num_scheduled.astype(np.int64)
    n, num_tokens = rows.size, int(counts.sum())
    out32 = np.full(5 * n + 1, -7, np.int32)  # stale contents everywhere: every entry must be written
    positions, input_ids = np.full(padded, -7, np.int64), np.full(padded, -7, np.int64)
    token_rows = np.full(num_tokens, -7, np.int64)
    computed, tokens = dev.num_computed.numpy(), dev.token_ids.numpy()
    assert flatten(rows, counts, computed, tokens, out32, positions, input_ids, token_rows) == num_tokens
    _assert_same("positions", torch.from_numpy(positions), want["positions"])
    _assert_same("input_ids", torch.from_numpy(input_ids), want["input_ids"])
    for name, part in (("seq_lens", out32[3 * n + 1 : 4 * n + 1]), ("logits_indices", out32[4 * n + 1 :])):
        _assert_same(name, torch.from_numpy(part), want[name])
    np.testing.assert_array_equal(out32[2 * n : 3 * n + 1], np.concatenate([[0], counts.cumsum()]))
    groups = len(dev.config.kv_groups)
    tables = np.full(n * dev.total_width, -7, np.int32)  # stale: every entry must be written
    slots = np.full(groups * padded, -7, np.int64)
    held = np.full((groups * n, 3), -1, np.int64)  # unknown: every out row copied, and cleared past its count
    versions = np.zeros((groups, dev.config.max_num_reqs), np.int64)
    tables_and_slots(dev.tables.numpy(), dev.config.max_num_reqs, dev.offsets_np, dev.widths_np, dev.block_sizes_np,
                     dev.num_blocks.numpy().astype(np.int64), versions, rows, token_rows, positions, tables, held,
                     slots)  # fmt: skip
    for g, (off, width) in enumerate(zip(dev.offsets_np.tolist(), dev.widths_np.tolist(), strict=True)):
        got = tables[n * off : n * (off + width)].reshape(n, width)
        _assert_same(f"block_tables[{g}]", torch.from_numpy(got), want["block_tables"][g])
        _assert_same(f"slot_mappings[{g}]", torch.from_numpy(slots[g * padded : (g + 1) * padded]),
                     want["slot_mappings"][g])  # fmt: skip


def test_cpu_tables_reused_rows_are_current() -> None:
    """The host path's out rows are reused from call to call: a row whose table version did not move keeps its copy,
    every other is copied (filled entries only) and cleared past its new count where it held a longer table (another
    request in that batch place, a row whose table was replaced); an out row of unknown contents (-1) is cleared over
    its whole width. Here some rows keep their tables and version between calls and the rest change."""
    rng = np.random.default_rng(7)
    config = WorkerConfig(6, 64, 10_000, 1000, (KVCacheGroup(4, 500), KVCacheGroup(16, 300)))
    dev = DeviceState(config, torch.device("cpu"))
    n, width = 4, dev.total_width
    tables = np.full(n * width, -7, np.int32)  # stale everywhere before the first call
    held = np.full((2 * n, 3), -1, np.int64)
    versions = np.zeros((2, 6), np.int64)
    for step in range(16):
        for g, group in enumerate(config.kv_groups):
            before = dev.table(g).numpy().copy()
            _fill_table(dev, g, rng.integers(1, group.num_blocks, dev.table(g).shape, dtype=np.int32), rng)
            keep = rng.random(6) < 0.5  # these rows keep last step's table, and so its version
            dev.table(g).numpy()[keep] = before[keep]
            dev.num_blocks[g].numpy()[keep] = (before[keep] != 0).sum(axis=1)
            versions[g, ~keep] += 1
        rows = rng.permutation(6)[:n].astype(np.int64)
        positions, token_rows = np.zeros(n, np.int64), rows.copy()  # one token per request at position 0
        slots = np.zeros(2 * n, np.int64)
        tables_and_slots(dev.tables.numpy(), 6, dev.offsets_np, dev.widths_np, dev.block_sizes_np,
                         dev.num_blocks.numpy().astype(np.int64), versions, rows, token_rows, positions, tables, held,
                         slots)  # fmt: skip
        for g, (off, w) in enumerate(zip(dev.offsets_np.tolist(), dev.widths_np.tolist(), strict=True)):
            got = tables[n * off : n * (off + w)].reshape(n, w)
            want = spec.slots.gather_block_tables(dev.table(g).numpy(), rows)
            np.testing.assert_array_equal(got, want, err_msg=f"step {step} block_tables[{g}]")


def test_records_are_the_constructors_records() -> None:
    """fast builds its batches and plans without the frozen dataclass's __init__ (fast/records.py): each object must
    be the one the constructor builds, defaults and default factories included, still frozen, and a missing or
    unknown field still the constructor's error; a class with __post_init__ is refused."""
    for cls, make in ((spec.BatchInputs, new_batch), (StepPlan, new_plan)):
        fields = {f.name: object() for f in dataclasses.fields(cls)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # fmt: skip
        got, want = make(**fields), cls(**fields)
        assert type(got) is cls and got.__dict__ == want.__dict__
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.req_ids = ()  # type: ignore[misc]
        missing = next(iter(fields))
        with pytest.raises(TypeError, match=missing):
            make(**{k: v for k, v in fields.items() if k != missing})
        with pytest.raises(TypeError, match="not_a_field"):
            make(**fields, not_a_field=1)
    assert new_plan(**fields).features is not new_plan(**fields).features  # a factory's default, one per record
    with pytest.raises(TypeError, match="__post_init__"):
        record_maker(spec.KVCacheGroup)


HUGE_BLOCKS = 2**26 + 5  # with block_size 64: 2**32 + 320 slots


@pytest.mark.parametrize("mode", [pytest.param(True, marks=[needs_triton, pytest.mark.interpret]), False])
def test_slots_past_int32_are_exact(mode: bool) -> None:
    config = WorkerConfig(2, 256, 512, 100, (KVCacheGroup(64, HUGE_BLOCKS), KVCacheGroup(3, 200)))
    top = (HUGE_BLOCKS - 1, HUGE_BLOCKS - 3, 1, HUGE_BLOCKS - 2)  # near the top, and one small id
    prompt = tuple(i % 100 for i in range(200))
    sched = SchedulerOutput(
        new_requests=(NewRequest("x", prompt, (top, tuple(range(1, 68)))),),
        num_scheduled_tokens={"x": 200},
    )
    with interpret(mode):
        pool = fast.RequestStatePool(config)
        pool.apply(sched)
        batch = pool.prepare(sched, pad_to=203)
    want = [top[p // 64] * 64 + p % 64 for p in range(200)] + [-1, -1, -1]  # Python ints: no overflow
    assert max(want) > 2**32
    assert batch.slot_mappings[0].dtype == torch.int64
    assert batch.slot_mappings[0].tolist() == want
    assert batch.block_tables[0].tolist() == [list(top)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@needs_triton
@pytest.mark.interpret
def test_triton_prepare_hands_out_views_of_buffers_allocated_once() -> None:
    """Triton mode, as host mode: every batch array lives in the pool's persistent buffers, at the same address for
    every step of the same shape (what a CUDA graph replays), with this step's values (spec's)."""
    config = WorkerConfig(2, 16, 8, 50, (KVCacheGroup(4, 16), KVCacheGroup(2, 16, sliding_window=4)))
    first = SchedulerOutput(
        new_requests=(NewRequest("A", (1, 2, 3), ((1,), (1, 2))), NewRequest("B", (4, 5, 6), ((2,), (3, 4)))),
        num_scheduled_tokens={"A": 3, "B": 3},
    )
    with interpret(True):
        pools = {"spec": spec.RequestStatePool(config), "fast": fast.RequestStatePool(config, "cpu")}
        assert not pools["fast"].host_mode
        addresses: list[list[int]] = []
        for step in range(3):
            sched = first if step == 0 else _decode(step)
            batches = {}
            for name, pool in pools.items():
                pool.apply(sched)
                batches[name] = pool.prepare(sched)
            got, want = batches["fast"], batches["spec"]
            arrays = [got.positions, got.input_ids, got.seq_lens, *got.slot_mappings, *got.block_tables]
            for name in ("positions", "input_ids", "seq_lens", "query_start_loc", "index_mapping"):
                np.testing.assert_array_equal(getattr(got, name).numpy(), getattr(want, name), err_msg=name)
            for g in range(2):
                np.testing.assert_array_equal(got.slot_mappings[g].numpy(), want.slot_mappings[g])
            addresses.append([t.data_ptr() for t in (*arrays, got.index_mapping)])
            buffers = pools["fast"]._batch_buffers
            assert {_storage(t) for t in arrays} == {_storage(buffers.out64), _storage(buffers.out32)}
            assert _storage(got.index_mapping) == _storage(buffers.batch)
            for name, pool in pools.items():
                pool.record_sampled(batches[name], np.array([7, 8]))
    assert addresses[1] == addresses[2]  # two decode steps of one shape: the same addresses


def _decode(step: int) -> SchedulerOutput:
    """A and B decode one token each (positions 3, then 4, where both groups need a new block)."""
    from spec.types import CachedRequest

    a_blocks, b_blocks = (((3,), (5,)), ((4,), (6,))) if step == 2 else (None, None)
    return SchedulerOutput(
        cached_requests=(CachedRequest("A", 2 + step, a_blocks), CachedRequest("B", 2 + step, b_blocks)),
        num_scheduled_tokens={"A": 1, "B": 1},
    )


def test_cpu_batches_of_a_recent_shape_reuse_its_tensors_with_this_steps_values() -> None:
    """Host mode keeps the tensor views of the last few batch shapes (fast/host_prepare.py): a batch whose shape
    comes back after other shapes (a request leaves, another joins) gets the tensor objects of that shape's last
    batch, holding this step's values, spec's."""
    from spec.types import CachedRequest

    config = WorkerConfig(3, 16, 16, 50, (KVCacheGroup(16, 16),))
    pools = {"spec": spec.RequestStatePool(config), "fast": fast.RequestStatePool(config, "cpu")}
    assert pools["fast"].host_mode

    def decode(done: dict[str, int], finished: frozenset[str] = frozenset()) -> SchedulerOutput:
        return SchedulerOutput(
            cached_requests=tuple(CachedRequest(r, c) for r, c in done.items()),
            num_scheduled_tokens=dict.fromkeys(done, 1),
            finished_req_ids=finished,
        )

    steps = [
        SchedulerOutput(  # A, B and C: their prompts (the largest step: the buffers are not reallocated after it)
            new_requests=tuple(NewRequest(r, (1, 2, 3), ((b,),)) for r, b in (("A", 1), ("B", 2), ("C", 3))),
            num_scheduled_tokens={"A": 3, "B": 3, "C": 3},
        ),
        decode({"A": 3, "B": 3, "C": 3}),  # three rows, three tokens
        decode({"A": 4, "B": 4}, frozenset({"C"})),  # C leaves: two rows, two tokens
        SchedulerOutput(  # D joins in C's row: three rows, five tokens
            new_requests=(NewRequest("D", (7, 8, 9), ((4,),)),),
            cached_requests=(CachedRequest("A", 5), CachedRequest("B", 5)),
            num_scheduled_tokens={"A": 1, "B": 1, "D": 3},
        ),
        decode({"A": 6, "B": 6, "D": 3}),  # three rows, three tokens again
    ]
    got_batches = []
    for step, sched in enumerate(steps):
        batches = {}
        for name, pool in pools.items():
            pool.apply(sched)
            batches[name] = pool.prepare(sched)
        got, want = batches["fast"], batches["spec"]
        for name in ("index_mapping", "num_scheduled_tokens", "query_start_loc", "seq_lens", "positions", "input_ids",
                     "logits_indices"):  # fmt: skip
            np.testing.assert_array_equal(getattr(got, name).numpy(), getattr(want, name), err_msg=f"{step} {name}")
        np.testing.assert_array_equal(got.block_tables[0].numpy(), want.block_tables[0], err_msg=f"{step} tables")
        np.testing.assert_array_equal(got.slot_mappings[0].numpy(), want.slot_mappings[0], err_msg=f"{step} slots")
        got_batches.append(got)
        for name, pool in pools.items():
            pool.record_sampled(batches[name], np.array([10 + step] * len(sched.num_scheduled_tokens)))
    then, now = got_batches[1], got_batches[4]
    for name in ("index_mapping", "query_start_loc", "seq_lens", "positions", "input_ids", "logits_indices"):
        assert getattr(now, name) is getattr(then, name), name
    assert now.block_tables[0] is then.block_tables[0] and now.slot_mappings[0] is then.slot_mappings[0]
    assert now.positions.tolist() == [6, 6, 3]  # the reused tensors hold this step's values, not step 1's [3, 3, 3]
