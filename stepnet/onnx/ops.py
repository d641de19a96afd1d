"""stepnet's own versions of ONNX operators: one entry per op.

The session runs a node with its entry here when there is one, and on the
ONNX reference implementation (:mod:`stepnet.onnx.reference`) otherwise. An
entry is kept for one of three reasons: it traces the op on step values
inside a Scan body (which the reference cannot), it is measurably faster on
arrays than the reference's per-node call (whose overhead dominates on small
arrays; Conv and the pools, :mod:`stepnet.onnx.conv`, vectorized where the
reference loops in Python, by far more), or the Gradient operator's rule for
the op lives on it
(:mod:`stepnet.onnx.gradient`).

An entry's ``run(ctx, *inputs, **attrs)`` computes the node; it returns
``NotImplemented`` for a case it does not cover (an integer ReduceMean, a
Cast to a string), and the reference runs that node instead. At graph level
its inputs are NumPy arrays. Inside a Scan body (``ctx.step``) an input may be
a step value (``sn.Value``), in one of two layouts (``ctx.rows``):

- rows: axis 0 of every state and scan slice is the batch axis (one
  sequence per row), so ONNX axis ``a`` is the step value's axis ``a``. An op
  that would mix rows (a reduction, concat, slice or transpose touching axis
  0, a row-sized constant, a step value on a matmul's right) raises
  :class:`NotRowWise`, and the Scan is traced again in the other layout.
- whole: the body's tensor of ONNX shape ``S`` is the step value ``[1, *S]``
  (one sequence), so ONNX axis ``a`` is the step value's axis ``a + 1``.

An entry with ``in_step=False`` only takes arrays; one that cannot trace a
case on step values raises UnsupportedError, and the Scan runs its body
node by node instead (:mod:`stepnet.onnx.scan`). Missing optional inputs
are ``None``. ``attrs`` lists the attributes the entry understands; a node
with any other attribute runs on the reference.

``vjp(ctx, inputs, outputs, grads, **attrs)`` (graph level, arrays only) gives
one gradient per input (``None``: not differentiable) for the ONNX Gradient
operator; see :mod:`stepnet.onnx.gradient`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import ops as sn_ops, registry
from ..errors import ShapeError, UnsupportedError
from ..tracing import Value
from .reference import rows_at

OPS: dict = {}


@dataclass
class OnnxOp:
    name: str
    run: Callable | None
    attrs: frozenset = frozenset()
    in_step: bool = True
    vjp: Callable | None = None
    # bind(ctx, known, **attrs) -> fn(*arrays) or None: the node's computation
    # on arrays with what its attributes and constant inputs decide done once,
    # when the session is made (``known[i]``: input i's constant value,
    # UNKNOWN, or None when left out). fn may return NotImplemented.
    bind: Callable | None = None


# an input whose value is known only when the model runs
UNKNOWN = type("Unknown", (), {"__repr__": lambda self: "UNKNOWN"})()


@dataclass
class NodeContext:
    """What an op needs to know about the node it runs: for error messages,
    the opset, and whether it runs inside a Scan body."""

    node: str  # the node's name, or its op and first output
    op: str
    opset: int
    step: bool = False
    rows: bool = False  # inside a Scan body: axis 0 of step values is the batch axis
    num_outputs: int = 1

    def unsupported(self, what) -> UnsupportedError:
        return UnsupportedError(f"ONNX node {self.node!r} ({self.op}): {what}")

    def bad_input(self, what) -> ShapeError:  # (a fed value that does not fit the node)
        return ShapeError(f"ONNX node {self.node!r} ({self.op}): {what}")


def op(name, attrs=(), in_step=True):
    def register(fn):
        OPS[name] = OnnxOp(name, fn, frozenset(attrs), in_step)
        return fn

    return register


def binds(*names):
    """Register ``fn`` as the ``bind`` of the entries ``names``."""

    def register(fn):
        for name in names:
            OPS[name].bind = fn
        return fn

    return register


def _known_ints(value):
    """A constant input as a list of ints; None when left out; UNKNOWN when it
    is known only at run time."""
    if value is None or value is UNKNOWN:
        return value
    return [int(v) for v in np.asarray(value).ravel()]


def _shape_cached(compute):
    """``fn(x, *rest)``: ``x`` reshaped to what ``compute(x)`` gives the first
    time a shape is seen (Squeeze, Unsqueeze, Reshape, Flatten)."""
    shapes = {}

    def run(x, *rest):
        shape = shapes.get(x.shape)
        if shape is None:
            if len(shapes) > 64:
                shapes.clear()
            shape = shapes[x.shape] = tuple(compute(x))
        return x.reshape(shape)

    return run


class NotRowWise(Exception):
    """A Scan body mixes the rows of axis 0: it cannot run one sequence per row."""


def is_step(x) -> bool:
    return isinstance(x, Value)


def rank(ctx, x) -> int:
    """The ONNX rank of a value (see the module docstring for step values)."""
    return len(x.shape) - (not ctx.rows) if is_step(x) else np.ndim(x)


def axis_of(ctx, x, axis, extra=0) -> int:
    """ONNX ``axis`` of ``x`` (negative allowed; ``extra`` more axes in the
    result, for Unsqueeze) as an axis of the array or step value."""
    r = rank(ctx, x) + extra
    if not -r <= axis < max(r, 1):
        raise ctx.unsupported(f"axis {axis} is out of range for rank {r}")
    axis %= max(r, 1)
    if is_step(x) and ctx.rows and axis == 0:
        raise NotRowWise(f"{ctx.op} on axis 0")
    return axis + 1 if is_step(x) and not ctx.rows else axis


def _any_step(xs) -> bool:
    return any(is_step(x) for x in xs)


def _check_constant_rank(ctx, xs):
    """ONNX broadcasting of a step value against a constant of higher rank
    would need the constant's leading axes outside the batch axis; in rows,
    a constant reaching axis 0 would differ per row."""
    r = max(rank(ctx, x) for x in xs if is_step(x))
    for x in xs:
        if x is None or is_step(x):
            continue
        if ctx.rows and (np.ndim(x) > r or (np.ndim(x) == r and np.shape(x)[0] != 1)):
            raise NotRowWise(f"a constant of shape {list(np.shape(x))} in {ctx.op}")
        if np.ndim(x) > r:
            raise ctx.unsupported(
                f"a constant of rank {np.ndim(x)} broadcast against a Scan state or scan "
                f"input of rank {r} inside a Scan body")


def _aligned(ctx, xs):
    """Step values of lower rank get leading size-1 axes after the batch axis,
    so ONNX's right-aligned broadcasting holds between step values."""
    r = max(rank(ctx, x) for x in xs if is_step(x))
    out = []
    for x in xs:
        while is_step(x) and rank(ctx, x) < r:
            if ctx.rows:
                raise NotRowWise(f"step values of ranks {rank(ctx, x)} and {r} in {ctx.op}")
            x = sn_ops.broadcast_axis(x, 1, 1)
        out.append(x)
    return out


