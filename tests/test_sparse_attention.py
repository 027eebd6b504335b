"""Sparse top-k attention (spec/sparse_attention.py, fast/sparse_attention.py): equal to dense attention masked to
the selected keys (a float64 reference that never reads a slot), fast within tolerance.py's rule, and under DCP
each rank's partial state over its share of the selection merges to the single-rank sparse attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fast
import fast.context_parallel as fast_cp
import fast.sparse_attention as fast_sparse
import spec
import spec.context_parallel as spec_cp
import spec.sparse_attention as spec_sparse
from conformance.context_parallel import CP_KNOBS, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE, TinyQKV, cp_worker_config
from conformance.sparse_topk import dense_masked_attention, random_topk, scheduled_batches
from conformance.tolerance import assert_attention_close
from spec.context_parallel import ContextParallel
from spec.sparse_topk import DuplicateIndexError, InvalidIndexError, ReleasedBlockIndexError
from spec.types import BatchInputs, WorkerConfig

TOP_K = 6


def _qkv(qkv: TinyQKV, batch: BatchInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's query, key and value as float64 holding float32 values (what every backend sees)."""
    q, k, v = qkv(np.asarray(batch.input_ids), np.asarray(batch.positions))
    return tuple(x.astype(np.float32).astype(np.float64) for x in (q, k, v))  # type: ignore[return-value]


