"""Each op of stepnet.ops against an independent reference.

Every primitive of the registry is traced inside a tiny step-net (a step input,
the op applied to the step value and/or a Parameter, an array, a Python scalar
or a second step input) over Hypothesis shapes, LoDs and float32/float64 data,
and the interpreter's result is compared with a computation written here in
float64 (``math`` functions, ONNX formulas), not with the registry's NumPy
reference. Then: the dtype rules (weak Python scalars, promotion, bool
comparisons), the shape rules (ShapeError naming the op and the shapes), the
composite ONNX activations with their alpha/beta, eager use on arrays, value
slicing, and every op on every backend against the interpreter.
"""

import inspect
import math
import operator
import re

import numpy as np
import pytest
from conftest import TOL, assert_backends_agree, available_backends
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from stepnet_strategies import float_dtypes, sequence_lengths

import stepnet as sn
from stepnet import registry

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)

feature_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)


# ----------------------------------------------------------------------------
# data


def floats(dtype, low, high):
    return st.floats(low, high, width=np.dtype(dtype).itemsize * 8, allow_nan=False,
                     allow_infinity=False, allow_subnormal=False)


def general(dtype):
    return floats(dtype, -4.0, 4.0)


def away_from_zero(dtype):
    return st.one_of(floats(dtype, -8.0, -0.5), floats(dtype, 0.5, 8.0))


GRID = (-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0)


def grid(dtype):
    """Few distinct values, so that comparisons meet ties."""
    return st.sampled_from(GRID)


@st.composite
def lod_input(draw, dtype, feature_shape, elements, lengths):
    rows = int(sum(lengths))
    data = draw(hnp.arrays(dtype, (rows,) + tuple(feature_shape), elements=elements))
    return sn.LoDTensor.from_lengths(data, [list(lengths)])


def draw_setup(data, max_sequences=4, max_length=4):
    """dtype, lengths, feature shape, reverse."""
    return (
        data.draw(float_dtypes, label="dtype"),
        data.draw(sequence_lengths(max_sequences, max_length), label="lengths"),
        data.draw(feature_shapes, label="feature shape"),
        data.draw(st.booleans(), label="reverse"),
    )


def feature_axes(shape):
    """A feature axis of step values of feature shape ``shape``, counted from
    either end (axis 0 is the batch)."""
    return st.sampled_from(list(range(1, len(shape) + 1)) + list(range(-len(shape), 0)))


def weak(value, dtype):
    """A Python scalar as NEP 50 uses it: converted to the other operand's dtype."""
    return float(np.dtype(dtype).type(value))


def type_str(dtype, shape):
    """How shapes appear in messages: ``f32[B,3]`` (B the batch axis)."""
    prefix = {F32: "f32", F64: "f64"}[np.dtype(dtype)]
    return prefix + "[" + ",".join("B" if d is None else str(d) for d in shape) + "]"


# ----------------------------------------------------------------------------
# tiny step-nets and checking them


def step_net(inputs, build, reverse=False):
    """A step-net over ``inputs`` (named x0, x1, ...) whose step outputs
    ``build(*step_values)`` (one value or a list). Returns (rnn, traced outputs)."""
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        xs = [rnn.add_input(X, name=f"x{i}") for i, X in enumerate(inputs)]
        outs = build(*xs)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        rnn.add_outputs(*outs)
    return rnn, outs


def as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


def assert_matches(actual, expected, dtype, exact=False, scale=None, what="output"):
    """``actual`` (computed in ``dtype``) against a float64/bool reference:
    bit-exact where asked, else |a - e| <= tol * max(1, scale) (DESIGN §4)."""
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if exact or np.dtype(dtype) == np.dtype(bool):
        np.testing.assert_array_equal(actual, np.asarray(expected).astype(dtype), err_msg=what)
        return
    scale = np.abs(expected) if scale is None else scale
    err = np.abs(actual.astype(np.float64) - expected)
    bound = TOL[np.dtype(dtype)] * np.maximum(1.0, scale)
    assert np.all(err <= bound), f"{what}: max error {err.max()} over {bound.min()}"


def last_rows(rows, lod, reverse):
    """Each sequence's last step (position 0 when reversed); zeros when empty."""
    offsets = lod[0]
    out = np.zeros((len(offsets) - 1,) + rows.shape[1:], rows.dtype)
    for s in range(len(offsets) - 1):
        if offsets[s + 1] > offsets[s]:
            out[s] = rows[offsets[s] if reverse else offsets[s + 1] - 1]
    return out


def check_net(rnn, traced, X, expected, dtype, reverse, exact=False, scale=None):
    """Run ``rnn`` on the interpreter in both modes against reference rows."""
    expected = expected if isinstance(expected, list) else [expected]
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(expected)
    scales = scale if isinstance(scale, list) else [scale] * len(expected)
    all_steps = as_list(rnn(backend="interpreter"))
    last = as_list(rnn(output_all_steps=False, backend="interpreter"))
    assert len(all_steps) == len(last) == len(expected)
    for i, (value, final, rows, dt, sc) in enumerate(
        zip(all_steps, last, expected, dtypes, scales)
    ):
        what = f"output {i}"
        # The traced value says what the run gives.
        assert traced[i].dtype == dt, f"{what}: traced as {traced[i].dtype}, expected {dt}"
        assert traced[i].shape == (None,) + rows.shape[1:], what
        assert isinstance(value, sn.LoDTensor) and value.lod == X.lod, what
        assert_matches(value.data, rows, dt, exact, sc, what)
        lsc = None if sc is None else last_rows(np.broadcast_to(sc, rows.shape), X.lod, reverse)
        assert_matches(final, last_rows(rows, X.lod, reverse), dt, exact, lsc, what + " (last)")


# ----------------------------------------------------------------------------
# the references, written independently of the registry (float64, math)


def elementwise(f):
    """Apply a scalar function of ``math`` to every element, in float64."""
    def ref(x):
        return np.vectorize(f, otypes=[np.float64])(np.asarray(x, np.float64))
    return ref


def _sigmoid(v):
    # 1 / (1 + exp(-v)), never overflowing.
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    return math.exp(v) / (1.0 + math.exp(v))


def _softplus(v):
    # log(1 + exp(v)) without overflow: max(v, 0) + log1p(exp(-|v|)).
    return max(v, 0.0) + math.log1p(math.exp(-abs(v)))


# name -> (reference, elements of the input, exact, traced forms)
UNARY = {
    "neg": (lambda x: -x, general, True, [sn.ops.neg, operator.neg]),
    "abs": (elementwise(math.fabs), general, True, [sn.ops.abs, abs]),
    "relu": (elementwise(lambda v: v if v > 0 else 0.0), general, True, [sn.ops.relu]),
    "exp": (elementwise(math.exp), lambda d: floats(d, -20.0, 20.0), False, [sn.ops.exp]),
    "log": (elementwise(math.log), lambda d: floats(d, 2.0**-10, 1000.0), False,
            [sn.ops.log]),
    "sqrt": (elementwise(math.sqrt), lambda d: floats(d, 0.0, 1e6), False, [sn.ops.sqrt]),
    # Large |x| (past exp's overflow in float32, and in float64 for softplus):
    # the activations saturate, never inf or nan.
    "tanh": (elementwise(math.tanh), lambda d: floats(d, -200.0, 200.0), False, [sn.ops.tanh]),
    "sigmoid": (elementwise(_sigmoid), lambda d: floats(d, -200.0, 200.0), False,
                [sn.ops.sigmoid]),
    "softplus": (elementwise(_softplus), lambda d: floats(d, -1000.0, 1000.0), False,
                 [sn.ops.softplus]),
    "erf": (elementwise(math.erf), lambda d: floats(d, -8.0, 8.0), False, [sn.ops.erf]),
}

