"""The primitives: one record each, its function under its registration.

A record holds the op's shape rule, NumPy reference, gradient rule, code for
each backend and ONNX forms (the fields of :class:`registry.OpDef`), then the
public function ``sn.ops.<name>``::

    @register("tanh", _unary_float_rule("tanh"), np.tanh, "elementwise", 1,
              grad=derivative(lambda em, x, y: em.op("sub", ONE, em.op("mul", y, y))),
              onnx="Tanh", onnx_import="Tanh")
    def tanh(x):
        return bind("tanh", [x])

On step values the functions trace into the IR; on plain arrays they compute
eagerly with the NumPy reference. Composite ops (the parametric ONNX
activations, mean, split, ...) live in ``composites.py`` and are built from
these, so they need nothing here. docs/adding-an-op.md says how to add one.

A gradient rule is ``grad(em, eqn, g) -> [cotangent or None per operand]``:
``g`` is the cotangent of the equation's output, ``em.val(v)`` gives a forward
value (an operand or the output), and ``em.op(name, *operands, **attrs)``
applies a primitive. Under :mod:`stepnet.autodiff` the emitter appends IR
equations to the backward step (so the backward compiles like the forward);
for constants outside the time loop, and for the ONNX Gradient operator, it
computes with the NumPy references. Each cotangent has the shape of the
equation's output; ``em.unbroadcast`` (applied by the caller) reduces it to the
operand's shape. ``None`` means "no gradient": the condition of ``where``,
Python scalars, and non-float operands.
"""

from __future__ import annotations

import builtins
import math

import numpy as np
from scipy import special

