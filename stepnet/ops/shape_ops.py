"""The primitives whose result element reads other elements than its own:
the reductions matmul and sum (a ``reduction`` record: a sum of products) and
the shape ops concat, slice, transpose, broadcast_axis and pad (a ``gather``
record: where each element comes from).
"""

from __future__ import annotations

import builtins
import numbers

import numpy as np

from ..errors import ShapeError, UnsupportedError
from ..ir import Literal
from ..tracing import bind
from ..registry import (
    Aval,
    Case,
    broadcast_shapes,
    check_float,
    normalize_axis,
    register,
    result_dtype,
    shape_str,
)
from .rules import (
    shape_of,
)



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

    stack = broadcast_shapes([ma[:-2], mb[:-2]])  # (the stacked dimensions only)
    if stack is None:
        raise ShapeError(f"matmul: the dimensions before the last two do not broadcast (the step "
                         f"value's batch axis among them): {shape_str(a)} @ {shape_str(b)}")
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
    if a.lod_depth and len(a.shape) > 2 and not b.batched:
        raise UnsupportedError(
            f"gradient of matmul: a ragged value of more than one feature axis "
            f"({a.type_str()}) by a constant ({b.type_str()}); give the memory's rows one "
            "feature axis (the rows [n, F] of a LoDTensor) for a gradient")
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
# sum and the shape ops


def _int(value, what, op) -> int:
    """``value`` as an int: a float (``1.5``) or a bool is refused, never
    truncated."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ShapeError(f"{op}: {what} must be an integer, got {value!r}")
    return int(value)


def axis_size(op, x, axis):
    """The size of ``x``'s axis ``axis`` (None: the batch axis, which the
    op's rule refuses by name), the axis checked first: an integer in range."""
    axis = _int(axis, "axis", op)
    shape = shape_of(x)
    if not -len(shape) <= axis < len(shape):
        dims = ", ".join("B" if d is None else str(d) for d in shape)
        raise ShapeError(f"{op}: axis {axis} is out of range for a value of shape [{dims}]")
    return shape[axis]


def _axis(e) -> int:
    return normalize_axis(e.op, e.inputs[0], e.attrs["axis"])


def _sum_rule(operands, axis, keepdims=False):
    (x,) = operands
    if np.dtype(x.dtype) == bool:
        raise ShapeError("sum: its operand is a mask (bool), which is no number here: count with "
                         "sum(where(mask, 1.0, 0.0))")
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
        ``axis`` is not an integer, out of range or the batch axis.
    """
    return bind("sum", [x], axis=_int(axis, "axis", "sum"), keepdims=bool(keepdims))


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
        ``axis`` not an integer, out of range or the batch axis.
    """
    values = list(values)
    if not values:  # (the rule says so in a block; NumPy's words outside one)
        raise ShapeError("concat: needs at least one operand")
    return bind("concat", values, axis=_int(axis, "axis", "concat"))


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
        ``axis`` is not an integer, out of range or the batch axis.
    """
    axis = _int(axis, "axis", "slice")
    start, stop = (None if v is None else _int(v, what, "slice")  # (None: as a Python slice's)
                   for v, what in ((start, "start"), (stop, "stop")))
    size = axis_size("slice", x, axis)
    if size is None:  # the batch axis: the rule refuses it with a clear error
        return bind("slice", [x], axis=axis, start=start, stop=stop)
    start, stop, _ = builtins.slice(start, stop).indices(size)
    return bind("slice", [x], axis=axis, start=start, stop=builtins.max(start, stop))


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
        ``size`` is negative, or ``axis`` is out of range (or not of size 1); one
        of them is not an integer.
    """
    return bind("broadcast_axis", [x], axis=_int(axis, "axis", "broadcast_axis"),
                size=_int(size, "size", "broadcast_axis"), insert=bool(insert))


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
        A negative width, or ``axis`` out of range or the batch axis; one of
        them not an integer.
    """
    return bind("pad", [x], axis=_int(axis, "axis", "pad"), before=_int(before, "before", "pad"),
                after=_int(after, "after", "pad"))