# name -> (reference on float64 operands, sn.ops function, operator or None)
ARITHMETIC = {
    "add": (operator.add, sn.ops.add, operator.add),
    "sub": (operator.sub, sn.ops.sub, operator.sub),
    "mul": (operator.mul, sn.ops.mul, operator.mul),
    "div": (operator.truediv, sn.ops.div, operator.truediv),
    "maximum": (lambda a, b: np.where(a >= b, a, b), sn.ops.maximum, None),
    "minimum": (lambda a, b: np.where(a <= b, a, b), sn.ops.minimum, None),
}
COMPARISONS = {
    "greater": (operator.gt, sn.ops.greater, operator.gt),
    "greater_equal": (operator.ge, sn.ops.greater_equal, operator.ge),
    "less": (operator.lt, sn.ops.less, operator.lt),
    "less_equal": (operator.le, sn.ops.less_equal, operator.le),
    "equal": (operator.eq, sn.ops.equal, None),  # == on a step value stays identity
}
OTHERS = {"where", "clip", "matmul", "sum", "concat", "slice", "transpose", "broadcast_axis", "pad",
          "seq_sum", "seq_max", "seq_expand",  # the segment ops: tests/test_attention.py
          "matmul_int8", "matmul_bf16"}  # the quantized products: tests/test_quantize.py


def test_every_primitive_is_checked_against_a_reference():
    checked = set(UNARY) | set(ARITHMETIC) | set(COMPARISONS) | OTHERS
    assert set(registry.all_ops()) == checked


def test_every_primitive_has_its_kind_and_arity():
    ops = registry.all_ops()
    for name in set(UNARY) | set(ARITHMETIC) | set(COMPARISONS) | {"where", "clip"}:
        assert ops[name].kind == "elementwise", name
    assert ops["matmul"].kind == "matmul"
    assert ops["sum"].kind == "reduce"
    assert ops["concat"].kind == "shape" and ops["slice"].kind == "shape"
    for name in UNARY:
        assert ops[name].num_inputs == 1, name
    for name in set(ARITHMETIC) | set(COMPARISONS):
        assert ops[name].num_inputs == 2, name
    assert ops["where"].num_inputs == 3
    assert ops["concat"].num_inputs is None


def test_every_primitive_has_code_for_every_backend_in_its_record():
    """The backends keep no op tables: each record holds its code."""
    for name, op in registry.all_ops().items():
        if op.kind == "elementwise":
            assert op.numba is not None and op.cuda is not None, name
        elif op.kind == "shape":
            assert op.gather is not None, name
        elif op.kind == "segment":
            assert op.segment is not None, name
        elif op.kind == "quantized":  # (each backend's routine: tests/test_quantize.py)
            assert op.grad is not None and op.numba is None, name
        else:
            assert op.reduction is not None, name


def test_gather_cases_of_pad_and_concat_cover_the_result():
    pad = registry.get("pad").gather(["b", "i1"], [(None, 3)], axis=1, before=2, after=1)
    assert [(c.operand, c.lo, c.hi) for c in pad] == [(None, 0, 2), (0, 2, 5), (None, 5, 6)]
    assert pad[1].index == ("b", "i1 - 2")
    concat = registry.get("concat").gather(["b", "i1"], [(None, 2), (None, 3)], axis=-1)
    assert [(c.operand, c.lo, c.hi, c.index[1]) for c in concat] == [
        (0, 0, 2, "i1 - 0"), (1, 2, 5, "i1 - 2")]


# ----------------------------------------------------------------------------
# unary ops


@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(data=st.data())
def test_unary_op_matches_reference(name, data):
    ref, elements, exact, forms = UNARY[name]
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, elements(dtype), lengths))
    form = data.draw(st.sampled_from(forms))
    rnn, traced = step_net([X], form, reverse)
    assert rnn.block.eqns[0].op == name
    check_net(rnn, traced, X, ref(X.data), dtype, reverse, exact)


@SETTINGS
@given(data=st.data())
def test_clip_matches_reference(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    lo, hi = sorted(data.draw(st.lists(floats(np.float64, -3, 3), min_size=2, max_size=2)))
    lo, hi = data.draw(st.sampled_from([(lo, hi), (lo, None), (None, hi)]))
    rnn, traced = step_net([X], lambda x: sn.ops.clip(x, lo, hi), reverse)
    expected = X.data.astype(np.float64)
    if lo is not None:  # the bounds are weak scalars: x's dtype
        expected = np.where(expected < weak(lo, dtype), weak(lo, dtype), expected)
    if hi is not None:
        expected = np.where(expected > weak(hi, dtype), weak(hi, dtype), expected)
    check_net(rnn, traced, X, expected, dtype, reverse, exact=True)


# ----------------------------------------------------------------------------
# binary ops: with a second step value, a Parameter, an array or a Python scalar


def step_operand_shapes(shape):
    """Shapes of a second step value that broadcast with ``shape`` (same rank)."""
    return [shape, shape[:-1] + (1,), (1,) * len(shape)]


def constant_shapes(shape):
    """Shapes of a constant (no batch axis) that broadcast with a step value."""
    return [shape, shape[-1:], (1,), shape[:-1] + (1,), ()]


@st.composite
def second_operand(draw, dtype, shape, lengths, elements):
    """(kind, operand or None, step input or None, float64 operand, its dtype or None)."""
    kind = draw(st.sampled_from(["step", "param", "array", "scalar"]), label="operand kind")
    if kind == "scalar":
        value = draw(elements(np.float64), label="scalar")
        return kind, value, None, None, None
    other_dtype = draw(float_dtypes, label="operand dtype")
    if kind == "step":
        other_shape = draw(st.sampled_from(step_operand_shapes(shape)))
        Y = draw(lod_input(other_dtype, other_shape, elements(other_dtype), lengths))
        return kind, None, Y, Y.data.astype(np.float64), other_dtype
    other_shape = draw(st.sampled_from(constant_shapes(shape)))
    arr = draw(hnp.arrays(other_dtype, other_shape, elements=elements(other_dtype)))
    value = sn.Parameter(arr) if kind == "param" else arr
    return kind, value, None, arr.astype(np.float64), other_dtype


def binary_case(data, function, symbol, elements_x, elements_y):
    """Trace ``x op other`` (or ``other op x``) and return what check_net needs."""
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, elements_x(dtype), lengths))
    kind, operand, Y, other64, other_dtype = data.draw(
        second_operand(dtype, shape, lengths, elements_y))
    on_left = data.draw(st.booleans(), label="operand on the left")
    use_symbol = symbol is not None and data.draw(st.booleans(), label="operator form")
    apply = symbol if use_symbol else function
    inputs = [X] if Y is None else [X, Y]

    def build(x, y=None):
        other = operand if y is None else y
        return apply(other, x) if on_left else apply(x, other)

    if kind == "scalar":
        other64 = weak(operand, dtype)
        result_dtype = dtype
    else:
        result_dtype = np.result_type(dtype, other_dtype)
    rnn, traced = step_net(inputs, build, reverse)
    x64 = X.data.astype(np.float64)
    return rnn, traced, X, (other64, x64) if on_left else (x64, other64), result_dtype, reverse


