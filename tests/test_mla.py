"""MLA's latent KV cache: the mla group's config, write_mla_kv, and the two attention forms, spec and fast.

Expectations come from outside the code under test: write positions by hand, attention from a dense float64
formulation written here over each request's latents as a plain array (no cache, no block table), and the
tolerance rule of conformance/tolerance.py for the low-precision dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import fast
import spec
from conformance.tolerance import as_float64, assert_attention_close, assert_quantized_close, round_to, spec_in_dtype
from spec.fp8 import KV_CACHE_DTYPES, Fp8Format, decode, encode
from spec.types import PAD_SLOT_ID, KVCacheGroup, WorkerConfig

DTYPES = ["float32", "float16", "bfloat16"]
L, R, H, P, V = 6, 4, 3, 5, 7  # kv_lora_rank, rope_dim, heads, qk_nope_head_dim, v_head_dim
BLOCK_SIZE = 4
SCALE = 0.37


# ---- config --------------------------------------------------------------------------------------------------


def test_mla_group_config_and_refusals() -> None:
    group = KVCacheGroup(64, 10, kind="mla", kv_lora_rank=512, qk_rope_head_dim=64)
    assert group.latent_width == 576 and spec.mla_cache_shape(group) == (10, 64, 576)
    assert KVCacheGroup(16, 4, kind="mla", kv_lora_rank=8).latent_width == 8  # a NoPE latent: rope_dim 0
    bad = [
        dict(kind="mla", kv_lora_rank=8, qk_rope_head_dim=4, sliding_window=8),  # no window for MLA
        dict(kind="mla", kv_lora_rank=0, qk_rope_head_dim=4),
        dict(kind="mla", kv_lora_rank=8, qk_rope_head_dim=3),  # RoPE rotates pairs
        dict(kind="mla", kv_lora_rank=8, qk_rope_head_dim=-2),
        dict(kind="mla", kv_lora_rank=8.0, qk_rope_head_dim=4),
        dict(kind="attention", kv_lora_rank=8),  # latent widths on a group that holds no latent
        dict(kind="mamba", qk_rope_head_dim=4),
    ]
    for fields in bad:
        with pytest.raises(ValueError, match=r"KVCacheGroup\.(kv_lora_rank|qk_rope_head_dim)|mla group|integer"):
            KVCacheGroup(16, 4, **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mla_cache_shape: group must be an mla group"):
        spec.mla_cache_shape(KVCacheGroup(16, 4))


@pytest.mark.parametrize("impl", [spec, fast], ids=["spec", "fast"])
def test_mla_group_takes_attention_slots(impl: Any) -> None:
    """An mla group's table and slots follow the attention rules: block * block_size + offset, by hand."""
    groups = (KVCacheGroup(4, 16), KVCacheGroup(2, 16, kind="mla", kv_lora_rank=8, qk_rope_head_dim=2))
    pool = impl.RequestStatePool(WorkerConfig(2, 16, 16, 50, groups))
    sched = spec.SchedulerOutput(
        new_requests=(spec.NewRequest("a", (1, 2, 3, 4, 5), ((3, 1), (7, 2, 9))),),
        num_scheduled_tokens={"a": 5},
    )
    pool.apply(sched)
    batch = pool.prepare(sched)
    slots = [np.asarray(s).tolist() for s in batch.slot_mappings]
    assert slots[0] == [12, 13, 14, 15, 4]  # block 3 offsets 0-3, block 1 offset 0
    assert slots[1] == [14, 15, 4, 5, 18]  # blocks 7, 2, 9 of size 2


# ---- write_mla_kv -------------------------------------------------------------------------------------------


def _np(x: torch.Tensor) -> np.ndarray:
    return as_float64(x) if x.is_floating_point() else x.numpy()


