"""The primitives: each one entry with its shape rule and NumPy reference.

Composite ops (the parametric ONNX activations, mean, split, ...) live in
``composites.py`` and are built from these, so they need nothing here.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from ..errors import ShapeError
from ..ir import Literal
from .registry import (
    Aval,
    broadcast,
    check_float,
    normalize_axis,
    register,
    result_dtype,
    shape_str,
)

# ----------------------------------------------------------------------------
# elementwise


def _binary_rule(name):
    def rule(operands):
        return Aval(broadcast(name, operands), result_dtype(operands))

    return rule


def _unary_float_rule(name):
    def rule(operands):
        (x,) = operands
        check_float(name, x.dtype)
        return Aval(x.shape, np.dtype(x.dtype))

    return rule


def _compare_rule(name):
    def rule(operands):
        result_dtype(operands)
        return Aval(broadcast(name, operands), np.dtype(bool))

    return rule


def _unary_rule(operands):
    (x,) = operands
    return Aval(x.shape, np.dtype(x.dtype))


register("add", _binary_rule("add"), np.add, "elementwise", 2)
register("sub", _binary_rule("sub"), np.subtract, "elementwise", 2)
register("mul", _binary_rule("mul"), np.multiply, "elementwise", 2)
register("div", _binary_rule("div"), np.divide, "elementwise", 2)
register("maximum", _binary_rule("maximum"), np.maximum, "elementwise", 2)
register("minimum", _binary_rule("minimum"), np.minimum, "elementwise", 2)
register("neg", _unary_rule, np.negative, "elementwise", 1)
register("abs", _unary_rule, np.abs, "elementwise", 1)

register("exp", _unary_float_rule("exp"), np.exp, "elementwise", 1)
register("log", _unary_float_rule("log"), np.log, "elementwise", 1)
register("tanh", _unary_float_rule("tanh"), np.tanh, "elementwise", 1)
register("sigmoid", _unary_float_rule("sigmoid"), special.expit, "elementwise", 1)
register(
    "softplus",
    _unary_float_rule("softplus"),
    lambda x: np.logaddexp(x.dtype.type(0), x),
    "elementwise",
    1,
)
register("relu", _unary_rule, lambda x: np.maximum(x, x.dtype.type(0)), "elementwise", 1)

register("greater", _compare_rule("greater"), np.greater, "elementwise", 2)
register("greater_equal", _compare_rule("greater_equal"), np.greater_equal, "elementwise", 2)
register("less", _compare_rule("less"), np.less, "elementwise", 2)
register("less_equal", _compare_rule("less_equal"), np.less_equal, "elementwise", 2)
register("equal", _compare_rule("equal"), np.equal, "elementwise", 2)


def _where_rule(operands):
    cond, a, b = operands
    if not hasattr(cond, "dtype") or np.dtype(cond.dtype) != np.dtype(bool):
        raise ShapeError(f"where: the condition must be a boolean step value, got {shape_str(cond)}")
    return Aval(broadcast("where", operands), result_dtype([a, b]))


register("where", _where_rule, np.where, "elementwise", 3)


def _clip_rule(operands, lo=None, hi=None):
    (x,) = operands
    if lo is None and hi is None:
        raise ShapeError("clip: needs lo, hi or both")
    if lo is not None and hi is not None and lo > hi:
        raise ShapeError(f"clip: lo {lo} is above hi {hi}")
    return Aval(x.shape, np.dtype(x.dtype))


def _clip(x, lo=None, hi=None):
    # Bounds are weak scalars: the result keeps x's dtype.
    if lo is not None:
        x = np.maximum(x, x.dtype.type(lo))
    if hi is not None:
        x = np.minimum(x, x.dtype.type(hi))
    return x


register("clip", _clip_rule, _clip, "elementwise", 1)


# ----------------------------------------------------------------------------
# matmul


def _matmul_rule(operands):
    a, b = operands
    if not hasattr(a, "shape") or not hasattr(b, "shape"):
        raise ShapeError("matmul: a Python scalar is not a matrix; use * to scale")
    sa, sb = a.shape, b.shape
    if len(sa) == 0 or len(sb) == 0:
        raise ShapeError(f"matmul: operands must have a dimension: {shape_str(a)} @ {shape_str(b)}")
    ma = sa if len(sa) > 1 else (1,) + sa
    mb = sb if len(sb) > 1 else sb + (1,)
    if ma[-1] is None or mb[-2] is None or ma[-1] != mb[-2]:
        raise ShapeError(
            f"matmul: contracted dimensions differ: {shape_str(a)} @ {shape_str(b)}"
        )

    class _S:  # broadcast the stacked dims only
        def __init__(self, s):
            self.shape = s

    stack = broadcast("matmul", [_S(ma[:-2]), _S(mb[:-2])]) if len(ma) > 2 or len(mb) > 2 else ()
    out = stack + (ma[-2], mb[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    if None in out[1:]:
        raise ShapeError(
            f"matmul: {shape_str(a)} @ {shape_str(b)} would move the batch axis; "
            "put the step value on the left (x @ W)"
        )
    dtype = result_dtype(operands)
    check_float("matmul", dtype)
    return Aval(out, dtype)


register("matmul", _matmul_rule, np.matmul, "matmul", 2)


# ----------------------------------------------------------------------------
# reductions and shape ops


def _sum_rule(operands, axis, keepdims=False):
    (x,) = operands
    axis = normalize_axis("sum", x, axis)
    shape = list(x.shape)
    if keepdims:
        shape[axis] = 1
    else:
        del shape[axis]
    return Aval(tuple(shape), np.dtype(x.dtype))


register("sum", _sum_rule, lambda x, axis, keepdims=False: np.sum(x, axis, keepdims=keepdims),
         "reduce", 1)


def _concat_rule(operands, axis):
    if not operands:
        raise ShapeError("concat: needs at least one operand")
    for index, v in enumerate(operands):
        if isinstance(v, Literal):
            raise ShapeError(
                f"concat: operand {index} is the scalar {v.value!r}; concat joins arrays "
                "(make it one with sn.Parameter(np.full(shape, value)))"
            )
    first = operands[0]
    axis = normalize_axis("concat", first, axis)
    total = 0
    for v in operands:
        if len(v.shape) != len(first.shape) or any(
            d != e for i, (d, e) in enumerate(zip(v.shape, first.shape)) if i != axis
        ):
            raise ShapeError(
                f"concat: shapes differ off axis {axis}: "
                + ", ".join(shape_str(o) for o in operands)
            )
        total += v.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    return Aval(tuple(shape), result_dtype(operands))


register("concat", _concat_rule, lambda *xs, axis: np.concatenate(xs, axis), "shape")


def _slice_rule(operands, axis, start, stop):
    (x,) = operands
    axis = normalize_axis("slice", x, axis)
    if x.shape[axis] is None:
        raise ShapeError(f"slice: cannot slice the batch axis (axis {axis}) of {shape_str(x)}")
    if not 0 <= start <= stop <= x.shape[axis]:
        raise ShapeError(
            f"slice: [{start}:{stop}] is out of range for axis {axis} of {shape_str(x)}"
        )
    shape = list(x.shape)
    shape[axis] = stop - start
    return Aval(tuple(shape), np.dtype(x.dtype))


def _slice(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


register("slice", _slice_rule, _slice, "shape", 1)


def _transpose_rule(operands):
    (x,) = operands
    if len(x.shape) < 2 or x.shape[-2] is None:
        raise ShapeError(
            f"transpose: swaps the last two feature axes; {shape_str(x)} has fewer than two"
        )
    return Aval(x.shape[:-2] + (x.shape[-1], x.shape[-2]), np.dtype(x.dtype))


register("transpose", _transpose_rule, lambda x: np.swapaxes(x, -1, -2), "shape", 1)


def _broadcast_axis_rule(operands, axis, size, insert):
    (x,) = operands
    if size < 0:
        raise ShapeError(f"broadcast_axis: size {size} is negative")
    shape = list(x.shape)
    if insert:
        if not (1 if x.batched else 0) <= axis <= len(shape):
            raise ShapeError(f"broadcast_axis: cannot insert axis {axis} into {shape_str(x)}")
        shape.insert(axis, size)
    else:
        if not 0 <= axis < len(shape) or shape[axis] != 1:
            raise ShapeError(f"broadcast_axis: axis {axis} of {shape_str(x)} is not of size 1")
        shape[axis] = size
    return Aval(tuple(shape), np.dtype(x.dtype))


def _broadcast_axis(x, axis, size, insert):
    if insert:
        x = np.expand_dims(x, axis)
    shape = list(x.shape)
    shape[axis] = size
    return np.ascontiguousarray(np.broadcast_to(x, shape))


register("broadcast_axis", _broadcast_axis_rule, _broadcast_axis, "shape", 1)


def _pad_rule(operands, axis, before, after):
    (x,) = operands
    axis = normalize_axis("pad", x, axis)
    if before < 0 or after < 0:
        raise ShapeError(f"pad: widths {before}, {after} must not be negative")
    shape = list(x.shape)
    shape[axis] += before + after
    return Aval(tuple(shape), np.dtype(x.dtype))


def _pad(x, axis, before, after):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, after)
    return np.pad(x, widths)


register("pad", _pad_rule, _pad, "shape", 1)