from ..errors import ShapeError, UnsupportedError
from ..ir import Literal, Var
from ..lod import LoDTensor
from ..tracing import Parameter, Value, bind
from ..registry import (
    Aval,
    Case,
    broadcast,
    check_float,
    normalize_axis,
    register,
    result_dtype,
    shape_str,
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


def _vals(em, e):
    """The forward values of ``e``'s operands."""
    return [em.val(v) for v in e.inputs]


def derivative(dydx):
    """The gradient rule of a unary op from its derivative ``dydx(em, x, y)``."""
    return lambda em, e, g: [em.op("mul", g, dydx(em, em.val(e.inputs[0]), em.val(e.outputs[0])))]


def _select(em, cond, g):
    """``[g where cond, 0 elsewhere; 0 where cond, g elsewhere]``."""
    return [em.op("where", cond, g, ZERO), em.op("where", cond, ZERO, g)]


# ----------------------------------------------------------------------------
# elementwise arithmetic


@register("add", _binary_rule("add"), np.add, "elementwise", 2,
          grad=lambda em, e, g: [g, g], numba="({0} + {1})", onnx="Add", onnx_import="Add")
def add(a, b):
    """Elementwise ``a + b``, with NumPy broadcasting; also ``a + b`` on step values.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("add", [a, b])


@register("sub", _binary_rule("sub"), np.subtract, "elementwise", 2,
          grad=lambda em, e, g: [g, em.op("neg", g)], numba="({0} - {1})",
          onnx="Sub", onnx_import="Sub")
def sub(a, b):
    """Elementwise ``a - b``, with NumPy broadcasting; also ``a - b`` on step values.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("sub", [a, b])


def _mul_grad(em, e, g):
    a, b = _vals(em, e)
    return [em.op("mul", g, b), em.op("mul", g, a)]


@register("mul", _binary_rule("mul"), np.multiply, "elementwise", 2,
          grad=_mul_grad, numba="({0} * {1})", onnx="Mul", onnx_import="Mul")
def mul(a, b):
    """Elementwise ``a * b``, with NumPy broadcasting; also ``a * b`` on step values.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("mul", [a, b])


def _div_grad(em, e, g):
    ga = em.op("div", g, em.val(e.inputs[1]))
    return [ga, em.op("neg", em.op("mul", ga, em.val(e.outputs[0])))]


@register("div", _binary_rule("div"), np.divide, "elementwise", 2,
          grad=_div_grad, numba="({0} / {1})", onnx="Div", onnx_import="Div")
def div(a, b):
    """Elementwise ``a / b``, with NumPy broadcasting; also ``a / b`` on step values.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("div", [a, b])


# NaN in gives NaN out, as in NumPy, by construction: Numba's max/min of
# floats and a GPU's fmaxf/fminf drop a NaN, so maximum and minimum pick the
# first operand when it is NaN or not beaten, else the second (NaN or not).
@register("maximum", _binary_rule("maximum"), np.maximum, "elementwise", 2,
          grad=lambda em, e, g: _select(em, em.op("greater_equal", *_vals(em, e)), g),
          numba="({0} if ({0} >= {1}) | ({0} != {0}) else {1})", onnx="Max")
def maximum(a, b):
    """Elementwise ``max(a, b)``, with NumPy broadcasting.

    A NaN operand gives NaN, as in NumPy; the gradient goes to ``a`` where
    ``a >= b``, else to ``b``.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("maximum", [a, b])


@register("minimum", _binary_rule("minimum"), np.minimum, "elementwise", 2,
          grad=lambda em, e, g: _select(em, em.op("less_equal", *_vals(em, e)), g),
          numba="({0} if ({0} <= {1}) | ({0} != {0}) else {1})", onnx="Min")
def minimum(a, b):
    """Elementwise ``min(a, b)``, with NumPy broadcasting.

    A NaN operand gives NaN, as in NumPy; the gradient goes to ``a`` where
    ``a <= b``, else to ``b``.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands (a Python scalar takes the other operand's dtype).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return bind("minimum", [a, b])


@register("neg", _unary_rule, np.negative, "elementwise", 1,
          grad=lambda em, e, g: [em.op("neg", g)], numba="(-{0})", onnx="Neg", onnx_import="Neg")
def neg(x):
    """Elementwise ``-x``; also ``-x`` on step values.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.
    """
    return bind("neg", [x])


def _abs_grad(em, e, g):
    x = em.val(e.inputs[0])
    positive = em.op("where", em.op("greater", x, ZERO), g, ZERO)
    negative = em.op("where", em.op("less", x, ZERO), g, ZERO)
    return [em.op("sub", positive, negative)]


@register("abs", _unary_rule, np.abs, "elementwise", 1,
          grad=_abs_grad, numba="abs({0})", onnx="Abs", onnx_import="Abs")
def abs(x):
    """Elementwise ``|x|``; also ``abs(x)`` on step values.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.
    """
    return bind("abs", [x])


# ----------------------------------------------------------------------------
# transcendental activations
#
# On CUDA a NaN fails every comparison, so each template sends it down a
# branch that keeps it (no max/min: fmaxf/fminf drop a NaN on a GPU).
# sigmoid and softplus call exp only on -|x| (no overflow, and on the
# simulator Python's math.exp raises where CUDA's gives inf): with
# e = exp(-|x|), sigmoid is 1/(1+e) for x >= 0 and e/(1+e) below, one exp.

_RELU_CUDA = "({0} if not ({0} <= {zero}) else {zero})"
_EXP_NEG_ABS = "math.exp(-abs({0}))"
_SIGMOID_CUDA = (f"({{one}} / ({{one}} + {_EXP_NEG_ABS})"
                 f" * ({{one}} if {{0}} >= {{zero}} else {_EXP_NEG_ABS}))")


@register("exp", _unary_float_rule("exp"), np.exp, "elementwise", 1,
          grad=derivative(lambda em, x, y: y), numba="np.exp({0})", cuda="math.exp({0})",
          onnx="Exp", onnx_import="Exp")
def exp(x):
    """Elementwise ``exp(x)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("exp", [x])


@register("log", _unary_float_rule("log"), np.log, "elementwise", 1,
          grad=lambda em, e, g: [em.op("div", g, em.val(e.inputs[0]))],
          numba="np.log({0})", cuda="math.log({0})", onnx="Log", onnx_import="Log")
def log(x):
    """Elementwise ``log(x)`` (natural logarithm).

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("log", [x])


@register("sqrt", _unary_float_rule("sqrt"), np.sqrt, "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("div", HALF, y)), numba="np.sqrt({0})",
          cuda="math.sqrt({0})", onnx="Sqrt", onnx_import="Sqrt")
def sqrt(x):
    """Elementwise ``sqrt(x)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("sqrt", [x])


@register("tanh", _unary_float_rule("tanh"), np.tanh, "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("sub", ONE, em.op("mul", y, y))),
          numba="tanh{bits}({0})", cuda="math.tanh({0})", onnx="Tanh", onnx_import="Tanh")
def tanh(x):
    """Elementwise ``tanh(x)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("tanh", [x])


@register("sigmoid", _unary_float_rule("sigmoid"), special.expit, "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("mul", y, em.op("sub", ONE, y))),
          numba="sigmoid{bits}({0})", cuda=_SIGMOID_CUDA, onnx="Sigmoid", onnx_import="Sigmoid")
def sigmoid(x):
    """Elementwise ``1 / (1 + exp(-x))``, the logistic function.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("sigmoid", [x])


def _softplus_onnx(g, e, operand):
    dtype = e.outputs[0].dtype
    x = operand(e.inputs[0], dtype)
    if np.dtype(dtype) == np.float32:
        return g.add("Softplus", [x])
    # onnxruntime has no float64 Softplus: max(x, 0) + log(1 + exp(-|x|))
    tail = g.add("Exp", [g.add("Neg", [g.add("Abs", [x])])])
    return g.add("Add", [g.add("Relu", [x]), g.add("Log", [g.add("Add", [g.const(1, dtype), tail])])])


@register("softplus", _unary_float_rule("softplus"),
          lambda x: np.logaddexp(x.dtype.type(0), x), "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("sigmoid", x)),
          numba="softplus{bits}({0})", cuda=f"({_RELU_CUDA} + math.log1p({_EXP_NEG_ABS}))",
          onnx=_softplus_onnx, onnx_import="Softplus")
def softplus(x):
    """ONNX Softplus: ``log(1 + exp(x))``, computed without overflow.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("softplus", [x])


@register("erf", _unary_float_rule("erf"), special.erf, "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("mul", TWO_OVER_SQRT_PI,
                                                 em.op("exp", em.op("neg", em.op("mul", x, x))))),
          numba="math.erf({0})", cuda="math.erf({0})", onnx="Erf", onnx_import="Erf")
