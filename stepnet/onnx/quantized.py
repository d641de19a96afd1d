"""The integer operators of quantized ONNX models, as
``onnxruntime.quantization.quantize_dynamic`` (``DynamicQuantizeLinear``,
``MatMulInteger``, ``ConvInteger``) and static quantization
(``QLinearMatMul``) write them: OPS entries on arrays (their meaning is the
ONNX reference's, :mod:`onnx.reference`, to the bit).

The integer products run on the BLAS: integers of up to 16 bits (an 8-bit
value less its zero point) multiplied and summed in float64 are exact while
a sum stays under 2**53, which every product of ``k < 2**36`` terms does,
where NumPy's integer ``matmul`` loops without one (tens of times slower).
``DynamicQuantizeLSTM`` is a recurrent node (:mod:`stepnet.onnx.recurrent`).
"""

from __future__ import annotations

import numpy as np

from .conv import _conv
from .ops import op


def _less_zero_point(x, zero_point, axis):
    """``x`` (integers) minus its zero point as float64: a scalar, or one per
    index of ``axis`` (a 1-D zero point)."""
    x = np.asarray(x).astype(np.float64)
    if zero_point is None:
        return x
    zero = np.asarray(zero_point).astype(np.float64)
    if zero.ndim == 1 and x.ndim >= 2:
        shape = [1] * x.ndim
        shape[axis] = zero.shape[0]
        zero = zero.reshape(shape)
    return x - zero


def _integer_product(a, b, a_zero_point, b_zero_point):
    """``(a - a_zero_point) @ (b - b_zero_point)`` in float64, exact: a 1-D
    zero point of ``a`` is one per row, of ``b`` one per column."""
    if np.ndim(a) < 2 or np.ndim(b) < 2:
        return None
    return _less_zero_point(a, a_zero_point, -2) @ _less_zero_point(b, b_zero_point, -1)


@op("DynamicQuantizeLinear", in_step=False)
def _dynamic_quantize_linear(ctx, x):
    x = np.asarray(x)
    if x.dtype != np.float32 or x.size == 0:
        return NotImplemented
    high, low = np.float32(np.maximum(0, x.max())), np.float32(np.minimum(0, x.min()))
    scale = np.float32(1.0 if high == low else high - low) / np.float32(255)
    zero = np.rint(max(0, min(255, np.float32(0) - low / scale)))
    y = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.uint8)
    return y, np.array(scale, np.float32), np.array(zero, np.uint8)


@op("MatMulInteger", in_step=False)
def _matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    found = _integer_product(a, b, a_zero_point, b_zero_point)
    return NotImplemented if found is None else found.astype(np.int32)


@op("QLinearMatMul", in_step=False)
def _qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                    y_zero_point=None):
    found = _integer_product(a, b, a_zero_point, b_zero_point)
    if found is None:
        return NotImplemented
    # (the reference's arithmetic: the int32 sums times the scales' float32 quotient)
    y = found.astype(np.int32) * (np.asarray(a_scale) * np.asarray(b_scale) / np.asarray(y_scale))
    dtype = np.asarray(a).dtype
    if y_zero_point is not None:
        y = y + np.asarray(y_zero_point)
        dtype = np.asarray(y_zero_point).dtype
    info = np.iinfo(dtype)
    return np.clip(np.rint(y), info.min, info.max).astype(dtype)


@op("ConvInteger", ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"],
    in_step=False)
def _conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
    if np.ndim(x) < 3 or np.ndim(w) < 3:
        return NotImplemented
    found = _conv(ctx, _less_zero_point(x, x_zero_point, 0),
                  _less_zero_point(w, w_zero_point, 0), None, **attrs)
    return NotImplemented if found is NotImplemented else np.asarray(found).astype(np.int32)
