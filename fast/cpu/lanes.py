"""Float32 lane arithmetic the CPU kernels inline: widening cache elements, exp and tanh without libm calls.

Numba has no float16 or bfloat16 type, so the kernels read those caches as 16-bit integers (float16 as
int16, bfloat16 as uint16: the element type says which) and `widen` turns one element into float32 with
the instruction LLVM has for it (a shift for bfloat16, vcvtph2ps for float16), exactly. fp8 caches
(spec.fp8) are read the same way as 8-bit integers, e4m3 as uint8 and e5m2 as int8: an e5m2 code is the
top byte of the float16 of the same value, and an e4m3 code without its sign, moved 7 bits up, is the
float16 of its value / 256 (subnormals included); NaN (0x7f) is selected apart. Both are selects and shifts,
which LLVM vectorises. libm's expf and
tanhf are scalar calls that keep LLVM from vectorising the softmax loops; `exp` and `tanh` here are
branch-free polynomials (selects only) that it vectorises, within about 2 ulp of the true value on the
arguments the kernels pass, and with IEEE behaviour on NaN and infinities (NaN stays NaN, exp(-inf) = 0,
tanh(+-inf) = +-1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# the kernels' flags: reassociation lets LLVM vectorise dot products and sums; no nnan/ninf, so NaN and inf
# stay IEEE
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
LOG2E = np.float32(1.4426950408889634)
_MINUS_2_LOG2E = np.float32(-2.0) * LOG2E  # exact: a power of 2 times LOG2E
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: n * _LN2_HI is exact for the n exp sees
_LN2_LO = np.float32(-2.12194440e-4)
_TANH_SERIES_BELOW = np.float32(0.55)  # below it the odd series (10 terms, error < 1e-8); above, the exp form
# Taylor coefficients, highest first after the leading one (e**r: 1/7! .. 1; tanh: x**19's .. x**3's, in x**2)
_EXP_TAYLOR = tuple(np.float32(1.0 / f) for f in (720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0))
# 2**r on |r| <= 1/2, highest first: a least-squares fit of relative error on Chebyshev nodes (1.6 ulp in float32)
_EXP2_POLY = tuple(np.float32(c) for c in (1.5337576041929424e-04, 1.3399859890341759e-03, 9.618519805371761e-03,
                                            5.550329014658928e-02, 2.4022646248340607e-01, 0.6931471824645996,
                                            1.0))  # fmt: skip
_TANH_TAYLOR = tuple(np.float32(c) for c in (6404582.0 / 10854718875.0, -929569.0 / 638512875.0,
                                              21844.0 / 6081075.0, -1382.0 / 155925.0, 62.0 / 2835.0,
                                              -17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0))  # fmt: skip


def _widen_typer(typingctx: Any, x: Any) -> Any:  # pragma: no cover - compiled
    """One cache element as float32: float32 as is, int16 as float16 bits, uint16 as bfloat16 bits,
    uint8 as an fp8 e4m3 code, int8 as an fp8 e5m2 code."""
    if x not in (types.float32, types.int16, types.uint16, types.uint8, types.int8):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        (value,) = args
        i16 = ir.IntType(16)
        if x == types.float32:
            return value
        if x == types.int16:
            return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())
        if x == types.int8:  # e5m2: the float16 whose top byte is the code (inf and NaN included)
            half_bits = builder.shl(builder.zext(value, i16), ir.Constant(i16, 8))
            return builder.fpext(builder.bitcast(half_bits, ir.HalfType()), ir.FloatType())
        if x == types.uint8:  # e4m3: sign | magnitude << 7 is the float16 of value / 2**8; 0x7f is NaN
            code = builder.zext(value, i16)
            magnitude = builder.and_(code, ir.Constant(i16, 0x7F))
            sign = builder.shl(builder.and_(code, ir.Constant(i16, 0x80)), ir.Constant(i16, 8))
            half_bits = builder.or_(builder.shl(magnitude, ir.Constant(i16, 7)), sign)
            wide = builder.fpext(builder.bitcast(half_bits, ir.HalfType()), ir.FloatType())
            scaled = builder.fmul(wide, ir.Constant(ir.FloatType(), 256.0))
            is_nan = builder.icmp_unsigned("==", magnitude, ir.Constant(i16, 0x7F))
            return builder.select(is_nan, ir.Constant(ir.FloatType(), float("nan")), scaled)
        wide = builder.shl(builder.zext(value, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(x), codegen


widen = cast(Callable[[Any], Any], intrinsic(_widen_typer))


def _float_bits_typer(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
    """The float32 whose bit pattern is the low 32 bits of the integer `bits`."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        width = bits.bitwidth  # type: ignore[attr-defined]
        low = args[0] if width == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


