"""Composite ops: built from primitives, so they get every backend's code
generation and gradients for free. The ONNX activations follow the ONNX
RNN/GRU/LSTM operator specs, alpha and beta included.
"""

from __future__ import annotations

import operator

import numpy as np

from ..errors import ShapeError, StepNetError
from ..lod import LoDTensor
from .primitives import (
    abs,
    add,
    clip,
    div,
    exp,
    greater,
    greater_equal,
    mul,
    seq_expand,
    seq_max,
    seq_sum,
    slice,
    sub,
    sum,
    tanh,
    where,
)
from .shape_ops import axis_size

__all__ = ["affine", "attention", "elu", "hard_sigmoid", "leaky_relu", "mean", "scaled_tanh",
           "seq_softmax", "softsign", "split", "thresholded_relu"]


def mean(x, axis=-1, keepdims=False):
    """Mean over ``axis``: ``sum(x, axis) * (1 / n)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    axis : int, default -1
        The axis averaged (negative counts from the end); not the batch axis.
    keepdims : bool, default False
        Keep the averaged axis, of size 1.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.

    Raises
    ------
    ShapeError
        ``axis`` is out of range or the batch axis.
    """
    n = axis_size("mean", x, axis)
    # (over no element: NaN, as NumPy's mean)
    return mul(sum(x, axis, keepdims), 1.0 / n if n else float("nan"))


def split(x, sections, axis=-1):
    """Split ``x`` along ``axis`` into ``sections`` equal parts, or at the
    sizes listed in ``sections`` (a list). Returns a list of slices.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand.
    sections : int or list of int
        A number of equal parts that divides the axis's size, or the sizes
        of the parts, in order, which must add up to the axis's size. Any
        integer will do (a NumPy integer too), not a bool.
    axis : int, default -1
        The axis split (negative counts from the end); not the batch axis.

    Returns
    -------
    list
        The parts, in order: step values inside a step-net block, arrays
        outside.

    Raises
    ------
    ShapeError
        ``axis`` is the batch axis, the axis does not split into
        ``sections`` equal parts, or the sizes are negative or do not add
        up to it.
    StepNetError
        ``sections`` is neither an integer nor a list of integers.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> [part.shape for part in sn.ops.split(np.zeros((2, 6)), [2, 4])]
    [(2, 2), (2, 4)]
    """
    size = axis_size("split", x, axis)
    if size is None:
        raise ShapeError(f"split: cannot split the batch axis (axis {axis}) of a step value")
    count = _integer(sections)
    if count is not None:
        if count <= 0 or size % count:
            raise ShapeError(f"split: axis of size {size} does not split into {count} parts")
        sizes = [size // count] * count
    else:
        sizes = None if isinstance(sections, str) else _integers(sections)
        if sizes is None:
            raise StepNetError(f"split: sections must be an int or a list of ints, got {sections!r}")
        if any(n < 0 for n in sizes):
            raise ShapeError(f"split: sizes {sizes} include a negative size")
    parts, start = [], 0
    for n in sizes:
        parts.append(slice(x, start, start + n, axis))
        start += n
    if start != size:
        raise ShapeError(f"split: sizes {sizes} do not add up to the axis size {size}")
    return parts


def _integer(n):
    """``n`` as an int if it is an integer (int, NumPy integer), not a bool; else None."""
    if isinstance(n, (bool, np.bool_)):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


def _integers(items):
    """A list of ints from an iterable of integers; else None."""
    try:
        sizes = [_integer(n) for n in items]
    except TypeError:  # not iterable
        return None
    return None if None in sizes else sizes


def affine(x, alpha=1.0, beta=0.0):
    """ONNX Affine: ``alpha * x + beta``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 1.0
        The scale.
    beta : float, default 0.0
        The offset.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return add(mul(x, alpha), beta)


def leaky_relu(x, alpha=0.01):
    """ONNX LeakyRelu: ``x if x >= 0 else alpha * x``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 0.01
        The slope below 0.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return where(greater_equal(x, 0.0), x, mul(x, alpha))


def thresholded_relu(x, alpha=1.0):
    """ONNX ThresholdedRelu: ``x if x > alpha else 0``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 1.0
        The threshold.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return where(greater(x, alpha), x, 0.0)


def scaled_tanh(x, alpha=1.0, beta=1.0):
    """ONNX ScaledTanh: ``alpha * tanh(beta * x)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 1.0
        The output's scale.
    beta : float, default 1.0
        The input's scale.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return mul(tanh(mul(x, beta)), alpha)


def hard_sigmoid(x, alpha=0.2, beta=0.5):
    """ONNX HardSigmoid: ``clip(alpha * x + beta, 0, 1)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 0.2
        The slope.
    beta : float, default 0.5
        The offset.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return clip(add(mul(x, alpha), beta), 0.0, 1.0)


def elu(x, alpha=1.0):
    """ONNX Elu: ``x if x >= 0 else alpha * (exp(x) - 1)``.

    ``exp`` reads ``min(x, 0)``, so large positive inputs do not overflow.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).
    alpha : float, default 1.0
        The scale below 0.

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return where(greater_equal(x, 0.0), x, mul(sub(exp(clip(x, None, 0.0)), 1.0), alpha))


