"""The reduced-precision products: ``a @ W`` with the weights ``W`` stored in
fewer bits, what :func:`stepnet.quantize` writes in place of a step's
``x @ W`` (see docs/quantization.md).

- ``matmul_int8(a, w, scale)``: ``w`` int8 ``[k, n]`` with a float32 scale
  per column (``W ~ w * scale``). Each row of ``a`` is quantized to int8 as
  it is made (symmetric: its scale is its largest magnitude / 127), the
  products are summed exactly in int32 and the sum is dequantized in
  float32: ``out[i, j] = float32(sum_k qa[i, k] * w[k, j]) * (s_i * scale_j)``.
  A row holding a NaN or an infinity gives NaN in every column (its scale
  is NaN); a row of zeros gives zeros.
- ``matmul_bf16(a, w)``: ``w`` holds bfloat16 numbers as their 16 bits
  (``uint16``); each element of ``a`` is rounded to bfloat16 (to nearest,
  ties to even; NaN stays NaN) and the products are summed in float32.

Their results are float32. Every backend computes the int8 product exactly
as the NumPy reference here does (the integer sums are exact, the
dequantize is the same two float32 products), so backends agree bit for
bit; the bf16 product's sums may be added in another order. Neither has a
gradient: a quantized model is for inference (train the float model, then
quantize it).
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError, UnsupportedError
from ..registry import Aval, register, shape_str
from ..tracing import bind

QMAX = 127  # int8's symmetric range: -127..127 (-128 unused)


def quantize_rows(a):
    """``(q, s)``: each row of ``a`` [m, k] (float32) as int8 ``q`` with its
    scale ``s`` [m] (float32): ``a[i] ~ q[i] * s[i]``. A row of zeros has
    scale 0; a row holding a NaN or an infinity has scale NaN and ``q`` 0."""
    a = np.asarray(a, np.float32)
    amax = np.max(np.abs(a), axis=-1) if a.shape[-1] else np.zeros(a.shape[:-1], np.float32)
    finite = np.isfinite(amax)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(finite, amax / np.float32(QMAX), np.float32(np.nan)).astype(np.float32)
        # (in float64: 127 / amax overflows float32 for rows below 4e-37)
        inv = np.where(finite & (amax > 0), QMAX / amax.astype(np.float64), 0.0)
        q = np.rint(np.where(finite[..., None], a, np.float32(0)).astype(np.float64) * inv[..., None])
    return np.clip(q, -QMAX, QMAX).astype(np.int8), scale


def int8_weights(w, what="the weights"):
    """``(q, scale)``: weights ``w`` [k, n] as int8 ``q`` [k, n] with a
    float32 scale per column (``w[:, j] ~ q[:, j] * scale[j]``), symmetric:
    a column's scale is its largest magnitude / 127 (0 for a column of
    zeros). Weights must be finite; ``what`` names them in the error."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ShapeError(f"int8 weights must be a matrix [k, n], got shape {list(w.shape)}")
    if not np.all(np.isfinite(w)):
        raise ShapeError(f"int8 weights: {what} hold NaN or infinity; quantize finite weights")
    q, scale = quantize_rows(w.T)
    return np.ascontiguousarray(q.T), scale


def to_bf16(x):
    """The bfloat16 nearest to each element of ``x`` (ties to even), as its
    16 bits (``uint16``); NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded).astype(np.uint16)


def from_bf16(bits):
    """bfloat16 numbers given as their 16 bits, as float32 (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _check_left(name, a, k):
    if np.dtype(a.dtype) != np.float32:
        raise ShapeError(f"{name}: the left operand must be float32, got {shape_str(a)}")
    if len(a.shape) != 2 or a.shape[-1] != k:
        raise ShapeError(f"{name}: {shape_str(a)} is not rows of {k} (the weights' rows)")


def _int8_rule(operands):
    a, w, scale = operands
    if np.dtype(w.dtype) != np.int8 or len(w.shape) != 2 or None in w.shape:
        raise ShapeError(f"matmul_int8: the weights must be an int8 matrix [k, n], got {shape_str(w)}")
    _check_left("matmul_int8", a, w.shape[0])
    if np.dtype(scale.dtype) != np.float32 or tuple(scale.shape) != (w.shape[1],):
        raise ShapeError(f"matmul_int8: the scales must be float32 [{w.shape[1]}] (one per column "
                         f"of the weights), got {shape_str(scale)}")
    return Aval((a.shape[0], w.shape[1]), np.dtype(np.float32))


def int8_product(a, w, scale):
    """The reference of ``matmul_int8`` (see the module docstring)."""
    q, s = quantize_rows(a)
    # integer sums in float64 are exact (|sum| <= 127 * 127 * k < 2**53)
    acc = q.astype(np.float64) @ np.asarray(w, np.int8).astype(np.float64)
    return acc.astype(np.float32) * (s[:, None] * np.asarray(scale, np.float32)[None, :])


def _no_gradient(em, e, g):
    raise UnsupportedError(f"{e.op} has no gradient: a quantized model is for inference; train "
                           "the float model, then quantize it")


@register("matmul_int8", _int8_rule, int8_product, "quantized", 3, grad=_no_gradient)
def matmul_int8(a, w, scale):
    """``a @ (w * scale)`` on int8: each row of ``a`` quantized to int8 as
    it comes, the products summed in int32, the sum dequantized in float32
    (see :mod:`stepnet.ops.quantized`); what ``sn.quantize(model, "int8")``
    writes for a step's ``x @ W``.

    Parameters
    ----------
    a : step value or ndarray
        Rows ``[B, k]``, float32.
    w : ndarray
        int8 weights ``[k, n]`` (:func:`int8_weights`).
    scale : ndarray
        float32 ``[n]``: each column's scale.

    Returns
    -------
    step value or ndarray
        float32 ``[B, n]``.

    Raises
    ------
    ShapeError
        Operands of other dtypes or shapes.
    """
    return bind("matmul_int8", [a, w, scale])


def _bf16_rule(operands):
    a, w = operands
    if np.dtype(w.dtype) != np.uint16 or len(w.shape) != 2 or None in w.shape:
        raise ShapeError("matmul_bf16: the weights must be bfloat16 bits (uint16) [k, n], got "
                         f"{shape_str(w)}")
    _check_left("matmul_bf16", a, w.shape[0])
    return Aval((a.shape[0], w.shape[1]), np.dtype(np.float32))


def bf16_product(a, w):
    """The reference of ``matmul_bf16`` (see the module docstring)."""
    return from_bf16(to_bf16(a)) @ from_bf16(w)


@register("matmul_bf16", _bf16_rule, bf16_product, "quantized", 2, grad=_no_gradient)
def matmul_bf16(a, w):
    """``a @ w`` in bfloat16: ``a``'s elements rounded to bfloat16, the
    products summed in float32 (see :mod:`stepnet.ops.quantized`); what
    ``sn.quantize(model, "bf16")`` writes for a step's ``x @ W``.

    Parameters
    ----------
    a : step value or ndarray
        Rows ``[B, k]``, float32.
    w : ndarray
        bfloat16 weights ``[k, n]`` as their bits, uint16 (:func:`to_bf16`).

    Returns
    -------
    step value or ndarray
        float32 ``[B, n]``.

    Raises
    ------
    ShapeError
        Operands of other dtypes or shapes.
    """
    return bind("matmul_bf16", [a, w])