@pytest.mark.parametrize("name", sorted(ARITHMETIC))
@SETTINGS
@given(data=st.data())
def test_arithmetic_op_matches_reference(name, data):
    ref, function, symbol = ARITHMETIC[name]
    # Divisors stay away from zero; here both sides, as either may divide.
    elements = away_from_zero if name == "div" else general
    rnn, traced, X, (a, b), dtype, reverse = binary_case(data, function, symbol,
                                                         elements, elements)
    assert [e.op for e in rnn.block.eqns] == [name]
    expected = np.broadcast_to(ref(a, b), X.data.shape[:1] + traced[0].shape[1:])
    # + - * / max min are correctly rounded in IEEE arithmetic: bit-exact.
    check_net(rnn, traced, X, np.asarray(expected), dtype, reverse, exact=True)


@pytest.mark.parametrize("name", sorted(COMPARISONS))
@SETTINGS
@given(data=st.data())
def test_comparison_matches_reference(name, data):
    ref, function, symbol = COMPARISONS[name]
    rnn, traced, X, (a, b), _, reverse = binary_case(data, function, symbol, grid, grid)
    assert len(rnn.block.eqns) == 1
    expected = np.broadcast_to(ref(a, b), X.data.shape[:1] + traced[0].shape[1:])
    check_net(rnn, traced, X, np.asarray(expected), np.dtype(bool), reverse)


@SETTINGS
@given(data=st.data())
def test_where_matches_reference(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, grid(dtype), lengths))
    threshold = data.draw(st.sampled_from(GRID))
    branches = []
    inputs = [X]
    for label in ("a", "b"):
        kind = data.draw(st.sampled_from(["x", "step", "param", "scalar"]), label=label)
        if kind == "x":
            branches.append((kind, None, X.data.astype(np.float64), dtype))
        elif kind == "step":
            other_dtype = data.draw(float_dtypes)
            Y = data.draw(lod_input(other_dtype, data.draw(st.sampled_from(
                step_operand_shapes(shape))), general(other_dtype), lengths))
            branches.append((kind, len(inputs), Y.data.astype(np.float64), other_dtype))
            inputs.append(Y)
        elif kind == "param":
            other_dtype = data.draw(float_dtypes)
            arr = data.draw(hnp.arrays(other_dtype, data.draw(st.sampled_from(
                constant_shapes(shape))), elements=general(other_dtype)))
            branches.append((kind, sn.Parameter(arr), arr.astype(np.float64), other_dtype))
        else:
            branches.append((kind, data.draw(general(np.float64)), None, None))
    strong = [b[3] for b in branches if b[3] is not None]
    if not strong:  # where(cond, 1.0, 2.0) has no array to take a dtype from
        branches[0] = ("x", None, X.data.astype(np.float64), dtype)
        strong = [dtype]
    result_dtype = np.result_type(*strong)

    def operand(branch, xs):
        kind, value, _, _ = branch
        return {"x": xs[0], "step": xs[value] if kind == "step" else None,
                "param": value, "scalar": value}[kind]

    def build(*xs):
        cond = xs[0] > threshold if data.draw(st.booleans()) else \
            sn.ops.greater(xs[0], threshold)
        return sn.ops.where(cond, operand(branches[0], xs), operand(branches[1], xs))

    rnn, traced = step_net(inputs, build, reverse)
    assert [e.op for e in rnn.block.eqns] == ["greater", "where"]
    ref_branches = [b[2] if b[0] != "scalar" else weak(b[1], result_dtype) for b in branches]
    expected = np.where(X.data.astype(np.float64) > weak(threshold, dtype), *ref_branches)
    expected = np.broadcast_to(expected, X.data.shape[:1] + traced[0].shape[1:])
    check_net(rnn, traced, X, np.asarray(expected), result_dtype, reverse, exact=True)


# ----------------------------------------------------------------------------
# matmul, sum, concat, slice


@SETTINGS
@given(data=st.data())
def test_matmul_matches_reference(data):
    dtype, lengths, _, reverse = draw_setup(data)
    n, k, m = (data.draw(st.integers(1, 4)) for _ in range(3))
    form = data.draw(st.sampled_from(
        ["x@P", "x@vector", "x3@P", "x3@vector", "x3@y3", "x@array", "ops.matmul"]))
    rank3 = form.startswith("x3")
    X = data.draw(lod_input(dtype, (n, k) if rank3 else (k,), general(dtype), lengths))
    other_dtype = data.draw(float_dtypes)
    inputs = [X]
    if form == "x3@y3":
        Y = data.draw(lod_input(other_dtype, (k, m), general(other_dtype), lengths))
        inputs.append(Y)
        b64 = Y.data.astype(np.float64)
    else:
        b_shape = (k,) if form.endswith("vector") else (k, m)
        arr = data.draw(hnp.arrays(other_dtype, b_shape, elements=general(other_dtype)))
        b64 = arr.astype(np.float64)
        operand = arr if form == "x@array" else sn.Parameter(arr, name="W")

    def build(x, y=None):
        if y is not None:
            return x @ y
        return sn.ops.matmul(x, operand) if form == "ops.matmul" else x @ operand

    rnn, traced = step_net(inputs, build, reverse)
    a64 = X.data.astype(np.float64)
    if form == "x3@y3":
        terms = a64[:, :, :, None] * b64[:, None, :, :]
        axis = -2
    elif b64.ndim == 1:
        terms, axis = a64 * b64, -1
    else:
        terms, axis = a64[..., :, None] * b64, -2
    check_net(rnn, traced, X, terms.sum(axis), np.result_type(dtype, other_dtype), reverse,
              scale=np.abs(terms).sum(axis))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@SETTINGS