def _int_div(a, b):
    return (np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(np.result_type(a, b))


def _primitive(name, entry):
    """ONNX op ``name`` run as stepnet's primitive ``entry`` (its ``onnx_import``)."""

    @op(name)
    def run(ctx, *xs):
        if len(xs) != entry.num_inputs:
            raise ctx.unsupported(f"takes {entry.num_inputs} inputs, got {len(xs)}")
        if _any_step(xs):
            _check_constant_rank(ctx, xs)
            return entry.function(*_aligned(ctx, xs))
        if name == "Div" and np.asarray(xs[0]).dtype.kind in "iu":
            return _int_div(*xs)
        if len(xs) == 1:  # a unary op keeps its input's dtype (float16 included)
            return np.asarray(entry.numpy(np.asarray(xs[0])), np.asarray(xs[0]).dtype)
        return entry.numpy(*xs)


    def bind(ctx, known):
        fn = entry.numpy
        if len(known) != entry.num_inputs:
            return None
        if entry.num_inputs == 1:
            def unary(x):
                y = fn(x)
                return y if y.dtype == x.dtype else y.astype(x.dtype)
            return unary
        if name == "Div":
            return lambda a, b: _int_div(a, b) if a.dtype.kind in "iu" else fn(a, b)
        return fn

    OPS[name].bind = bind


for _entry in registry.all_ops().values():
    if _entry.onnx_import:
        _primitive(_entry.onnx_import, _entry)


def _variadic(name, np_fn, sn_fn):
    @op(name)
    def run(ctx, *xs):
        if not xs:
            raise ctx.unsupported("needs at least one input")
        step = _any_step(xs)
        if step:
            _check_constant_rank(ctx, xs)
            xs = _aligned(ctx, xs)
        out = xs[0]
        for x in xs[1:]:
            out = (sn_fn if step else np_fn)(out, x)
        if name == "Mean":
            out = sn_ops.mul(out, 1.0 / len(xs)) if step else out / np.asarray(len(xs), out.dtype)
        return out


_variadic("Sum", np.add, sn_ops.add)
_variadic("Mean", np.add, sn_ops.add)
_variadic("Max", np.maximum, sn_ops.maximum)
_variadic("Min", np.minimum, sn_ops.minimum)


def _unary(name, fn, attrs=(), defaults=None, on_arrays=None):
    """An elementwise op: ``fn`` traces on step values and computes its NumPy
    reference on arrays (stepnet's ops do both); ``on_arrays`` replaces it on
    arrays where NumPy has the exact function."""
    defaults = defaults or {}

    @op(name, attrs)
    def run(ctx, x, **kw):
        kw = {**defaults, **kw}
        if is_step(x):
            return fn(x, **kw)
        x = np.asarray(x)
        return np.asarray((on_arrays or fn)(x, **kw), x.dtype)

    @binds(name)
    def bind(ctx, known, **kw):
        kw = {**defaults, **kw}
        compute = on_arrays or fn
        return lambda x: np.asarray(compute(x, **kw), x.dtype)


_unary("Softsign", sn_ops.softsign)
_unary("Elu", sn_ops.elu, ["alpha"], {"alpha": 1.0})
_unary("LeakyRelu", sn_ops.leaky_relu, ["alpha"], {"alpha": 0.01})
_unary("ThresholdedRelu", sn_ops.thresholded_relu, ["alpha"], {"alpha": 1.0})
_unary("HardSigmoid", sn_ops.hard_sigmoid, ["alpha", "beta"], {"alpha": 0.2, "beta": 0.5})


def _selu(x, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    return sn_ops.mul(sn_ops.elu(x, alpha=alpha), gamma)


_unary("Selu", _selu, ["alpha", "gamma"])


_unary("Reciprocal", lambda x: sn_ops.div(1.0, x))


@op("Identity")
def _identity(ctx, x):
    return x


@binds("Identity")
def _bind_identity(ctx, known):
    return lambda x: x


@op("Dropout", ["seed"])
def _dropout(ctx, x, ratio=None, training_mode=None, seed=None):
    if training_mode is not None and (is_step(training_mode) or bool(np.asarray(training_mode))):
        if is_step(x):
            raise ctx.unsupported("Dropout with training_mode inside a traced Scan body")
        return NotImplemented  # random dropout: the reference's
    if is_step(x):
        return x
    return x, np.ones(np.shape(x), bool)


@op("Clip", ["min", "max"])
def _clip(ctx, x, lo=None, hi=None, **kw):
    if ctx.opset < 11:
        lo, hi = kw.get("min"), kw.get("max")
    for bound in (lo, hi):
        if is_step(bound):
            raise ctx.unsupported("Clip's min and max must be constants inside a Scan body")
    if np.dtype(x.dtype).kind == "f":  # a bound not given: the dtype's largest (inf is clipped too)
        lo, hi = (np.finfo(x.dtype).min if lo is None else lo), (np.finfo(x.dtype).max if hi is None else hi)
    if is_step(x):
        return sn_ops.clip(x, None if lo is None else float(np.asarray(lo)),
                           None if hi is None else float(np.asarray(hi)))
    x = np.asarray(x)
    out = x
    if lo is not None:
        out = np.maximum(out, np.asarray(lo, x.dtype))
    if hi is not None:
        out = np.minimum(out, np.asarray(hi, x.dtype))
    return out


@op("MatMul")
def _matmul(ctx, a, b):
    if not _any_step((a, b)):
        return np.matmul(a, b)
    if ctx.rows and (is_step(b) or rank(ctx, a) < 2):
        raise NotRowWise("a matmul contracting or stacking over axis 0")
    if is_step(b) and not is_step(a):
        if rank(ctx, b) == 1:  # W @ v == v @ W.T for a vector v
            return sn_ops.matmul(b, np.ascontiguousarray(np.swapaxes(a, -1, -2)))
        if np.ndim(a) < 2:
            raise ctx.unsupported("a constant vector times a Scan value inside a Scan body")
    return sn_ops.matmul(a, b)


@binds("MatMul")
def _bind_matmul(ctx, known):
    return np.matmul


@op("Gemm", ["alpha", "beta", "transA", "transB"])
def _gemm(ctx, a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0):
    def t(x):
        return sn_ops.transpose(x) if is_step(x) else np.swapaxes(x, -1, -2)

    if transA:
        if ctx.rows and is_step(a):
            raise NotRowWise("Gemm's transA on a step value")
        a = t(a)
    if transB:
        b = t(b)
    step = _any_step((a, b, c))
    y = _matmul(ctx, a, b)
    if alpha != 1.0:
        y = sn_ops.mul(y, float(alpha)) if step else y * np.asarray(alpha, y.dtype)
    if c is not None and beta != 0.0:  # (beta 0: C is not read, its NaN neither; onnxruntime's)
        if beta != 1.0:
            c = sn_ops.mul(c, float(beta)) if is_step(c) else c * np.asarray(beta, np.asarray(c).dtype)
        y = sn_ops.add(y, c) if step else y + c
    return y


@binds("Gemm")
def _bind_gemm(ctx, known, alpha=1.0, beta=1.0, transA=0, transB=0):
    def gemm(a, b, c=None):
        y = np.matmul(a.T if transA else a, b.T if transB else b)
        if alpha != 1.0:
            y = y * np.asarray(alpha, y.dtype)
        if c is not None and beta != 0.0:
            y = y + (c * np.asarray(beta, c.dtype) if beta != 1.0 else c)
        return y

    return gemm


@op("Concat", ["axis"])
def _concat(ctx, *xs, axis):
    if _any_step(xs):
        if not all(is_step(x) for x in xs):
            raise ctx.unsupported("Concat of a Scan value with a constant inside a Scan body")
        return sn_ops.concat(list(xs), axis=axis_of(ctx, xs[0], axis))
    return np.concatenate(xs, axis=axis)


@binds("Concat")
def _bind_concat(ctx, known, axis):
    return lambda *xs: np.concatenate(xs, axis=axis)


def _constant_ints(ctx, x, what):
    if x is None:
        return None
    if is_step(x):
        raise ctx.unsupported(f"{what} must be a constant inside a Scan body")
    return [int(v) for v in np.asarray(x).ravel()]


@op("Split", ["axis", "split", "num_outputs"])
def _split(ctx, x, split_in=None, axis=0, num_outputs=None, split=None):
    sizes = split if ctx.opset < 13 else _constant_ints(ctx, split_in, "Split's split")
    ax = axis_of(ctx, x, axis)
    length = x.shape[ax]
    if sizes is None:
        n = num_outputs or ctx.num_outputs
        if ctx.opset < 18 and length % n:  # (opset 18's num_outputs: a smaller last part)
            raise ctx.bad_input(f"an axis of {length} does not split into {n} equal parts")
        chunk = -(-length // n)
        sizes = [min(chunk, length - i * chunk) for i in range(n)]
    if sum(sizes) != length:
        raise ctx.unsupported(f"split sizes {sizes} do not add up to axis length {length}")
    outs, start = [], 0
    for s in sizes:
        if is_step(x):
            outs.append(sn_ops.slice(x, start, start + s, axis=ax))
        else:
            outs.append(np.take(x, range(start, start + s), axis=ax))
        start += s
    return tuple(outs)


@op("Slice", ["starts", "ends", "axes"])
def _slice(ctx, x, starts_in=None, ends_in=None, axes_in=None, steps_in=None,
           starts=None, ends=None, axes=None):
    steps = None
    if ctx.opset >= 10:
        starts = _constant_ints(ctx, starts_in, "Slice's starts")
        ends = _constant_ints(ctx, ends_in, "Slice's ends")
        axes = _constant_ints(ctx, axes_in, "Slice's axes")
        steps = _constant_ints(ctx, steps_in, "Slice's steps")
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not is_step(x):
        index = [slice(None)] * np.ndim(x)
        for a, s, e, st in zip(axes, starts, ends, steps):
            index[axis_of(ctx, x, a)] = slice(s, e, st)
        return np.asarray(x)[tuple(index)]
    for a, s, e, st in zip(axes, starts, ends, steps):
        if st != 1:
            raise ctx.unsupported(f"Slice step {st} inside a Scan body (only 1)")
        ax = axis_of(ctx, x, a)
        size = x.shape[ax]
        s = min(max(s + size if s < 0 else s, 0), size)
        e = min(max(e + size if e < 0 else e, 0), size)
        x = sn_ops.slice(x, s, max(s, e), axis=ax)
    return x


@binds("Slice")
def _bind_slice(ctx, known, starts=None, ends=None, axes=None):
    steps = None
    if ctx.opset >= 10:
        known = list(known[1:]) + [None] * (5 - len(known))
        starts, ends, axes, steps = (_known_ints(v) for v in known[:4])
        if UNKNOWN in (starts, ends, axes, steps):
            return None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    indices = {}  # rank -> the index tuple

    def run(x, *params):
        index = indices.get(x.ndim)
        if index is None:
            index = [slice(None)] * x.ndim
            for a, b, e, st in zip(axes, starts, ends, steps):
                if not -x.ndim <= a < x.ndim:
                    raise ctx.unsupported(f"axis {a} is out of range for rank {x.ndim}")
                index[a % x.ndim] = slice(b, e, st)
            index = indices[x.ndim] = tuple(index)
        return x[index]

    return run


def _axes_input(ctx, axes, attr_axes, what):
    return attr_axes if ctx.opset < 13 else _constant_ints(ctx, axes, f"{what}'s axes")


@op("Squeeze", ["axes"])
def _squeeze(ctx, x, axes_in=None, axes=None):
    axes = _axes_input(ctx, axes_in, axes, "Squeeze")
    if not is_step(x):
        return np.squeeze(x, axis=None if axes is None else tuple(axes))
    if axes is None:
        if ctx.rows:
            raise NotRowWise("Squeeze without axes (it would squeeze a batch of one)")
        axes = [i for i, d in enumerate(x.shape[1:]) if d == 1]
    for a in sorted((axis_of(ctx, x, a) for a in axes), reverse=True):
        if x.shape[a] != 1:
            raise ctx.unsupported(f"cannot squeeze an axis of size {x.shape[a]}")
        x = sn_ops.sum(x, axis=a)
    return x


@binds("Squeeze")
def _bind_squeeze(ctx, known, axes=None):
    if ctx.opset >= 13:
        axes = _known_ints(known[1]) if len(known) > 1 else None
        if axes is UNKNOWN:
            return None
    return _shape_cached(lambda x: np.squeeze(x, axis=None if axes is None else tuple(axes)).shape)


@op("Unsqueeze", ["axes"])
def _unsqueeze(ctx, x, axes_in=None, axes=None):
    axes = _axes_input(ctx, axes_in, axes, "Unsqueeze")
    for a in _new_axes(ctx, axes, rank(ctx, x) + len(axes)):
        if not is_step(x):
            x = np.expand_dims(x, a)
        elif ctx.rows:
            if a == 0:
                raise NotRowWise("Unsqueeze at axis 0")
            x = sn_ops.broadcast_axis(x, a, 1)
        else:
            x = sn_ops.broadcast_axis(x, a + 1, 1)
    return x


@binds("Unsqueeze")
def _bind_unsqueeze(ctx, known, axes=None):
    if ctx.opset >= 13:
        axes = _known_ints(known[1]) if len(known) > 1 else None
        if axes is UNKNOWN or axes is None:
            return None

    def shape(x):
        out = list(x.shape)
        for a in _new_axes(ctx, axes, x.ndim + len(axes)):
            out.insert(a, 1)
        return out

    return _shape_cached(shape)


def _new_axes(ctx, axes, r):
    """Unsqueeze's ``axes`` of an output of rank ``r``, checked, in order."""
    new = sorted(a % r for a in axes if -r <= a < r)
    if len(new) < len(axes) or len(set(new)) < len(new):
        raise ctx.bad_input(f"axes {list(axes)} must be distinct, in [-{r}, {r}) (the output's rank)")
    return new


@op("Transpose", ["perm"])
def _transpose(ctx, x, perm=None):
    r = rank(ctx, x)
    perm = list(reversed(range(r))) if perm is None else list(perm)
    if not is_step(x):
        return np.transpose(x, perm)
    if ctx.rows and perm[0] != 0:
        raise NotRowWise("Transpose moving axis 0")
    if perm == list(range(r)):
        return x
    if r >= 2 and perm == list(range(r - 2)) + [r - 1, r - 2]:
        return sn_ops.transpose(x)
    raise ctx.unsupported(f"Transpose perm {perm} inside a Scan body (only a swap of the last two axes)")


@binds("Transpose")
def _bind_transpose(ctx, known, perm=None):
    return (lambda x: x.transpose()) if perm is None else (lambda x: x.transpose(perm))


def _reduce(name, np_fn, sn_fn):
    @op(name, ["axes", "keepdims", "noop_with_empty_axes"])
    def run(ctx, x, axes_in=None, keepdims=1, noop_with_empty_axes=0, axes=None):
        since = 18 if name != "ReduceSum" else 13
        if ctx.opset >= since:
            axes = _constant_ints(ctx, axes_in, f"{name}'s axes")
        if not axes:
            if noop_with_empty_axes:
                return x
            axes = list(range(rank(ctx, x)))
        if not is_step(x):
            x = np.asarray(x)
            if x.dtype.kind != "f":
                return NotImplemented  # integer means and sums keep their type: the reference's
            return np_fn(x, axis=tuple(axes), keepdims=bool(keepdims))
        for a in sorted((axis_of(ctx, x, a) for a in axes), reverse=True):
            x = sn_fn(x, axis=a, keepdims=bool(keepdims))
        return x


    @binds(name)
    def bind(ctx, known, keepdims=1, noop_with_empty_axes=0, axes=None):
        since = 18 if name != "ReduceSum" else 13
        if ctx.opset >= since:
            axes = _known_ints(known[1]) if len(known) > 1 else None
            if axes is UNKNOWN:
                return None
        if not axes and noop_with_empty_axes:
            return lambda x, *rest: x

        plans = {}  # input shape -> (axes, the divisor of a mean)

        def reduce(x, *rest):
            if x.dtype.kind != "f":
                return NotImplemented
            plan = plans.get((x.shape, x.dtype))
            if plan is None:
                over = tuple(a % x.ndim for a in axes) if axes else tuple(range(x.ndim))
                count = int(np.prod([x.shape[a] for a in over]))
                plan = plans[x.shape, x.dtype] = (over, x.dtype.type(1.0 / count if count
                                                                    else np.nan))
            total = np.add.reduce(x, axis=plan[0], keepdims=bool(keepdims))
            if name == "ReduceMean":
                total *= plan[1]  # in place where the sum is an array
            return total

        return reduce


_reduce("ReduceSum", np.sum, sn_ops.sum)
_reduce("ReduceMean", np.mean, sn_ops.mean)


# ----------------------------------------------------------------------------
# graph-level only: shapes, indices, casts


_ONNX_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64,
                9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


@op("Cast", ["to", "saturate"], in_step=False)
def _cast(ctx, x, to, saturate=1):
    x = np.asarray(x)
    if to not in _ONNX_DTYPES or x.dtype.kind not in "biuf":
        return NotImplemented  # strings, bfloat16, float8: the reference's
    return x.astype(_ONNX_DTYPES[to])


@binds("Cast")
def _bind_cast(ctx, known, to, saturate=1):
    dtype = _ONNX_DTYPES.get(to)
    if dtype is None:
        return None
    return lambda x: x.astype(dtype) if x.dtype.kind in "biuf" else NotImplemented


@op("Shape", ["start", "end"], in_step=False)
def _shape(ctx, x, start=0, end=None):
    return np.asarray(np.shape(x)[start:end], np.int64)


@binds("Shape")
def _bind_shape(ctx, known, start=0, end=None):
    return lambda x: np.array(x.shape[start:end], np.int64)


@op("Reshape", ["allowzero"], in_step=False)
def _reshape(ctx, x, shape, allowzero=0):
    shape = [int(d) for d in np.asarray(shape)]
    if not allowzero:
        shape = [np.shape(x)[i] if d == 0 else d for i, d in enumerate(shape)]
    return np.reshape(x, shape)


@binds("Reshape")
def _bind_reshape(ctx, known, allowzero=0):
    shape = _known_ints(known[1]) if len(known) > 1 else None
    if shape is UNKNOWN or shape is None:
        return None
    if allowzero:
        return _shape_cached(lambda x: np.reshape(x, shape).shape)
    return _shape_cached(lambda x: np.reshape(
        x, [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]).shape)


@op("Flatten", ["axis"], in_step=False)
def _flatten(ctx, x, axis=1):
    x = np.asarray(x)
    if not -x.ndim <= axis <= x.ndim:
        raise ctx.bad_input(f"axis {axis} is out of range for a value of rank {x.ndim}")
    axis %= max(x.ndim, 1) if axis < 0 else x.ndim + 1
    return x.reshape(int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:])))


