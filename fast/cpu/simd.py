"""Sixteen float32 lanes as one LLVM vector value, for the register tiles of fast.cpu.prefill.

LLVM vectorises an inner loop, but it does not tile registers: a sum over head_dim kept for 8 keys x 32 query
rows at once (16 vectors) is beyond what it derives from scalar loops. `F32x16` is a Numba type whose value
is an LLVM `<16 x float>`; a kernel holds sixteen of them in named variables across a loop, so they live in
vector registers (zmm with AVX-512; two ymm each elsewhere), and every operation below is one instruction
there. Loads and broadcasts take the element index as given: no wraparound, no bounds checks (the callers'
indices come from plan_items' checked ranges), so the address arithmetic of a tile stays a base register
plus the loop counter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, models, register_model

LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_I32 = ir.IntType(32)


class F32x16(types.Type):
    """Sixteen float32 lanes, an LLVM vector value (a register, not memory)."""

    def __init__(self) -> None:
        super().__init__(name="f32x16")


f32x16 = F32x16()


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        super().__init__(dmm, fe_type, _VECTOR)


def _element_pointer(context: Any, builder: Any, array_type: Any, array: Any, index: Any) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [index])


def _is_float32_array(array: Any) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.float32


def _splat(builder: Any, scalar: Any) -> Any:
    one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined), ir.Constant(ir.VectorType(_I32, LANES),
                                                                                       [0] * LANES))  # fmt: skip


def _load_typer(typingctx: Any, array: Any, index: Any) -> Any:  # pragma: no cover - compiled
    """array[index : index + 16] as a vector (an unaligned load)."""
    if not (_is_float32_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        at = builder.bitcast(_element_pointer(context, builder, sig.args[0], *args), _VECTOR.as_pointer())
        return builder.load(at, align=4)

    return f32x16(array, index), codegen


def _store_typer(typingctx: Any, array: Any, index: Any, vector: Any) -> Any:  # pragma: no cover - compiled
    """array[index : index + 16] = vector (an unaligned store)."""
    if not (_is_float32_array(array) and isinstance(index, types.Integer) and vector == f32x16):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        at = builder.bitcast(_element_pointer(context, builder, sig.args[0], args[0], args[1]), _VECTOR.as_pointer())
        builder.store(args[2], at, align=4)
        return context.get_dummy_value()

    return types.none(array, index, vector), codegen


def _broadcast_typer(typingctx: Any, array: Any, index: Any) -> Any:  # pragma: no cover - compiled
    """array[index] in every lane: one broadcast load (an FMA's memory operand on AVX-512)."""
    if not (_is_float32_array(array) and isinstance(index, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        scalar = builder.load(_element_pointer(context, builder, sig.args[0], *args), align=4)
        return _splat(builder, scalar)

    return f32x16(array, index), codegen


def _zeros_typer(typingctx: Any) -> Any:  # pragma: no cover - compiled
    """Sixteen zeros."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return ir.Constant(_VECTOR, [0.0] * LANES)

    return f32x16(), codegen


def _fma_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:  # pragma: no cover - compiled
    """a * b + c per lane, rounded once (llvm.fma)."""
    if not (a == b == c == f32x16):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        fn = builder.module.declare_intrinsic("llvm.fma.v16f32", (), ir.FunctionType(_VECTOR, [_VECTOR] * 3))
        return builder.call(fn, args)

    return f32x16(a, b, c), codegen


def _mul_typer(typingctx: Any, a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """a * b per lane."""
    if not (a == b == f32x16):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fmul(*args)

    return f32x16(a, b), codegen


load = cast(Callable[[Any, Any], Any], intrinsic(_load_typer))
store = cast(Callable[[Any, Any, Any], None], intrinsic(_store_typer))
broadcast = cast(Callable[[Any, Any], Any], intrinsic(_broadcast_typer))
zeros = cast(Callable[[], Any], intrinsic(_zeros_typer))
fma = cast(Callable[[Any, Any, Any], Any], intrinsic(_fma_typer))
mul = cast(Callable[[Any, Any], Any], intrinsic(_mul_typer))