@given(data=st.data())
def test_reductions_match_reference(reduction, data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    axis = data.draw(feature_axes(shape))
    keepdims = data.draw(st.booleans())
    op = getattr(sn.ops, reduction)
    rnn, traced = step_net([X], lambda x: op(x, axis=axis, keepdims=keepdims), reverse)
    x64 = X.data.astype(np.float64)
    n = x64.shape[axis] if reduction == "mean" else 1
    expected = np.add.reduce(x64, axis=axis, keepdims=keepdims) / n
    scale = np.add.reduce(np.abs(x64), axis=axis, keepdims=keepdims) / n
    check_net(rnn, traced, X, expected, dtype, reverse, scale=scale)


@SETTINGS
@given(data=st.data())
def test_concat_matches_reference(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    axis = data.draw(st.integers(1, len(shape)))
    other_shape = list(shape)
    other_shape[axis - 1] = data.draw(st.integers(1, 4))
    other_dtype = data.draw(float_dtypes)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    Y = data.draw(lod_input(other_dtype, tuple(other_shape), general(other_dtype), lengths))
    user_axis = data.draw(st.sampled_from([axis, axis - len(shape) - 1]))
    three = data.draw(st.booleans())

    def build(x, y):
        return sn.ops.concat([x, y, x] if three else [x, y], axis=user_axis)

    rnn, traced = step_net([X, Y], build, reverse)
    parts = [X.data, Y.data, X.data] if three else [X.data, Y.data]
    expected = np.concatenate([p.astype(np.float64) for p in parts], axis=axis)
    check_net(rnn, traced, X, expected, np.result_type(dtype, other_dtype), reverse, exact=True)


@SETTINGS
@given(data=st.data())
def test_layout_ops_match_numpy(data):
    """transpose, broadcast_axis and pad (the gradient rules' layout ops)."""
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    before, after, size = (data.draw(st.integers(0, 3)) for _ in range(3))

    def build(x):
        wide = sn.ops.broadcast_axis(x, 1, size)                  # [B, size, *shape]
        return [sn.ops.transpose(wide) if len(shape) == 1 else wide,
                sn.ops.pad(x, before, after, axis=-1),
                sn.ops.broadcast_axis(sn.ops.slice(x, 0, 1, axis=-1), len(shape), 3,
                                      insert=False)]

    rnn, traced = step_net([X], build, reverse)
    x = X.data.astype(np.float64)
    wide = np.repeat(x[:, None], size, axis=1)
    widths = [(0, 0)] * (x.ndim - 1) + [(before, after)]
    expected = [np.swapaxes(wide, -1, -2) if len(shape) == 1 else wide, np.pad(x, widths),
                np.repeat(x[..., :1], 3, axis=-1)]
    check_net(rnn, traced, X, expected, dtype, reverse, exact=True)


slice_bounds = st.one_of(st.none(), st.integers(-6, 6))


@SETTINGS
@given(data=st.data())
def test_slice_matches_python_slicing(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    axis = data.draw(feature_axes(shape))
    start, stop = data.draw(slice_bounds), data.draw(slice_bounds)
    rnn, traced = step_net([X], lambda x: sn.ops.slice(x, start, stop, axis=axis), reverse)
    index = [slice(None)] * X.data.ndim
    index[axis] = slice(start, stop)
    check_net(rnn, traced, X, X.data[tuple(index)].astype(np.float64), dtype, reverse,
              exact=True)


@SETTINGS
@given(data=st.data())
def test_value_slicing_matches_numpy(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    items = tuple(
        slice(data.draw(slice_bounds), data.draw(slice_bounds))
        for _ in range(data.draw(st.integers(1, len(shape))))
    )
    rnn, traced = step_net([X], lambda x: x[(slice(None),) + items], reverse)
    assert all(e.op == "slice" for e in rnn.block.eqns)
    expected = X.data[(slice(None),) + items]
    check_net(rnn, traced, X, expected.astype(np.float64), dtype, reverse, exact=True)


def test_value_slicing_two_axes_and_an_empty_slice():
    X = sn.LoDTensor.from_lengths(np.arange(24, dtype=np.float32).reshape(2, 3, 4), [[2]])
    rnn, _ = step_net([X], lambda x: [x[:, 1:, 1:3], x[:, :, 3:1], x[:, -2:]])
    a, empty, b = rnn(backend="interpreter")
    np.testing.assert_array_equal(a.data, X.data[:, 1:, 1:3])
    assert empty.data.shape == (2, 3, 0)
    np.testing.assert_array_equal(b.data, X.data[:, -2:])


@pytest.mark.parametrize("index", [0, (slice(None), 0), (slice(None), slice(None, None, 2)),
                                   slice(0, 1), Ellipsis])
def test_value_slicing_refuses_what_it_does_not_support(index):
    X = sn.LoDTensor.from_lengths(np.ones((2, 3), np.float32), [[2]])
    with pytest.raises(sn.StepNetError):
        step_net([X], lambda x: x[index])


# ----------------------------------------------------------------------------
# dtype rules


def _traced_dtype(X, build, Y=None):
    rnn, traced = step_net([X] if Y is None else [X, Y], build)
    out = rnn(backend="interpreter")
    assert out.data.dtype == traced[0].dtype, "the run disagrees with the trace"
    return np.dtype(traced[0].dtype)


def _lod(dtype, width=3):
    return sn.LoDTensor.from_lengths(np.linspace(-1, 1, 3 * width, dtype=dtype)
                                     .reshape(3, width), [[1, 2]])


WEAK_FORMS = [
    lambda z: 1 - z, lambda z: z - 1, lambda z: 2.5 * z, lambda z: z / 3, lambda z: 3 / (z + 2),
    lambda z: z + True, lambda z: sn.ops.maximum(z, 0.5), lambda z: sn.ops.minimum(0, z),
    lambda z: sn.ops.where(z > 0, z, 0.0), lambda z: sn.ops.where(z > 0, 1, z),
    lambda z: sn.ops.clip(z, 0, 1), lambda z: sn.ops.mean(z), lambda z: sn.ops.affine(z, 2, 1),
    lambda z: sn.ops.leaky_relu(z), lambda z: sn.ops.hard_sigmoid(z), lambda z: sn.ops.elu(z),
    lambda z: sn.ops.softsign(z), lambda z: sn.ops.scaled_tanh(z, 2, 0.5),
    lambda z: sn.ops.thresholded_relu(z),
]


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("form", range(len(WEAK_FORMS)))
def test_python_scalars_are_weak(dtype, form):
    assert _traced_dtype(_lod(dtype), WEAK_FORMS[form]) == dtype


@pytest.mark.parametrize("x_dtype", [F32, F64])
@pytest.mark.parametrize("p_dtype", [F32, F64])
@pytest.mark.parametrize("kind", ["param", "array", "step"])
def test_float32_op_float64_promotes(x_dtype, p_dtype, kind):
    expected = np.result_type(x_dtype, p_dtype)
    value = np.full((3,), 0.5, p_dtype)
    other = sn.Parameter(value) if kind == "param" else value
    Y = _lod(p_dtype) if kind == "step" else None
    for op in (operator.add, operator.sub, operator.mul, operator.truediv, sn.ops.maximum):
        build = (lambda x, y, op=op: op(x, y)) if Y is not None else \
            (lambda x, op=op: op(x, other))
        assert _traced_dtype(_lod(x_dtype), build, Y) == expected
    W = np.full((3, 2), 0.5, p_dtype)
    assert _traced_dtype(_lod(x_dtype), lambda x: x @ W) == expected
    if Y is None:
        assert _traced_dtype(_lod(x_dtype), lambda x: sn.ops.where(x > 0, x, other)) == expected
        assert _traced_dtype(_lod(x_dtype), lambda x: sn.ops.concat([x, x @ W])) == expected
    else:
        assert _traced_dtype(_lod(x_dtype), lambda x, y: sn.ops.where(x > y, y, x), Y) == \
            expected


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("name", sorted(COMPARISONS))
def test_comparisons_give_bool(dtype, name):
    op = COMPARISONS[name][1]
    X = _lod(dtype)
    for other in (0.0, np.zeros(3, F64), sn.Parameter(np.zeros(3, F32))):
        assert _traced_dtype(X, lambda x, other=other: op(x, other)) == np.dtype(bool)
    # A bool step value mixes with floats by promotion, and where takes it.
    assert _traced_dtype(X, lambda x: op(x, 0.0) * x) == dtype
    assert _traced_dtype(X, lambda x: sn.ops.where(op(x, 0.0), x, -x)) == dtype


def test_float_ops_refuse_a_bool_step_value():
    X = _lod(F32)
    for name in ("exp", "log", "tanh", "sigmoid", "softplus", "erf"):
        with pytest.raises(sn.ShapeError, match=name):
            step_net([X], lambda x, name=name: getattr(sn.ops, name)(x > 0))


def test_neg_refuses_a_mask():
    with pytest.raises(sn.ShapeError, match=r"neg: its operand is a mask \(bool\)"):
        step_net([_lod(F32)], lambda x: -(x > 0))


def test_where_takes_a_constant_mask_on_every_backend():
    """A NumPy boolean array as the condition ("boolean step value or array"):
    a constant mask broadcast against the step's rows, as NumPy's where, on
    every backend."""
    X = _lod(F32, width=4)
    mask = np.array([True, False, False, True])
    rnn, _ = step_net([X], lambda x: sn.ops.where(mask, x, -2 * x))
    expected = assert_backends_agree(rnn)
    np.testing.assert_array_equal(expected.data, np.where(mask, X.data, -2 * X.data))


def test_where_needs_a_bool_condition_and_an_array_branch():
    X = _lod(F32)
    with pytest.raises(sn.ShapeError, match="where"):
        step_net([X], lambda x: sn.ops.where(x, x, 0.0))
    with pytest.raises(sn.ShapeError, match=r"where: both branches are numbers \(1.0, 0.0\)"
                                            r".* \(in Python, np.float32\(1.0\) will do\)"):
        step_net([X], lambda x: sn.ops.where(x > 0, 1.0, 0.0))


# ----------------------------------------------------------------------------
# shape rules: ShapeError naming the op and the shapes


def _raises_naming(build, inputs, op, *shapes):
    with pytest.raises(sn.ShapeError) as info:
        step_net(inputs, build)
    message = str(info.value)
    assert op in message, message
    for shape in shapes:
        assert shape in message, f"{shape} not in: {message}"
    return message


@SETTINGS
@given(dtype=float_dtypes, k=st.integers(1, 5), other=st.integers(1, 5), m=st.integers(1, 5))
def test_matmul_with_mismatched_inner_dims_raises(dtype, k, other, m):
    if other == k:
        other += 1
    X = _lod(dtype, k)
    W = sn.Parameter(np.ones((other, m), dtype))
    _raises_naming(lambda x: x @ W, [X], "matmul", type_str(dtype, (None, k)),
                   type_str(dtype, (other, m)))
    v = np.ones((other,), dtype)
    _raises_naming(lambda x: sn.ops.matmul(x, v), [X], "matmul",
                   type_str(dtype, (None, k)), type_str(dtype, (other,)))


def test_matmul_refuses_moving_the_batch_axis_and_scalars():
    X = _lod(F32, 3)
    W = sn.Parameter(np.ones((2, 3), np.float32))
    _raises_naming(lambda x: W @ x, [X], "matmul", "f32[2,3]", "f32[B,3]")
    _raises_naming(lambda x: sn.ops.matmul(x, 2.0), [X], "matmul")
    # stacked: the step value's [B] against the weights' [2] before the last two
    X3 = sn.LoDTensor.from_lengths(np.ones((3, 2, 4), np.float32), [[1, 2]])
    P = sn.Parameter(np.ones((2, 4, 3), np.float32))
    message = _raises_naming(lambda x: x @ P, [X3], "matmul", "f32[B,2,4]", "f32[2,4,3]")
    assert "the dimensions before the last two do not broadcast" in message, message


BROADCASTING_OPS = sorted(set(ARITHMETIC) | set(COMPARISONS))


@pytest.mark.parametrize("name", BROADCASTING_OPS)
@SETTINGS
@given(dtype=float_dtypes, width=st.integers(2, 5), other=st.integers(2, 5))
def test_broadcasting_failures_raise(name, dtype, width, other):
    if other == width:
        other += 1
    function = (ARITHMETIC.get(name) or COMPARISONS[name])[1]
    X, Y = _lod(dtype, width), _lod(dtype, other)
    P = sn.Parameter(np.ones((other,), dtype))
    _raises_naming(lambda x: function(x, P), [X], name,
                   type_str(dtype, (None, width)), type_str(dtype, (other,)))
    _raises_naming(lambda x, y: function(y, x), [X, Y], name,
                   type_str(dtype, (None, width)), type_str(dtype, (None, other)))
    # A constant with more dimensions than the step value would move the batch axis.
    Q = np.ones((2, width), dtype)
    _raises_naming(lambda x: function(x, Q), [X], name,
                   type_str(dtype, (None, width)), type_str(dtype, (2, width)))


def test_where_broadcasting_failure_raises():
    X, Y = _lod(F64, 3), _lod(F64, 2)
    _raises_naming(lambda x, y: sn.ops.where(x > 0, x, y), [X, Y], "where",
                   "f64[B,3]", "f64[B,2]")


@pytest.mark.parametrize("build", [
    lambda x: sn.ops.sum(x, axis=0),
    lambda x: sn.ops.sum(x, axis=-3, keepdims=True),
    lambda x: sn.ops.concat([x, x], axis=0),
    lambda x: sn.ops.concat([x, x], axis=-3),
    lambda x: sn.ops.mean(x, axis=0),
], ids=["sum", "sum-negative", "concat", "concat-negative", "mean"])
def test_batch_axis_ops_raise(build):
    X = sn.LoDTensor.from_lengths(np.ones((3, 2, 4), np.float32), [[1, 2]])
    message = _raises_naming(build, [X], "", "f32[B,2,4]")
    assert re.match(r"(sum|concat)\b", message) and "batch axis" in message, message


def test_slice_on_the_batch_axis_raises_shape_error():
    X = _lod(F32)
    _raises_naming(lambda x: sn.ops.slice(x, 0, 1, axis=0), [X], "slice", "f32[B,3]")


def test_split_on_the_batch_axis_raises_shape_error():
    X = _lod(F32)
    _raises_naming(lambda x: sn.ops.split(x, 1, axis=0), [X], "split")


def test_concat_with_a_python_scalar_raises_stepnet_error():
    with pytest.raises(sn.StepNetError):
        step_net([_lod(F32)], lambda x: sn.ops.concat([x, 1.0]))


def test_axis_out_of_range_and_off_axis_mismatches_raise():
    X = sn.LoDTensor.from_lengths(np.ones((3, 2, 4), np.float32), [[1, 2]])
    Y = sn.LoDTensor.from_lengths(np.ones((3, 3, 4), np.float64), [[1, 2]])
    _raises_naming(lambda x: sn.ops.sum(x, axis=3), [X], "sum", "f32[B,2,4]")
    _raises_naming(lambda x, y: sn.ops.concat([x, y], axis=-1), [X, Y], "concat",
                   "f32[B,2,4]", "f64[B,3,4]")
    Z = sn.LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
    _raises_naming(lambda x, z: sn.ops.concat([x, z]), [X, Z], "concat",
                   "f32[B,2,4]", "f32[B,2]")


def test_axes_and_bounds_must_be_integers_not_truncated():
    X = sn.LoDTensor.from_lengths(np.ones((3, 2, 4), np.float32), [[1, 2]])
    for build, what in [(lambda x: sn.ops.sum(x, axis=1.5), "sum: axis must be an integer, got 1.5"),
                        (lambda x: sn.ops.sum(x, axis=True), "sum: axis must be an integer"),
                        (lambda x: sn.ops.concat([x, x], axis=-1.5), "concat: axis"),
                        (lambda x: sn.ops.slice(x, 0, 2.7, axis=1), "slice: stop must be an integer"),
                        (lambda x: sn.ops.pad(x, 1, 0.5, axis=1), "pad: after must be an integer")]:
        with pytest.raises(sn.ShapeError, match=re.escape(what)):
            step_net([X], build)
    step_net([X], lambda x: sn.ops.sum(x, axis=np.int64(1), keepdims=True) + sn.ops.slice(x, None, 1, axis=1))


def test_clip_and_split_refuse_bad_arguments():
    X = _lod(F32, 6)
    _raises_naming(lambda x: sn.ops.clip(x, 1.0, 0.0), [X], "clip")
    _raises_naming(lambda x: sn.ops.clip(x), [X], "clip")
    _raises_naming(lambda x: sn.ops.split(x, 4), [X], "split")
    _raises_naming(lambda x: sn.ops.split(x, [2, 2]), [X], "split")
    for bound in ("a", np.zeros(2), [0.0, 1.0], True):
        with pytest.raises(sn.ShapeError, match="clip: lo must be one number"):
            sn.ops.clip(np.ones(3), bound, 1.0)
    with pytest.raises(sn.ShapeError, match="concat: needs at least one operand"):
        sn.ops.concat([])


@pytest.mark.parametrize("op", ["mean", "split", "slice"])
def test_axis_of_mean_split_and_slice_is_checked_as_sum_s(op):
    call = {"mean": lambda x, axis: sn.ops.mean(x, axis=axis),
            "split": lambda x, axis: sn.ops.split(x, 1, axis=axis),
            "slice": lambda x, axis: sn.ops.slice(x, 0, 1, axis=axis)}[op]
    for axis, message in [(5, f"{op}: axis 5 is out of range for a value of shape "),
                          (1.5, f"{op}: axis must be an integer, got 1.5")]:
        with pytest.raises(sn.ShapeError, match=message):
            step_net([_lod(F32, 3)], lambda x, axis=axis: call(x, axis))
        with pytest.raises(sn.ShapeError, match=message):
            call(np.ones((2, 3)), axis)  # on an array, outside a block


def test_mean_over_no_element_is_nan_as_numpy_s():
    X = _lod(F32, 3)
    rnn, _ = step_net([X], lambda x: sn.ops.mean(sn.ops.slice(x, 1, 1), axis=-1))
    for backend in ("interpreter", "numba"):
        assert np.isnan(rnn(backend=backend).data).all()
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(sn.ops.mean(np.zeros((2, 0)), axis=-1), np.full(2, np.nan))


@pytest.mark.parametrize("sections, cuts", [(np.int64(3), [2, 4]), (np.int32(2), [3]),
                                            (np.array(3), [2, 4]), (np.array([2, 4]), [2]),
                                            ([np.int64(1), np.int64(5)], [1])])
def test_split_takes_numpy_integers(sections, cuts):
    X = _lod(F64, 6)
    rnn, traced = step_net([X], lambda x: sn.ops.split(x, sections))
    got = rnn(backend="interpreter")
    expected = np.split(X.data, cuts, axis=-1)
    assert len(got) == len(traced) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g.data, e)
    for g, e in zip(sn.ops.split(X.data, sections), expected):  # eager, on an array
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("sections", [2.0, True, np.True_, [2.0, 4], "24", None])
def test_split_sections_that_are_not_integers_are_refused(sections):
    with pytest.raises(sn.StepNetError, match=r"split: sections must be an int or a list of "
                                              r"ints, got "):
        step_net([_lod(F32, 6)], lambda x: sn.ops.split(x, sections))


def test_split_with_a_negative_size_is_refused():
    message = _raises_naming(lambda x: sn.ops.split(x, [4, -1, 3]), [_lod(F32, 6)], "split")
    assert "sizes [4, -1, 3] include a negative size" in message


# ----------------------------------------------------------------------------
# composites: the ONNX activation formulas, alpha/beta defaults included


def _hard_sigmoid(x, alpha, beta):
    return np.maximum(0.0, np.minimum(1.0, alpha * x + beta))


# name -> (ONNX defaults, formula(x, **params) in float64, parameter range)
ONNX_ACTIVATIONS = {
    "affine": ({"alpha": 1.0, "beta": 0.0}, lambda x, alpha, beta: alpha * x + beta),
    "leaky_relu": ({"alpha": 0.01}, lambda x, alpha: np.where(x >= 0, x, alpha * x)),
    "thresholded_relu": ({"alpha": 1.0}, lambda x, alpha: np.where(x > alpha, x, 0.0)),
    "scaled_tanh": ({"alpha": 1.0, "beta": 1.0},
                    lambda x, alpha, beta: alpha * np.tanh(beta * x)),
    "hard_sigmoid": ({"alpha": 0.2, "beta": 0.5}, _hard_sigmoid),
    "elu": ({"alpha": 1.0}, lambda x, alpha: np.where(x >= 0, x, alpha * (np.exp(x) - 1))),
    "softsign": ({}, lambda x: x / (1 + np.abs(x))),
    "softplus": ({}, lambda x: np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))),
}


def test_onnx_activation_defaults():
    for name, (defaults, _) in ONNX_ACTIVATIONS.items():
        params = inspect.signature(getattr(sn.ops, name)).parameters
        for key, value in defaults.items():
            assert params[key].default == value, (name, key)
        assert set(params) == {"x"} | set(defaults), name


@pytest.mark.parametrize("name", sorted(ONNX_ACTIVATIONS))
@SETTINGS
@given(data=st.data())
def test_onnx_activation_matches_formula(name, data):
    defaults, formula = ONNX_ACTIVATIONS[name]
    dtype, lengths, shape, reverse = draw_setup(data)
    elements = st.one_of(general(dtype), grid(dtype))
    X = data.draw(lod_input(dtype, shape, elements, lengths))
    use_defaults = data.draw(st.booleans(), label="defaults")
    params = dict(defaults) if use_defaults else {
        key: data.draw(st.one_of(floats(np.float64, -2.0, 2.0), st.sampled_from(GRID)),
                       label=key)
        for key in defaults
    }
    function = getattr(sn.ops, name)
    positional = data.draw(st.booleans(), label="positional")

    def build(x):
        if use_defaults:
            return function(x)
        return function(x, *params.values()) if positional else function(x, **params)

    rnn, traced = step_net([X], build, reverse)
    # Weak scalars: alpha and beta are used in the step's dtype.
    expected = formula(X.data.astype(np.float64), **{k: weak(v, dtype) for k, v in params.items()})
    check_net(rnn, traced, X, expected, dtype, reverse)


@SETTINGS
@given(data=st.data())
def test_split_matches_reference(data):
    dtype, lengths, shape, reverse = draw_setup(data)
    X = data.draw(lod_input(dtype, shape, general(dtype), lengths))
    axis = data.draw(feature_axes(shape))
    size = X.data.shape[axis]
    if data.draw(st.booleans(), label="equal parts"):
        sections = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        cuts = [size // sections * i for i in range(1, sections)]
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=3)))
        sections = [b - a for a, b in zip([0] + cuts, cuts + [size])]
    rnn, traced = step_net([X], lambda x: sn.ops.split(x, sections, axis=axis), reverse)
    expected = [p.astype(np.float64) for p in np.split(X.data, cuts, axis=axis)]
    assert len(traced) == len(expected)
    check_net(rnn, traced, X, expected, dtype, reverse, exact=True)


