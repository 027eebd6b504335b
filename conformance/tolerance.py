"""The one place slotmap states how close a floating-point result must be (flash-attention style).

Rule. Let `ref64` be spec computed in float64 on the very inputs the backend saw (their values,
exactly representable in the input dtype, widened to float64), and `low` the same spec computation done
in the input dtype. Then

    max|fast - ref64|  <=  2 * max|low - ref64|  +  floor(dtype) * max(1, max|ref64|)

with floor(dtype) = FLOOR_EPS * finfo(dtype).eps. The factor 2 says a backend may be at most twice as
inexact as the straightforward computation in its own dtype; the floor covers the case where that
computation happens to be (nearly) exact, and the rounding of the output to the dtype, which no backend
can avoid: half an ulp of the largest output is eps/2 * max|out|.

"spec in the input dtype" per dtype:
  float32, float16: spec on NumPy arrays of that dtype (spec computes in the dtype of its inputs).
  bfloat16: NumPy has no bfloat16, so spec runs in float32 on the bfloat16 inputs and its output is rounded
      to bfloat16. This baseline is more accurate than true bfloat16 arithmetic would be, so the rule is
      stricter there, and the floor (from bfloat16's eps) carries the weight of the bound.
Non-finite values in a backend's output always fail. Values that are exact by contract (padding rows
are zero) are compared exactly by the caller, not through this rule.

fp8 KV caches (spec/fp8.py). Two bounds, kept apart:
  attention over an fp8 cache: the rule above, with dtype the query's dtype, ref64 = spec on the very
      codes the backend read with a float64 query (so the keys and values are decode(code) * scale in
      float64: exact), and low = spec in the query's dtype on the same codes. The quantization error is
      not part of this comparison: both references read the quantized values.
  write_kv into an fp8 cache: its codes must equal spec's exactly (an encode is defined bit for bit). How
      far a stored value may be from what was written is the format's own bound, fp8_quantization_bound:
      with y = float32(x) / float32(scale) (the quotient every backend encodes), |decode(code) - y| is at
      most half the spacing of the format's values at |y| (2**(e - mantissa_bits - 1) for |y| in
      [2**e, 2**(e+1)), e >= 1 - bias; below the smallest normal value, half the subnormal spacing), and
      for |y| past the largest finite value M the stored value is sign(y) * M (saturation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from spec.fp8 import Fp8Format, decode

# The floor, in units of the dtype's machine epsilon (relative to max(1, max|ref64|)): the output's own
# rounding (eps/2), plus about one eps each for the reassociated softmax denominator and the P.V sum,
# which a tiled or fused kernel orders differently from the reference. 2 was observed too tight
# (float32: error 3.9e-7 against a bound of 3.8e-7 from an example with a near-exact reference), and so was 4:
# each logit is rounded too, and the output moves by up to that rounding times |v - out|, so with logits of
# a few units (|q| 4.5 at head_dim 4) and a lucky reference the CPU kernel (before and after fp8) erred by
# 9.6e-7 against a bound of 7.0e-7 (float32, 125 keys, spec in float32 1.1e-7; the differential suite found it).
FLOOR_EPS = 8


def dtype_name(dtype: Any) -> str:
    """'float16', 'bfloat16', 'float32' or 'float64' for a torch dtype, NumPy dtype or name."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(np.dtype(dtype)) if str(dtype) != "bfloat16" else "bfloat16"


def floor(dtype: Any) -> float:
    return FLOOR_EPS * float(torch.finfo(getattr(torch, dtype_name(dtype))).eps)