def erf(x):
    """The Gauss error function ``2/sqrt(pi) * integral of exp(-t*t) from 0 to x``
    (``gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2)))``). Exports as ONNX Erf,
    which onnxruntime runs in float32 only.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` is not floating-point.
    """
    return bind("erf", [x])


@register("relu", _unary_rule, lambda x: np.maximum(x, x.dtype.type(0)), "elementwise", 1,
          grad=lambda em, e, g: [em.op("where", em.op("greater", em.val(e.inputs[0]), ZERO), g, ZERO)],
          numba="relu({0})", cuda=_RELU_CUDA, onnx="Relu", onnx_import="Relu")
def relu(x):
    """Elementwise ``max(x, 0)``, the rectifier.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.
    """
    return bind("relu", [x])


# ----------------------------------------------------------------------------
# comparisons (no gradient: the result is a mask), where, clip


def _comparison(name, numpy, symbol, onnx):
    @register(name, _compare_rule(name), numpy, "elementwise", 2, numba=f"({{0}} {symbol} {{1}})",
              onnx=onnx, onnx_import=onnx)
    def compare(a, b):
        return bind(name, [a, b])

    compare.__name__ = compare.__qualname__ = name
    operator = "" if symbol == "==" else f"; also ``a {symbol} b`` on step values"
    compare.__doc__ = f"""Elementwise ``a {symbol} b``: a boolean mask (no gradient), with NumPy
    broadcasting{operator}.

    Parameters
    ----------
    a, b : step value, Parameter, array or Python scalar
        The operands.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        The shapes do not broadcast.
    """
    return compare


greater = _comparison("greater", np.greater, ">", "Greater")
greater_equal = _comparison("greater_equal", np.greater_equal, ">=", "GreaterOrEqual")
less = _comparison("less", np.less, "<", "Less")
less_equal = _comparison("less_equal", np.less_equal, "<=", "LessOrEqual")
equal = _comparison("equal", np.equal, "==", "Equal")


def _where_rule(operands):
    cond, a, b = operands
    if not hasattr(cond, "dtype") or np.dtype(cond.dtype) != np.dtype(bool):
        raise ShapeError(f"where: the condition must be a boolean step value, got {shape_str(cond)}")
    return Aval(broadcast("where", operands), result_dtype([a, b]))


def _where_onnx(g, e, operand):
    cond, a, b = e.inputs
    dtype = e.outputs[0].dtype
    return g.add("Where", [operand(cond), operand(a, dtype), operand(b, dtype)])


@register("where", _where_rule, np.where, "elementwise", 3,
          grad=lambda em, e, g: [None] + _select(em, em.val(e.inputs[0]), g),
          numba="({1} if {0} else {2})", onnx=_where_onnx, onnx_import="Where")