@pytest.mark.parametrize("rope", [R, 0], ids=["rope", "nope"])
def test_write_mla_kv_positions_by_hand(mode: str, rope: int) -> None:
    """Token t's [kv_c[t], k_pe[t]] lands at (slot // bs, slot % bs); PAD_SLOT_ID writes nothing; rest untouched."""
    kv_c = torch.arange(4 * L, dtype=torch.float32).reshape(4, L) + 1  # [T, L], no zeros
    k_pe = -torch.arange(4 * rope, dtype=torch.float32).reshape(4, rope) - 1  # [T, rope]; 0: a NoPE latent
    slots = torch.tensor([5, PAD_SLOT_ID, 0, 14])
    want = np.zeros((4, BLOCK_SIZE, L + rope))
    for t, (block, offset) in {0: (1, 1), 2: (0, 0), 3: (3, 2)}.items():
        want[block, offset, :L], want[block, offset, L:] = kv_c[t].numpy(), k_pe[t].numpy()
    for impl, convert in ((spec, torch.Tensor.numpy), (fast, lambda x: x)):
        cache = convert(torch.zeros(4, BLOCK_SIZE, L + rope))
        impl.write_mla_kv(cache, convert(kv_c), convert(k_pe), convert(slots))
        np.testing.assert_array_equal(np.asarray(cache), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_write_mla_kv_copies_bits_through_strided_views(mode: str, dtype: torch.dtype) -> None:
    """kv_c a slice of a wider projection and the cache a view of padded blocks, as engines pass them."""
    gen = torch.Generator().manual_seed(1)
    projection = torch.randn(5, L + R + 3, generator=gen).to(dtype)
    kv_c, k_pe = projection[:, :L], projection[:, L : L + R]
    backing = torch.zeros(6, BLOCK_SIZE + 2, L + R, dtype=dtype)
    cache = backing[:, :BLOCK_SIZE]  # block stride past block_size * width
    slots = torch.tensor([9, 2, PAD_SLOT_ID, 23, 12])
    fast.write_mla_kv(cache, kv_c, k_pe, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot != PAD_SLOT_ID:
            got = cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]
            assert torch.equal(got.view(torch.int16), torch.cat([kv_c[t], k_pe[t]]).view(torch.int16))
    assert int(torch.count_nonzero(backing[:, BLOCK_SIZE:])) == 0 and int(torch.count_nonzero(cache)) <= 4 * (L + R)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_type", ["uint8", "float8"])
def test_write_mla_kv_fp8_matches_spec(mode: str, kv_cache_dtype: str, dtype: torch.dtype, cache_type: str) -> None:
    """Every element, latent and RoPE part, stored as encode(float32(x) / k_scale): fast's codes are spec's, and
    within the format's bound of the quotient (saturated past its largest value)."""
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    assert fmt is not None
    gen = torch.Generator().manual_seed(2)
    kv_c = (torch.randn(6, L, generator=gen) * torch.logspace(-4, 3, L)).to(dtype)  # subnormal to saturating
    k_pe = (torch.randn(6, R, generator=gen) * 40).to(dtype)
    slots = torch.tensor([3, 0, PAD_SLOT_ID, 10, 7, 1])
    k_scale = 0.011  # small: the largest latents saturate in e4m3
    codes = np.zeros((3, BLOCK_SIZE, L + R), np.uint8)
    spec_args = [_np(kv_c).astype(np.float32), _np(k_pe).astype(np.float32), slots.numpy()]
    if dtype == torch.float16:
        spec_args[:2] = [a.astype(np.float16) for a in spec_args[:2]]
    spec.write_mla_kv(codes, *spec_args, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)
    cache = torch.zeros(3, BLOCK_SIZE, L + R, dtype=torch.uint8)
    if cache_type == "float8":
        cache = cache.view(fast.fp8.torch_dtype(fmt))
    fast.write_mla_kv(cache, kv_c, k_pe, slots, kv_cache_dtype=kv_cache_dtype, k_scale=torch.tensor([k_scale]))
    got = cache.view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, codes)
    real = [t for t, s in enumerate(slots.tolist()) if s != PAD_SLOT_ID]
    written = got.reshape(-1, L + R)[slots[real].numpy()]  # [num_real, L + R]
    source = np.concatenate([_np(kv_c), _np(k_pe)], axis=1)[real]
    assert_quantized_close(written, source, np.float32(k_scale), fmt)


