"""Sparse top-k attention over an MLA latent cache (spec/sparse_mla.py, fast/sparse_mla.py):
spec in float64 equals the absorbed MLA decode over each request's entries masked to the selected positions (a
float64 reference that never reads a slot), and mla_decode_attention itself when every visible key is selected;
fast is within tolerance.py's rule for float32, float16, bfloat16 and fp8 caches; under DCP each rank's partial
state over its share of the selection merges to the single-rank result."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fast
import fast.context_parallel as fast_cp
import fast.sparse_mla as fast_sparse_mla
import spec
import spec.context_parallel as spec_cp
import spec.sparse_mla as spec_sparse_mla
from conformance.context_parallel import CP_KNOBS
from conformance.sparse_topk import TinyLatent, dense_masked_mla, random_topk, scheduled_batches
from conformance.tolerance import assert_attention_close, round_to, spec_in_dtype
from spec.context_parallel import ContextParallel
from spec.fp8 import cache_format, decode, encode
from spec.sparse_topk import DuplicateIndexError, InvalidIndexError, ReleasedBlockIndexError
from spec.types import BatchInputs, KVCacheGroup, WorkerConfig

RANK, HEADS, TOP_K, MAX_LEN = 8, 4, 6, 40
K_SCALE = 0.5  # the fp8 cases' one scale: values of a few units become codes of twice that


def _config(rope: int, block_size: int = 4) -> WorkerConfig:
    group = KVCacheGroup(block_size, 4 * -(-MAX_LEN // block_size) + 1, kind="mla", kv_lora_rank=RANK,
                         qk_rope_head_dim=rope)  # fmt: skip
    return WorkerConfig(4, MAX_LEN, 24, 50, (group,))


def _scale(rope: int) -> float:
    return 1.0 / math.sqrt(RANK + rope)


class _Cache:
    """One latent cache per backend, written through its own write_mla_kv, and the values each entry then holds
    as an independent formula of what was written (rounding to the dtype, or the fp8 format's encode/decode)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, kv_cache_dtype: str) -> None:
        self.dtype, self.fp8 = dtype, kv_cache_dtype != "auto"
        self.kw = {"kv_cache_dtype": kv_cache_dtype, "k_scale": K_SCALE} if self.fp8 else {}
        self.fmt = cache_format(kv_cache_dtype, "test")
        self.spec = np.zeros(shape, np.uint8 if self.fp8 else np.float64)  # float64 holding values of `dtype`
        self.fast = torch.zeros(shape, dtype=torch.uint8 if self.fp8 else getattr(torch, dtype))

    def write(self, kv_c: np.ndarray, k_pe: np.ndarray, slots: np.ndarray) -> None:
        kv_c, k_pe = round_to(kv_c, self.dtype), round_to(k_pe, self.dtype)
        host = (kv_c.astype(np.float32), k_pe.astype(np.float32)) if self.fp8 else (kv_c, k_pe)
        spec.write_mla_kv(self.spec, *host, slots, **self.kw)
        fast.write_mla_kv(self.fast, *(torch.from_numpy(x).to(getattr(torch, self.dtype)) for x in (kv_c, k_pe)),
                          torch.from_numpy(slots), **self.kw)  # fmt: skip
        assert np.array_equal(self.fast.double().numpy() if not self.fp8 else self.fast.numpy(), self.spec)

    def held(self, values: np.ndarray) -> np.ndarray:  # [n, L + R] float64: what entries written from `values` hold
        values = round_to(values, self.dtype)
        if self.fmt is None:
            return values
        scale = np.float32(K_SCALE)
        return decode(encode(values.astype(np.float32) / scale, self.fmt), self.fmt) * np.float64(scale)


def _queries(latent: TinyLatent, batch: BatchInputs, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    q, q_pe = latent.queries(np.asarray(batch.input_ids), np.asarray(batch.positions))
    return round_to(q, dtype), round_to(q_pe, dtype)


def _request_entries(latent: TinyLatent, cache: _Cache, batch: BatchInputs, tokens: dict[str, tuple[int, ...]]
                     ) -> list[np.ndarray]:  # fmt: skip
    """Per real token at position p: what its request's positions 0..p hold, from the request's token ids."""
    qsl = np.asarray(batch.query_start_loc)
    out = []
    for t in range(batch.num_tokens):
        ids = np.array(tokens[batch.req_ids[int(np.searchsorted(qsl[1:], t, side="right"))]], np.int64)
        p = int(batch.positions[t])
        out.append(cache.held(np.concatenate(latent.entries(ids[: p + 1], np.arange(p + 1)), axis=1)))
    return out


def _spec_state(cache: _Cache, slots: np.ndarray, scale: float, q: np.ndarray, q_pe: np.ndarray,
                cache_values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    kv = cache.spec if cache_values is None else cache_values
    return spec_sparse_mla.sparse_mla_attention_state(q, q_pe, kv, slots, scale=scale, **cache.kw)


def _low(cache: _Cache, slots: np.ndarray, scale: float, q: np.ndarray, q_pe: np.ndarray, which: int) -> np.ndarray:
    """spec "in the dtype" (tolerance.py) of the output (which=0) or the LSE (which=1)."""
    if cache.fp8:  # both references read the very codes
        return spec_in_dtype(lambda a, b: _spec_state(cache, slots, scale, a, b)[which], cache.dtype, (q, q_pe))
    return spec_in_dtype(lambda a, b, c: _spec_state(cache, slots, scale, a, b, c)[which], cache.dtype,
                         (q, q_pe, cache.spec))  # fmt: skip


def _check_fast(cache: _Cache, slots: np.ndarray, scale: float, q: np.ndarray, q_pe: np.ndarray,
                ref: np.ndarray, ref_lse: np.ndarray) -> None:  # fmt: skip
    to = getattr(torch, cache.dtype)
    got, got_lse = fast_sparse_mla.sparse_mla_attention_state(
        torch.from_numpy(q).to(to), torch.from_numpy(q_pe).to(to), cache.fast, torch.from_numpy(slots),
        scale=scale, **cache.kw,
    )  # fmt: skip
    assert got.dtype == to and got_lse.dtype == torch.float32
    out, lse = got.double().numpy(), got_lse.double().numpy()
    empty = ref_lse == -np.inf
    assert np.array_equal(lse == -np.inf, empty) and np.all(out[empty] == 0), "the empty states differ"
    assert_attention_close(out, ref, _low(cache, slots, scale, q, q_pe, 0), cache.dtype)
    low_lse = _low(cache, slots, scale, q, q_pe, 1)
    assert_attention_close(lse[~empty], ref_lse[~empty], low_lse[~empty], cache.dtype)


CASES = [("auto", "float32", 4), ("auto", "float16", 0), ("auto", "bfloat16", 4), ("fp8_e4m3", "float32", 4),
         ("fp8_e5m2", "bfloat16", 2)]  # fmt: skip


@pytest.mark.parametrize(("kv_cache_dtype", "dtype", "rope"), CASES, ids=[f"{c[0]}-{c[1]}-r{c[2]}" for c in CASES])
def test_sparse_mla_is_the_absorbed_decode_masked_to_the_selection(kv_cache_dtype: str, dtype: str, rope: int) -> None:
    """Per step of a scheduler run (prefills, chunks, decodes, padding): spec in float64 equals the dense masked
    absorbed decode (to 1e-12) and, with every position up to the query's selected, spec.mla_decode_attention on
    the same cache; fast is within the rule of spec in the dtype, output and LSE, both selections."""
    config, scale = _config(rope), _scale(rope)
    latent, rng = TinyLatent(config.vocab_size, RANK, rope, HEADS, seed=len(dtype) + rope), np.random.default_rng(3)
    cache = _Cache(spec.mla_cache_shape(config.kv_groups[0]), dtype, kv_cache_dtype)
    pool = spec.RequestStatePool(config)
    steps = 0
    for (batch,) in scheduled_batches(config, 5, [pool], 12, CP_KNOBS):
        n, padded = batch.num_tokens, batch.num_tokens_padded
        kv_c, k_pe = latent.entries(np.asarray(batch.input_ids), np.asarray(batch.positions))
        cache.write(kv_c, k_pe, batch.slot_mappings[0])
        q, q_pe = _queries(latent, batch, dtype)
        entries = _request_entries(latent, cache, batch, {row.req_id: row.token_ids for row in pool.snapshot()})
        every = np.full((padded, MAX_LEN), -1, np.int32)
        for t in range(n):
            every[t, : int(batch.positions[t]) + 1] = np.arange(int(batch.positions[t]) + 1)
        for topk in (random_topk(batch.positions, n, TOP_K, None, rng), every):
            slots = spec.sparse_slot_mapping(batch, config, topk, 0)
            out, lse = _spec_state(cache, slots, scale, q, q_pe)
            dense, dense_lse = dense_masked_mla(q[:n], q_pe[:n], entries, topk[:n], scale)
            np.testing.assert_allclose(out[:n], dense, rtol=0, atol=1e-12)
            assert np.array_equal(lse[:n] == -np.inf, dense_lse == -np.inf)
            finite = dense_lse > -np.inf
            np.testing.assert_allclose(lse[:n][finite], dense_lse[finite], rtol=0, atol=1e-12)
            assert np.all(out[n:] == 0) and np.all(lse[n:] == -np.inf), "padding rows are empty states"
            _check_fast(cache, slots, scale, q, q_pe, out, lse)
        decode = spec.mla_decode_attention(q, q_pe, cache.spec, batch.block_tables[0], batch.seq_lens,
                                           batch.query_start_loc, scale=scale, **cache.kw)  # fmt: skip
        np.testing.assert_allclose(out[:n], decode[:n], rtol=0, atol=1e-12)  # `out` is the `every` selection's
        steps += 1
    assert steps >= 5


@pytest.mark.parametrize(("world_size", "interleave", "kv_cache_dtype"), [(2, 1, "auto"), (2, 2, "fp8_e4m3"),
                                                                          (4, 1, "auto")])  # fmt: skip
def test_dcp_partials_merge_to_the_single_rank_sparse_mla(world_size: int, interleave: int, kv_cache_dtype: str
                                                          ) -> None:  # fmt: skip
    """The mla group sharded: every rank writes its share of the latents (rank_inputs' slots), reads its share of
    each selection (sparse_slot_mapping with its cp) and returns a partial state; merge_attention_states of the
    partials equals the sparse MLA attention on the pool's own single-rank layout, spec (float64) and fast."""
    rope, dtype = 4, "float32"
    config, scale = _config(rope, block_size=4 * world_size), _scale(rope)
    latent, rng = TinyLatent(config.vocab_size, RANK, rope, HEADS, seed=world_size), np.random.default_rng(interleave)
    cps = [ContextParallel(world_size, r, interleave) for r in range(world_size)]
    single = _Cache(spec.mla_cache_shape(config.kv_groups[0]), dtype, kv_cache_dtype)
    rank_shape = (config.kv_groups[0].num_blocks, cps[0].block_size(config, 0), RANK + rope)
    ranks = [_Cache(rank_shape, dtype, kv_cache_dtype) for _ in cps]
    steps = 0
    for (batch,) in scheduled_batches(config, world_size + interleave, [spec.RequestStatePool(config)], 10, CP_KNOBS):
        kv_c, k_pe = latent.entries(np.asarray(batch.input_ids), np.asarray(batch.positions))
        single.write(kv_c, k_pe, batch.slot_mappings[0])
        q, q_pe = _queries(latent, batch, dtype)
        topk = random_topk(batch.positions, batch.num_tokens, TOP_K, None, rng)
        ref, ref_lse = _spec_state(single, spec.sparse_slot_mapping(batch, config, topk, 0), scale, q, q_pe)
        outs, lses, fast_outs, fast_lses = [], [], [], []
        for cp, cache in zip(cps, ranks, strict=True):
            cache.write(kv_c, k_pe, spec_cp.rank_inputs(batch, config, cp).slot_mappings[0])
            slots = spec.sparse_slot_mapping(batch, config, topk, 0, cp=cp)
            out, lse = _spec_state(cache, slots, scale, q, q_pe)
            outs.append(out)
            lses.append(lse)
            got, got_lse = fast_sparse_mla.sparse_mla_attention_state(
                torch.from_numpy(q.astype(np.float32)), torch.from_numpy(q_pe.astype(np.float32)), cache.fast,
                torch.from_numpy(slots), scale=scale, **cache.kw,
            )  # fmt: skip
            fast_outs.append(got)
            fast_lses.append(got_lse)
        merged, merged_lse = spec_cp.merge_attention_states(np.stack(outs), np.stack(lses))
        empty = ref_lse == -np.inf
        assert np.array_equal(merged_lse == -np.inf, empty) and np.all(merged[empty] == 0)
        np.testing.assert_allclose(merged, ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(merged_lse[~empty], ref_lse[~empty], rtol=0, atol=1e-12)
        fast_merged, fast_merged_lse = fast_cp.merge_attention_states(torch.stack(fast_outs), torch.stack(fast_lses))
        slots = spec.sparse_slot_mapping(batch, config, topk, 0)
        assert np.array_equal(fast_merged_lse.numpy() == -np.inf, empty)
        assert_attention_close(fast_merged.numpy(), ref, _low(single, slots, scale, q, q_pe, 0), dtype)
        low_lse = _low(single, slots, scale, q, q_pe, 1)
        assert_attention_close(fast_merged_lse.numpy()[~empty], ref_lse[~empty], low_lse[~empty], dtype)
        steps += 1
    assert steps >= 5


def _tiny(rope: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return (rng.standard_normal((3, 2, 3)), rng.standard_normal((3, 2, rope)),
            rng.standard_normal((4, 2, 3 + rope)))  # fmt: skip


@pytest.mark.parametrize("rope", [2, 0], ids=["rope", "nope"])
@pytest.mark.parametrize("module", [spec_sparse_mla, fast_sparse_mla], ids=["spec", "fast"])
def test_sparse_mla_by_hand(module: object, rope: int) -> None:
    """Token 0 reads slots 2 and 7 (block 1 offset 0, block 3 offset 1), token 1 nothing, token 2 slot 5: each
    head's logits written out as q_latent . c + q_pe . k_pe, the output the weighted latents (no RoPE part)."""
    q, q_pe, cache = _tiny(rope)
    slots = np.array([[2, -1, 7], [-1, -1, -1], [-1, 5, -1]], np.int64)
    expected, expected_lse = np.zeros_like(q), np.full((3, 2), -np.inf)
    for t, chosen in ((0, [(1, 0), (3, 1)]), (2, [(2, 1)])):
        for h in range(2):
            logits = np.array([(q[t, h] @ cache[b, o, :3] + q_pe[t, h] @ cache[b, o, 3:]) * 0.7 for b, o in chosen])
            expected[t, h] = sum(np.exp(x) * cache[b, o, :3] for x, (b, o) in zip(logits, chosen, strict=True))
            expected[t, h] /= np.exp(logits).sum()
            expected_lse[t, h] = np.log(np.exp(logits).sum())
    if module is spec_sparse_mla:
        out, lse = spec_sparse_mla.sparse_mla_attention_state(q, q_pe, cache, slots, scale=0.7)
    else:
        floats = (torch.from_numpy(x.astype(np.float32)) for x in (q, q_pe, cache))
        got = fast_sparse_mla.sparse_mla_attention_state(*floats, torch.from_numpy(slots), scale=0.7)
        out, lse = (x.numpy() for x in got)
    atol = 1e-12 if module is spec_sparse_mla else 1e-5
    np.testing.assert_allclose(out, expected, rtol=0, atol=atol)
    assert np.all(lse[1] == -np.inf) and np.all(out[1] == 0)
    np.testing.assert_allclose(lse[[0, 2]], expected_lse[[0, 2]], rtol=0, atol=atol)


@pytest.mark.parametrize("which", ["spec", "fast"])
@pytest.mark.parametrize(
    ("error", "slot", "match"),
    [(InvalidIndexError, -2, "not -1"), (InvalidIndexError, 8, "not -1"), (ReleasedBlockIndexError, 1, "null block"),
     (DuplicateIndexError, 5, "twice")],
)  # fmt: skip
def test_bad_slots_are_refused_by_the_mla_reader(which: str, error: type, slot: int, match: str) -> None:
    q, q_pe, cache = _tiny(2)
    slots = np.array([[2, -1, 7], [-1, -1, -1], [-1, 5, -1]], np.int64)
    slots[2, 2] = slot  # 4 blocks of 2: real slots are 2..7; token 2 already lists 5
    with pytest.raises(error, match=match) as caught:
        if which == "fast":
            floats = (torch.from_numpy(x.astype(np.float32)) for x in (q, q_pe, cache))
            fast.sparse_mla_attention(*floats, torch.from_numpy(slots), scale=0.7)
        else:
            spec.sparse_mla_attention(q, q_pe, cache, slots, scale=0.7)
    assert (caught.value.token, caught.value.field) == (2, "topk_slots[2, 2]")


@pytest.mark.parametrize("which", ["spec", "fast"])
def test_bad_mla_reader_arguments_are_refused(which: str) -> None:
    q, q_pe, cache = _tiny(2)
    slots = np.full((3, 2), -1, np.int64)
    call = spec.sparse_mla_attention
    wrong_slots = slots.astype(float)
    if which == "fast":
        q, q_pe, cache = (torch.from_numpy(x.astype(np.float32)) for x in (q, q_pe, cache))  # type: ignore[assignment]
        slots, wrong_slots = torch.from_numpy(slots), torch.from_numpy(wrong_slots)  # type: ignore[assignment]
        call = fast.sparse_mla_attention  # type: ignore[assignment]
    with pytest.raises(ValueError, match="topk_slots"):
        call(q, q_pe, cache, slots[:2], scale=0.7)
    with pytest.raises(ValueError, match="int32 or int64"):
        call(q, q_pe, cache, wrong_slots, scale=0.7)
    with pytest.raises(ValueError, match="q_latent"):
        call(q[:, :, :2], q_pe, cache, slots, scale=0.7)
    with pytest.raises(ValueError, match="q_pe"):
        call(q, q_pe[:, :, :1], cache, slots, scale=0.7)
    with pytest.raises(ValueError, match="head axis"):
        call(q, q_pe, cache[:, :, None], slots, scale=0.7)
    with pytest.raises(ValueError, match="scale"):
        call(q, q_pe, cache, slots, scale="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        call(q, q_pe, cache, slots, scale=0.7, kv_cache_dtype="fp8_e4m3")
