"""The routines of the quantized products (``matmul_int8``, ``matmul_bf16``:
:mod:`stepnet.ops.quantized`) that the kernels (called apart) and the
executor run: the weights prepared by the caller (``prepared``: packed by
``int8_prepare`` or widened by ``bf16_prepare``, kept while the same arrays
come back), then a product over a step's rows or every token
(``int8_rows``, ``bf16_rows``).

bf16 products multiply pairs of bfloat16 with ``vdpbf16ps`` where the CPU
has AVX512_BF16 (``int8_gemm.BF16``); elsewhere the weights are widened to
float32 (exactly) and each row of the left operand is rounded to bfloat16,
then the library's float32 product runs: the bf16 product's results at
float32's speed.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)
from .blas import gemm
from .int8_gemm import (
    BF16, bf16_bits, bf16_product, int8_product, int8_sums, pack_bf16, pack_int8, quantize_rows,
)


# the weights prepared last, by op and the arrays' identities (the arrays kept:
# their ids stay theirs): a model's constants come again at every call
_KEPT = {}
_KEPT_MOST = 64
_KEPT_LOCK = threading.Lock()


def prepared(op, operands):
    """The weights of a quantized product ``op`` (``matmul_int8``: weights
    and scales; ``matmul_bf16``: weights), each operand given as its parts
    to join by columns, as its routine reads them: made once while the same
    arrays come back."""
    key = (op, tuple(id(a) for parts in operands for a in parts))
    with _KEPT_LOCK:
        kept = _KEPT.get(key)
    if kept is not None:
        return kept[1]
    joined = [parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1) for parts in operands]
    made = ROUTINES[op][0](*joined)
    with _KEPT_LOCK:
        if len(_KEPT) >= _KEPT_MOST:
            _KEPT.pop(next(iter(_KEPT)))
        _KEPT[key] = (operands, made)
    return made


@njit(cache=True, nogil=True)
def int8_prepare(w, scale):
    """int8 weights ``w`` [k, n] with their scales [n], as ``int8_rows``
    and ``int8_row_sums`` read them."""
    return pack_int8(np.ascontiguousarray(w)), np.ascontiguousarray(scale)


@njit(cache=True, nogil=True)
def int8_rows(a, prepared, out):
    """out[:m] = ``matmul_int8`` of a[:m] by the weights ``int8_prepare``
    made (``a`` float32 [m, k], rows contiguous)."""
    m, k = a.shape
    q, scale = np.empty((m, (k + 3) // 4 * 4), np.int8)[:, :k], np.empty(m, np.float32)  # (whole words)
    quantize_rows(a, q, scale)
    int8_product(q, scale, prepared[0], prepared[1], out)


@njit(cache=True, nogil=True)
def int8_row_sums(a, prepared, sums, scale):
    """``matmul_int8`` of a[:m] left for its readers to dequantize: a's
    rows quantized (their scales into scale[:m]), their int32 sums by the
    weights ``int8_prepare`` made into sums[:m] (``int8_gemm.int8_sums``);
    element [i, j] of the product is then ``float32(sums[i, j]) *
    (scale[i] * prepared[1][j])``, int8_rows's bits."""
    m, k = a.shape
    q = np.empty((m, (k + 3) // 4 * 4), np.int8)[:, :k]
    quantize_rows(a, q, scale)
    int8_sums(q, prepared[0], sums)


@njit(cache=True, nogil=True)
def bf16_prepare(w):
    """bfloat16 weights ``w`` [k, n] (their bits, uint16) as ``bf16_rows``
    reads them: packed in pairs (``pack_bf16``) where the CPU multiplies
    bfloat16, else widened to float32."""
    if BF16:
        return pack_bf16(np.ascontiguousarray(w))
    k, n = w.shape
    out = np.empty((k, n), np.float32)
    wide = out.reshape(k * n).view(np.uint32)
    for i in range(k):
        for j in range(n):
            wide[i * n + j] = np.uint32(w[i, j]) << np.uint32(16)
    return out


@njit(cache=True, nogil=True)
def bf16_rows(a, prepared, out):
    """out[:m] = ``matmul_bf16`` of a[:m] by the weights ``bf16_prepare``
    made: each element of ``a`` rounded to bfloat16 (to nearest, ties to
    even; NaN stays NaN), then ``bf16_product``, or the float32 product of
    the rounded values."""
    m, k = a.shape
    if BF16:
        bf16_product(np.ascontiguousarray(a), prepared, out)
        return
    rounded = np.empty((m, k), np.float32)
    bits = rounded.reshape(m * k).view(np.uint32)
    source = np.ascontiguousarray(a).reshape(m * k).view(np.uint32)
    for i in range(m * k):
        bits[i] = bf16_bits(source[i])
    gemm(rounded, prepared, out)


# each quantized op's routines: (what prepares its weights, its product over rows)
ROUTINES = {"matmul_int8": (int8_prepare, int8_rows), "matmul_bf16": (bf16_prepare, bf16_rows)}
