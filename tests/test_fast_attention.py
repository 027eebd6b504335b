"""fast.paged_attention against spec (float64 reference, tolerance rule) in both CPU modes.

Every cache slot the attention must not read holds NaN: the null block 0, blocks no request owns, blocks
wholly outside a request's sliding window (their table entries are the null block, as a scheduler would
leave them), positions before the window inside a partly needed block, and slots past seq_len. Padding
query rows are NaN too, and their output must be exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from conformance.tolerance import as_float64, assert_attention_close, round_to, spec_in_dtype
from fast.attention import paged_attention
from fast.runtime import interpret

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclass
class Case:
    """float64 arrays holding values exactly representable in the case's dtype (NaN where unreadable)."""

    query: np.ndarray  # [T, num_heads, head_dim]
    key_cache: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: np.ndarray  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    seq_lens: np.ndarray  # [num_reqs] int32
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    num_tokens: int  # real tokens; rows past it are padding
    kwargs: dict[str, float | int | None]  # scale, sliding_window, softcap


def make_case(
    seed: int,
    dtype: torch.dtype,
    requests: list[tuple[int, int]],  # per batch row: (num_computed_tokens, num_scheduled_tokens)
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_pad: int = 0,
    spare_blocks: int = 3,
    run_blocks: int = 1,
) -> Case:
    """run_blocks: physical ids come in runs of that many consecutive blocks (in shuffled order)."""
    rng = np.random.default_rng(seed)
    seq_lens = [computed + scheduled for computed, scheduled in requests]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed) + 1  # at least one trailing unused (null) entry per row
    num_blocks = 1 + sum(blocks_needed) + spare_blocks
    runs = np.array_split(np.arange(1, num_blocks), max(1, (num_blocks - 1) // run_blocks))
    physical = np.concatenate([runs[i] for i in rng.permutation(len(runs))])  # block 0 is the null block
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = np.full(shape, np.nan), np.full(shape, np.nan)
    block_table = np.zeros((len(requests), max_blocks), np.int32)
    for b, ((computed, _), seq_len) in enumerate(zip(requests, seq_lens, strict=True)):
        ids, physical = physical[: blocks_needed[b]], physical[blocks_needed[b] :]
        block_table[b, : len(ids)] = ids
        first_query = computed
        first_visible = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        block_table[b, : first_visible // block_size] = 0  # wholly outside the window: released to the null block
        pos = np.arange(first_visible, seq_len)  # the only positions any query of this row may read
        blocks, offsets = block_table[b, pos // block_size], pos % block_size
        key_cache[blocks, offsets] = rng.standard_normal((len(pos), num_kv_heads, head_dim))
        value_cache[blocks, offsets] = rng.standard_normal((len(pos), num_kv_heads, head_dim))
    query_start_loc = np.concatenate([[0], np.cumsum([s for _, s in requests])]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    query = np.full((num_tokens + num_pad, num_kv_heads * group, head_dim), np.nan)
    query[:num_tokens] = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim))
    return Case(
        round_to(query, dtype), round_to(key_cache, dtype), round_to(value_cache, dtype), block_table,
        np.array(seq_lens, np.int32), query_start_loc, num_tokens,
        {"scale": head_dim**-0.5, "sliding_window": sliding_window, "softcap": softcap},
    )  # fmt: skip


def run_fast(case: Case, dtype: torch.dtype) -> torch.Tensor:
    floats = (torch.from_numpy(a).to(dtype) for a in (case.query, case.key_cache, case.value_cache))
    ints = (torch.from_numpy(a) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    return paged_attention(*floats, *ints, **case.kwargs)  # type: ignore[arg-type]


def check_against_spec(case: Case, dtype: torch.dtype) -> None:
    out = run_fast(case, dtype)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert (out[case.num_tokens :] == 0).all(), "padding rows must be exactly zero"
    ints = (case.block_table, case.seq_lens, case.query_start_loc)
    ref64 = spec.paged_attention(case.query, case.key_cache, case.value_cache, *ints, **case.kwargs)  # type: ignore[arg-type]
    low = spec_in_dtype(spec.paged_attention, dtype, (case.query, case.key_cache, case.value_cache), *ints,
                        **case.kwargs)  # fmt: skip
    n = case.num_tokens
    assert np.isfinite(ref64[:n]).all()  # the case itself reads no NaN through spec
    assert_attention_close(out[:n], ref64[:n], low[:n], dtype)


# (num_computed_tokens, num_scheduled_tokens) per batch row: decodes, chunked prefills, fresh prefills
MIXED = [(6, 1), (0, 9), (13, 4), (0, 1), (21, 1), (3, 6)]

CASES = {
    "gqa3-hd12-bs4": dict(requests=MIXED, block_size=4, num_kv_heads=2, group=3, head_dim=12),
    "window5-gqa2": dict(requests=MIXED, block_size=4, num_kv_heads=1, group=2, head_dim=16, sliding_window=5),
    "softcap-window3-pad": dict(
        requests=MIXED, block_size=3, num_kv_heads=2, group=4, head_dim=8, sliding_window=3, softcap=2.5, num_pad=5
    ),
    "mha-hd80-bs16-softcap": dict(
        requests=[(0, 18), (30, 1), (5, 3)], block_size=16, num_kv_heads=3, group=1, head_dim=80, softcap=8.0
    ),
    "gqa8-window1-decode": dict(
        requests=[(40, 1), (7, 1), (0, 3)],
        block_size=8,
        num_kv_heads=1,
        group=8,
        head_dim=12,
        sliding_window=1,
        num_pad=2,
    ),
    "gqa16-long-prefill": dict(
        requests=[(0, 37), (2, 1)], block_size=5, num_kv_heads=1, group=16, head_dim=4, sliding_window=11
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_spec(mode: str, name: str, dtype: torch.dtype) -> None:
    check_against_spec(make_case(len(name), dtype, **CASES[name]), dtype)  # type: ignore[arg-type]


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, dict[str, object]]:
    num_reqs = draw(st.integers(1, 4))
    requests = [(draw(st.integers(0, 20)), draw(st.integers(1, 10))) for _ in range(num_reqs)]
    return draw(st.integers(0, 2**32 - 1)), dict(
        requests=requests,
        block_size=draw(st.integers(1, 9)),
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 5)),
        head_dim=draw(st.integers(1, 24)),
        sliding_window=draw(st.none() | st.integers(1, 12)),
        softcap=draw(st.none() | st.floats(0.5, 20.0)),
        num_pad=draw(st.integers(0, 3)),
    )


@settings(deadline=None)  # the CPU's speed is shared with other jobs: no per-example deadline
@given(cases(), st.sampled_from(DTYPES))
def test_paged_attention_matches_spec_property(case: tuple[int, dict[str, object]], dtype: torch.dtype) -> None:
    seed, params = case
    with interpret(False):  # the interpreter is too slow for many examples; the parametrized test covers it
        check_against_spec(make_case(seed, dtype, **params), dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_paged_attention_long_contexts(sliding_window: int | None) -> None:
    """The benchmark's shape (8 query heads over 2 KV heads, head_dim 64, blocks of 16) at contexts of hundreds of
    tokens: many blocks per request, requests of very different spans sharing one gather buffer, in both orders."""
    requests = [(300, 1), (0, 40), (129, 1), (200, 17), (15, 1)]
    for order in (requests, requests[::-1]):
        case = make_case(len(order), torch.float32, order, block_size=16, num_kv_heads=2, group=4, head_dim=64,
                         sliding_window=sliding_window, num_pad=2)  # fmt: skip
        with interpret(False):  # hundreds of keys per request: too slow for the interpreter
            check_against_spec(case, torch.float32)


def test_paged_attention_matches_dense_sdpa(mode: str) -> None:
    """Independently of spec: torch SDPA over each request's contiguous keys, with a bottom-right causal mask."""
    case = make_case(5, torch.float32, MIXED, block_size=4, num_kv_heads=2, group=3, head_dim=12)
    out = run_fast(case, torch.float32)

    def dense(dtype: torch.dtype) -> np.ndarray:
        result = np.zeros_like(case.query)
        for b, seq_len in enumerate(case.seq_lens.tolist()):
            start, end = case.query_start_loc[b], case.query_start_loc[b + 1]
            pos = np.arange(seq_len)
            rows = case.block_table[b, pos // 4], pos % 4
            k, v = (torch.from_numpy(c[rows]).to(dtype).transpose(0, 1) for c in (case.key_cache, case.value_cache))
            q = torch.from_numpy(case.query[start:end]).to(dtype).transpose(0, 1)
            causal = torch.ones(end - start, seq_len, dtype=torch.bool).tril(diagonal=seq_len - (end - start))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
            result[start:end] = o.transpose(0, 1).double().numpy()
        return result

    assert_attention_close(out, dense(torch.float64), dense(torch.float32), torch.float32)


def test_paged_attention_rejects_bad_inputs(mode: str) -> None:
    case = make_case(1, torch.float32, [(2, 3)], block_size=4, num_kv_heads=2, group=2, head_dim=8)
    q, k, v = (torch.from_numpy(a).float() for a in (case.query, case.key_cache, case.value_cache))
    bt, sl, qsl = (torch.from_numpy(a) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(q[:, :3], k, v, bt, sl, qsl, scale=1.0)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        spec.paged_attention(case.query[:, :3], case.key_cache, case.value_cache, case.block_table, case.seq_lens,
                             case.query_start_loc, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, k, v, bt, sl, qsl[:1], scale=1.0)
    with pytest.raises(ValueError, match="key_cache is float32, query float16"):
        paged_attention(q.half(), k, v, bt, sl, qsl, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, k, v, bt, sl, qsl, scale=1.0, sliding_window=0)


def test_padding_rows_are_zero_even_when_the_query_is_nan(mode: str) -> None:
    case = make_case(2, torch.float16, [(4, 2)], block_size=4, num_kv_heads=1, group=2, head_dim=8, num_pad=4)
    out = run_fast(case, torch.float16)
    assert np.isnan(case.query[case.num_tokens :]).all()
    assert (as_float64(out[case.num_tokens :]) == 0).all() and np.isfinite(as_float64(out)).all()


def test_paged_attention_strided_caches(mode: str) -> None:
    """Caches with padded blocks (not contiguous) give exactly the contiguous result: same values, same math."""
    case = make_case(3, torch.float32, MIXED, block_size=4, num_kv_heads=2, group=3, head_dim=12, sliding_window=6)
    expected = run_fast(case, torch.float32)
    num_blocks, block_size, num_kv_heads, head_dim = case.key_cache.shape
    padded = torch.full((2, num_blocks, block_size + 1, num_kv_heads, head_dim), float("nan"))
    padded[0, :, :block_size] = torch.from_numpy(case.key_cache)
    padded[1, :, :block_size] = torch.from_numpy(case.value_cache)
    key_cache, value_cache = padded[0, :, :block_size], padded[1, :, :block_size]
    assert not key_cache.is_contiguous()
    ints = (torch.from_numpy(a) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    out = paged_attention(torch.from_numpy(case.query).float(), key_cache, value_cache, *ints, **case.kwargs)  # type: ignore[arg-type]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_engine_shape(dtype: torch.dtype) -> None:
    """vLLM's CPU shape (blocks of 32, head_dim 128, 4 query heads per KV head): decodes, a prefill longer than one
    query tile on cached tokens, a window that starts inside a block, soft-cap; blocks shuffled."""
    requests = [(200, 1), (37, 45), (0, 70), (95, 1)]
    for sliding_window, softcap in ((None, None), (50, 30.0)):
        case = make_case(7, dtype, requests, block_size=32, num_kv_heads=2, group=4, head_dim=128,
                         sliding_window=sliding_window, softcap=softcap, num_pad=3)  # fmt: skip
        with interpret(False):
            check_against_spec(case, dtype)


def test_paged_attention_same_answer_on_any_thread_count() -> None:
    """Each work item is computed by one thread in a fixed order, so the thread count changes no bit."""
    case = make_case(9, torch.float32, MIXED, block_size=4, num_kv_heads=2, group=3, head_dim=12, sliding_window=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with interpret(False):
            one = run_fast(case, torch.float32)
        torch.set_num_threads(2)
        with interpret(False):
            two = run_fast(case, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("sliding_window", [None, 23])
def test_prompt_rows_same_answer_with_any_number_of_tiles_per_item(sliding_window: int | None) -> None:
    """plan_items puts up to TILES_PER_ITEM tiles of queries in one item (fewer when the threads want more items);
    an item copies each block once for its tiles, and each tile's arithmetic stays the same: no bit changes."""
    from fast.cpu.attention import TILES_PER_ITEM, plan_items, query_tile
    from fast.cpu.prefill import prefill_kernel

    group, tile = 4, query_tile(4)
    case = make_case(3, torch.float32, [(40, 7 * tile + 5), (0, 3 * tile), (9, 2)], block_size=8, num_kv_heads=2,
                     group=group, head_dim=32, sliding_window=sliding_window)  # fmt: skip
    num_blocks, block_size, num_kv_heads, head_dim = case.key_cache.shape
    key, value = (np.ascontiguousarray(c, np.float32).reshape(-1) for c in (case.key_cache, case.value_cache))
    strides = np.array([block_size * num_kv_heads * head_dim, num_kv_heads * head_dim, head_dim], np.int64)
    ones, query = np.ones(num_kv_heads, np.float32), case.query.astype(np.float32)
    outs, sizes = [], []
    for min_items in (1, 10**9):  # as many tiles per item as the plan takes; one tile per item
        items, *_ = plan_items(case.seq_lens, case.query_start_loc, case.block_table, query.shape[0], num_blocks,
                               block_size, num_kv_heads, group, tile, sliding_window or 0, min_items)  # fmt: skip
        out = np.zeros_like(query)
        prefill_kernel(out, query, key, value, strides, case.block_table, items, tile, group, head_dim, block_size,
                       np.float32(case.kwargs["scale"]), sliding_window or 0, np.float32(0.0), ones, ones)  # fmt: skip
        outs.append(out)
        sizes.append(int((items[:, 2] - items[:, 1]).max()))
    assert sizes == [min(TILES_PER_ITEM * tile, 7 * tile + 5), tile]  # the first row's 8 tiles in one item; one each
    assert np.array_equal(outs[0], outs[1], equal_nan=True)
    n = case.num_tokens
    assert np.isfinite(outs[0][: n - 2]).all()  # every prompt row computed (the decode row is not the kernel's)


@pytest.mark.parametrize("bad", ["block id", "table width", "queries past seq_len", "query rows"])
def test_paged_attention_refuses_reads_outside_the_tensors(bad: str) -> None:
    """The CPU kernel has no bounds checks of its own: its planner refuses any batch that would read outside."""
    case = make_case(4, torch.float32, [(5, 1), (2, 3)], block_size=4, num_kv_heads=1, group=2, head_dim=8)
    q, k, v = (torch.from_numpy(a).float() for a in (case.query, case.key_cache, case.value_cache))
    bt, sl, qsl = (torch.from_numpy(a.copy()) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    if bad == "block id":
        bt[1, 0] = k.shape[0]
    elif bad == "table width":
        sl[0] = 4 * bt.shape[1] + 1
    elif bad == "queries past seq_len":
        sl[1] = 2
    else:
        qsl[-1] = q.shape[0] + 1
    with interpret(False), pytest.raises(ValueError, match="paged_attention"):
        paged_attention(q, k, v, bt, sl, qsl, scale=0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_conversions_to_and_from_float32_round_as_torch_does(dtype: torch.dtype) -> None:
    """fast.cpu.attention converts the query and the output on the calling thread (compiled loops; NumPy for a
    float16 output), no torch parallel region: bit for bit torch's conversion, ties to even, overflow, subnormals
    and signed zeros included; NaN stays NaN."""
    from fast.cpu.attention import as_float32, narrowed

    gen = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-45, 39, (20000,), generator=gen).double()
    values = (torch.randn(20000, generator=gen, dtype=torch.float64) * magnitudes).float()
    ties = torch.tensor([1.00390625, 1.01171875, -1.00390625, 65520.0, 3.3961776e38, -0.0, 0.0, float("inf")])
    values = torch.cat([values, ties, torch.tensor([float("nan"), -float("nan")])]).reshape(-1, 2, 5)
    mine, torchs = narrowed(values.clone(), dtype), values.to(dtype)
    finite = ~values.isnan()
    assert torch.equal(mine.view(torch.int16)[finite], torchs.view(torch.int16)[finite])
    assert mine.isnan().equal(values.isnan())
    assert torch.equal(as_float32(torchs).view(torch.int32)[finite], torchs.float().view(torch.int32)[finite])
    assert as_float32(torchs).isnan().equal(values.isnan())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_receives_the_result_and_its_padding_rows_are_zeroed(mode: str, dtype: torch.dtype) -> None:
    """An engine's reused buffer, full of an earlier layer's values (NaN here): the same bits as a fresh output."""
    case = make_case(5, dtype, MIXED, block_size=4, num_kv_heads=2, group=3, head_dim=12, sliding_window=6,
                     num_pad=3)  # fmt: skip
    expected = run_fast(case, dtype)
    floats = (torch.from_numpy(a).to(dtype) for a in (case.query, case.key_cache, case.value_cache))
    ints = (torch.from_numpy(a) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    out = torch.full(expected.shape, float("nan"), dtype=dtype)
    got = paged_attention(*floats, *ints, **case.kwargs, out=out)  # type: ignore[arg-type]
    assert got is out
    assert torch.equal(out, expected)


def test_a_bad_out_is_refused_and_a_refused_call_leaves_out_as_it_was(mode: str) -> None:
    case = make_case(6, torch.float32, [(5, 1), (2, 3)], block_size=4, num_kv_heads=1, group=2, head_dim=8,
                     num_pad=2)  # fmt: skip
    q, k, v = (torch.from_numpy(a).float() for a in (case.query, case.key_cache, case.value_cache))
    bt, sl, qsl = (torch.from_numpy(a.copy()) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    bad_outs = {
        "out must be": torch.zeros(q.shape[0] + 1, *q.shape[1:]),
        "out must be .*float32 .*got .*float64": torch.zeros(q.shape, dtype=torch.float64),
        "out must be contiguous": torch.zeros(tuple(reversed(q.shape))).permute(2, 1, 0),
        "shares its memory with query": q,
    }
    for match, out in bad_outs.items():
        before = out.clone()
        with pytest.raises(ValueError, match=match):
            paged_attention(q, k, v, bt, sl, qsl, scale=0.5, out=out)
        torch.testing.assert_close(out, before, rtol=0, atol=0, equal_nan=True)  # the query's NaN padding too
    out = torch.full(q.shape, 7.0)
    bt[1, 0] = k.shape[0]  # a block id outside the cache: refused by the CPU planner before any write
    with interpret(False), pytest.raises(ValueError, match="block id outside the cache"):
        paged_attention(q, k, v, bt, sl, qsl, scale=0.5, out=out)
    assert (out == 7.0).all()