def _request_kv(qkv: TinyQKV, batch: BatchInputs, tokens: dict[str, tuple[int, ...]]
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:  # fmt: skip
    """Per real token at position p: the keys and values of its request's positions 0..p, from the request's
    token ids (not from any cache: a prefix-cache hit's early positions were written by another request)."""
    qsl = np.asarray(batch.query_start_loc)
    keys, values = [], []
    for t in range(batch.num_tokens):
        ids = np.array(tokens[batch.req_ids[int(np.searchsorted(qsl[1:], t, side="right"))]], np.int64)
        p = int(batch.positions[t])
        _, k, v = qkv(ids[: p + 1], np.arange(p + 1))
        keys.append(k.astype(np.float32).astype(np.float64))
        values.append(v.astype(np.float32).astype(np.float64))
    return keys, values


def _caches(config: WorkerConfig, group: int, block_size: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    shape = (config.kv_groups[group].num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return np.zeros(shape, dtype), np.zeros(shape, dtype)


def _check_state(out: np.ndarray, lse: np.ndarray, ref: np.ndarray, ref_lse: np.ndarray, low: np.ndarray,
                 low_lse: np.ndarray, dtype: str) -> None:  # fmt: skip
    """Outputs and finite LSEs by tolerance.py's rule; an empty state (-inf) exactly, with output exactly 0."""
    empty = ref_lse == -np.inf  # [T, H]
    assert np.array_equal(lse == -np.inf, empty), "the empty states differ"
    assert np.all(out[empty] == 0)
    assert_attention_close(out, ref, low, dtype)
    assert_attention_close(lse[~empty], ref_lse[~empty], low_lse[~empty], dtype)


@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_attention_is_dense_attention_masked_to_the_selection(seed: int) -> None:
    """Per step of a scheduler run (prefills, chunks, decodes, padding, both groups of cp_worker_config, the second
    with a sliding window): spec in float64 equals the dense masked reference, and fast (float32) is within the
    rule of spec in float32."""
    config = cp_worker_config(1, 1)
    qkv, rng = TinyQKV(config.vocab_size, seed), np.random.default_rng(seed)
    caches64 = [_caches(config, g, grp.block_size, np.float64) for g, grp in enumerate(config.kv_groups)]
    fast_caches = [tuple(torch.zeros(c.shape, dtype=torch.float32) for c in pair) for pair in caches64]
    pool = spec.RequestStatePool(config)
    steps = 0
    for (batch,) in scheduled_batches(config, seed, [pool], 12, CP_KNOBS):
        q, k, v = _qkv(qkv, batch)
        n = batch.num_tokens
        keys, values = _request_kv(qkv, batch, {row.req_id: row.token_ids for row in pool.snapshot()})
        for g, kv_group in enumerate(config.kv_groups):
            spec.write_kv(*caches64[g], k, v, batch.slot_mappings[g])
            fast.write_kv(*fast_caches[g], *(torch.from_numpy(x.astype(np.float32)) for x in (k, v)),
                          torch.from_numpy(batch.slot_mappings[g]))  # fmt: skip
            topk = random_topk(batch.positions, n, TOP_K, kv_group.sliding_window, rng)
            slots = spec.sparse_slot_mapping(batch, config, topk, g)
            out, lse = spec_sparse.sparse_attention_state(q, *caches64[g], slots, scale=SCALE)
            dense, dense_lse = dense_masked_attention(q[:n], keys, values, topk[:n], SCALE)
            np.testing.assert_allclose(out[:n], dense, rtol=0, atol=1e-12)
            assert np.array_equal(lse[:n] == -np.inf, dense_lse == -np.inf)
            np.testing.assert_allclose(lse[:n][dense_lse > -np.inf], dense_lse[dense_lse > -np.inf], atol=1e-12)
            assert np.all(out[n:] == 0) and np.all(lse[n:] == -np.inf), "padding rows are empty states"
            low, low_lse = spec_sparse.sparse_attention_state(
                q.astype(np.float32), *(c.astype(np.float32) for c in caches64[g]), slots, scale=SCALE
            )
            got, got_lse = fast_sparse.sparse_attention_state(
                torch.from_numpy(q.astype(np.float32)), *fast_caches[g], torch.from_numpy(slots), scale=SCALE
            )
            assert got.dtype == torch.float32 and got_lse.dtype == torch.float32
            _check_state(got.numpy(), got_lse.numpy(), out, lse, low, low_lse, "float32")
        steps += 1
    assert steps >= 8


@pytest.mark.parametrize(("world_size", "interleave", "seed"), [(2, 1, 0), (2, 2, 1), (4, 1, 2)])
def test_dcp_partials_merge_to_the_single_rank_sparse_attention(world_size: int, interleave: int, seed: int) -> None:
    """Every rank writes its share of the sharded group's KV (rank_inputs' slots), reads its share of each
    selection (sparse_slot_mapping with its cp) and returns a partial state; merge_attention_states of the
    partials equals sparse attention on the pool's own single-rank layout, in spec (float64) and in fast."""
    config = cp_worker_config(world_size, interleave)
    qkv, rng = TinyQKV(config.vocab_size, seed), np.random.default_rng(seed)
    cps = [ContextParallel(world_size, r, interleave) for r in range(world_size)]
    bs_rank = cps[0].block_size(config, 0)
    single = _caches(config, 0, config.kv_groups[0].block_size, np.float64)
    ranks = [_caches(config, 0, bs_rank, np.float64) for _ in cps]
    fast_ranks = [tuple(torch.zeros(c.shape, dtype=torch.float32) for c in pair) for pair in ranks]
    steps = 0
    for (batch,) in scheduled_batches(config, seed, [spec.RequestStatePool(config)], 10, CP_KNOBS):
        q, k, v = _qkv(qkv, batch)
        spec.write_kv(*single, k, v, batch.slot_mappings[0])
        topk = random_topk(batch.positions, batch.num_tokens, TOP_K, None, rng)
        ref, ref_lse = spec_sparse.sparse_attention_state(
            q, *single, spec.sparse_slot_mapping(batch, config, topk, 0), scale=SCALE
        )
        low, low_lse = spec_sparse.sparse_attention_state(
            q.astype(np.float32), *(c.astype(np.float32) for c in single),
            spec.sparse_slot_mapping(batch, config, topk, 0), scale=SCALE,
        )  # fmt: skip
        outs, lses, fast_outs, fast_lses = [], [], [], []
        for cp, caches, fast_caches in zip(cps, ranks, fast_ranks, strict=True):
            written = spec_cp.rank_inputs(batch, config, cp).slot_mappings[0]
            spec.write_kv(*caches, k, v, written)
            fast.write_kv(*fast_caches, *(torch.from_numpy(x.astype(np.float32)) for x in (k, v)),
                          torch.from_numpy(written))  # fmt: skip
            slots = spec.sparse_slot_mapping(batch, config, topk, 0, cp=cp)
            out, lse = spec_sparse.sparse_attention_state(q, *caches, slots, scale=SCALE)
            outs.append(out)
            lses.append(lse)
            got, got_lse = fast_sparse.sparse_attention_state(
                torch.from_numpy(q.astype(np.float32)), *fast_caches, torch.from_numpy(slots), scale=SCALE
            )
            fast_outs.append(got)
            fast_lses.append(got_lse)
        merged, merged_lse = spec_cp.merge_attention_states(np.stack(outs), np.stack(lses))
        empty = ref_lse == -np.inf
        assert np.array_equal(merged_lse == -np.inf, empty) and np.all(merged[empty] == 0)
        np.testing.assert_allclose(merged, ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(merged_lse[~empty], ref_lse[~empty], rtol=0, atol=1e-12)
        fast_merged, fast_merged_lse = fast_cp.merge_attention_states(torch.stack(fast_outs), torch.stack(fast_lses))
        _check_state(fast_merged.numpy(), fast_merged_lse.numpy(), ref, ref_lse, low, low_lse, "float32")
        steps += 1
    assert steps >= 6


def _tiny() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    query = rng.standard_normal((3, NUM_HEADS, HEAD_DIM))
    key_cache, value_cache = (rng.standard_normal((4, 2, NUM_KV_HEADS, HEAD_DIM)) for _ in range(2))
    return query, key_cache, value_cache


@pytest.mark.parametrize("module", [spec_sparse, fast_sparse], ids=["spec", "fast"])
def test_softcap_gqa_and_empty_rows_by_hand(module: object) -> None:
    """Token 0 reads slots 2 and 7 (block 1 offset 0, block 3 offset 1), token 1 nothing, token 2 slot 5: the
    expected output written out per head, its KV head h // 2, with the soft-cap applied to the logits."""
    query, key_cache, value_cache = _tiny()
    slots = np.array([[2, -1, 7], [-1, -1, -1], [-1, 5, -1]], np.int64)
    expected, expected_lse = np.zeros_like(query), np.full((3, NUM_HEADS), -np.inf)
    for t, chosen in ((0, [(1, 0), (3, 1)]), (2, [(2, 1)])):
        for h in range(NUM_HEADS):
            logits = np.array([query[t, h] @ key_cache[b, o, h // 2] for b, o in chosen]) * SCALE
            logits = 2.0 * np.tanh(logits / 2.0)
            expected[t, h] = sum(
                np.exp(x) * value_cache[b, o, h // 2] for x, (b, o) in zip(logits, chosen, strict=True)
            )
            expected[t, h] /= np.exp(logits).sum()
            expected_lse[t, h] = np.log(np.exp(logits).sum())
    if module is spec_sparse:
        out, lse = spec_sparse.sparse_attention_state(query, key_cache, value_cache, slots, scale=SCALE, softcap=2.0)
    else:
        floats = (torch.from_numpy(x.astype(np.float32)) for x in (query, key_cache, value_cache))
        out, lse = (
            x.numpy()
            for x in fast_sparse.sparse_attention_state(*floats, torch.from_numpy(slots), scale=SCALE, softcap=2.0)
        )
    atol = 1e-12 if module is spec_sparse else 1e-5
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=atol)
    assert np.all(np.asarray(lse)[1] == -np.inf) and np.all(np.asarray(out)[1] == 0)
    np.testing.assert_allclose(np.asarray(lse)[[0, 2]], expected_lse[[0, 2]], rtol=0, atol=atol)


@pytest.mark.parametrize("which", ["spec", "fast"])
@pytest.mark.parametrize(
    ("error", "slot", "match"),
    [(InvalidIndexError, -2, "not -1"), (InvalidIndexError, 8, "not -1"), (ReleasedBlockIndexError, 1, "null block"),
     (DuplicateIndexError, 5, "twice")],
)  # fmt: skip
def test_bad_slots_are_refused_naming_the_token(which: str, error: type, slot: int, match: str) -> None:
    query, key_cache, value_cache = _tiny()
    slots = np.array([[2, -1, 7], [-1, -1, -1], [-1, 5, -1]], np.int64)
    slots[2, 2] = slot  # 4 blocks of 2: real slots are 2..7; token 2 already lists 5 (token 0 lists 7: another row)
    if which == "fast":
        args = [torch.from_numpy(x.astype(np.float32)) for x in (query, key_cache, value_cache)]
        with pytest.raises(error, match=match) as caught:
            fast.sparse_paged_attention(*args, torch.from_numpy(slots), scale=SCALE)
    else:
        with pytest.raises(error, match=match) as caught:
            spec.sparse_paged_attention(query, key_cache, value_cache, slots, scale=SCALE)
    assert (caught.value.token, caught.value.field) == (2, "topk_slots[2, 2]")


@pytest.mark.parametrize("which", ["spec", "fast"])
def test_bad_arguments_are_refused(which: str) -> None:
    query, key_cache, value_cache = _tiny()
    slots = np.full((3, 2), -1, np.int64)
    call = spec.sparse_paged_attention
    if which == "fast":
        query, key_cache, value_cache = (torch.from_numpy(x.astype(np.float32)) for x in _tiny())
        slots, call = torch.from_numpy(slots), fast.sparse_paged_attention  # type: ignore[assignment]
    with pytest.raises(ValueError, match="topk_slots"):
        call(query, key_cache, value_cache, slots[:2], scale=SCALE)
    with pytest.raises(ValueError, match="int32 or int64"):
        call(query, key_cache, value_cache, slots.float() if which == "fast" else slots.astype(float), scale=SCALE)
    with pytest.raises(ValueError, match="query"):
        call(query[:, :3], key_cache, value_cache, slots, scale=SCALE)
    with pytest.raises(ValueError, match="softcap"):
        call(query, key_cache, value_cache, slots, scale=SCALE, softcap=0.0)
    with pytest.raises(ValueError, match="scale"):
        call(query, key_cache, value_cache, slots, scale="1")  # type: ignore[arg-type]
