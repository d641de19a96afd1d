"""What the records of the primitives share: the usual shape rules, the
gradient rule of a unary op from its derivative, the literals gradient rules
use, and the shape of a value.

A shape rule takes the operands' avals (and the op's attributes) and gives the
result's :class:`registry.Aval`; it raises ``ShapeError`` naming the op.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ShapeError
from ..ir import Literal
from ..tracing import Parameter, Value
from ..registry import (
    Aval,
    broadcast,
    check_float,
    result_dtype,
)

ZERO, HALF, ONE = Literal(0.0), Literal(0.5), Literal(1.0)
TWO_OVER_SQRT_PI = Literal(2 / math.sqrt(math.pi))


def shape_of(x) -> tuple:
    """The full shape of a step value (``None`` = batch axis) or an array."""
    if isinstance(x, (Value, Parameter)):
        return x.shape
    return np.shape(x)


# ----------------------------------------------------------------------------
# shape rules and gradient helpers


def binary_rule(name):
    def rule(operands):
        dtype = result_dtype(operands)
        if dtype == np.dtype(bool) and name in ("add", "sub", "div"):  # (NumPy's meanings of them differ)
            raise ShapeError(f"{name}: its operands are masks (bool), which are no numbers here: "
                             "count with where(mask, 1.0, 0.0)")
        return Aval(broadcast(name, operands), dtype)

    return rule


def unary_float_rule(name):
    def rule(operands):
        (x,) = operands
        check_float(name, x.dtype)
        return Aval(x.shape, np.dtype(x.dtype))

    return rule


def compare_rule(name):
    def rule(operands):
        result_dtype(operands)
        return Aval(broadcast(name, operands), np.dtype(bool))

    return rule


def unary_rule(operands):
    (x,) = operands
    return Aval(x.shape, np.dtype(x.dtype))


def neg_rule(operands):
    (x,) = operands
    if np.dtype(x.dtype) == np.dtype(bool):  # (NumPy refuses it)
        raise ShapeError("neg: its operand is a mask (bool), which is no number here: negate "
                         "where(mask, 1.0, 0.0), or use where(mask, b, a) for the opposite choice")
    return Aval(x.shape, np.dtype(x.dtype))



def derivative(dydx):
    """The gradient rule of a unary op from its derivative ``dydx(em, x, y)``."""
    return lambda em, e, g: [em.op("mul", g, dydx(em, em.val(e.inputs[0]), em.val(e.outputs[0])))]