def where(cond, a, b):
    """Per element: ``a`` where ``cond`` holds, else ``b``.

    Parameters
    ----------
    cond : boolean step value or array
        The condition (no gradient flows to it).
    a, b : step value, Parameter, array or Python scalar
        The values chosen from; the three shapes broadcast.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``cond`` is not boolean, or the shapes do not broadcast.
    """
    return bind("where", [cond, a, b])


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


def _clip_grad(em, e, g):
    x = em.val(e.inputs[0])
    lo, hi = e.attrs.get("lo"), e.attrs.get("hi")
    if lo is not None:
        g = em.op("where", em.op("less", x, Literal(lo)), ZERO, g)
    if hi is not None:
        g = em.op("where", em.op("greater", x, Literal(hi)), ZERO, g)
    return [g]


def _clip_code(x, lo=None, hi=None):
    # np.clip: the bounds are numbers, so only x can be NaN, and it fails
    # both comparisons and stays NaN
    if lo is not None:
        x = f"({x} if not ({x} < {lo}) else {lo})"
    if hi is not None:
        x = f"({x} if not ({x} > {hi}) else {hi})"
    return x


def _clip_onnx(g, e, operand):
    dtype = e.outputs[0].dtype
    lo, hi = e.attrs.get("lo"), e.attrs.get("hi")
    bounds = ["" if lo is None else g.const(lo, dtype)] + ([] if hi is None else [g.const(hi, dtype)])
    return g.add("Clip", [operand(e.inputs[0], dtype)] + bounds)


@register("clip", _clip_rule, _clip, "elementwise", 1, grad=_clip_grad, numba=_clip_code,
          onnx=_clip_onnx)
def clip(x, lo=None, hi=None):
    """Clip to ``[lo, hi]``; either bound may be None.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    lo, hi : float, optional
        The bounds (weak scalars: the result keeps ``x``'s dtype); at least
        one is given.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        Neither bound is given, or ``lo > hi``.
    """
    return bind("clip", [x], lo=None if lo is None else float(lo),
                hi=None if hi is None else float(hi))


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


def _matmul_grad(em, e, g):
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


def _matmul_reduction(index, shapes):
    """A dot product per result element (a GEMM by a constant is scheduled as
    a GEMM instead); 1-D operands as NumPy promotes them."""
    sa, sb = shapes
    full = list(index) if len(sa) > 1 else list(index[:-1]) + ["0"] + list(index[-1:])
    if len(sb) == 1:
        full.append("0")
    stack = full[:-2]
    a_index = stack[len(stack) - (len(sa) - 2):] if len(sa) > 2 else []
    a_index += ([full[-2]] if len(sa) > 1 else []) + ["k"]
    b_index = stack[len(stack) - (len(sb) - 2):] if len(sb) > 2 else []
    b_index += ["k"] + ([full[-1]] if len(sb) > 1 else [])
    return sa[-1], [a_index, b_index]


@register("matmul", _matmul_rule, np.matmul, "matmul", 2, grad=_matmul_grad, onnx="MatMul",
          reduction=_matmul_reduction)
def matmul(a, b):
    """Matrix product ``a @ b``, as ``np.matmul`` (1-D operands promoted, stacked
    dimensions broadcast); also ``a @ b`` on step values.

    Parameters
    ----------
    a, b : step value, Parameter or array
        The operands; a ragged value (an attention memory) may only be
        multiplied by a constant (``rows @ W``).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        A Python scalar operand, a 0-d operand, contracted dimensions that
        differ, or a product that would move the batch axis.
    UnsupportedError
        A ragged value multiplied by a step value.
    """
    return bind("matmul", [a, b])


# ----------------------------------------------------------------------------
# reductions and shape ops


def _axis(e) -> int:
    return normalize_axis(e.op, e.inputs[0], e.attrs["axis"])


def _sum_rule(operands, axis, keepdims=False):
    (x,) = operands
    axis = normalize_axis("sum", x, axis)
    shape = list(x.shape)
    if keepdims:
        shape[axis] = 1
    else:
        del shape[axis]
    return Aval(tuple(shape), np.dtype(x.dtype))


def _sum_grad(em, e, g):
    (x,) = e.inputs
    axis, keep = e.attrs["axis"], e.attrs.get("keepdims", False)
    return [em.op("broadcast_axis", g, axis=axis, size=x.shape[axis], insert=not keep)]


