"""The loops a compiled graph (:mod:`stepnet.onnx.lowering`) calls, and
the generated modules it imports: compiled once per install, kept in
``STEPNET_CACHE_DIR``; imported by a graph's module only (importing stepnet
starts no engine)."""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from ..jit.atomics import job_of
from ..jit.blas import row_cut, share_rows, taps_product
from ..jit.threads import RAISED


def generated(key):
    """The generated module of ``key`` (a kernel's or a fused loop's), from
    this process's modules or imported from its file in ``STEPNET_CACHE_DIR``."""
    from ..jit import loading
    from ..jit.cache import cache_dir

    name = f"stepnet_kernel_{key}"
    module = sys.modules.get(name)
    return module if module is not None else loading.import_file(name, cache_dir() / f"{name}.py")


@njit(cache=True, nogil=True, error_model="numpy")
def conv1d(x, w, bias, K, stride, dilation, pad, out_len, board):
    """A 1-D Conv of one group and ``K`` taps: ``x`` [N, C, L] (any strides),
    ``w`` the weight [M, C, K] by taps at stride 1, [K, C, M], else as
    columns, [1, C * K, M] (C-contiguous), ``bias`` [M]; its rows laid out
    channels-last, [N, per_sample, M] (C-contiguous; the output is
    ``[:, :out_len, :].transpose((0, 2, 1))`` of it: ``per_sample`` is
    ``out_len`` but at stride 1, where it is the padded input's length).
    Its samples cut in two where the work is big enough (``blas.row_cut``),
    the second part on the helper where it is free on ``board`` (each part's
    product whole: the same bits either way); where they are not, its
    product's rows are (``taps_product``)."""
    N, C, L = x.shape
    M = w.shape[2]
    span = (out_len - 1) * stride + (K - 1) * dilation + 1
    Lp = max(span, pad + L)
    per_sample = Lp if stride == 1 else out_len
    out = np.empty((N * per_sample, M), x.dtype)
    work = N * per_sample * w.shape[0] * w.shape[1] * M  # (multiply-adds: C * K by M a row)
    cut = row_cut(N, work, board, 2)
    if cut == 0:
        _conv_samples(x, w, bias, K, stride, dilation, pad, out_len, Lp, out, board)
    else:
        alone = np.zeros_like(board)  # (a part's product is not cut again)
        split = cut * per_sample
        own = job_of(_conv_samples, (x[:cut], w, bias, K, stride, dilation, pad, out_len, Lp,
                                     out[:split], alone))
        other = job_of(_conv_samples, (x[cut:], w, bias, K, stride, dilation, pad, out_len, Lp,
                                       out[split:], alone))
        if share_rows(board, work, own, other, cut, N) == RAISED:
            _conv_samples(x, w, bias, K, stride, dilation, pad, out_len, Lp, out, alone)
    return out.reshape((N, per_sample, M))


@njit(cache=True, nogil=True, error_model="numpy")
def _conv_samples(x, w, bias, K, stride, dilation, pad, out_len, Lp, out, board):
    """``conv1d``'s rows of the samples ``x`` into ``out`` [N * per_sample,
    M]: the input copied channels-last, padded with zeros to ``Lp``; with
    stride 1, one product per tap over every sample's rows at that tap's
    offset (sample n's output o: row n * Lp + o; the rows past a sample's
    outputs are not written), else every window's values a row, then one
    product (``taps_product``; each as a Conv node's)."""
    N, C, L = x.shape
    M = w.shape[2]
    padded = np.empty((N, Lp, C), x.dtype)
    padded[:, :pad, :] = 0
    padded[:, pad + L:, :] = 0
    if x.strides[1] <= x.strides[2]:  # (read in x's memory order)
        for n in range(N):
            for i in range(L):
                for c in range(C):
                    padded[n, pad + i, c] = x[n, c, i]
    else:
        for n in range(N):
            for c in range(C):
                for i in range(L):
                    padded[n, pad + i, c] = x[n, c, i]
    if stride == 1:
        rows = N * Lp - (K - 1) * dilation
        taps_product(padded.reshape((N * Lp, C)), w, out[:rows], dilation, board)
    else:
        rows = N * out_len
        windows = np.empty((rows, K * C), x.dtype)
        flat = padded.reshape(N * Lp * C)
        for n in range(N):
            for o in range(out_len):
                row, at = n * out_len + o, (n * Lp + o * stride) * C
                for c in range(C):  # (by channel, then tap: a Conv node's order)
                    for k in range(K):
                        windows[row, c * K + k] = flat[at + k * dilation * C + c]
        taps_product(windows, w, out[:rows], 1, board)
    for r in range(rows):
        for m in range(M):
            out[r, m] += bias[m]