_float_bits = cast(Callable[[Any], Any], intrinsic(_float_bits_typer))


def _fma_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:  # pragma: no cover - compiled
    """a * b + c rounded once (llvm.fma): an intrinsic call, which no fast-math flag of the caller reorders."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fma = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fma, args)

    return types.float32(a, b, c), codegen


_fma = cast(Callable[[Any, Any, Any], Any], intrinsic(_fma_typer))


def _maximum_typer(typingctx: Any, a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """The larger of two float32, NaN if either is (llvm.maximum): a max reduction LLVM vectorises without
    the nnan flag, where `x if x > m else m` stays scalar."""
    if not (a == types.float32 and b == types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maximum", [f32], ir.FunctionType(f32, [f32, f32]))
        return builder.call(fn, args)

    return types.float32(a, b), codegen


maximum = cast(Callable[[Any, Any], Any], intrinsic(_maximum_typer))


def _prefetch_typer(typingctx: Any, array: Any, index: Any) -> Any:  # pragma: no cover - compiled
    """Ask for the cache line of array[index] in every cache level (llvm.prefetch, read, locality 3: prefetcht0):
    a hint, never a fault, so an index past the array is harmless. Locality 3 rather than 2 (prefetcht1):
    fast.cpu.decode at one thread on a Zen 5 took 0.90-0.94x the time on MHA 64 x 512, 0.88-0.98x on decode
    64 x 1024 (group 4)."""
    if not (isinstance(array, types.Array) and isinstance(index, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [args[1]])
        ptr, i32 = ir.PointerType(), ir.IntType(32)
        signature = ir.FunctionType(ir.VoidType(), [ptr, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr], signature)
        builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, index), codegen


prefetch = cast(Callable[[Any, Any], Any], intrinsic(_prefetch_typer))


@njit(cache=True, inline="always")
def exp(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """e**x in float32: x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite), e**r by its degree-7 Taylor polynomial."""
    xc = x if x > np.float32(-87.0) else np.float32(-87.0)  # NaN takes the clamp here and is restored below
    xc = xc if xc < np.float32(88.0) else np.float32(88.0)
    n = np.floor(xc * LOG2E + np.float32(0.5))
    r = _fma(-n, _LN2_LO, _fma(-n, _LN2_HI, xc))
    p = np.float32(1.0 / 5040.0)
    for c in _EXP_TAYLOR:
        p = _fma(p, r, c)
    y = p * _float_bits((np.int64(n) + 127) << 23)  # times 2**n, n in [-126, 127]
    y = y if x > np.float32(-87.0) else np.float32(0.0)  # e**-87 is 1.6e-38: below that, 0 (NaN passes)
    y = y if x < np.float32(88.0) else np.float32(np.inf)
    return y if x == x else x


@njit(cache=True, inline="always")
def exp2_nonpositive(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """2**x in float32 for x <= 0, the softmax's arguments in log2 units (a logit times log2(e) minus the running
    max): x = n + r, |r| <= 1/2, 2**r by a degree-6 polynomial; below -126 it is 0, -inf gives 0, NaN stays NaN.
    Against exp: no multiply by log2(e), no two-part reduction, no overflow branch (prefill's softmax: 0.97x the
    time of the kernel with exp)."""
    xc = x if x >= np.float32(-126.0) else np.float32(-126.0)  # NaN takes the clamp here and is restored below
    n = np.floor(xc + np.float32(0.5))
    r = xc - n  # exact
    p = _EXP2_POLY[0]
    for c in _EXP2_POLY[1:]:
        p = _fma(p, r, c)
    y = p * _float_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # times 2**n, n in [-126, 0]
    y = y if x >= np.float32(-126.0) else np.float32(0.0)
    return y if x == x else x


@njit(cache=True, inline="always")
def tanh(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """tanh in float32: the odd Taylor series near 0, (1 - e**-2|x|) / (1 + e**-2|x|) elsewhere (e**-2|x| as a
    power of 2: `exp2_nonpositive` takes fewer instructions than `exp`)."""
    a = abs(x)
    x2 = x * x
    s = np.float32(-443861162.0 / 1856156927625.0)
    for c in _TANH_TAYLOR:
        s = _fma(s, x2, c)
    series = _fma(x * x2, s, x)
    e = exp2_nonpositive(_MINUS_2_LOG2E * a)
    t = (np.float32(1.0) - e) / (np.float32(1.0) + e)
    t = t if x >= np.float32(0.0) else -t
    return series if a < _TANH_SERIES_BELOW else t  # NaN fails the test and takes t, which is NaN
