"""The primitives as functions: ``sn.ops.tanh(x)`` and friends.

On step values they are traced into the IR; on plain arrays they compute
eagerly with the NumPy reference.
"""

from __future__ import annotations

import builtins

import numpy as np

from ..tracing import Parameter, Value, bind


def shape_of(x) -> tuple:
    """The full shape of a step value (``None`` = batch axis) or an array."""
    if isinstance(x, (Value, Parameter)):
        return x.shape
    return np.shape(x)


def add(a, b):
    return bind("add", [a, b])


def sub(a, b):
    return bind("sub", [a, b])


def mul(a, b):
    return bind("mul", [a, b])


def div(a, b):
    return bind("div", [a, b])


def maximum(a, b):
    return bind("maximum", [a, b])


def minimum(a, b):
    return bind("minimum", [a, b])


def neg(x):
    return bind("neg", [x])


def abs(x):
    return bind("abs", [x])


def exp(x):
    return bind("exp", [x])


def log(x):
    return bind("log", [x])


def tanh(x):
    return bind("tanh", [x])


def sigmoid(x):
    return bind("sigmoid", [x])


def softplus(x):
    """ONNX Softplus: ``log(1 + exp(x))``, computed without overflow."""
    return bind("softplus", [x])


def relu(x):
    return bind("relu", [x])


def clip(x, lo=None, hi=None):
    """Clip to ``[lo, hi]``; either bound may be None."""
    return bind("clip", [x], lo=None if lo is None else float(lo),
                hi=None if hi is None else float(hi))


def greater(a, b):
    return bind("greater", [a, b])


def greater_equal(a, b):
    return bind("greater_equal", [a, b])


def less(a, b):
    return bind("less", [a, b])


def less_equal(a, b):
    return bind("less_equal", [a, b])


def equal(a, b):
    return bind("equal", [a, b])


def where(cond, a, b):
    """Per element: ``a`` where ``cond`` holds, else ``b``."""
    return bind("where", [cond, a, b])


def matmul(a, b):
    return bind("matmul", [a, b])


def sum(x, axis=-1, keepdims=False):
    return bind("sum", [x], axis=int(axis), keepdims=bool(keepdims))


def concat(values, axis=-1):
    return bind("concat", list(values), axis=int(axis))


def slice(x, start, stop, axis=-1):
    size = shape_of(x)[axis]
    if size is None:  # the batch axis: the rule refuses it with a clear error
        return bind("slice", [x], axis=int(axis), start=int(start), stop=int(stop))
    start, stop, _ = builtins.slice(start, stop).indices(size)
    return bind("slice", [x], axis=int(axis), start=start, stop=builtins.max(start, stop))


def transpose(x):
    """Swap the last two feature axes (``W.T`` for a matrix)."""
    return bind("transpose", [x])


def broadcast_axis(x, axis, size, insert=True):
    """Repeat ``x`` ``size`` times along ``axis``: a new axis (``insert=True``)
    or one of size 1."""
    return bind("broadcast_axis", [x], axis=int(axis), size=int(size), insert=bool(insert))


def pad(x, before, after, axis=-1):
    """Zero-pad ``axis`` with ``before`` and ``after`` elements."""
    return bind("pad", [x], axis=int(axis), before=int(before), after=int(after))