# ----------------------------------------------------------------------------
# eager use on plain arrays


def _array(data, dtype, elements, shape=None):
    shape = shape or data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))
    return data.draw(hnp.arrays(dtype, shape, elements=elements(dtype)))


@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(data=st.data())
def test_eager_unary_op_on_arrays(name, data):
    ref, elements, exact, _ = UNARY[name]
    dtype = data.draw(float_dtypes)
    x = _array(data, dtype, elements)
    out = getattr(sn.ops, name)(x)
    assert isinstance(out, np.ndarray)
    assert_matches(out, ref(x), dtype, exact)


@pytest.mark.parametrize("name", sorted(set(ARITHMETIC) | set(COMPARISONS)))
@SETTINGS
@given(data=st.data())
def test_eager_binary_op_on_arrays(name, data):
    ref, function, _ = ARITHMETIC.get(name) or COMPARISONS[name]
    elements = away_from_zero if name == "div" else grid
    dtype, other_dtype = data.draw(float_dtypes), data.draw(float_dtypes)
    x = _array(data, dtype, elements)
    y = _array(data, other_dtype, elements, x.shape[-1:])
    s = data.draw(st.sampled_from([-2.0, -0.5, 0.5, 2.0]))
    is_compare = name in COMPARISONS
    for a, b, a64, b64, result in [
        (x, y, x, y, np.result_type(dtype, other_dtype)),
        (x, s, x, weak(s, dtype), dtype),  # a Python scalar stays weak eagerly too
        (s, x, weak(s, dtype), x, dtype),
        (sn.Parameter(y), x, y, x, np.result_type(dtype, other_dtype)),
    ]:
        out = function(a, b)
        expected = ref(np.asarray(a64, np.float64), np.asarray(b64, np.float64))
        assert_matches(out, expected, np.dtype(bool) if is_compare else result, exact=True)


