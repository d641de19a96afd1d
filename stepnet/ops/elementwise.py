"""The elementwise primitives: arithmetic (add .. abs), the transcendental
activations (exp .. relu), the comparisons, where and clip. Each result
element reads only the operands' elements at its own index, so the backends
fuse a run of them into one loop.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import ShapeError
from ..ir import Literal
from ..tracing import bind
from ..registry import (
    Aval,
    broadcast,
    register,
    result_dtype,
    shape_str,
)
from .rules import (
    HALF,
    ONE,
    TWO_OVER_SQRT_PI,
    ZERO,
    binary_rule,
    compare_rule,
    derivative,
    neg_rule,
    unary_float_rule,
    unary_rule,
)


def _vals(em, e):
    """The forward values of ``e``'s operands."""
    return [em.val(v) for v in e.inputs]



def _select(em, cond, g):
    """``[g where cond, 0 elsewhere; 0 where cond, g elsewhere]``."""
    return [em.op("where", cond, g, ZERO), em.op("where", cond, ZERO, g)]



# ----------------------------------------------------------------------------
# elementwise arithmetic


@register("add", binary_rule("add"), np.add, "elementwise", 2,
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


@register("sub", binary_rule("sub"), np.subtract, "elementwise", 2,
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


@register("mul", binary_rule("mul"), np.multiply, "elementwise", 2,
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


@register("div", binary_rule("div"), np.divide, "elementwise", 2,
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
# first operand when it is NaN or beats the second, else the second (NaN, or
# equal: NumPy's maximum of -0.0 and 0.0 is its second operand).
@register("maximum", binary_rule("maximum"), np.maximum, "elementwise", 2,
          grad=lambda em, e, g: _select(em, em.op("greater_equal", *_vals(em, e)), g),
          numba="({0} if ({0} > {1}) | ({0} != {0}) else {1})", onnx="Max")
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


@register("minimum", binary_rule("minimum"), np.minimum, "elementwise", 2,
          grad=lambda em, e, g: _select(em, em.op("less_equal", *_vals(em, e)), g),
          numba="({0} if ({0} < {1}) | ({0} != {0}) else {1})", onnx="Min")
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


@register("neg", neg_rule, np.negative, "elementwise", 1,
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


@register("abs", unary_rule, np.abs, "elementwise", 1,
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
# exp, log and sqrt give CUDA's inf and NaN themselves where Python's math
# raises (an overflow, a value out of their domain), the same on a GPU
# (709: above it a double's exp overflows).
_EXP_CUDA = "(math.exp({0}) if not ({0} > {dt}(709.0)) else {inf})"
_LOG_CUDA = "(math.log({0}) if {0} > {zero} else (-{inf} if {0} == {zero} else {nan}))"
_SQRT_CUDA = "(math.sqrt({0}) if not ({0} < {zero}) else {nan})"

_RELU_CUDA = "({0} if not ({0} <= {zero}) else {zero})"
_EXP_NEG_ABS = "math.exp(-abs({0}))"
_SIGMOID_CUDA = (f"({{one}} / ({{one}} + {_EXP_NEG_ABS})"
                 f" * ({{one}} if {{0}} >= {{zero}} else {_EXP_NEG_ABS}))")


@register("exp", unary_float_rule("exp"), np.exp, "elementwise", 1,
          grad=derivative(lambda em, x, y: y), numba="np.exp({0})", cuda=_EXP_CUDA,
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


@register("log", unary_float_rule("log"), np.log, "elementwise", 1,
          grad=lambda em, e, g: [em.op("div", g, em.val(e.inputs[0]))],
          numba="np.log({0})", cuda=_LOG_CUDA, onnx="Log", onnx_import="Log")
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


@register("sqrt", unary_float_rule("sqrt"), np.sqrt, "elementwise", 1,
          grad=derivative(lambda em, x, y: em.op("div", HALF, y)), numba="np.sqrt({0})",
          cuda=_SQRT_CUDA, onnx="Sqrt", onnx_import="Sqrt")
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


@register("tanh", unary_float_rule("tanh"), np.tanh, "elementwise", 1,
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


def _special(name):
    """scipy.special's ``name``, the module imported at the first call
    (importing it made up much of ``import stepnet``'s time)."""
    def call(x):
        from scipy import special

        return getattr(special, name)(x)

    call.__name__ = call.__qualname__ = name
    return call


@register("sigmoid", unary_float_rule("sigmoid"), _special("expit"), "elementwise", 1,
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


@register("softplus", unary_float_rule("softplus"),
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


@register("erf", unary_float_rule("erf"), _special("erf"), "elementwise", 1,
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


@register("relu", unary_rule, lambda x: np.maximum(x, x.dtype.type(0)), "elementwise", 1,
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
    @register(name, compare_rule(name), numpy, "elementwise", 2, numba=f"({{0}} {symbol} {{1}})",
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
    if isinstance(a, Literal) and isinstance(b, Literal):
        raise ShapeError(f"where: both branches are numbers ({a.value!r}, {b.value!r}), which "
                         "take their dtype from an array operand; make one a parameter or step "
                         f"value of the dtype wanted (in Python, np.float32({a.value!r}) will do)")
    return Aval(broadcast("where", operands), result_dtype([a, b]))


def _where_onnx(g, e, operand):
    cond, a, b = e.inputs
    dtype = e.outputs[0].dtype
    return g.where(operand(cond), operand(a, dtype), operand(b, dtype), dtype)


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
    # maximum(x, lo), then minimum(.., hi), as _clip: a NaN x or bound gives
    # NaN, and a bound equal to x (0.0 and -0.0) gives the bound
    if lo is not None:
        x = f"({x} if ({x} > {lo}) | ({x} != {x}) else {lo})"
    if hi is not None:
        x = f"({x} if ({x} < {hi}) | ({x} != {x}) else {hi})"
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
        Neither bound is given, a bound is not a number, or ``lo > hi``.
    """
    return bind("clip", [x], lo=_bound(lo, "lo"), hi=_bound(hi, "hi"))


def _bound(value, what):
    """A bound of clip as a float (None: none)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.ndarray)) \
            or np.ndim(value) != 0:
        raise ShapeError(f"clip: {what} must be one number, got {value!r}")
    return float(value)