@pytest.mark.parametrize("impl", [spec, fast], ids=["spec", "fast"])
def test_write_mla_kv_refusals_leave_the_cache(mode: str, impl: Any) -> None:
    convert: Callable[[torch.Tensor], Any] = torch.Tensor.numpy if impl is spec else (lambda x: x)
    cache = convert(torch.ones(3, BLOCK_SIZE, L + R))
    kv_c, k_pe, slots = torch.ones(2, L), torch.ones(2, R), torch.tensor([0, 1])
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("no head axis", (convert(torch.ones(3, BLOCK_SIZE, 1, L + R)), kv_c, k_pe, slots), {}),
        ("entries are 10 wide", (cache, torch.ones(2, L + 1), k_pe, slots), {}),
        ("even rope_dim", (cache, torch.ones(2, L + 1), torch.ones(2, R - 1), slots), {}),
        ("k_pe is float16", (cache, kv_c, k_pe.half(), slots), {}),
        ("kv_c is float16", (cache, kv_c.half(), k_pe.half(), slots), {}),
        ("slot_mapping must be int32 or int64", (cache, kv_c, k_pe, slots.float()), {}),
        ("slot_mapping .* must be", (cache, kv_c, k_pe, torch.tensor([0])), {}),
        ("outside", (cache, kv_c, k_pe, torch.tensor([0, 3 * BLOCK_SIZE])), {}),
        ("k_scale applies to fp8 caches only", (cache, kv_c, k_pe, slots), {"k_scale": 0.5}),
        ("k_scale must be one value", (cache, kv_c, k_pe, slots), {"k_scale": torch.ones(2)}),
        ("kv_cache must be one of", (cache, kv_c, k_pe, slots), {"kv_cache_dtype": "fp8"}),
        ("kv_cache_dtype must be one of", (cache, kv_c, k_pe, slots), {"kv_cache_dtype": "int8"}),
    ]
    for message, args, kwargs in calls:
        args = tuple(convert(a) if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(ValueError, match=message):
            impl.write_mla_kv(*args, **kwargs)
        assert (np.asarray(cache) == 1).all(), message


# ---- attention ------------------------------------------------------------------------------------------------


class Case:
    """Three requests over a shuffled block table: a decode of 1 token, a 1 + K = 3 token verify row, and a prefill
    chunk of 5 tokens after 6 cached ones. Dense per-request latents, the weights and the queries in float64."""

    query_lens = (1, 3, 5)
    seq_lens = (7, 4, 11)

    def __init__(self, dtype: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        num_blocks = 1 + sum(-(-s // BLOCK_SIZE) for s in self.seq_lens)
        ids = rng.permutation(np.arange(1, num_blocks))
        self.block_table = np.zeros((3, 3), np.int32)
        start = 0
        for b, seq_len in enumerate(self.seq_lens):
            n = -(-seq_len // BLOCK_SIZE)
            self.block_table[b, :n], start = ids[start : start + n], start + n
        self.latents = [round_to(rng.normal(size=(s, L)), dtype) for s in self.seq_lens]  # per request [S, L]
        self.k_pe = [round_to(rng.normal(size=(s, R)), dtype) for s in self.seq_lens]  # per request [S, R]
        num_tokens = sum(self.query_lens) + 2  # 2 padding rows
        self.q_nope = round_to(rng.normal(size=(num_tokens, H, P)), dtype)
        self.q_pe = round_to(rng.normal(size=(num_tokens, H, R)), dtype)
        self.w_uk = round_to(rng.normal(size=(L, H, P)) / np.sqrt(L), dtype)
        self.w_uv = round_to(rng.normal(size=(L, H, V)) / np.sqrt(L), dtype)
        self.q_latent = round_to(np.einsum("thp,lhp->thl", self.q_nope, self.w_uk), dtype)  # the absorbed query
        self.query_start_loc = np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)
        self.seq_lens_np = np.array(self.seq_lens, np.int32)
        self.cache = np.zeros((num_blocks, BLOCK_SIZE, L + R))  # float64, values representable in dtype
        for b, seq_len in enumerate(self.seq_lens):
            pos = np.arange(seq_len)
            slots = self.block_table[b, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            spec.write_mla_kv(self.cache, self.latents[b], self.k_pe[b], slots)

    def dense(
        self, latents: list[np.ndarray] | None = None, k_pe: list[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(absorbed [T, H, L], prefill [T, H, V]) in float64, query by query and head by head."""
        latents, k_pe = latents or self.latents, k_pe or self.k_pe
        absorbed = np.zeros(self.q_latent.shape)
        prefill = np.zeros((self.q_nope.shape[0], H, V))
        for b, (q_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens, strict=True)):
            c, pe = latents[b], k_pe[b]
            for i in range(q_len):
                t, position = int(self.query_start_loc[b]) + i, seq_len - q_len + i
                seen = slice(0, position + 1)
                for h in range(H):
                    keys = c[seen] @ self.w_uk[:, h, :]  # [k, P]
                    values = c[seen] @ self.w_uv[:, h, :]  # [k, V]
                    rope = pe[seen] @ self.q_pe[t, h]
                    w = _softmax((keys @ self.q_nope[t, h] + rope) * SCALE)
                    prefill[t, h] = w @ values
                    w = _softmax((c[seen] @ self.q_latent[t, h] + rope) * SCALE)
                    absorbed[t, h] = w @ c[seen]
        return absorbed, prefill

    def decode_args(self) -> tuple[np.ndarray, ...]:
        return self.q_latent, self.q_pe, self.cache

    def prefill_args(self) -> tuple[np.ndarray, ...]:
        return self.q_nope, self.q_pe, self.cache, self.w_uk, self.w_uv

    def indices(self) -> tuple[np.ndarray, ...]:
        return self.block_table, self.seq_lens_np, self.query_start_loc


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _torch(x: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(getattr(torch, dtype)) if t.is_floating_point() else t


def test_absorbed_and_prefill_forms_agree_in_float64() -> None:
    """absorbed output @ W_UV == prefill output (q_latent = q_nope @ W_UK^T per head), both equal to dense."""
    case = Case("float64")
    dense_absorbed, dense_prefill = case.dense()
    np.testing.assert_allclose(np.einsum("thl,lhv->thv", dense_absorbed, case.w_uv), dense_prefill, atol=1e-12)
    absorbed = spec.mla_decode_attention(*case.decode_args(), *case.indices(), scale=SCALE)
    prefill = spec.mla_prefill_attention(*case.prefill_args(), *case.indices(), scale=SCALE)
    np.testing.assert_allclose(absorbed, dense_absorbed, atol=1e-12)
    np.testing.assert_allclose(prefill, dense_prefill, atol=1e-12)
    np.testing.assert_allclose(np.einsum("thl,lhv->thv", absorbed, case.w_uv), prefill, atol=1e-12)
    assert not absorbed[-2:].any() and not prefill[-2:].any()  # padding rows are zero


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_mla_forms_match_dense_reference(mode: str, dtype: str, form: str) -> None:
    """fast in each dtype within the flash-attention rule of the dense float64 reference; spec in float64 equals it."""
    case = Case(dtype, seed=3)
    dense = case.dense()[0 if form == "decode" else 1]
    fn_spec = spec.mla_decode_attention if form == "decode" else spec.mla_prefill_attention
    fn_fast = fast.mla_decode_attention if form == "decode" else fast.mla_prefill_attention
    float_args = case.decode_args() if form == "decode" else case.prefill_args()
    np.testing.assert_allclose(fn_spec(*float_args, *case.indices(), scale=SCALE), dense, atol=1e-12)
    low = spec_in_dtype(fn_spec, dtype, float_args, *case.indices(), scale=SCALE)
    got = fn_fast(*(_torch(a, dtype) for a in float_args), *(_torch(a, dtype) for a in case.indices()), scale=SCALE)
    assert got.dtype == getattr(torch, dtype)
    assert_attention_close(got, dense, low, dtype)
    assert not got[-2:].any()  # padding rows exactly zero


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_mla_forms_read_fp8_caches(mode: str, kv_cache_dtype: str, dtype: str, form: str) -> None:
    """Over an fp8 cache both forms read decode(code) * k_scale: the dense reference on those values, exactly."""
    case = Case(dtype, seed=4)
    fmt: Fp8Format | None = KV_CACHE_DTYPES[kv_cache_dtype]
    assert fmt is not None
    k_scale = 0.05
    codes = np.zeros(case.cache.shape, np.uint8)
    for b, seq_len in enumerate(case.seq_lens):
        pos = np.arange(seq_len)
        slots = case.block_table[b, pos // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        spec.write_mla_kv(codes, case.latents[b].astype(np.float32), case.k_pe[b].astype(np.float32), slots,
                          kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)  # fmt: skip
    stored = [decode(encode(np.concatenate([c, pe], 1).astype(np.float32) / np.float32(k_scale), fmt), fmt)
              * np.float32(k_scale) for c, pe in zip(case.latents, case.k_pe, strict=True)]  # fmt: skip
    dense = case.dense([s[:, :L] for s in stored], [s[:, L:] for s in stored])[0 if form == "decode" else 1]
    fn_spec = spec.mla_decode_attention if form == "decode" else spec.mla_prefill_attention
    fn_fast = fast.mla_decode_attention if form == "decode" else fast.mla_prefill_attention
    floats = (case.q_latent, case.q_pe) if form == "decode" else (case.q_nope, case.q_pe)
    weights = () if form == "decode" else (case.w_uk, case.w_uv)
    options: dict[str, Any] = dict(scale=SCALE, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)

    def spec_call(*f: np.ndarray) -> np.ndarray:
        return fn_spec(f[0], f[1], codes, *f[2:], *case.indices(), **options)

    np.testing.assert_allclose(spec_call(*(a.astype(np.float64) for a in (*floats, *weights))), dense, atol=1e-12)
    low = spec_in_dtype(spec_call, dtype, (*floats, *weights))
    t = [_torch(a, dtype) for a in (*floats, *weights)]
    got = fn_fast(t[0], t[1], torch.from_numpy(codes), *t[2:], *(_torch(a, dtype) for a in case.indices()), **options)
    assert_attention_close(got, dense, low, dtype)


@pytest.mark.parametrize("impl", [spec, fast], ids=["spec", "fast"])
def test_mla_attention_refusals(impl: Any) -> None:
    case = Case("float32")
    convert: Callable[[np.ndarray], Any] = (lambda a: a) if impl is spec else (lambda a: torch.from_numpy(a))
    q_latent, q_pe, cache, w_uk, w_uv = (convert(a.astype(np.float32)) for a in (case.q_latent, case.q_pe, case.cache,
                                                                                case.w_uk, case.w_uv))  # fmt: skip
    idx = tuple(convert(a) for a in case.indices())
    q_nope = convert(case.q_nope.astype(np.float32))
    decode_calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("kv_lora_rank=6", (q_nope, q_pe, cache), {}),  # a query not absorbed into latent space
        ("no head axis", (q_latent, q_pe, convert(np.zeros((3, 4, 1, L + R), np.float32))), {}),
        ("even rope_dim", (q_latent, q_pe[:, :, :3], cache), {}),
        ("q_pe is float64", (q_latent, convert(case.q_pe), cache), {}),
        ("query is float32, kv_cache float64", (q_latent, q_pe, convert(case.cache)), {}),
        ("scale must be a real number", (q_latent, q_pe, cache), {"scale": True}),
        ("k_scale applies to fp8 caches only", (q_latent, q_pe, cache), {"k_scale": 2.0}),
    ]
    for message, args, kwargs in decode_calls:
        with pytest.raises(ValueError, match=message):
            impl.mla_decode_attention(*args, *idx, **{"scale": SCALE, **kwargs})
    with pytest.raises(ValueError, match="seq_lens must be int32 or int64"):
        impl.mla_decode_attention(q_latent, q_pe, cache, idx[0], convert(case.seq_lens_np.astype(np.float32)),
                                     idx[2], scale=SCALE)  # fmt: skip
    prefill_calls = [
        ("w_uk .* must be", (q_nope, q_pe, cache, w_uv, w_uv)),
        ("w_uv .* must be", (q_nope, q_pe, cache, w_uk, w_uk[:, :2])),
        ("w_uk is float64", (q_nope, q_pe, cache, convert(case.w_uk), w_uv)),
    ]
    for message, args in prefill_calls:
        with pytest.raises(ValueError, match=message):
            impl.mla_prefill_attention(*args, *idx, scale=SCALE)