@pytest.mark.parametrize("name", sorted(ONNX_ACTIVATIONS))
@SETTINGS
@given(data=st.data())
def test_eager_onnx_activation_on_arrays(name, data):
    defaults, formula = ONNX_ACTIVATIONS[name]
    dtype = data.draw(float_dtypes)
    x = _array(data, dtype, general)
    out = getattr(sn.ops, name)(x)
    assert isinstance(out, np.ndarray)
    expected = formula(x.astype(np.float64), **{k: weak(v, dtype) for k, v in defaults.items()})
    assert_matches(out, expected, dtype)


def test_eager_shape_ops_and_matmul_on_arrays():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert_matches(sn.ops.sum(x, axis=1), x.astype(np.float64).sum(1), F32)
    assert_matches(sn.ops.sum(x, axis=0, keepdims=True), x.sum(0, keepdims=True) * 1.0, F32)
    assert_matches(sn.ops.mean(x), x.astype(np.float64).mean(-1), F32)
    assert_matches(sn.ops.concat([x, x[:, :, :1]]), np.concatenate([x, x[:, :, :1]], -1) * 1.0,
                   F32, exact=True)
    assert_matches(sn.ops.slice(x, 1, None, axis=0), x[1:] * 1.0, F32, exact=True)
    assert_matches(sn.ops.slice(x, -3, -1), x[..., -3:-1] * 1.0, F32, exact=True)
    parts = sn.ops.split(x, [1, 3])
    assert [p.shape for p in parts] == [(2, 3, 1), (2, 3, 3)]
    assert_matches(parts[1], x[..., 1:] * 1.0, F32, exact=True)
    W = sn.Parameter(np.ones((4, 2), np.float64))
    assert_matches(sn.ops.matmul(x, W), x.astype(np.float64).sum(-1, keepdims=True)
                   .repeat(2, -1), F64)
    assert_matches(sn.ops.where(x > 5, x, 0.0), np.where(x > 5, x, 0) * 1.0, F32, exact=True)
    assert_matches(sn.ops.clip(x, 2, 7), np.clip(x, 2, 7) * 1.0, F32, exact=True)


