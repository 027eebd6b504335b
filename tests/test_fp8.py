"""spec.fp8's formats against torch's float8 dtypes: every code, and float32 values around every code.

torch is the independent implementation here (its conversions are C++ code of its own); spec.fp8's module
docstring states the one place the two differ on purpose (e5m2 saturates in spec, overflows in torch),
and test_encode_matches_torch pins exactly that difference. fast's two encoders (torch-based for CPU
tensors, integer arithmetic in the Triton kernel) must give spec's codes on the same values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fast
import spec
from fast.fp8 import quantize
from fast.runtime import HAVE_TRITON, interpret
from spec.fp8 import E4M3, E5M2, KV_CACHE_DTYPES, Fp8Format, decode, decode_table, encode

FORMATS = {"e4m3": (E4M3, torch.float8_e4m3fn), "e5m2": (E5M2, torch.float8_e5m2)}


def _torch_encode(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).view(torch.uint8).numpy()


def _probe_values(fmt: Fp8Format) -> np.ndarray:  # [n] float32
    """Every finite value of the format, the midpoints between neighbours (the ties), their float32 neighbours,
    values past the largest one, infinities, NaNs of both signs and a sweep over all float32 bit patterns."""
    table = decode_table(fmt)
    finite = np.unique(np.abs(table[np.isfinite(table)]))  # [k] increasing, 0 first
    mids = (finite[:-1] + finite[1:]) / 2
    top = fmt.max_value
    base = np.concatenate([finite, mids, [top * 1.03, top * 1.1, top * 2, 1e30, np.inf]]).astype(np.float32)
    near = np.concatenate([base, np.nextafter(base, np.float32(0)), np.nextafter(base, np.float32(np.inf))])
    sweep = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)  # ~1M bit patterns
    nans = np.array([np.nan, -np.nan], np.float32)
    return np.concatenate([near, -near, nans, sweep])  # float32 throughout: NaN payloads stay as they are


@pytest.mark.parametrize("name", FORMATS)
def test_decode_matches_torch_on_every_code(name: str) -> None:
    fmt, dtype = FORMATS[name]
    ours = decode(np.arange(256, dtype=np.uint8), fmt)
    theirs = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaN where torch has NaN, and the sign of every zero
    assert np.array_equal(np.signbit(ours), np.signbit(theirs))
    assert fmt.max_value == {"e4m3": 448.0, "e5m2": 57344.0}[name]


@pytest.mark.parametrize("name", FORMATS)
def test_encode_inverts_decode(name: str) -> None:
    """Every code that is not NaN encodes back to itself; NaN codes encode to sign | nan_code."""
    fmt, _ = FORMATS[name]
    codes = np.arange(256, dtype=np.uint8)
    values = decode(codes, fmt).astype(np.float32)
    again = encode(values, fmt)
    nan = np.isnan(values)
    inf = np.isinf(values)  # e5m2's infinities saturate (module docstring)
    np.testing.assert_array_equal(again[~nan & ~inf], codes[~nan & ~inf])
    np.testing.assert_array_equal(again[nan], (codes[nan] & 0x80) | fmt.nan_code)
    np.testing.assert_array_equal(again[inf], (codes[inf] & 0x80) | fmt.max_code)


@pytest.mark.parametrize("name", FORMATS)
def test_encode_matches_torch(name: str) -> None:
    """spec's encode is torch's conversion, except e5m2's saturation: there torch overflows to +-inf."""
    fmt, dtype = FORMATS[name]
    x = _probe_values(fmt)
    ours, theirs = encode(x, fmt), _torch_encode(x, dtype)
    differ = ours != theirs
    if name == "e4m3":
        assert not differ.any(), f"differ at {x[differ][:5]}: {ours[differ][:5]} vs {theirs[differ][:5]}"
        return
    # e5m2: exactly the magnitudes torch rounds up to infinity (>= 61440, the tie with 2**16) and inf itself
    overflow = np.abs(x.astype(np.float64)) >= 61440.0
    np.testing.assert_array_equal(differ, overflow)
    np.testing.assert_array_equal(theirs[overflow] & 0x7F, 0x7C)  # torch: +-inf
    np.testing.assert_array_equal(ours[overflow], (theirs[overflow] & 0x80) | fmt.max_code)  # spec: +-57344


@pytest.mark.parametrize("name", FORMATS)
def test_encode_rounds_to_nearest_even_and_saturates(name: str) -> None:
    """The rule itself, on hand-picked values: a tie goes to the even code, the max and beyond saturate."""
    fmt, _ = FORMATS[name]
    one = int(encode(np.float32(1.0), fmt))
    step = 2.0**-fmt.mantissa_bits  # the spacing of the values in [1, 2)
    assert int(encode(np.float32(1 + step / 2), fmt)) == one  # tie between 1 (even code) and 1 + step: 1
    assert int(encode(np.float32(1 + 1.5 * step), fmt)) == one + 2  # tie between odd 1 + step and even 1 + 2 step
    assert int(encode(np.float32(fmt.max_value * 4), fmt)) == fmt.max_code
    assert int(encode(np.float32(-np.inf), fmt)) == 0x80 | fmt.max_code
    assert int(encode(np.float32(-0.0), fmt)) == 0x80
    smallest = 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)
    assert int(encode(np.float32(smallest / 2), fmt)) == 0  # tie with 0: the even code
    assert int(encode(np.float32(smallest * 0.51), fmt)) == 1


@pytest.mark.parametrize("name", FORMATS)
def test_fast_torch_quantize_matches_spec(name: str) -> None:
    """fast's CPU encoder (torch's conversion after a clamp) gives spec's codes on every probe value."""
    fmt, _ = FORMATS[name]
    x = _probe_values(fmt)
    got = quantize(torch.from_numpy(x).view(-1, 1, 1), torch.ones(1), fmt).view(-1).numpy()
    np.testing.assert_array_equal(got, encode(x, fmt))


@pytest.mark.interpret
@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform")
@pytest.mark.parametrize("name", FORMATS)
def test_triton_encoder_matches_spec(name: str) -> None:
    """The Triton write_kv kernel's integer encoder, under the interpreter, on every probe value but the
    sweep (a few thousand values: the ties, the subnormals, the saturation edge), and a scale that is not a
    power of two, so that the division's rounding is part of what is compared."""
    fmt, _ = FORMATS[name]
    x = _probe_values(fmt)[: -(2**32 // 4099 + 1)]
    head_dim = 1024
    x = np.concatenate([x, np.zeros(-len(x) % head_dim, np.float32)]).reshape(-1, 1, head_dim)  # [T, 1, 1024]
    kv_cache_dtype = f"fp8_{name}"
    for scale in (1.0, 0.37):
        expected = np.zeros((len(x), 1, 1, head_dim), np.uint8)
        spec.write_kv(expected, expected.copy(), x, x, np.arange(len(x)), kv_cache_dtype=kv_cache_dtype,
                      k_scale=scale, v_scale=scale)  # fmt: skip
        cache = torch.zeros(len(x), 1, 1, head_dim, dtype=torch.uint8)
        source = torch.from_numpy(x)
        with interpret(True):
            fast.write_kv(cache, torch.zeros_like(cache), source, source, torch.arange(len(x)),
                          kv_cache_dtype=kv_cache_dtype, k_scale=scale, v_scale=scale)  # fmt: skip
        np.testing.assert_array_equal(cache.numpy(), expected)


def test_kv_cache_dtype_names() -> None:
    """vLLM's names: "fp8" is e4m3 (as on CUDA)."""
    assert KV_CACHE_DTYPES == {"auto": None, "fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
