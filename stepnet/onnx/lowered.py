"""The loops a compiled graph (:mod:`stepnet.onnx.lowering`) calls, and
the generated modules it imports: compiled once per install, kept in
``STEPNET_CACHE_DIR``; imported by a graph's module only (importing stepnet
starts no engine)."""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from ..jit.blas import gemm


def generated(key):
    """The generated module of ``key`` (a kernel's or a fused loop's), from
    this process's modules or imported from its file in ``STEPNET_CACHE_DIR``."""
    from ..jit import loading
    from ..jit.cache import cache_dir

    name = f"stepnet_kernel_{key}"
    module = sys.modules.get(name)
    return module if module is not None else loading.import_file(name, cache_dir() / f"{name}.py")


@njit(cache=True, nogil=True, error_model="numpy")
def conv1d(x, w_t, bias, K, stride, dilation, pad, out_len):
    """A 1-D Conv of one group: ``x`` [N, C, L], ``w_t`` [C * K, M] (the
    weight [M, C, K] as columns), ``bias`` [M]: every window's values a row
    (of the input padded with zeros), then one product on the chosen BLAS
    (on this thread); [N, M, out_len], a view of the product's rows."""
    N, C, L = x.shape
    M = w_t.shape[1]
    span = (out_len - 1) * stride + (K - 1) * dilation + 1
    padded = np.zeros((N, C, max(span, pad + L)), x.dtype)
    padded[:, :, pad:pad + L] = x
    rows = np.empty((N * out_len, C * K), x.dtype)
    for n in range(N):
        for o in range(out_len):
            for c in range(C):
                for k in range(K):
                    rows[n * out_len + o, c * K + k] = padded[n, c, o * stride + k * dilation]
    product = np.empty((N * out_len, M), x.dtype)
    gemm(rows, w_t, product)
    for r in range(N * out_len):
        for m in range(M):
            product[r, m] += bias[m]
    return np.transpose(product.reshape((N, out_len, M)), (0, 2, 1))


@njit(cache=True, nogil=True, error_model="numpy")
def reduce_rows(x, mean):
    """Each row's sum of ``x`` [R, S] (its mean where ``mean``), in order."""
    out = np.empty(x.shape[0], x.dtype)
    for i in range(x.shape[0]):
        total = x.dtype.type(0)
        for j in range(x.shape[1]):
            total += x[i, j]
        out[i] = total / x.shape[1] if mean else total
    return out