@njit(cache=True, nogil=True, error_model="numpy")
def product(a, w, board):
    """``a`` [R, K] @ ``w`` [1, K, M] (both C-contiguous), on the chosen BLAS:
    its rows cut in two where the product is big enough, the second part on
    the helper where ``board`` is ``threads.BOARD`` and it is free (as a
    Conv node's: ``blas.taps_product``; the same bits either way)."""
    out = np.empty((a.shape[0], w.shape[2]), a.dtype)
    taps_product(a, w, out, 1, board)
    return out


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


@njit(cache=True, nogil=True, error_model="numpy")
def conv2d(x, w, bias, group, strides, pads, dilations, out_hw):
    """A 2-D Conv of ``group`` groups by direct loops: ``x`` [N, C, H, W]
    (any strides), ``w`` [M, C / group, KH, KW], ``bias`` [M]; the output
    [N, M, OH, OW] C-contiguous. For what one call of a streaming model
    convolves (a 3x3 over a few channels, a depthwise or pointwise Conv),
    which im2col and a product would spend more on than the loops. Each
    output adds its terms in the order channel, row, column of the kernel
    (its innermost loop runs along an output row); a padded position reads
    zero, as the padded copy a Conv node multiplies does."""
    N, C, H, W = x.shape
    M, Cg, KH, KW = w.shape
    per = M // group
    zero = x.dtype.type(0)
    out = np.zeros((N, M, out_hw[0], out_hw[1]), x.dtype)
    for n in range(N):
        for m in range(M):
            c0 = (m // per) * Cg
            for c in range(Cg):
                for kh in range(KH):
                    for kw in range(KW):
                        weight = w[m, c, kh, kw]
                        for oh in range(out_hw[0]):
                            ih = oh * strides[0] - pads[0] + kh * dilations[0]
                            row = 0 <= ih < H
                            for ow in range(out_hw[1]):
                                iw = ow * strides[1] - pads[1] + kw * dilations[1]
                                value = x[n, c0 + c, ih, iw] if row and 0 <= iw < W else zero
                                out[n, m, oh, ow] += value * weight
            for oh in range(out_hw[0]):
                for ow in range(out_hw[1]):
                    out[n, m, oh, ow] += bias[m]
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def max_pool2d(x, kernel, strides, pads, dilations, out_hw):
    """MaxPool over 2-D windows of ``x`` [N, C, H, W] (any strides): each
    window's largest value, NaN where it holds one (as ``np.maximum``);
    padded positions are left out (they are -inf)."""
    N, C, H, W = x.shape
    out = np.empty((N, C, out_hw[0], out_hw[1]), x.dtype)
    for n in range(N):
        for c in range(C):
            for oh in range(out_hw[0]):
                for ow in range(out_hw[1]):
                    best = -np.inf
                    for kh in range(kernel[0]):
                        ih = oh * strides[0] - pads[0] + kh * dilations[0]
                        if 0 <= ih < H:
                            for kw in range(kernel[1]):
                                iw = ow * strides[1] - pads[1] + kw * dilations[1]
                                if 0 <= iw < W:
                                    value = x[n, c, ih, iw]
                                    if value > best or value != value:
                                        best = value
                    out[n, c, oh, ow] = best
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def conv_transpose2d(x, w, bias, group, strides, pads, dilations, out_hw):
    """A 2-D ConvTranspose of ``group`` groups by direct loops: ``x`` [N, C,
    H, W] (any strides), ``w`` [C, M / group, KH, KW], ``bias`` [M]; input
    position ``i`` and tap ``k`` add to output ``i * stride + k * dilation -
    pad`` where the output [N, M, OH, OW] (C-contiguous) holds it."""
    N, C, H, W = x.shape
    Cg, Mg, KH, KW = C // group, w.shape[1], w.shape[2], w.shape[3]
    out = np.zeros((N, Mg * group, out_hw[0], out_hw[1]), x.dtype)
    for n in range(N):
        for g in range(group):
            for c in range(g * Cg, (g + 1) * Cg):
                for ih in range(H):
                    for kh in range(KH):
                        oh = ih * strides[0] + kh * dilations[0] - pads[0]
                        if 0 <= oh < out_hw[0]:
                            for iw in range(W):
                                value = x[n, c, ih, iw]
                                for kw in range(KW):
                                    ow = iw * strides[1] + kw * dilations[1] - pads[1]
                                    if 0 <= ow < out_hw[1]:
                                        for m in range(Mg):
                                            out[n, g * Mg + m, oh, ow] += value * w[c, m, kh, kw]
    for n in range(N):
        for m in range(Mg * group):
            out[n, m] += bias[m]
    return out