def _sum_onnx(g, e, operand):
    x = operand(e.inputs[0], e.outputs[0].dtype)
    return g.add("ReduceSum", [x, g.ints([_axis(e)])], keepdims=int(bool(e.attrs.get("keepdims", False))))


def _sum_reduction(index, shapes, axis, keepdims=False):
    axis %= len(shapes[0])
    source = list(index)
    if keepdims:
        source[axis] = "k"
    else:
        source.insert(axis, "k")
    return shapes[0][axis], [source]


@register("sum", _sum_rule, lambda x, axis, keepdims=False: np.sum(x, axis, keepdims=keepdims),
          "reduce", 1, grad=_sum_grad, onnx=_sum_onnx, reduction=_sum_reduction)
def sum(x, axis=-1, keepdims=False):
    """Sum over one axis.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    axis : int, default -1
        The axis summed (negative counts from the end); not the batch axis.
    keepdims : bool, default False
        Keep the summed axis, of size 1.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``axis`` is out of range or the batch axis.
    """
    return bind("sum", [x], axis=int(axis), keepdims=bool(keepdims))


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


def _concat_grad(em, e, g):
    axis = e.attrs["axis"]
    out, start = [], 0
    for v in e.inputs:
        n = v.shape[axis]
        out.append(em.op("slice", g, axis=axis, start=start, stop=start + n))
        start += n
    return out


def _concat_onnx(g, e, operand):
    dtype = e.outputs[0].dtype
    return g.add("Concat", [operand(v, dtype) for v in e.inputs], axis=_axis(e))


def _concat_gather(index, shapes, axis):
    axis %= len(shapes[0])
    cases, start = [], 0
    for k, shape in enumerate(shapes):
        source = list(index)
        source[axis] = f"{index[axis]} - {start}"
        cases.append(Case(k, tuple(source), axis, start, start + shape[axis]))
        start += shape[axis]
    return cases


@register("concat", _concat_rule, lambda *xs, axis: np.concatenate(xs, axis), "shape",
          grad=_concat_grad, onnx=_concat_onnx, gather=_concat_gather)
def concat(values, axis=-1):
    """Join arrays along one axis, as ``np.concatenate``.

    Parameters
    ----------
    values : sequence of step values, Parameters or arrays
        The operands: their shapes are equal but along ``axis``; no Python
        scalars.
    axis : int, default -1
        The axis joined along (negative counts from the end); not the batch axis.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        No operand, a scalar operand, shapes that differ off ``axis``, or
        ``axis`` out of range or the batch axis.
    """
    return bind("concat", list(values), axis=int(axis))


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
    index = [builtins.slice(None)] * x.ndim
    index[axis] = builtins.slice(start, stop)
    return x[tuple(index)]


def _slice_grad(em, e, g):
    (x,) = e.inputs
    axis, start, stop = e.attrs["axis"], e.attrs["start"], e.attrs["stop"]
    return [em.op("pad", g, axis=axis, before=start, after=x.shape[axis] - stop)]


def _slice_onnx(g, e, operand):
    a = e.attrs
    return g.add("Slice", [operand(e.inputs[0]), g.ints([a["start"]]), g.ints([a["stop"]]),
                           g.ints([_axis(e)])])


def _slice_gather(index, shapes, axis, start, stop):
    source = list(index)
    source[axis % len(shapes[0])] = f"{start} + {index[axis % len(shapes[0])]}"
    return [Case(0, tuple(source))]


@register("slice", _slice_rule, _slice, "shape", 1, grad=_slice_grad, onnx=_slice_onnx,
          gather=_slice_gather)
def slice(x, start, stop, axis=-1):
    """``x[..., start:stop]`` along one axis (Python slice bounds: negative
    counts from the end, out-of-range bounds are clipped); also ``x[...]``
    on step values.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    start, stop : int
        The bounds, as a Python slice's (no step).
    axis : int, default -1
        The axis sliced; not the batch axis.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``axis`` is out of range or the batch axis.
    """
    size = shape_of(x)[axis]
    if size is None:  # the batch axis: the rule refuses it with a clear error
        return bind("slice", [x], axis=int(axis), start=int(start), stop=int(stop))
    start, stop, _ = builtins.slice(start, stop).indices(size)
    return bind("slice", [x], axis=int(axis), start=start, stop=builtins.max(start, stop))