def test_numpy_float64_scalar_promotes_as_it_does_eagerly():
    x = np.ones((3, 2), np.float32)
    eager = sn.ops.mul(x, np.float64(2)).dtype
    traced = _traced_dtype(_lod(F32, 2), lambda v: sn.ops.mul(v, np.float64(2)))
    assert traced == eager


# ----------------------------------------------------------------------------
# every op on every backend: the interpreter against eager evaluation, and
# every other backend against the interpreter (assert_backends_agree)


def _backend_cases():
    """name -> (build(x, y) -> outputs, elements of x, elements of y). Both
    inputs are [B, 3]; builds use only what also works on plain arrays, so the
    expected rows are the same build evaluated eagerly on the whole data."""
    P = {d: sn.Parameter(np.linspace(0.5, 1.5, 3).astype(d)) for d in (F32, F64)}
    W = {d: sn.Parameter(np.linspace(-1, 1, 6).reshape(3, 2).astype(d)) for d in (F32, F64)}

    def other(x):  # a Parameter of the other dtype: promotion on every backend
        return P[F64 if x.dtype == F32 else F32]

    def unary(x, y):
        return [sn.ops.neg(x), -x, abs(x), sn.ops.abs(x), sn.ops.relu(x), sn.ops.exp(x),
                sn.ops.log(y), sn.ops.sqrt(y), sn.ops.tanh(x), sn.ops.sigmoid(x),
                sn.ops.softplus(x), sn.ops.erf(x),
                sn.ops.clip(x, -0.5, 0.5), sn.ops.clip(x, None, 0.2), sn.ops.clip(x, -0.1),
                # saturation, past exp's float32 overflow
                sn.ops.tanh(x * 50.0), sn.ops.sigmoid(x * 50.0), sn.ops.softplus(x * 50.0)]

    def arithmetic(x, y):
        outs = []
        for f in (sn.ops.add, sn.ops.sub, sn.ops.mul, sn.ops.div, sn.ops.maximum,
                  sn.ops.minimum):
            outs += [f(x, y), f(x, P[x.dtype]), f(x, other(x)), f(0.5, y), f(y, 2.0),
                     f(x, y[:, :1])]
        outs += [1 - x, x * 3, 2 / y, x + np.float32(1)]
        return outs

    def comparisons(x, y):
        # Each comparison feeds a where: conftest.assert_close has no tolerance
        # for bool outputs (test_bool_outputs_agree_on_every_backend has them).
        outs = []
        for f in (sn.ops.greater, sn.ops.greater_equal, sn.ops.less, sn.ops.less_equal,
                  sn.ops.equal):
            outs += [sn.ops.where(f(x, y), x, y), sn.ops.where(f(x, 0.5), 1.0, y),
                     sn.ops.where(f(0.0, x), x, -2.0), sn.ops.where(f(x, other(x)), other(x), x)]
        outs += [sn.ops.where(x < 0.5, -x, 0.25), sn.ops.where(x > 0, x, P[x.dtype])]
        return outs

    def structural(x, y):
        return [sn.ops.matmul(x, W[x.dtype]), sn.ops.matmul(x, P[x.dtype]),
                sn.ops.matmul(x, W[F64 if x.dtype == F32 else F32]),
                sn.ops.sum(x, -1), sn.ops.sum(x, 1, keepdims=True), sn.ops.mean(y),
                sn.ops.concat([x, y]), sn.ops.concat([x, y[:, 1:], x], axis=-1),
                sn.ops.slice(x, 1, 3), x[:, :2], x[:, 2:],
                sn.ops.transpose(sn.ops.broadcast_axis(x, 1, 2)), sn.ops.pad(y, 1, 2),
                sn.ops.broadcast_axis(x[:, :1], 1, 4, insert=False)] + sn.ops.split(y, [1, 2])

    def composites(x, y):
        return [sn.ops.affine(x), sn.ops.affine(x, 0.5, -1.0), sn.ops.leaky_relu(x),
                sn.ops.leaky_relu(x, 0.3), sn.ops.thresholded_relu(x),
                sn.ops.thresholded_relu(x, -0.5), sn.ops.scaled_tanh(x),
                sn.ops.scaled_tanh(x, 1.7, 0.6), sn.ops.hard_sigmoid(x),
                sn.ops.hard_sigmoid(x, 0.3, 0.4), sn.ops.elu(x), sn.ops.elu(x, 0.5),
                sn.ops.softsign(x), sn.ops.softplus(x)]

    return {
        "unary": (unary, general, lambda d: floats(d, 0.25, 4.0)),
        "arithmetic": (arithmetic, general, away_from_zero),
        "comparisons": (comparisons, grid, grid),
        "structural": (structural, general, general),
        "composites": (composites, lambda d: st.one_of(general(d), grid(d)), general),
    }


