"""The two 8-bit float formats of fp8 KV caches, and the cache-dtype names that select them.

A code is one byte: sign bit, EXPONENT_BITS exponent bits, MANTISSA_BITS mantissa bits.

  e4m3 ("float8_e4m3fn", OCP FP8 E4M3): 4 exponent bits, bias 7, 3 mantissa bits. No infinities; the
      codes 0x7f and 0xff are NaN, so the largest finite value is 0x7e = 1.75 * 2**8 = 448. Smallest
      subnormal 2**-9.
  e5m2 ("float8_e5m2", IEEE-like): 5 exponent bits, bias 15, 2 mantissa bits; exponent 31 holds +-inf
      (0x7c, 0xfc) and NaN (0x7d-0x7f, 0xfd-0xff). Largest finite value 0x7b = 1.75 * 2**15 = 57344.
      Smallest subnormal 2**-16.

decode(code) is the value the bits spell. encode(x) of a float32 x rounds |x| to the nearest finite
value of the format, ties to the even code (the one whose mantissa ends in 0), and **saturates**: a value
past the largest finite one (an infinity included) encodes as the largest finite value of its sign. NaN
encodes as sign | 0x7f. -0.0 keeps its sign (0x80).

Saturation is what vLLM's CUDA KV-cache write does (`__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)`
for both formats): a key that overflows after scaling stays finite instead of becoming inf, which would turn
every attention row that reads it into NaN. torch's `.to(torch.float8_e4m3fn)` saturates too (torch 2.13:
the same code for every float32, tests/test_fp8.py checks all of them around every code), so for e4m3 spec
and torch agree everywhere. torch's float8_e5m2 conversion does not saturate: |x| >= 61440 (the tie between
57344 and 2**16) and +-inf become +-inf there; spec's encode gives +-57344. That is the one difference, and
the test pins it.

Cache dtype names (vLLM's `kv_cache_dtype`): "auto" (the cache holds the model's float dtype),
"fp8" (e4m3, as on CUDA), "fp8_e4m3", "fp8_e5m2".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fp8Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_code: int  # the largest finite positive code; codes 0..max_code increase in value
    nan_code: int  # what encode gives for NaN (with the sign bit of the NaN)

    @property
    def max_value(self) -> float:
        return float(decode_table(self)[self.max_code])


E4M3 = Fp8Format("e4m3", exponent_bits=4, mantissa_bits=3, bias=7, max_code=0x7E, nan_code=0x7F)
E5M2 = Fp8Format("e5m2", exponent_bits=5, mantissa_bits=2, bias=15, max_code=0x7B, nan_code=0x7F)

KV_CACHE_DTYPES = {"auto": None, "fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


def cache_format(kv_cache_dtype: object, function: str) -> Fp8Format | None:
    """The format a kv_cache_dtype names (None for "auto"); ValueError for any other name."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{function}: kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def decode_table(fmt: Fp8Format) -> np.ndarray:  # [256] float64: code -> value
    """The value of every code, from the bit fields."""
    codes = np.arange(256)  # [256]
    sign = np.where(codes & 0x80, -1.0, 1.0)  # [256]
    exponent = (codes >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)  # [256] biased
    mantissa = (codes & ((1 << fmt.mantissa_bits) - 1)) / (1 << fmt.mantissa_bits)  # [256] fraction in [0, 1)
    subnormal = exponent == 0
    magnitude = np.where(
        subnormal,
        mantissa * 2.0 ** (1 - fmt.bias),
        (1.0 + mantissa) * 2.0 ** (exponent - fmt.bias),
    )  # [256]
    top = (1 << fmt.exponent_bits) - 1
    if fmt is E4M3:  # "fn": only the all-ones code of the top exponent is special, and it is NaN
        magnitude = np.where((codes & 0x7F) == 0x7F, np.nan, magnitude)
    else:  # IEEE: the top exponent is inf (mantissa 0) or NaN
        magnitude = np.where(exponent == top, np.where(mantissa == 0, np.inf, np.nan), magnitude)
    return np.copysign(magnitude, sign)  # the sign bit of NaNs too


def decode(codes: np.ndarray, fmt: Fp8Format) -> np.ndarray:  # same shape as codes, float64
    return decode_table(fmt)[np.asarray(codes, np.uint8)]


def encode(x: np.ndarray, fmt: Fp8Format) -> np.ndarray:  # same shape as x, uint8 codes
    """Round-to-nearest-even with saturation (module docstring) of float32 values."""
    with np.errstate(invalid="ignore"):  # signalling NaNs widen to quiet NaNs, which is all encode needs
        x = np.asarray(x, np.float32).astype(np.float64)  # exact: every float32 is a float64
    magnitude = np.minimum(np.abs(x), fmt.max_value)  # saturate (NaN stays NaN, handled below)
    finite_magnitude = np.where(np.isnan(magnitude), 0.0, magnitude)
    # the spacing of the format's values around each magnitude: 2**(e - mantissa_bits) in the binade
    # [2**e, 2**(e+1)), and the subnormal spacing below the smallest normal value 2**(1 - bias)
    _, frexp_exponent = np.frexp(finite_magnitude)  # magnitude = f * 2**frexp_exponent, f in [0.5, 1)
    binade = np.maximum(frexp_exponent - 1, 1 - fmt.bias)
    spacing = np.ldexp(1.0, binade - fmt.mantissa_bits)
    rounded = np.rint(finite_magnitude / spacing) * spacing  # np.rint: ties to even (the even multiple)
    positive = decode_table(fmt)[: fmt.max_code + 1]  # increasing values of codes 0..max_code
    code = np.searchsorted(positive, rounded)  # exact hits: rounded is one of the format's values
    code = np.where(np.isnan(x), fmt.nan_code, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def dequantize(codes: np.ndarray, fmt: Fp8Format, scale: np.ndarray, dtype: type) -> np.ndarray:
    """decode(codes) * scale in `dtype` (scale broadcast over codes' trailing axes as the caller shapes it)."""
    return decode(codes, fmt).astype(dtype) * np.asarray(scale).astype(dtype)
