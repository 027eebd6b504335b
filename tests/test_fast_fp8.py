"""fp8 KV caches in fast against spec, in both CPU modes: write_kv's codes bit for bit, attention by the rule.

The attention cases are tests/test_fast_attention.py's (every slot attention must not read holds NaN, here
the NaN code), quantized per tensor or per KV head; the comparison is conformance.tolerance's fp8 rule
(references on the same codes). A cache whose element offsets pass 2**31 is addressed without allocating
it: 2 GiB of address space of which only the few blocks used are ever touched.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import spec
from conformance.tolerance import assert_attention_close, assert_quantized_close, spec_in_dtype
from fast.attention import paged_attention
from fast.fp8 import TORCH_DTYPES
from fast.kv_cache import write_kv
from fast.runtime import HAVE_TRITON, interpret
from spec.fp8 import KV_CACHE_DTYPES, Fp8Format, encode
from spec.types import PAD_SLOT_ID
from tests.test_fast_attention import CASES, make_case

KV_DTYPES = ["fp8_e4m3", "fp8_e5m2"]
SOURCE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _format(kv_cache_dtype: str) -> Fp8Format:
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    assert fmt is not None
    return fmt


def _scales(kind: str, num_kv_heads: int, rng: np.random.Generator) -> np.ndarray:  # [1] or [num_kv_heads]
    """Scales that are not powers of two, so the division rounds; one small enough that large keys saturate."""
    if kind == "per-tensor":
        return np.array([0.37], np.float32)
    return rng.choice(np.array([0.011, 0.37, 1.9, 5.3], np.float32), num_kv_heads, replace=False)


def _as_argument(scales: np.ndarray, on: str) -> Any:
    """A per-tensor scale as a Python float, per head as an array (spec) or tensor (fast)."""
    if scales.shape == (1,):
        return float(scales[0])
    return scales if on == "spec" else torch.from_numpy(scales)


# ---- write_kv -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=str)
@pytest.mark.parametrize("scale_kind", ["per-tensor", "per-head"])
@pytest.mark.parametrize("cache_type", ["uint8", "float8"])
def test_write_kv_fp8_matches_spec(mode: str, kv_cache_dtype: str, dtype: torch.dtype, scale_kind: str,
                                   cache_type: str) -> None:  # fmt: skip
    """Codes equal spec's; each stored value is within the format's quantization bound (or saturated)."""
    fmt = _format(kv_cache_dtype)
    rng = np.random.default_rng(len(kv_cache_dtype) + len(scale_kind))
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 7, 4, 3, 20, 18
    magnitudes = rng.choice([1e-4, 1.0, 30.0, 3e4], (num_tokens, num_kv_heads, head_dim))  # subnormal to saturated
    key = torch.from_numpy(rng.standard_normal((num_tokens, num_kv_heads, head_dim)) * magnitudes).to(dtype)
    value = torch.from_numpy(rng.standard_normal((num_tokens, num_kv_heads, head_dim))).to(dtype)
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False)
    slots[[2, 9]] = PAD_SLOT_ID
    k_scales, v_scales = _scales(scale_kind, num_kv_heads, rng), _scales(scale_kind, num_kv_heads, rng)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    initial = rng.integers(0, 256, shape).astype(np.uint8)  # slots not written keep whatever they held
    expected_k, expected_v = initial.copy(), initial.copy()
    key32, value32 = key.float().numpy(), value.float().numpy()  # exact: NumPy has no bfloat16
    if dtype == torch.float16:
        key32, value32 = key.numpy(), value.numpy()  # spec on float16 itself
    spec.write_kv(expected_k, expected_v, key32, value32, slots, kv_cache_dtype=kv_cache_dtype,
                  k_scale=_as_argument(k_scales, "spec"), v_scale=_as_argument(v_scales, "spec"))  # fmt: skip
    key_cache, value_cache = torch.from_numpy(initial.copy()), torch.from_numpy(initial.copy())
    if cache_type == "float8":
        key_cache, value_cache = key_cache.view(TORCH_DTYPES[fmt.name]), value_cache.view(TORCH_DTYPES[fmt.name])
    write_kv(key_cache, value_cache, key, value, torch.from_numpy(slots), kv_cache_dtype=kv_cache_dtype,
             k_scale=_as_argument(k_scales, "fast"), v_scale=_as_argument(v_scales, "fast"))  # fmt: skip
    got_k, got_v = key_cache.view(torch.uint8).numpy(), value_cache.view(torch.uint8).numpy()
    np.testing.assert_array_equal(got_k, expected_k)
    np.testing.assert_array_equal(got_v, expected_v)
    real = slots != PAD_SLOT_ID
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    for codes, x, scales in ((got_k, key32, k_scales), (got_v, value32, v_scales)):
        assert_quantized_close(codes[blocks, offsets], x[real], scales[None, :, None], fmt)
    saturated = np.abs(key32[real] / k_scales[None, :, None]) > fmt.max_value
    assert saturated.any() and (got_k[blocks, offsets][saturated] & 0x7F == fmt.max_code).all()


def _write_case(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(5)
    key_cache, value_cache = torch.zeros(4, 4, 2, 8, dtype=torch.uint8), torch.zeros(4, 4, 2, 8, dtype=torch.uint8)
    key, value = (torch.from_numpy(rng.standard_normal((5, 2, 8))).to(dtype) for _ in "kv")
    return key_cache, value_cache, key, value, torch.arange(5)


BAD_WRITES: dict[str, tuple[dict[str, Any], str]] = {
    "zero scale": ({"k_scale": 0.0}, "k_scale must be finite and > 0"),
    "negative scale": ({"v_scale": -1.0}, "v_scale must be finite and > 0"),
    "nan scale": ({"k_scale": float("nan")}, "k_scale must be finite and > 0"),
    "inf scale": ({"k_scale": float("inf")}, "k_scale must be finite and > 0"),
    "scale underflowing float32": ({"k_scale": 1e-50}, "k_scale must be finite and > 0"),
    "one head's scale zero": ({"k_scale": np.array([1.0, 0.0], np.float32)}, "k_scale must be finite and > 0"),
    "three scales for two heads": ({"v_scale": np.ones(3, np.float32)}, r"v_scale must be one value or \[num_kv"),
    "2-d scale": ({"k_scale": np.ones((2, 1), np.float32)}, r"k_scale must be one value or \[num_kv"),
    "integer scale array": ({"k_scale": np.ones(2, np.int32)}, "k_scale must hold floats"),
    "bool scale": ({"k_scale": True}, "k_scale must be a real number"),
    "unknown cache dtype": ({"kv_cache_dtype": "fp8_e4m3fnuz"}, "kv_cache_dtype must be one of"),
    "scale on an auto cache": ({"kv_cache_dtype": "auto", "k_scale": 2.0}, "k_scale applies to fp8 caches only"),
}


@pytest.mark.parametrize("bad", list(BAD_WRITES))
def test_write_kv_fp8_refusals(mode: str, bad: str) -> None:
    """Both backends refuse with ValueError naming the argument, and the caches stay as they were."""
    kwargs: dict[str, Any] = {"kv_cache_dtype": "fp8_e4m3", **BAD_WRITES[bad][0]}
    message = BAD_WRITES[bad][1]
    key_cache, value_cache, key, value, slots = _write_case()
    if kwargs["kv_cache_dtype"] == "auto":
        key_cache, value_cache = key_cache.float(), value_cache.float()
    before = key_cache.clone(), value_cache.clone()
    fast_kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        write_kv(key_cache, value_cache, key, value, slots, **fast_kwargs)
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])
    with pytest.raises(ValueError, match=message):
        spec.write_kv(key_cache.numpy().copy(), value_cache.numpy().copy(), key.numpy(), value.numpy(),
                      slots.numpy(), **kwargs)  # fmt: skip


def test_write_kv_fp8_refuses_mismatched_dtypes(mode: str) -> None:
    key_cache, value_cache, key, value, slots = _write_case()
    with pytest.raises(ValueError, match="key_cache must be one of"):  # a float cache named fp8
        write_kv(key_cache.float(), value_cache.float(), key, value, slots, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="key_cache must be one of"):  # e5m2 codes typed as e4m3
        write_kv(key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn), key, value, slots,
                 kv_cache_dtype="fp8_e5m2")  # fmt: skip
    with pytest.raises(ValueError, match="key and value must share one of"):
        write_kv(key_cache, value_cache, key.double(), value.double(), slots, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="key and value must share one of"):
        spec.write_kv(key_cache.numpy(), value_cache.numpy(), key.double().numpy(), value.double().numpy(),
                      slots.numpy(), kv_cache_dtype="fp8")  # fmt: skip
    with pytest.raises(ValueError, match="key is float32, key_cache uint8"):  # codes without kv_cache_dtype
        write_kv(key_cache, value_cache, key, value, slots)


# ---- paged_attention ------------------------------------------------------------------------------------------

ATTENTION_CASES = ["gqa3-hd12-bs4", "softcap-window3-pad", "gqa16-long-prefill", "gqa8-window1-decode"]
# the interpreter is slow: every case and format in float16, one case in the others
INTERPRETED = {(name, kv, dt) for name in ATTENTION_CASES for kv in KV_DTYPES for dt in SOURCE_DTYPES
               if dt == torch.float16 or name == "gqa3-hd12-bs4"}  # fmt: skip


ENGINE_SHAPE = dict(requests=[(200, 1), (37, 45), (0, 70), (95, 1)], block_size=32, num_kv_heads=2, group=4,
                    head_dim=128, sliding_window=50, num_pad=3)  # fmt: skip


def check_fp8_attention(name: str, kv_cache_dtype: str, dtype: torch.dtype, scale_kind: str, cache_type: str) -> None:
    fmt = _format(kv_cache_dtype)
    case = make_case(len(name), dtype, **(ENGINE_SHAPE if name == "engine" else CASES[name]))  # type: ignore[arg-type]
    rng = np.random.default_rng(len(name) + len(scale_kind))
    num_kv_heads = case.key_cache.shape[2]
    k_scales, v_scales = _scales(scale_kind, num_kv_heads, rng), _scales(scale_kind, num_kv_heads, rng)
    with np.errstate(invalid="ignore"):  # the NaN slots: NaN codes, so a stray read still shows
        k_codes = encode(case.key_cache / k_scales[None, None, :, None], fmt)
        v_codes = encode(case.value_cache / v_scales[None, None, :, None], fmt)
    ints = (case.block_table, case.seq_lens, case.query_start_loc)
    kwargs: dict[str, Any] = {**case.kwargs, "kv_cache_dtype": kv_cache_dtype}
    spec_scales = {"k_scale": _as_argument(k_scales, "spec"), "v_scale": _as_argument(v_scales, "spec")}
    ref64 = spec.paged_attention(case.query, k_codes, v_codes, *ints, **kwargs, **spec_scales)
    low = spec_in_dtype(spec.paged_attention, dtype, (case.query,), k_codes, v_codes, *ints, **kwargs, **spec_scales)
    key_cache, value_cache = torch.from_numpy(k_codes), torch.from_numpy(v_codes)
    if cache_type == "float8":
        key_cache, value_cache = key_cache.view(TORCH_DTYPES[fmt.name]), value_cache.view(TORCH_DTYPES[fmt.name])
    out = paged_attention(
        torch.from_numpy(case.query).to(dtype), key_cache, value_cache, *(torch.from_numpy(a) for a in ints),
        **kwargs, k_scale=_as_argument(k_scales, "fast"), v_scale=_as_argument(v_scales, "fast"),
    )  # fmt: skip
    n = case.num_tokens
    assert out.dtype == dtype and (out[n:] == 0).all()
    assert np.isfinite(ref64[:n]).all()  # the case reads no NaN code through spec
    assert_attention_close(out[:n], ref64[:n], low[:n], dtype)


def _attention_params() -> list[Any]:
    """Every combination in host mode; under the interpreter the INTERPRETED subset, with per-head scales."""
    params = []
    for name, kv_cache_dtype, dtype, scale_kind in itertools.product(
        ATTENTION_CASES, KV_DTYPES, SOURCE_DTYPES, ["per-tensor", "per-head"]
    ):
        values = (name, kv_cache_dtype, dtype, scale_kind)
        label = f"{name}-{kv_cache_dtype}-{str(dtype).removeprefix('torch.')}-{scale_kind}"
        params.append(pytest.param("host", *values, id=f"host-{label}"))
        if (name, kv_cache_dtype, dtype) in INTERPRETED and scale_kind == "per-head":
            params.append(pytest.param("interpret", *values, id=f"interpret-{label}", marks=pytest.mark.interpret))
    return params


@pytest.mark.parametrize(("kernel_mode", "name", "kv_cache_dtype", "dtype", "scale_kind"), _attention_params())
def test_paged_attention_fp8_matches_spec(kernel_mode: str, name: str, kv_cache_dtype: str, dtype: torch.dtype,
                                          scale_kind: str) -> None:  # fmt: skip
    if kernel_mode == "interpret" and not HAVE_TRITON:
        pytest.skip("Triton is not installed on this platform")
    with interpret(kernel_mode == "interpret"):
        check_fp8_attention(name, kv_cache_dtype, dtype, scale_kind, "uint8")


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_paged_attention_reads_torch_float8_caches(mode: str, kv_cache_dtype: str) -> None:
    check_fp8_attention("gqa3-hd12-bs4", kv_cache_dtype, torch.float32, "per-head", "float8")


def test_paged_attention_fp8_engine_shape() -> None:
    """vLLM's CPU shape (blocks of 32, head_dim 128, GQA 4): the compiled decode kernel over all KV heads and the
    kernel of rows of several queries, both with per-head scales."""
    with interpret(False):
        for kv_cache_dtype in KV_DTYPES:
            check_fp8_attention("engine", kv_cache_dtype, torch.bfloat16, "per-head", "uint8")


def test_paged_attention_fp8_refusals(mode: str) -> None:
    case = make_case(1, torch.float32, [(2, 3)], block_size=4, num_kv_heads=2, group=2, head_dim=8)
    codes = torch.zeros(case.key_cache.shape, dtype=torch.uint8)
    q = torch.from_numpy(case.query).float()
    ints = tuple(torch.from_numpy(a) for a in (case.block_table, case.seq_lens, case.query_start_loc))
    refusals: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = [
        ({"k_scale": 0.0}, "k_scale must be finite and > 0", q, codes),
        ({"v_scale": torch.tensor([1.0, float("inf")])}, "v_scale must be finite and > 0", q, codes),
        ({"k_scale": torch.ones(4)}, r"k_scale must be one value or \[num_kv_heads=2\]", q, codes),
        ({}, "query must be one of", q.double(), codes),  # fast computes in float16, bfloat16, float32
        ({}, "query must hold floats", torch.zeros(q.shape, dtype=torch.uint8), codes),
        ({"kv_cache_dtype": "auto"}, "key_cache is uint8, query float32", q, codes),
        ({}, "key_cache must be one of", q, codes.float()),
    ]
    for extra, message, query, cache in refusals:
        kwargs: dict[str, Any] = {"scale": 0.5, "kv_cache_dtype": "fp8_e4m3", **extra}
        with pytest.raises(ValueError, match=message):
            paged_attention(query, cache, cache, *ints, **kwargs)
        if query.dtype == torch.float64:
            continue  # spec computes in any float dtype: float64 is how the reference is made
        spec_kwargs = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=message):
            spec.paged_attention(query.numpy(), cache.numpy(), cache.numpy(), *(a.numpy() for a in ints),
                                 **spec_kwargs)  # fmt: skip


# ---- offsets past 2**31 -------------------------------------------------------------------------------------


def test_fp8_cache_offsets_past_int32(mode: str) -> None:
    """write_kv (int32 slot mapping) then attention in an fp8 cache of more than 2**31 elements, at blocks whose
    element offsets pass 2**31: any offset computed in int32 wraps. The cache is `torch.empty` (address space,
    not memory): only the blocks written and read are touched. spec runs on a small cache of those blocks."""
    block_size, num_kv_heads, head_dim, group = 16, 8, 128, 2
    slot_bytes = num_kv_heads * head_dim
    num_blocks = 2**31 // (2 * block_size * slot_bytes) + 4  # key and value interleaved per block: 2**31 + 256 KiB
    memory = torch.empty((num_blocks, 2, block_size, num_kv_heads, head_dim), dtype=torch.uint8)
    key_cache, value_cache = memory[:, 0], memory[:, 1]  # one set of strides; block stride 2 * 16 KiB
    used = np.array([num_blocks - 1, num_blocks - 3, num_blocks - 2])  # all past the 2**31-th element
    assert used.min() * key_cache.stride(0) >= 2**31
    rng = np.random.default_rng(0)
    seq_len = 3 * block_size - 5
    key = torch.from_numpy(rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32))
    value = torch.from_numpy(rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32))
    pos = np.arange(seq_len)
    slots = torch.from_numpy((used[pos // block_size] * block_size + pos % block_size).astype(np.int32))
    k_scale = torch.from_numpy(np.linspace(0.2, 1.6, num_kv_heads).astype(np.float32))
    write_kv(key_cache, value_cache, key, value, slots, kv_cache_dtype="fp8_e5m2", k_scale=k_scale, v_scale=0.5)
    small_k = key_cache[torch.from_numpy(used)].numpy().copy()  # [3, block_size, num_kv_heads, head_dim]
    small_v = value_cache[torch.from_numpy(used)].numpy().copy()
    expected_k, expected_v = np.zeros_like(small_k), np.zeros_like(small_v)
    small_slots = (pos // block_size) * block_size + pos % block_size
    spec.write_kv(expected_k, expected_v, key.numpy(), value.numpy(), small_slots, kv_cache_dtype="fp8_e5m2",
                  k_scale=k_scale.numpy(), v_scale=0.5)  # fmt: skip
    written = np.zeros(small_k.shape[:2], bool)
    written.reshape(-1)[small_slots] = True
    np.testing.assert_array_equal(small_k[written], expected_k[written])
    np.testing.assert_array_equal(small_v[written], expected_v[written])
    # a decode at the last position and a prefill of the first 6, both through the far blocks
    query = torch.from_numpy(rng.standard_normal((7, num_kv_heads * group, head_dim)).astype(np.float32))
    seq_lens, starts = np.array([seq_len, 6], np.int32), np.array([0, 1, 7], np.int32)
    table = np.stack([used, used]).astype(np.int32)
    kwargs: dict[str, Any] = {"scale": head_dim**-0.5, "kv_cache_dtype": "fp8_e5m2"}
    out = paged_attention(query, key_cache, value_cache, torch.from_numpy(table), torch.from_numpy(seq_lens),
                          torch.from_numpy(starts), **kwargs, k_scale=k_scale, v_scale=0.5)  # fmt: skip
    small_table = np.stack([np.arange(3), np.arange(3)]).astype(np.int32)
    spec_args = (expected_k, expected_v, small_table, seq_lens, starts)
    ref64 = spec.paged_attention(query.double().numpy(), *spec_args, **kwargs, k_scale=k_scale.numpy(), v_scale=0.5)
    low = spec.paged_attention(query.numpy(), *spec_args, **kwargs, k_scale=k_scale.numpy(), v_scale=0.5)
    assert_attention_close(out, ref64, low, torch.float32)