def as_float64(x: Any) -> np.ndarray:
    """A NumPy float64 copy of a NumPy array or a torch tensor of any float dtype (bfloat16 included)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, np.float64)


def round_to(x: np.ndarray, dtype: Any) -> np.ndarray:
    """x rounded to `dtype` (round to nearest even), returned as float64: the values a backend will see."""
    return torch.from_numpy(np.asarray(x, np.float64)).to(getattr(torch, dtype_name(dtype))).double().numpy()


def spec_in_dtype(fn: Callable[..., np.ndarray], dtype: Any, float_args: tuple[np.ndarray, ...], /,
                  *args: Any, **kwargs: Any) -> np.ndarray:  # fmt: skip
    """`fn(*float_args, *args, **kwargs)` computed "in `dtype`" as the module docstring defines, as float64.

    float_args must already be representable in dtype (see round_to); args/kwargs pass through unchanged.
    """
    name = dtype_name(dtype)
    if name == "bfloat16":
        out = fn(*(np.asarray(a, np.float32) for a in float_args), *args, **kwargs)
        return round_to(out, "bfloat16")
    return np.asarray(fn(*(np.asarray(a, name) for a in float_args), *args, **kwargs), np.float64)


def tolerance(ref64: np.ndarray, low_precision_ref: np.ndarray, dtype: Any) -> float:
    """The bound of the rule for one comparison."""
    low_error = float(np.max(np.abs(low_precision_ref - ref64), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(ref64), initial=0.0)))
    return 2.0 * low_error + floor(dtype) * scale


def assert_attention_close(fast_out: Any, ref64: Any, low_precision_ref: Any, dtype: Any) -> None:
    """Assert the rule; the message gives the error, the bound and where the worst element is."""
    fast, ref, low = as_float64(fast_out), as_float64(ref64), as_float64(low_precision_ref)
    assert fast.shape == ref.shape == low.shape, f"shapes differ: {fast.shape}, {ref.shape}, {low.shape}"
    assert np.isfinite(fast).all(), f"non-finite output at {np.argwhere(~np.isfinite(fast))[:5].tolist()}"
    error = np.abs(fast - ref)
    bound = tolerance(ref, low, dtype)
    worst = np.unravel_index(int(np.argmax(error)), error.shape) if error.size else ()
    assert float(np.max(error, initial=0.0)) <= bound, (
        f"{dtype_name(dtype)}: max abs error {float(np.max(error)):.3e} at {worst} > bound {bound:.3e} "
        f"(spec in {dtype_name(dtype)}: {float(np.max(np.abs(low - ref), initial=0.0)):.3e})"
    )


def fp8_quantization_bound(y: np.ndarray, fmt: Fp8Format) -> np.ndarray:  # same shape as y, float64
    """Half the spacing of the format's values at |y| (the module docstring's bound for |y| <= max_value)."""
    magnitude = np.abs(np.asarray(y, np.float64))
    _, frexp_exponent = np.frexp(magnitude)  # magnitude = f * 2**frexp_exponent, f in [0.5, 1)
    binade = np.maximum(frexp_exponent - 1, 1 - fmt.bias)
    return np.ldexp(1.0, binade - fmt.mantissa_bits - 1)


def assert_quantized_close(codes: np.ndarray, x: np.ndarray, scale: np.ndarray, fmt: Fp8Format) -> None:
    """codes (uint8) hold x / scale within fp8_quantization_bound, or saturated; scale broadcasts over x.

    NaN is left out: it encodes as NaN by definition, which the exact comparison with spec covers.
    """
    with np.errstate(over="ignore"):
        y = (np.asarray(x, np.float32) / np.asarray(scale, np.float32)).astype(np.float64)
    stored = decode(codes, fmt)
    inside = np.abs(y) <= fmt.max_value
    error = np.abs(stored - y)
    bound = fp8_quantization_bound(y, fmt)
    bad = inside & ~(error <= bound)
    assert not bad.any(), f"{fmt.name}: |decode - x/scale| {error[bad][:3]} > half a spacing {bound[bad][:3]}"
    saturated = ~inside & ~np.isnan(y)  # past the largest value, infinities included
    assert np.array_equal(stored[saturated], np.copysign(fmt.max_value, y[saturated])), f"{fmt.name}: not saturated"
