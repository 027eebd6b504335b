"""fast.cpu.lanes: the float32 exp, tanh and element widening the CPU kernels inline, against NumPy in float64."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fast.cpu.lanes import FASTMATH, exp, exp2_nonpositive, tanh, widen

MAX_ULP = 2.0  # what fast.cpu.lanes promises; the attention tolerance rule is checked by the kernel tests


@njit(fastmath=FASTMATH, error_model="numpy")
def _apply_exp(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = exp(x[i])


@njit(fastmath=FASTMATH, error_model="numpy")
def _apply_exp2(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = exp2_nonpositive(x[i])


@njit(fastmath=FASTMATH, error_model="numpy")
def _apply_tanh(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = tanh(x[i])


@njit
def _apply_widen(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = widen(x[i])


def _ulps(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.spacing(np.abs(want).astype(np.float32))))


def test_exp_within_two_ulp_on_the_softmax_range() -> None:
    """Arguments the softmax passes are <= 0; below -80 the weights are 1e-35 of the largest and only must be tiny."""
    x = np.concatenate([np.linspace(-80, 0, 400_001), -np.logspace(-8, 0, 1001)]).astype(np.float32)
    got = np.empty_like(x)
    _apply_exp(x, got)
    assert _ulps(got, np.exp(x.astype(np.float64))) <= MAX_ULP
    deep = np.linspace(-200, -80, 1001).astype(np.float32)
    tiny = np.empty_like(deep)
    _apply_exp(deep, tiny)
    assert (tiny >= 0).all() and (tiny <= np.exp(np.float32(-79.0))).all()


def test_exp_ieee_special_values() -> None:
    x = np.array([-np.inf, np.nan, 0.0, -0.0, 100.0, np.inf], np.float32)
    got = np.empty_like(x)
    _apply_exp(x, got)
    assert got[0] == 0 and np.isnan(got[1]) and got[2] == 1 and got[3] == 1 and got[4] == np.inf and got[5] == np.inf


def test_exp2_within_two_ulp_on_the_softmax_range() -> None:
    """The prompt kernel's softmax in log2 units: arguments <= 0, down to 2**-126; below, 0."""
    x = np.concatenate([np.linspace(-126, 0, 400_001), -np.logspace(-8, 0, 1001), [-0.5, -1.5]]).astype(np.float32)
    got = np.empty_like(x)
    _apply_exp2(x, got)
    assert _ulps(got, np.exp2(x.astype(np.float64))) <= MAX_ULP
    special = np.array([-np.inf, np.nan, 0.0, -0.0, -126.5, -300.0], np.float32)
    out = np.empty_like(special)
    _apply_exp2(special, out)
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == 1 and out[3] == 1 and out[4] == 0 and out[5] == 0


def test_tanh_within_two_ulp() -> None:
    x = np.concatenate([np.linspace(-20, 20, 400_001), np.logspace(-30, 0, 1001)]).astype(np.float32)
    got = np.empty_like(x)
    _apply_tanh(x, got)
    want = np.tanh(x.astype(np.float64))
    assert _ulps(got, want) <= MAX_ULP
    special = np.array([-np.inf, np.inf, np.nan, 0.0], np.float32)
    out = np.empty_like(special)
    _apply_tanh(special, out)
    assert out[0] == -1 and out[1] == 1 and np.isnan(out[2]) and out[3] == 0


def test_widen_is_exact_for_every_16_bit_pattern() -> None:
    """All 65536 bit patterns of float16 (as int16) and bfloat16 (as uint16), NaNs included, as torch widens them."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype, view in ((torch.float16, np.int16), (torch.bfloat16, np.uint16)):
        want = bits.view(dtype).float().numpy()
        got = np.empty(want.shape, np.float32)
        _apply_widen(bits.numpy().view(view), got)
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
        assert np.isnan(got[np.isnan(want)]).all()
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    same = np.empty_like(x)
    _apply_widen(x, same)
    np.testing.assert_array_equal(same, x)


def test_widen_decodes_every_fp8_code() -> None:
    """All 256 codes of e4m3 (read as uint8) and e5m2 (read as int8) widen to spec.fp8's values, signed zeros,
    infinities and NaNs included."""
    from spec.fp8 import E4M3, E5M2, decode

    codes = np.arange(256, dtype=np.uint8)
    for fmt, view in ((E4M3, np.uint8), (E5M2, np.int8)):
        want = decode(codes, fmt).astype(np.float32)
        got = np.empty(256, np.float32)
        _apply_widen(codes.view(view), got)
        nan = np.isnan(want)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        assert np.isnan(got[nan]).all()
