"""spec.context_parallel and fast.context_parallel on their own: the formulas against the round-robin
definition, partial attention merged against single-rank attention, the merge's empty states, the errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fast.context_parallel as fast_cp
import spec.context_parallel as spec_cp
from conformance.context_parallel import owner_slot
from conformance.tolerance import assert_attention_close
from fast.runtime import interpret
from spec.attention import paged_attention
from spec.context_parallel import ContextParallel
from spec.types import PAD_SLOT_ID, KVCacheGroup, WorkerConfig


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ContextParallel, int, np.ndarray, np.ndarray, np.ndarray]:
    """(cp, bs, lens, query lens, gathered virtual tables) of a small batch; the tables' ids are distinct."""
    world = draw(st.sampled_from([1, 2, 3, 4]))
    interleave = draw(st.sampled_from([1, 2, 4]))
    bs = interleave * draw(st.integers(1, 2))
    cp = ContextParallel(world, draw(st.integers(0, world - 1)), interleave)
    lens = np.array(draw(st.lists(st.integers(1, 30), min_size=1, max_size=4)), np.int32)
    q_lens = np.array([draw(st.integers(1, int(n))) for n in lens], np.int32)
    width = int(-(-lens.max() // (bs * world)))
    ids = np.random.default_rng(draw(st.integers(0, 99))).permutation(np.arange(1, 1 + len(lens) * width))
    return cp, bs, lens, q_lens, ids.reshape(len(lens), width).astype(np.int32)


def _flat(lens: np.ndarray, q_lens: np.ndarray, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(positions [T], query_start_loc): each row's last q_len positions, then `pad` padding tokens."""
    positions = [np.arange(n - q, n) for n, q in zip(lens, q_lens, strict=True)] + [np.zeros(pad, np.int64)]
    return np.concatenate(positions).astype(np.int64), np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(0, 3))
def test_slots_lengths_and_positions_follow_the_round_robin_definition(layout, pad) -> None:
    cp, bs, lens, q_lens, tables = layout
    positions, qsl = _flat(lens, q_lens, pad)
    slots = spec_cp.cp_slot_mapping(positions, qsl, tables, bs, cp)
    rows = np.repeat(np.arange(len(lens)), q_lens)
    for t, row in enumerate(rows):
        owner, slot = owner_slot(int(positions[t]), tables[row], bs, cp)
        assert slots[t] == (slot if owner == cp.rank else PAD_SLOT_ID)
    assert np.all(slots[len(rows) :] == PAD_SLOT_ID)
    local = spec_cp.local_seq_lens(lens, cp)
    for r, n in enumerate(lens.tolist()):
        mine = [p for p in range(n) if owner_slot(p, tables[r], bs, cp)[0] == cp.rank]
        assert local[r] == len(mine)
        assert spec_cp.local_kv_positions(int(local[r]), cp).tolist() == mine
        # the rank's j-th entry lies at its j-th slot of the row's blocks: the rank's own paged sequence
        assert [owner_slot(p, tables[r], bs, cp)[1] for p in mine] == [
            int(tables[r, j // bs]) * bs + j % bs for j in range(len(mine))
        ]
    for mode in (False, True):
        with interpret(mode):
            got = fast_cp.cp_slot_mapping(
                torch.from_numpy(positions), torch.from_numpy(qsl), torch.from_numpy(tables), bs, cp
            )
        assert got.dtype == torch.int64 and np.array_equal(got.numpy(), slots), f"interpret={mode}"
    assert np.array_equal(fast_cp.local_seq_lens(torch.from_numpy(lens), cp).numpy(), local)
    assert np.array_equal(
        fast_cp.local_kv_positions(int(local[0]), cp).numpy(), spec_cp.local_kv_positions(int(local[0]), cp)
    )


@pytest.mark.parametrize("mode", [False, True], ids=["host", "interpret"])
def test_an_empty_batch_has_only_padding_on_every_rank(mode: bool) -> None:
    """A step that only finishes requests: no rows, maybe padded tokens; every slot PAD, every state empty."""
    cp = ContextParallel(2, 1)
    positions, qsl, table = np.zeros(3, np.int64), np.zeros(1, np.int32), np.zeros((0, 2), np.int32)
    assert np.all(spec_cp.cp_slot_mapping(positions, qsl, table, 4, cp) == PAD_SLOT_ID)
    with interpret(mode):
        slots = fast_cp.cp_slot_mapping(
            torch.from_numpy(positions), torch.from_numpy(qsl), torch.from_numpy(table), 4, cp
        )
    assert slots.tolist() == [PAD_SLOT_ID] * 3
    caches = torch.zeros((2, 3, 4, 1, 2))
    out, lse = fast_cp.partial_paged_attention(
        torch.ones((3, 1, 2)), caches[0], caches[1], torch.from_numpy(table), torch.zeros(0, dtype=torch.int32),
        torch.from_numpy(qsl), cp=cp, scale=1.0,
    )  # fmt: skip
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def _rank_caches(cp: ContextParallel, bs: int, lens: np.ndarray, tables: np.ndarray, kv: list[np.ndarray],
                 dtype: type) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Rank cp.rank's caches holding every position of every row (kv[row]: [L, 2, KV, D]), written at its slots."""
    heads, dim = kv[0].shape[2:]
    caches: np.ndarray = np.zeros((2, int(tables.max()) + 1, bs, heads, dim), dtype)
    for row, n in enumerate(lens):
        slots = spec_cp.cp_slot_mapping(np.arange(n), np.array([0, n], np.int32), tables[row : row + 1], bs, cp)
        mine = slots != PAD_SLOT_ID
        caches[:, slots[mine] // bs, slots[mine] % bs] = kv[row][mine].transpose(1, 0, 2, 3)
    return caches[0], caches[1]


@settings(max_examples=25, deadline=None)
@given(layouts(), st.sampled_from([None, 5.0]), st.integers(0, 99))
def test_merged_partials_equal_single_rank_attention(layout, softcap, seed) -> None:
    cp0, bs, lens, q_lens, tables = layout
    world, inter = cp0.world_size, cp0.interleave
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = 4, 2, 8
    kv = [rng.standard_normal((int(n), 2, kv_heads, dim)).astype(np.float32).astype(np.float64) for n in lens]
    positions, qsl = _flat(lens, q_lens, pad=1)
    query = rng.standard_normal((len(positions), heads, dim)).astype(np.float32).astype(np.float64)
    virtual = bs * world  # the single-rank layout: the pool's blocks of bs * world tokens
    full = np.zeros((2, int(tables.max()) + 1, virtual, kv_heads, dim))
    for row, n in enumerate(lens):
        p = np.arange(n)
        full[:, tables[row, p // virtual], p % virtual] = kv[row].transpose(1, 0, 2, 3)
    args = (tables, lens, qsl)
    ref64 = paged_attention(query, full[0], full[1], *args, scale=0.4, softcap=softcap)
    f32 = full.astype(np.float32)
    low = paged_attention(query.astype(np.float32), f32[0], f32[1], *args, scale=0.4, softcap=softcap)
    cps = [ContextParallel(world, r, inter) for r in range(world)]
    spec_parts = [spec_cp.partial_paged_attention(query, *_rank_caches(cp, bs, lens, tables, kv, np.float64), *args,
                                                  cp=cp, scale=0.4, softcap=softcap) for cp in cps]  # fmt: skip
    merged, lse = spec_cp.merge_attention_states(
        np.stack([o for o, _ in spec_parts]), np.stack([x for _, x in spec_parts])
    )
    np.testing.assert_allclose(merged, ref64, rtol=0, atol=1e-12)
    assert np.isfinite(lse[: qsl[-1]]).all() and np.all(lse[qsl[-1] :] == -np.inf)
    tq = torch.from_numpy(query.astype(np.float32))
    targs = [torch.from_numpy(a) for a in args]
    fast_parts = [
        fast_cp.partial_paged_attention(tq, *map(torch.from_numpy, _rank_caches(cp, bs, lens, tables, kv, np.float32)),
                                        *targs, cp=cp, scale=0.4, softcap=softcap)
        for cp in cps
    ]  # fmt: skip
    for (_, x), (_, fx) in zip(spec_parts, fast_parts, strict=True):
        assert fx.dtype == torch.float32 and np.array_equal(np.isinf(x), np.isinf(fx.numpy()))  # the same empty states
    fast_merged, _ = fast_cp.merge_attention_states(
        torch.stack([o for o, _ in fast_parts]), torch.stack([x for _, x in fast_parts])
    )
    assert_attention_close(fast_merged, ref64, low, "float32")


def test_merging_empty_states_gives_zero_and_minus_infinity_not_nan() -> None:
    """A query that no rank holds a key for (a padding row): every partial is empty (FlashInfer #4051)."""
    outputs = np.zeros((2, 3, 2, 4))
    lses = np.full((2, 3, 2), -np.inf)
    lses[1, 1] = 0.5  # token 1: rank 1 has keys, rank 0 none
    outputs[1, 1] = 7.0
    cases: list[tuple[Any, Any]] = [
        (spec_cp.merge_attention_states, np.asarray),
        (fast_cp.merge_attention_states, torch.from_numpy),
    ]
    for merge, wrap in cases:
        out, lse = (np.asarray(x) for x in merge(wrap(outputs), wrap(lses)))
        assert not np.isnan(out).any() and not np.isnan(lse).any()
        assert np.all(out[[0, 2]] == 0) and np.all(lse[[0, 2]] == -np.inf)
        assert np.all(out[1] == 7.0) and np.allclose(lse[1], 0.5)


def test_one_state_merges_to_itself_and_the_order_of_ranks_does_not_matter() -> None:
    rng = np.random.default_rng(3)
    outputs, lses = rng.standard_normal((3, 5, 2, 4)), rng.standard_normal((3, 5, 2))
    out, lse = spec_cp.merge_attention_states(outputs[:1], lses[:1])
    np.testing.assert_allclose(out, outputs[0], atol=1e-15)
    np.testing.assert_allclose(lse, lses[0], atol=1e-15)
    a = spec_cp.merge_attention_states(outputs, lses)
    b = spec_cp.merge_attention_states(outputs[::-1], lses[::-1])
    np.testing.assert_allclose(a[0], b[0], atol=1e-14)
    np.testing.assert_allclose(a[1], np.log(np.exp(lses).sum(axis=0)), atol=1e-14)


def _config(*groups: KVCacheGroup) -> WorkerConfig:
    return WorkerConfig(max_num_reqs=2, max_model_len=32, max_num_batched_tokens=8, vocab_size=10, kv_groups=groups)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ContextParallel(0, 0), "world_size"),
        (lambda: ContextParallel(2, 2), "rank"),
        (lambda: ContextParallel(2, 0, interleave=0), "interleave"),
        (lambda: ContextParallel(2, 0, sharded_groups=(0, 0)), "sharded_groups"),
        (lambda: ContextParallel(2.0, 0), "world_size"),  # type: ignore[arg-type]
        (lambda: ContextParallel(2, 0, sharded_groups=(2,)).check_config(_config(KVCacheGroup(8, 4))), "exist"),
        (lambda: ContextParallel(2, 0).check_config(_config(KVCacheGroup(8, 4, sliding_window=4))), "sliding window"),
        (lambda: ContextParallel(3, 0).check_config(_config(KVCacheGroup(8, 4))), "block_size"),
        (lambda: ContextParallel(2, 0, interleave=3).check_config(_config(KVCacheGroup(8, 4))), "interleave"),
    ],
)  # fmt: skip
def test_a_split_that_does_not_fit_is_refused_naming_the_field(make, field) -> None:
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("module", [spec_cp, fast_cp], ids=["spec", "fast"])
def test_bad_inputs_are_refused_naming_the_argument(module) -> None:
    wrap = np.asarray if module is spec_cp else torch.from_numpy
    cp = ContextParallel(2, 0)
    positions, qsl, table = np.array([0, 9], np.int64), np.array([0, 2], np.int32), np.array([[1]], np.int32)
    with pytest.raises(ValueError, match="past block_table"):  # position 9 needs a second virtual block of 4 * 2
        module.cp_slot_mapping(wrap(positions), wrap(qsl), wrap(table), 4, cp)
    with pytest.raises(ValueError, match="query_start_loc"):
        module.cp_slot_mapping(wrap(positions), wrap(qsl[:1]), wrap(table), 4, cp)
    with pytest.raises(ValueError, match="positions"):
        module.cp_slot_mapping(wrap(positions.astype(np.float64)), wrap(qsl), wrap(table), 4, cp)
    with pytest.raises(ValueError, match="block_size"):
        module.cp_slot_mapping(wrap(positions), wrap(qsl), wrap(table), 0, cp)
    with pytest.raises(ValueError, match="seq_lens"):
        module.local_seq_lens(wrap(np.array([[3]], np.int32)), cp)
    with pytest.raises(ValueError, match="lses"):
        module.merge_attention_states(wrap(np.zeros((2, 3, 1, 4))), wrap(np.zeros((2, 3, 2))))
    with pytest.raises(ValueError, match="outputs"):
        module.merge_attention_states(wrap(np.zeros((3, 1, 4))), wrap(np.zeros((3, 1))))


def test_spec_and_fast_offer_the_same_functions() -> None:
    assert spec_cp.__all__ == fast_cp.__all__
    for name in spec_cp.__all__:
        assert hasattr(spec_cp, name) and hasattr(fast_cp, name), name