def softsign(x):
    """ONNX Softsign: ``x / (1 + |x|)``.

    Parameters
    ----------
    x : step value, Parameter or array
        The operand (floating-point).

    Returns
    -------
    step value or ndarray
        A step value inside a step-net block (the ops are traced into the
        IR); on plain arrays and Parameters outside a block, the result
        computed with the ops' NumPy references.
    """
    return div(x, add(abs(x), 1.0))


# ----------------------------------------------------------------------------
# attention over a ragged memory (a static input given as a LoDTensor)


def seq_softmax(x):
    """Softmax over each batch row's own rows of the ragged value ``x``
    (each feature apart): ``exp(x - seq_max(x)) / seq_sum(...)``.

    Parameters
    ----------
    x : step value or LoDTensor
        A ragged step value of one level (e.g. scores over a memory given to
        ``add_static_input`` as a LoDTensor); outside a step-net, a
        LoDTensor of one level, computed on NumPy.

    Returns
    -------
    step value or LoDTensor
        Ragged like ``x``: each batch row's rows sum to 1, feature by
        feature.
    """
    if isinstance(x, LoDTensor):  # (outside a step-net: on NumPy, row by row)
        e = LoDTensor(np.exp(x.data - seq_expand(seq_max(x), x).data), x.lod)
        return LoDTensor(e.data / seq_expand(seq_sum(e), x).data, x.lod)
    e = exp(sub(x, seq_max(x)))
    return div(e, seq_sum(e))


def attention(query, memory, keys=None):
    """Dot-product (Luong) attention of each batch row's ``query`` ``[B, D]``
    over its own rows of the ragged ``memory`` ``[rows, F]``: the weights are
    ``seq_softmax`` of ``keys_j . query`` (``keys`` defaults to ``memory``),
    the result ``[B, F]`` the weighted sum of the memory rows. A batch row with
    no memory rows gets zeros. For additive (Bahdanau) scores, write them out:
    ``w = seq_softmax(tanh(keys + query @ Wq) @ v)``, ``seq_sum(w * memory)``.

    Parameters
    ----------
    query : step value
        ``[B, D]``, one query per batch row.
    memory : step value or LoDTensor
        Ragged, one level, ``[rows, F]``: each batch row's own memory rows
        (e.g. a LoDTensor given to ``add_static_input``); outside a
        step-net, a LoDTensor (with an array ``query``), computed on NumPy.
    keys : step value or LoDTensor, optional
        Ragged like ``memory``, ``[rows, D]``: what the query is compared
        with. None: ``memory`` itself (then ``F == D``).

    Returns
    -------
    step value or ndarray
        ``[B, F]``, the attention-weighted sum of each batch row's memory
        rows.

    Examples
    --------
    Inside a step block, with ``M`` a LoDTensor of one sequence of rows per
    sequence of the step input::

        mem = rnn.add_static_input(M, name="memory")
        context = sn.ops.attention(h.pre_state(), mem)
    """
    keys = memory if keys is None else keys
    if isinstance(memory, LoDTensor) and isinstance(keys, LoDTensor):  # (outside a step-net)
        scores = LoDTensor((keys.data * seq_expand(query, keys).data).sum(-1, keepdims=True),
                           keys.lod)
        return seq_sum(LoDTensor(seq_softmax(scores).data * memory.data, memory.lod))
    weights = seq_softmax(sum(mul(keys, query), axis=-1, keepdims=True))
    return seq_sum(mul(weights, memory))