def _transpose_rule(operands):
    (x,) = operands
    if len(x.shape) < 2 or x.shape[-2] is None:
        raise ShapeError(
            f"transpose: swaps the last two feature axes; {shape_str(x)} has fewer than two"
        )
    return Aval(x.shape[:-2] + (x.shape[-1], x.shape[-2]), np.dtype(x.dtype))


def _transpose_onnx(g, e, operand):
    rank = len(e.inputs[0].shape)
    return g.add("Transpose", [operand(e.inputs[0])], perm=list(range(rank - 2)) + [rank - 1, rank - 2])


@register("transpose", _transpose_rule, lambda x: np.swapaxes(x, -1, -2), "shape", 1,
          grad=lambda em, e, g: [em.op("transpose", g)], onnx=_transpose_onnx,
          gather=lambda index, shapes: [Case(0, tuple(index[:-2]) + (index[-1], index[-2]))])
def transpose(x):
    """Swap the last two feature axes (``W.T`` for a matrix).

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (at least 2-D; the last two axes are not the batch axis).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``x`` has fewer than two feature axes.
    """
    return bind("transpose", [x])


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


def _broadcast_axis_onnx(g, e, operand):
    x = operand(e.inputs[0])
    axis, size = e.attrs["axis"], e.attrs["size"]
    if e.attrs["insert"]:
        x = g.add("Unsqueeze", [x, g.ints([axis])])
    target = [1] * len(e.outputs[0].shape)
    target[axis] = size
    return g.add("Expand", [x, g.ints(target)])  # Expand broadcasts both ways


def _broadcast_axis_gather(index, shapes, axis, size, insert):
    source = list(index)
    if insert:
        del source[axis]
    else:
        source[axis] = "0"
    return [Case(0, tuple(source))]


@register("broadcast_axis", _broadcast_axis_rule, _broadcast_axis, "shape", 1,
          grad=lambda em, e, g: [em.op("sum", g, axis=e.attrs["axis"], keepdims=not e.attrs["insert"])],
          onnx=_broadcast_axis_onnx, gather=_broadcast_axis_gather, numba="{0}",
          elementwise_when=lambda axis, size, insert: not insert)
def broadcast_axis(x, axis, size, insert=True):
    """Repeat ``x`` ``size`` times along ``axis``: a new axis (``insert=True``)
    or one of size 1.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    axis : int
        Where the new axis goes (``insert=True``), or the axis of size 1 that
        grows; counted from 0 with the batch axis included, not negative.
    size : int
        The length of that axis (not negative).
    insert : bool, default True
        Insert a new axis, or grow an existing one of size 1.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        ``size`` is negative, or ``axis`` is out of range (or not of size 1).
    """
    return bind("broadcast_axis", [x], axis=int(axis), size=int(size), insert=bool(insert))


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


def _pad_grad(em, e, g):
    (x,) = e.inputs
    axis, before = e.attrs["axis"], e.attrs["before"]
    return [em.op("slice", g, axis=axis, start=before, stop=before + x.shape[axis])]


def _pad_onnx(g, e, operand):
    rank = len(e.inputs[0].shape)
    axis = _axis(e)
    pads = [0] * (2 * rank)
    pads[axis], pads[rank + axis] = e.attrs["before"], e.attrs["after"]
    return g.add("Pad", [operand(e.inputs[0]), g.ints(pads)], mode="constant")


def _pad_gather(index, shapes, axis, before, after):
    axis %= len(shapes[0])
    n = shapes[0][axis]
    source = list(index)
    source[axis] = f"{index[axis]} - {before}"
    cases = [Case(None, (), axis, 0, before), Case(0, tuple(source), axis, before, before + n),
             Case(None, (), axis, before + n, before + n + after)]
    return [c for c in cases if c.hi > c.lo]


@register("pad", _pad_rule, _pad, "shape", 1, grad=_pad_grad, onnx=_pad_onnx, gather=_pad_gather)
def pad(x, before, after, axis=-1):
    """Zero-pad ``axis`` with ``before`` and ``after`` elements.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    before, after : int
        The number of zeros put before and after (not negative).
    axis : int, default -1
        The axis padded (negative counts from the end); not the batch axis.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the op is traced into the IR);
        on plain arrays and Parameters outside a block, the result computed
        with the op's NumPy reference.

    Raises
    ------
    ShapeError
        A negative width, or ``axis`` out of range or the batch axis.
    """
    return bind("pad", [x], axis=int(axis), before=int(before), after=int(after))


