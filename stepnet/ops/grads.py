"""Gradient rules: one per primitive, written with the ops themselves.

A rule is ``rule(em, eqn, g) -> [cotangent or None per operand]``: ``g`` is
the cotangent of the equation's output, ``em.val(v)`` gives a forward value
(an operand or the output), and ``em.op(name, *operands, **attrs)`` applies a
primitive. Under :mod:`stepnet.autodiff` the emitter appends IR equations to
the backward step (so the backward compiles like the forward); for constants
outside the time loop it computes with the NumPy references. Each cotangent
has the shape of the equation's output; ``em.unbroadcast`` (applied by the
caller) reduces it to the operand's shape.

``None`` means "no gradient": comparisons, the condition of ``where``, Python
scalars, and non-float operands.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from ..ir import Literal
from .registry import get


def _rule(name):
    def register(fn):
        get(name).grad = fn
        return fn

    return register


@_rule("add")
def _add(em, e, g):
    return [g, g]


@_rule("sub")
def _sub(em, e, g):
    return [g, em.op("neg", g)]


@_rule("mul")
def _mul(em, e, g):
    a, b = (em.val(v) for v in e.inputs)
    return [em.op("mul", g, b), em.op("mul", g, a)]


@_rule("div")
def _div(em, e, g):
    _, b = (em.val(v) for v in e.inputs)
    y = em.val(e.outputs[0])
    ga = em.op("div", g, b)
    return [ga, em.op("neg", em.op("mul", ga, y))]


def _select(em, cond, g):
    """``(g where cond, 0 elsewhere; 0 where cond, g elsewhere)``."""
    zero = Literal(0.0)
    return em.op("where", cond, g, zero), em.op("where", cond, zero, g)


@_rule("maximum")
def _maximum(em, e, g):
    a, b = (em.val(v) for v in e.inputs)
    return list(_select(em, em.op("greater_equal", a, b), g))


@_rule("minimum")
def _minimum(em, e, g):
    a, b = (em.val(v) for v in e.inputs)
    return list(_select(em, em.op("less_equal", a, b), g))


@_rule("neg")
def _neg(em, e, g):
    return [em.op("neg", g)]


@_rule("abs")
def _abs(em, e, g):
    x = em.val(e.inputs[0])
    zero = Literal(0.0)
    positive = em.op("where", em.op("greater", x, zero), g, zero)
    negative = em.op("where", em.op("less", x, zero), g, zero)
    return [em.op("sub", positive, negative)]


@_rule("exp")
def _exp(em, e, g):
    return [em.op("mul", g, em.val(e.outputs[0]))]


@_rule("log")
def _log(em, e, g):
    return [em.op("div", g, em.val(e.inputs[0]))]


@_rule("tanh")
def _tanh(em, e, g):
    y = em.val(e.outputs[0])
    return [em.op("mul", g, em.op("sub", Literal(1.0), em.op("mul", y, y)))]


@_rule("sigmoid")
def _sigmoid(em, e, g):
    y = em.val(e.outputs[0])
    return [em.op("mul", g, em.op("mul", y, em.op("sub", Literal(1.0), y)))]


@_rule("softplus")
def _softplus(em, e, g):
    return [em.op("mul", g, em.op("sigmoid", em.val(e.inputs[0])))]


@_rule("relu")
def _relu(em, e, g):
    x = em.val(e.inputs[0])
    return [em.op("where", em.op("greater", x, Literal(0.0)), g, Literal(0.0))]


def _no_grad(em, e, g):
    return [None] * len(e.inputs)


for _name in ("greater", "greater_equal", "less", "less_equal", "equal"):
    _rule(_name)(_no_grad)


@_rule("where")
def _where(em, e, g):
    ga, gb = _select(em, em.val(e.inputs[0]), g)
    return [None, ga, gb]


@_rule("clip")
def _clip(em, e, g):
    x = em.val(e.inputs[0])
    lo, hi = e.attrs.get("lo"), e.attrs.get("hi")
    if lo is not None:
        g = em.op("where", em.op("less", x, Literal(lo)), Literal(0.0), g)
    if hi is not None:
        g = em.op("where", em.op("greater", x, Literal(hi)), Literal(0.0), g)
    return [g]


@_rule("matmul")
def _matmul(em, e, g):
    a, b = e.inputs
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise UnsupportedError(
            "gradient of matmul with a one-dimensional operand is not supported; "
            "make the vector a [1, n] or [n, 1] matrix"
        )
    av, bv = em.val(a), em.val(b)
    ga = em.op("matmul", g, em.op("transpose", bv))
    if a.batched and len(a.shape) == 2:
        # x @ W with x one row per sequence: dW is the sum over rows of the
        # outer products x^T g, one GEMM over every step (em.outer)
        return [ga, em.outer(av, g)]
    return [ga, em.op("matmul", em.op("transpose", av), g)]


@_rule("sum")
def _sum(em, e, g):
    (x,) = e.inputs
    axis, keep = e.attrs["axis"], e.attrs.get("keepdims", False)
    return [em.op("broadcast_axis", g, axis=axis, size=x.shape[axis], insert=not keep)]


@_rule("concat")
def _concat(em, e, g):
    axis = e.attrs["axis"]
    out, start = [], 0
    for v in e.inputs:
        n = v.shape[axis]
        out.append(em.op("slice", g, axis=axis, start=start, stop=start + n))
        start += n
    return out


@_rule("slice")
def _slice(em, e, g):
    (x,) = e.inputs
    axis, start, stop = e.attrs["axis"], e.attrs["start"], e.attrs["stop"]
    return [em.op("pad", g, axis=axis, before=start, after=x.shape[axis] - stop)]


@_rule("transpose")
def _transpose(em, e, g):
    return [em.op("transpose", g)]


@_rule("broadcast_axis")
def _broadcast_axis(em, e, g):
    return [em.op("sum", g, axis=e.attrs["axis"], keepdims=not e.attrs["insert"])]


@_rule("pad")
def _pad(em, e, g):
    (x,) = e.inputs
    axis, before = e.attrs["axis"], e.attrs["before"]
    return [em.op("slice", g, axis=axis, start=before, stop=before + x.shape[axis])]