@binds("Flatten")
def _bind_flatten(ctx, known, axis=1):
    return _shape_cached(lambda x: _flatten(ctx, x, axis).shape)


@op("Gather", ["axis"], in_step=False)
def _gather(ctx, x, indices, axis=0):
    return np.take(x, np.asarray(indices, np.int64), axis=axis)


@binds("Gather")
def _bind_gather(ctx, known, axis=0):
    return lambda x, indices: np.take(x, indices, axis=axis)


_SCATTER = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


@op("ScatterND", ["reduction"], in_step=False)
def _scatter_nd(ctx, data, indices, updates, reduction="none"):
    """``data`` with ``updates`` written (or combined by ``reduction``) at
    ``indices``, all at once (the reference loops over the indices in
    Python: an enhancement model's caches, updated at each call)."""
    data, indices, updates = np.asarray(data), np.asarray(indices), np.asarray(updates)
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    k = indices.shape[-1] if indices.ndim else 0
    if (indices.dtype.kind not in "iu" or not 1 <= k <= data.ndim
            or updates.shape != indices.shape[:-1] + data.shape[k:]
            or reduction != "none" and reduction not in _SCATTER):
        return NotImplemented
    out = data.copy()
    at = tuple(indices.reshape(-1, k).T)
    rows = updates.reshape((-1,) + data.shape[k:]).astype(data.dtype, copy=False)
    if reduction == "none":
        out[at] = rows
    else:
        _SCATTER[reduction].at(out, at, rows)
    return out


@op("Softmax", ["axis"], in_step=False)
def _softmax(ctx, x, axis=None):
    x = np.asarray(x)
    if ctx.opset < 13:  # the input read as 2-D at axis (default 1)
        return rows_at(lambda rows: _softmax(NodeContext(ctx.node, ctx.op, 13), rows, axis=1), x,
                       1 if axis is None else axis)
    axis = -1 if axis is None else axis
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


@op("Pow", in_step=False)
def _pow(ctx, x, y):
    x = np.asarray(x)
    return np.power(x, np.asarray(y)).astype(x.dtype)


@op("Not", in_step=False)
def _not(ctx, x):
    return np.logical_not(x)


@binds("Not")
def _bind_not(ctx, known):
    return np.logical_not


@op("Size", in_step=False)
def _size(ctx, x):
    return np.array(np.size(x), np.int64)


@binds("Size")
def _bind_size(ctx, known):
    return lambda x: np.array(x.size, np.int64)