# ----------------------------------------------------------------------------
# segment ops: over each batch row's own rows of a ragged value (an attention
# memory given by add_static_input(LoDTensor), or a value computed from one)


def _ragged_operand(name, v):
    if not (isinstance(v, Var) and v.lod_depth == 1):
        raise ShapeError(
            f"{name}: {shape_str(v)} is not a ragged value of one level (a static input given "
            "as a LoDTensor, e.g. an attention memory, or a value computed from one)"
        )


def _segment_rule(name):
    def rule(operands):
        (x,) = operands
        _ragged_operand(name, x)
        return Aval(x.shape, np.dtype(x.dtype))
    return rule


def _segments(x):
    """(data rows, start per segment, row count per segment) of a one-level LoDTensor."""
    offsets = np.asarray(x.levels[-1])
    return np.asarray(x.data), offsets[:-1], np.diff(offsets)


def _segment_reduce(ufunc, empty):
    def reference(x):
        data, starts, counts = _segments(x)
        out = np.full((len(counts),) + data.shape[1:], empty, data.dtype)
        full = counts > 0
        if full.any():  # non-empty segments are contiguous and in order
            out[full] = ufunc.reduceat(data[:starts[-1] + counts[-1]], starts[full], axis=0)
        return out
    return reference


@register("seq_sum", _segment_rule("seq_sum"), _segment_reduce(np.add, 0), "segment", 1,
          grad=lambda em, e, g: [em.op("seq_expand", g, e.inputs[0])], onnx=None,
          segment=("{acc} + {x}", 0.0), takes_lod=True)
def seq_sum(x):
    """Each batch row's sum over its own rows of the ragged value ``x``
    (``[B, ...]``; zeros for a row with none).

    Parameters
    ----------
    x : step value
        A ragged step value of one level (e.g. a memory given to
        ``add_static_input`` as a LoDTensor, or arithmetic on it).

    Returns
    -------
    step value
        A dense value ``[B, ...]``.
    """
    return bind("seq_sum", [x])


def _seq_max_grad(em, e, g):
    x = e.inputs[0]
    return [em.op("where", em.op("equal", em.val(x), em.val(e.outputs[0])), g, ZERO)]


@register("seq_max", _segment_rule("seq_max"), _segment_reduce(np.maximum, -np.inf), "segment", 1,
          grad=_seq_max_grad, onnx=None, takes_lod=True,
          segment=("({acc} if {acc} >= {x} or {acc} != {acc} else {x})", -np.inf))  # NaN wins
def seq_max(x):
    """Each batch row's maximum over its own rows of the ragged value ``x``
    (``[B, ...]``; -inf for a row with none).

    Parameters
    ----------
    x : step value
        A ragged step value of one level (e.g. a memory given to
        ``add_static_input`` as a LoDTensor, or arithmetic on it).

    Returns
    -------
    step value
        A dense value ``[B, ...]``.
    """
    return bind("seq_max", [x])


def _seq_expand_rule(operands):
    x, like = operands
    _ragged_operand("seq_expand", like)
    if isinstance(x, Literal) or x.lod_depth or not x.batched:
        raise ShapeError(f"seq_expand: {shape_str(x)} is not a dense step value [B, ...]")
    return Aval(x.shape, np.dtype(x.dtype))


def _seq_expand(x, like):
    counts = np.diff(np.asarray(like.levels[-1]))
    return LoDTensor(np.repeat(np.asarray(x), counts, axis=0), [np.asarray(like.levels[-1]) -
                                                                like.levels[-1][0]])


@register("seq_expand", _seq_expand_rule, _seq_expand, "elementwise", 2,
          grad=lambda em, e, g: [em.op("seq_sum", g), None], numba="{0}", onnx=None,
          takes_lod=True)
def seq_expand(x, like):
    """The dense step value ``x`` (``[B, ...]``) repeated over each batch row's
    rows of the ragged value ``like``: a ragged value. (Arithmetic between a
    ragged and a dense value does this by itself.)

    Parameters
    ----------
    x : step value
        The dense value.
    like : step value
        The ragged value whose rows ``x`` is repeated over.

    Returns
    -------
    step value
        A ragged value, with ``like``'s rows.
    """
    return bind("seq_expand", [x, like])
