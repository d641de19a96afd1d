"""The segment primitives: over each batch row's own rows of a ragged value
(an attention memory given by add_static_input(LoDTensor), or a value
computed from one): seq_sum, seq_max, and seq_expand their gradient's
counterpart.
"""

from __future__ import annotations


import numpy as np

from ..errors import ShapeError
from ..ir import Literal, Var
from ..lod import LoDTensor
from ..tracing import bind
from ..registry import (
    Aval,
    register,
    shape_str,
)
from .rules import (
    ZERO,
)


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
    """The reference of a segment op: ``ufunc`` over each batch row's rows,
    folded into ``empty`` (a sum from +0.0, as ``np.sum`` and the kernels
    fold it, where ``reduceat`` gives -0.0 for rows of -0.0 alone; a maximum
    from -inf)."""
    def reference(x):
        data, starts, counts = _segments(x)
        out = np.full((len(counts),) + data.shape[1:], empty, data.dtype)
        full = counts > 0
        if full.any():  # non-empty segments are contiguous and in order
            out[full] = ufunc(out[full], ufunc.reduceat(data[:starts[-1] + counts[-1]], starts[full],
                                                        axis=0))
        return out
    return reference


@register("seq_sum", _segment_rule("seq_sum"), _segment_reduce(np.add, 0), "segment", 1,
          grad=lambda em, e, g: [em.op("seq_expand", g, e.inputs[0])], onnx=None,
          segment=("{acc} + {x}", 0.0), takes_lod=True)
def seq_sum(x):
    """Each batch row's sum over its own rows of the ragged value ``x``
    (``[B, ...]``; zeros for a row with none), summed from +0.0 on every
    backend as ``np.sum`` sums (rows of -0.0 alone sum to +0.0).

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
          segment=("({acc} if {acc} > {x} or {acc} != {acc} else {x})", -np.inf))  # NaN wins;
# (a tie goes to the later row, as np.maximum gives its second operand: 0.0 then -0.0 is -0.0)
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
