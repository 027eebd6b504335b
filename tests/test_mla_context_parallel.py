"""MLA under decode context parallelism, spec and fast on their own: each rank's latent cache holds the positions
it owns, and the ranks' partial absorbed decodes merge to the single-rank mla_decode_attention.

Expectations come from outside the code under test: slots and cache contents by hand, rank caches built from the
round-robin definition (conformance.context_parallel.owner_slot, not spec's formulas), and the single-rank
reference is spec.mla_decode_attention on the pool's layout (virtual blocks of bs * CP tokens), a formulation of
its own (split logits, no LSE), compared by conformance/tolerance.py's rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fast
import fast.context_parallel as fast_cp
import spec
import spec.context_parallel as spec_cp
from conformance.context_parallel import owner_slot
from conformance.tolerance import as_float64, assert_attention_close, round_to, spec_in_dtype
from fast.runtime import interpret
from spec.context_parallel import ContextParallel
from spec.fp8 import E4M3, encode
from spec.types import PAD_SLOT_ID

L, R, H = 6, 4, 3  # kv_lora_rank, rope_dim, heads
SCALE = 0.41


@pytest.mark.parametrize("impl", ["spec", "host", pytest.param("interpret", marks=pytest.mark.interpret)])
def test_each_rank_latent_cache_holds_exactly_the_positions_it_owns(impl: str) -> None:
    """CP 2, interleave 2, bs 2 (virtual block 4), one request of 7 tokens over virtual blocks [3, 1], by hand:
    rank 0 owns positions 0, 1, 4, 5 and rank 1 positions 2, 3, 6; the slots and the written caches follow."""
    backend: Any = spec if impl == "spec" else fast
    cp_module: Any = spec_cp if impl == "spec" else fast_cp
    wrap = np.asarray if impl == "spec" else torch.from_numpy
    positions, qsl, table = np.arange(7, dtype=np.int64), np.array([0, 7], np.int32), np.array([[3, 1]], np.int32)
    kv_c = (np.arange(7 * L, dtype=np.float32).reshape(7, L) + 1) / 8  # [T, L], token t's values from 1 + t*L
    k_pe = -(np.arange(7 * R, dtype=np.float32).reshape(7, R) + 1) / 8  # [T, R]
    pad = PAD_SLOT_ID
    expected_slots = {0: [6, 7, pad, pad, 2, 3, pad], 1: [pad, pad, 6, 7, pad, pad, 2]}
    # (block, offset) -> position held, per rank: block 3 holds the rank's share of virtual block 0, block 1 of 1
    expected_entries = {0: {(3, 0): 0, (3, 1): 1, (1, 0): 4, (1, 1): 5}, 1: {(3, 0): 2, (3, 1): 3, (1, 0): 6}}
    for rank in (0, 1):
        cp = ContextParallel(2, rank, interleave=2)
        with interpret(impl == "interpret"):
            slots = cp_module.cp_slot_mapping(wrap(positions), wrap(qsl), wrap(table), 2, cp)
            cache = wrap(np.zeros((4, 2, L + R), np.float32))
            backend.write_mla_kv(cache, wrap(kv_c), wrap(k_pe), slots)
        assert np.asarray(slots).tolist() == expected_slots[rank]
        want = np.zeros((4, 2, L + R), np.float32)
        for (block, offset), p in expected_entries[rank].items():
            want[block, offset] = np.concatenate([kv_c[p], k_pe[p]])
        assert np.array_equal(np.asarray(cache), want), f"rank {rank}"
        local = cp_module.local_seq_lens(wrap(np.array([7], np.int32)), cp)
        assert np.asarray(local).tolist() == [len(expected_entries[rank])]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]:
    """(world, interleave, bs, lens, query lens, virtual tables) of a small batch; table ids distinct."""
    world = draw(st.sampled_from([2, 4]))
    interleave = draw(st.sampled_from([1, 2, 4]))
    bs = interleave * draw(st.integers(1, 2))
    lens = np.array(draw(st.lists(st.integers(1, 26), min_size=1, max_size=4)), np.int32)
    q_lens = np.array([draw(st.sampled_from(sorted({1, min(3, int(n)), int(n)}))) for n in lens], np.int32)
    width = int(-(-lens.max() // (bs * world)))
    ids = np.random.default_rng(draw(st.integers(0, 99))).permutation(np.arange(1, 1 + len(lens) * width))
    return world, interleave, bs, lens, q_lens, ids.reshape(len(lens), width).astype(np.int32)


class Case:
    """A batch's latents on the single-rank layout and on each rank's cache, and its queries (values of float32)."""

    def __init__(self, world: int, interleave: int, bs: int, lens: np.ndarray, q_lens: np.ndarray,
                 tables: np.ndarray, seed: int, pad: int = 1) -> None:  # fmt: skip
        rng = np.random.default_rng(seed)
        self.cps = [ContextParallel(world, r, interleave) for r in range(world)]
        self.tables, self.lens = tables, lens
        self.qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_blocks, virtual = int(tables.max()) + 1, bs * world
        # NaN wherever no position of the batch lies (the null block, unowned and unwritten slots): a reader that
        # strays past a rank's local entries, or past its table, turns its output NaN
        self.full = np.full((num_blocks, virtual, L + R), np.nan)  # the pool's layout: virtual blocks of bs * CP
        self.ranks = np.full((world, num_blocks, bs, L + R), np.nan)  # [CP, num_blocks, bs, L + R]
        for row, n in enumerate(lens.tolist()):
            entries = rng.standard_normal((n, L + R)).astype(np.float32)  # position p's [c, k_pe]
            for p in range(n):
                self.full[tables[row, p // virtual], p % virtual] = entries[p]
                owner, slot = owner_slot(p, tables[row], bs, self.cps[0])
                self.ranks[owner, slot // bs, slot % bs] = entries[p]
        num_tokens = int(self.qsl[-1]) + pad
        self.q_latent = rng.standard_normal((num_tokens, H, L)).astype(np.float32).astype(np.float64)
        self.q_pe = rng.standard_normal((num_tokens, H, R)).astype(np.float32).astype(np.float64)
        self.q_latent[self.qsl[-1] :] = 0  # padding tokens
        self.q_pe[self.qsl[-1] :] = 0

    @property
    def indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.tables, self.lens, self.qsl

    def reference(self, dtype: Any) -> np.ndarray:  # [T, H, L] float64
        """Single-rank spec.mla_decode_attention, computed in `dtype` (tolerance.py's definition)."""
        return spec_in_dtype(
            spec.mla_decode_attention, dtype, (round_to(self.q_latent, dtype), round_to(self.q_pe, dtype),
                                               round_to(self.full, dtype)), *self.indices, scale=SCALE,
        )  # fmt: skip

    def fast_partials(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        q = [torch.from_numpy(x).to(dtype) for x in (self.q_latent, self.q_pe)]
        idx = [torch.from_numpy(x) for x in self.indices]
        return [
            fast_cp.partial_mla_decode_attention(*q, torch.from_numpy(self.ranks[cp.rank]).to(dtype), *idx, cp=cp,
                                                 scale=SCALE)
            for cp in self.cps
        ]  # fmt: skip


def _merged(parts: list[tuple[Any, Any]], merge: Any, stack: Any) -> tuple[np.ndarray, np.ndarray]:
    out, lse = merge(stack([o for o, _ in parts]), stack([x for _, x in parts]))
    return as_float64(out), as_float64(lse)


@settings(max_examples=30, deadline=None)
@given(layouts(), st.integers(0, 999))
def test_partial_mla_decodes_merge_to_single_rank_mla_decode(layout, seed) -> None:
    """spec in float64 to 1e-12, fast's CPU path in float32 within tolerance.py's rule; padding rows are empty
    states on every rank, and spec and fast agree on which rows are empty (no local key visible)."""
    case = Case(*layout, seed=seed)
    num_tokens = int(case.qsl[-1])
    spec_parts = [
        spec_cp.partial_mla_decode_attention(case.q_latent, case.q_pe, case.ranks[cp.rank], *case.indices, cp=cp,
                                             scale=SCALE)
        for cp in case.cps
    ]  # fmt: skip
    merged, lse = _merged(spec_parts, spec_cp.merge_attention_states, np.stack)
    ref64 = case.reference("float64")
    np.testing.assert_allclose(merged, ref64, rtol=0, atol=1e-12)
    assert np.isfinite(lse[:num_tokens]).all() and np.all(lse[num_tokens:] == -np.inf)
    fast_parts = case.fast_partials(torch.float32)
    for (out, x), (fout, fx) in zip(spec_parts, fast_parts, strict=True):
        assert fout.shape == out.shape and fx.dtype == torch.float32
        assert np.array_equal(np.isinf(x), np.isinf(fx.numpy())), "spec and fast disagree on the empty states"
        assert np.all(fout.numpy()[np.isinf(x)] == 0), "an empty state's output must be 0"
    fast_merged, fast_lse = _merged(fast_parts, fast_cp.merge_attention_states, torch.stack)
    assert np.all(fast_merged[num_tokens:] == 0) and np.all(fast_lse[num_tokens:] == -np.inf)
    assert_attention_close(fast_merged, ref64, case.reference("float32"), "float32")


# The Triton kernel through the interpreter: a few fixed layouts (it runs ~1000x slower than compiled).
KERNEL_CASES = [
    # world, interleave, bs, lens, q_lens: decode rows, a 1 + 2 verify row, a prefill chunk, a row of one token
    (2, 1, 2, [21, 5, 1], [1, 3, 1]),
    (4, 2, 2, [19, 9], [6, 1]),
    (2, 4, 4, [26, 3], [1, 3]),
]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("world", "interleave", "bs", "lens", "q_lens"), KERNEL_CASES)
def test_partial_mla_decode_in_the_triton_kernel(world, interleave, bs, lens, q_lens, dtype) -> None:
    """The kernel with DCP's positions and the LSE stored: each rank's state equals fast's CPU path (LSE within
    float32 rounding, the same empty states), and the merge equals single-rank mla_decode_attention."""
    lens_np, q_np = np.array(lens, np.int32), np.array(q_lens, np.int32)
    width = int(-(-max(lens) // (bs * world)))
    tables = np.arange(1, 1 + len(lens) * width, dtype=np.int32)[::-1].reshape(len(lens), width).copy()
    case = Case(world, interleave, bs, lens_np, q_np, tables, seed=world + interleave, pad=2)
    host = case.fast_partials(dtype)
    with interpret(True):
        kernel = case.fast_partials(dtype)
    name = str(dtype).removeprefix("torch.")
    for cp, (_, lse), (kout, klse) in zip(case.cps, host, kernel, strict=True):
        assert kout.dtype == dtype and klse.dtype == torch.float32
        assert torch.equal(torch.isinf(lse), torch.isinf(klse))
        finite = torch.isfinite(lse)
        assert torch.allclose(klse[finite], lse[finite], rtol=0, atol=1e-5)
        assert torch.all(kout[~finite] == 0)
        spec_state = [  # each rank's own output against spec's partial, computed in float64 and in the dtype
            spec_in_dtype(lambda *a, cp=cp: spec_cp.partial_mla_decode_attention(*a, *case.indices, cp=cp,
                          scale=SCALE)[0], d, tuple(round_to(x, d) for x in (case.q_latent, case.q_pe,
                          case.ranks[cp.rank])))
            for d in ("float64", name)
        ]  # fmt: skip
        assert_attention_close(kout, *spec_state, name)
    merged, _ = _merged(kernel, fast_cp.merge_attention_states, torch.stack)
    assert_attention_close(merged, case.reference("float64"), case.reference(name), name)


@pytest.mark.parametrize("impl", ["spec", "host", pytest.param("interpret", marks=pytest.mark.interpret)])
def test_a_query_with_no_local_latent_is_an_empty_state(impl: str) -> None:
    """CP 4, interleave 1: a one-token request lives on rank 0 only; ranks 1-3 return output 0 and LSE -inf for
    it (not NaN), and rank 0 the whole attention (LSE = its one logit)."""
    tables, lens, qsl = np.array([[1]], np.int32), np.array([1], np.int32), np.array([0, 1], np.int32)
    entry = np.array([0.5] * L + [0.25] * R, np.float32)
    q_latent, q_pe = np.ones((1, H, L), np.float32), np.ones((1, H, R), np.float32)
    logit = SCALE * (0.5 * L + 0.25 * R)
    for rank in range(4):
        cp = ContextParallel(4, rank)
        cache = np.zeros((2, 1, L + R), np.float32)
        if rank == 0:
            cache[1, 0] = entry
        if impl == "spec":
            out, lse = spec_cp.partial_mla_decode_attention(q_latent, q_pe, cache, tables, lens, qsl, cp=cp,
                                                            scale=SCALE)  # fmt: skip
        else:
            with interpret(impl == "interpret"):
                out, lse = fast_cp.partial_mla_decode_attention(
                    *map(torch.from_numpy, (q_latent, q_pe, cache, tables, lens, qsl)), cp=cp, scale=SCALE
                )
        out, lse = as_float64(out), as_float64(lse)
        if rank == 0:
            np.testing.assert_allclose(out, np.broadcast_to(entry[:L], (1, H, L)), rtol=1e-6)
            np.testing.assert_allclose(lse, np.full((1, H), logit), rtol=1e-6)
        else:
            assert np.all(out == 0) and np.all(lse == -np.inf), f"rank {rank}"


@pytest.mark.parametrize("impl", ["spec", "host", pytest.param("interpret", marks=pytest.mark.interpret)])
def test_partial_mla_decode_reads_fp8_caches(impl: str) -> None:
    """e4m3 latent caches, one scale: each rank reads decode(code) * k_scale, and the merge equals single-rank
    mla_decode_attention over the very codes (tolerance.py's fp8 rule: both references read the codes)."""
    case = Case(2, 2, 2, np.array([8, 5], np.int32), np.array([1, 4], np.int32),
                np.array([[4, 2], [1, 3]], np.int32), seed=7)  # fmt: skip
    k_scale = 0.75
    full_codes = encode(case.full.astype(np.float32) / np.float32(k_scale), E4M3)
    rank_codes = encode(case.ranks.astype(np.float32) / np.float32(k_scale), E4M3)
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "k_scale": k_scale}
    ref64 = spec.mla_decode_attention(case.q_latent, case.q_pe, full_codes, *case.indices, scale=SCALE, **fp8)
    low = spec.mla_decode_attention(case.q_latent.astype(np.float32), case.q_pe.astype(np.float32), full_codes,
                                    *case.indices, scale=SCALE, **fp8)  # fmt: skip
    parts: list[tuple[Any, Any]] = []
    for cp in case.cps:
        if impl == "spec":
            parts.append(spec_cp.partial_mla_decode_attention(
                case.q_latent, case.q_pe, rank_codes[cp.rank], *case.indices, cp=cp, scale=SCALE, **fp8))  # fmt: skip
            continue
        with interpret(impl == "interpret"):
            parts.append(fast_cp.partial_mla_decode_attention(
                *(torch.from_numpy(x.astype(np.float32)) for x in (case.q_latent, case.q_pe)),
                torch.from_numpy(rank_codes[cp.rank]), *map(torch.from_numpy, case.indices), cp=cp, scale=SCALE, **fp8,
            ))  # fmt: skip
    if impl == "spec":
        merged, _ = _merged(parts, spec_cp.merge_attention_states, np.stack)
        np.testing.assert_allclose(merged, ref64, rtol=0, atol=1e-12)
    else:
        merged, _ = _merged(parts, fast_cp.merge_attention_states, torch.stack)
        assert_attention_close(merged, ref64, low, "float32")


@pytest.mark.parametrize("module", [spec_cp, fast_cp], ids=["spec", "fast"])
def test_partial_mla_decode_refusals(module: Any) -> None:
    """A ValueError naming the function and the argument, as mla_decode_attention's contract."""
    wrap = np.asarray if module is spec_cp else torch.from_numpy
    cp = ContextParallel(2, 0)
    q_latent, q_pe = np.zeros((2, H, L), np.float32), np.zeros((2, H, R), np.float32)
    cache, table = np.zeros((3, 2, L + R), np.float32), np.array([[1]], np.int32)
    lens, qsl = np.array([2], np.int32), np.array([0, 2], np.int32)

    def call(**changed: Any) -> Any:
        args = dict(q_latent=q_latent, q_pe=q_pe, kv_cache=cache, block_table=table, seq_lens=lens,
                    query_start_loc=qsl)  # fmt: skip
        arrays = {k: wrap(v) for k, v in {**args, **changed}.items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in changed.items() if not isinstance(v, np.ndarray)}
        return module.partial_mla_decode_attention(*arrays.values(), cp=cp, scale=SCALE, **scalars)

    refusals = [
        (dict(q_latent=np.zeros((2, H, L + 1), np.float32)), "q_latent"),  # not absorbed into latent space
        (dict(kv_cache=np.zeros((3, 2, 1, L + R), np.float32)), "no head axis"),  # an attention cache
        (dict(q_pe=np.zeros((2, H, R), np.float64)), "q_pe"),
        (dict(seq_lens=lens.astype(np.float32)), "seq_lens"),
        (dict(k_scale=0.5), "k_scale"),  # a scale with an "auto" cache
    ]
    for changed, name in refusals:
        with pytest.raises(ValueError, match=rf"partial_mla_decode_attention.*{name}|{name}.*partial_mla_decode"):
            call(**changed)
    assert call()[1].shape == (2, H)  # the unchanged arguments are accepted