BACKEND_CASES = _backend_cases()
_BACKEND_NETS = {}


def _backend_net(group, dtype):
    """One step-net per (group, dtype), traced once and rebound for every
    example: compiled backends compile it once."""
    key = (group, dtype)
    if key not in _BACKEND_NETS:
        build = BACKEND_CASES[group][0]
        X = sn.LoDTensor.from_lengths(np.full((3, 3), 0.5, dtype), [[1, 2]])
        Y = sn.LoDTensor.from_lengths(np.full((3, 3), 0.75, dtype), [[1, 2]])
        _BACKEND_NETS[key] = step_net([X, Y], build)
    return _BACKEND_NETS[key]


def test_backend_cases_cover_every_primitive():
    traced = set()
    for group in BACKEND_CASES:
        for dtype in (F32, F64):
            rnn, _ = _backend_net(group, dtype)
            traced |= {eqn.op for eqn in rnn.block.eqns}
    # the segment ops need a ragged static input: tests/test_attention.py runs
    # them on every backend that has them; sn.quantize writes the quantized
    # products (tests/test_quantize.py)
    assert traced == set(registry.all_ops()) - {"seq_sum", "seq_max", "seq_expand", "matmul_int8",
                                                "matmul_bf16"}


def _check_backend_case(group, dtype, X, Y, backends, flags=(True, False)):
    """The net of ``group`` on ``backends`` against the interpreter, and the
    interpreter against the same build evaluated eagerly, for each
    ``output_all_steps`` of ``flags``."""
    build = BACKEND_CASES[group][0]
    rnn, traced = _backend_net(group, dtype)
    expected = build(X.data, Y.data)  # eager, on the whole data
    for all_steps in flags:
        results = as_list(assert_backends_agree(rnn, output_all_steps=all_steps,
                                                backends=backends, x0=X, x1=Y))
        assert len(results) == len(expected)
        for i, (result, rows) in enumerate(zip(results, expected)):
            what = f"{group} output {i} ({traced[i].name})"
            assert rows.dtype == traced[i].dtype, f"{what}: eager and traced dtypes differ"
            if all_steps:
                assert result.lod == X.lod, what
                result = result.data
            else:
                rows = last_rows(rows, X.lod, reverse=False)
            assert_matches(result, rows.astype(np.float64) if rows.dtype.kind == "f" else rows,
                           rows.dtype, what=what)


# every step's outputs of every group in both dtypes; the last step's
# outputs (a kernel of their own, the same code whatever the op) of one
# group in float32, the others' under -m slow
_LAST_GROUP = "composites"


@pytest.mark.parametrize("group,dtype,flags", [
    pytest.param(group, dtype, flags, id=f"{name}-{group}",
                 marks=() if default else pytest.mark.slow)
    for group in sorted(BACKEND_CASES)
    for dtype, flags, name, default in [
        (F32, (True,), "float32", True),
        (F32, (False,), "float32-last", group == _LAST_GROUP),
        (F64, (True,), "float64", True),
        (F64, (False,), "float64-last", False)]])
@SETTINGS
@given(data=st.data())
def test_ops_agree_on_every_backend(group, dtype, flags, data):
    _, x_elements, y_elements = BACKEND_CASES[group]
    lengths = data.draw(sequence_lengths(max_sequences=5, max_length=6))
    X = data.draw(lod_input(dtype, (3,), x_elements(dtype), lengths))
    Y = data.draw(lod_input(dtype, (3,), y_elements(dtype), lengths))
    # the CPU backends: the CUDA simulator costs about a second a call on
    # these nets, so CUDA runs each net once, on the data of the test below
    _check_backend_case(group, dtype, X, Y, backends=available_backends(), flags=flags)


@pytest.mark.parametrize("group", sorted(BACKEND_CASES))
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_ops_agree_on_every_backend_cuda_included(group, dtype):
    # values every group's element strategies can draw (y in [0.25, 4], away
    # from zero and on GRID); an empty sequence, a shrinking batch, two steps.
    # All steps only: both output forms are checked on every backend elsewhere
    # (test_interpreter.py, test_numba_backend.py's edge cases).
    lengths = [[2, 0, 1]]
    X = sn.LoDTensor.from_lengths(np.resize(np.array(GRID, dtype), (3, 3)), lengths)
    Y = sn.LoDTensor.from_lengths(np.resize(np.array([0.5, 1.0, 2.0], dtype), (3, 3)), lengths)
    _check_backend_case(group, dtype, X, Y, backends=None, flags=(True,))


def test_bool_outputs_agree_on_every_backend():
    X = sn.LoDTensor.from_lengths(np.array([[-1.0, 0.5], [0.5, 0.5], [2.0, -0.5]], F32),
                                  [[0, 1, 2]])
    rnn, _ = step_net([X], lambda x: [x > 0.5, sn.ops.equal(x, 0.5), x <= x[:, :1]])
    expected_rows = [X.data > 0.5, X.data == 0.5, X.data <= X.data[:, :1]]
    for all_steps in (True, False):
        results = assert_backends_agree(rnn, output_all_steps=all_steps)  # bools: exactly
        for result, rows in zip(results, expected_rows):
            if all_steps:
                assert result.lod == X.lod
                result = result.data
            else:
                rows = last_rows(rows, X.lod, reverse=False)
            assert result.dtype == np.dtype(bool)
            np.testing.assert_array_equal(result, rows)


def test_bool_mask_times_a_python_float_is_a_float():
    X = sn.LoDTensor.from_lengths(np.array([[-1.0], [2.0]], F32), [[2]])
    rnn, traced = step_net([X], lambda x: (x > 0) * 0.5)
    out = rnn(backend="interpreter")
    assert traced[0].dtype.kind == "f"
    np.testing.assert_array_equal(out.data.ravel(), [0.0, 0.5])
