"""Conv, MaxPool and AveragePool with NumPy, for whole arrays (graph level).

``onnx.reference`` runs these with a Python loop over output positions;
here a Conv is one GEMM over the windows (im2col), several times faster on
the sizes of small audio models, and the pools take the elementwise maximum
(or sum) of one strided view per kernel tap.
A Conv whose weight is a constant is bound to it when the session is made:
the weight laid out for the GEMM once, the window geometry once per input
shape.
Each entry declines (returns ``NotImplemented``, and the node runs on the
reference) the cases it does not cover: pools with ``ceil_mode``, MaxPool's
``Indices`` output, a Conv whose weight is not a constant of the right rank.
"""

from __future__ import annotations

import numpy as np

from .ops import UNKNOWN, binds, op

# a 1-D Conv of stride 1 whose im2col copy would hold at least this many
# elements sums one GEMM per kernel tap instead (no copy of the windows),
# which is faster than the copy for a batch of VAD streams, small batches
# included
_SHIFT_MIN_ELEMENTS = 16384


def _spatial(x, kernel, strides, dilations, pads, auto_pad):
    """(begin pads, end pads, output sizes) over the spatial axes of ``x``."""
    nd = len(kernel)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    sizes = x.shape[2:]
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, s, span in zip(sizes, strides, spans):
            out = -(-n // s)
            total = max((out - 1) * s + span - n, 0)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
    elif auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    else:
        pads = list(pads or [0] * (2 * nd))
        begin, end = pads[:nd], pads[nd:]
    outs = [(n + b + e - span) // s + 1 for n, b, e, span, s in zip(sizes, begin, end, spans, strides)]
    return begin, end, outs, strides, dilations


def _decode(value):
    return value.decode() if isinstance(value, bytes) else value


@op("Conv", ["auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"], in_step=False)
def _conv(ctx, x, w, b=None, **attrs):
    conv = _bind_conv(ctx, [UNKNOWN, w, b], **attrs)
    return NotImplemented if conv is None else conv(np.asarray(x), w, b)


@binds("Conv")
def _bind_conv(ctx, known, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
               pads=None, strides=None):
    """The Conv with its weight a constant: the weight laid out for the GEMM
    once, and per input shape the padding and window geometry once."""
    if len(known) < 2 or known[1] is UNKNOWN or (len(known) > 2 and known[2] is UNKNOWN):
        return None
    w = np.asarray(known[1])
    if w.ndim >= 3 and w.shape[0] % group:
        return None
    if w.ndim < 3 or w.dtype.kind != "f" or (kernel_shape is not None
                                             and list(kernel_shape) != list(w.shape[2:])):
        return None
    kernel, nd = list(w.shape[2:]), w.ndim - 2
    M, Cg, G = w.shape[0], w.shape[1], group
    K = int(np.prod(kernel))
    weights = np.ascontiguousarray(w.reshape(G, M // G, Cg * K))              # [G, Mg, CgK]
    weights_t = np.ascontiguousarray(weights[0].T) if G == 1 else None         # [CK, M]
    per_tap = np.ascontiguousarray(w.transpose(2, 1, 0)) if nd == 1 else None  # [K, C, M]
    bias = None if len(known) < 3 or known[2] is None else np.asarray(known[2]).reshape(
        (M,) + (1,) * nd)
    plans = {}

    def conv(x, w_, b_=None):
        if x.ndim != w.ndim or x.dtype != w.dtype or x.shape[1] != Cg * G:
            return NotImplemented
        p = plans.get(x.shape)
        if p is None:
            if len(plans) > 64:
                plans.clear()
            p = plans[x.shape] = _window_plan(x, kernel, strides, dilations, pads, auto_pad, G, Cg)
        padded, inner, shape, steps, outs, O, by_window, shift = p
        if min(outs, default=1) < 1:
            return NotImplemented
        if shift is not None:
            y = _conv_by_taps(x, per_tap, padded, shift, O)
            return y + bias if bias is not None else y
        if padded is not None:
            buf = np.zeros(padded, x.dtype)
            buf[inner] = x
        else:
            buf = np.ascontiguousarray(x)
        N = x.shape[0]
        windows = np.ndarray(shape, x.dtype, buffer=buf, strides=steps)
        if by_window:
            rows = windows.reshape(N * O, Cg * K)
            if N == 1:  # [M, O] at once: each channel's row contiguous for the ops after
                y = weights[0] @ rows.T
            else:
                y = _product(rows, weights_t[None], N * O, 0).reshape(N, O, M).transpose(0, 2, 1)
        else:
            cols = windows.reshape(G, Cg * K, N * O)
            if G == 1:  # NumPy's stacked matmul does not call BLAS: one 2-D product
                y = (weights[0] @ cols[0]).reshape(M, N, O)
            else:
                y = np.matmul(weights, cols).reshape(M, N, O)              # [G, Mg, N * O]
            y = y.transpose(1, 0, 2)
        y = y.reshape((N, M) + outs)  # a view where the layout allows: no copy
        if bias is not None:
            y = y + bias
        return y

    return conv


def _window_plan(x, kernel, strides, dilations, pads, auto_pad, G, Cg):
    """How a Conv of ``G`` groups of ``Cg`` channels and window ``kernel``
    reads an input shaped like ``x``: ``(the padded input's shape or None,
    where x goes in it, the windows' shape and strides, the output's spatial
    shape, its size, whether each window is a row of the GEMM's operand,
    (the padding before and the dilation of a 1-D stride-1 Conv run tap by
    tap) or None)``."""
    nd, K = len(kernel), int(np.prod(kernel))
    begin, end, outs, st, dil = _spatial(x, kernel, strides, dilations, pads, _decode(auto_pad))
    padded = x.shape[:2] + tuple(n + b + e for n, b, e in zip(x.shape[2:], begin, end))
    inner = (slice(None), slice(None)) + tuple(slice(b, b + n) for b, n in zip(begin, x.shape[2:]))
    item = x.itemsize
    row = [item * int(np.prod(padded[i + 1:])) for i in range(len(padded))]
    taps = tuple(row[2 + i] * dil[i] for i in range(nd))
    positions = tuple(row[2 + i] * st[i] for i in range(nd))
    # im2col copies the windows into the GEMM's operand; the copy is fast
    # when its innermost axis is long and contiguous: the taps of a window
    # (strided or wide kernels, as an STFT's) or the output positions
    by_window = G == 1 and dil[-1] == 1 and (st[-1] > 1 or kernel[-1] >= outs[-1])
    if by_window:  # [N, *outs, C, *kernel] -> [N * O, C * K]
        shape = (x.shape[0],) + tuple(outs) + (Cg,) + tuple(kernel)
        steps = (row[0],) + positions + (row[1],) + taps
    else:  # [G, Cg, *kernel, N, *outs] -> [G, Cg * K, N * O]
        shape = (G, Cg) + tuple(kernel) + (x.shape[0],) + tuple(outs)
        steps = (row[1] * Cg, row[1]) + taps + (row[0],) + positions
    # stride 1 along one axis: y[n] = sum over taps k of W_k @ x[n] shifted
    # by k * dilation, each a GEMM over every sample's positions at once
    shift = (nd == 1 and G == 1 and st[0] == 1 and not by_window and K > 1
             and Cg * K * x.shape[0] * outs[0] >= _SHIFT_MIN_ELEMENTS)
    return (padded if any(begin) or any(end) else None, inner, shape, steps, tuple(outs),
            int(np.prod(outs)), by_window, (begin[0], dil[0]) if shift else None)


def _conv_by_taps(x, per_tap, padded, shift, O):
    """A 1-D Conv of stride 1 ([N, C, L] -> [N, M, O], ``per_tap`` [K, C, M])
    over a channels-last copy of the input ([N * Lp, C], padded: the samples
    one after another): one GEMM per tap over all of its rows at that tap's
    offset, and each sample's O outputs read at its rows (a channels-last
    view)."""
    (N, C, L), (K, _, M) = x.shape, per_tap.shape
    begin, dilation = shift
    Lp = L if padded is None else padded[2]
    rows = np.empty((N, Lp, C), x.dtype)
    rows[:, :begin] = 0  # (the padding only: the rest is the input's copy)
    rows[:, begin + L:] = 0
    rows[:, begin:begin + L] = x.transpose(0, 2, 1)
    span = N * Lp - (K - 1) * dilation  # the rows every tap reads
    acc = _product(rows.reshape(N * Lp, C), per_tap, span, dilation)
    # sample n's output o is row n * Lp + o
    item = acc.itemsize
    return np.ndarray((N, M, O), acc.dtype, buffer=acc, strides=(Lp * M * item, item, M * item))


def _product(a, w, rows, dilation):
    """``out[r] = sum over k of a[r + k * dilation] @ w[k]`` for ``rows`` rows
    (``a`` [rows + (K - 1) * dilation, C], ``w`` [K, C, M]): on
    stepnet's BLAS (``blas.taps_product``, its rows shared with the helper
    thread where the product is big enough) for float32 and float64, else
    NumPy's."""
    if a.dtype not in _ON_BLAS or w.dtype != a.dtype:
        out = a[:rows] @ w[0]
        for k in range(1, w.shape[0]):
            out += a[k * dilation:k * dilation + rows] @ w[k]
        return out
    from ..jit import blas  # (loaded here: the session may run without compiling)

    a, w = np.ascontiguousarray(a), np.ascontiguousarray(w)  # (copies only where strided)
    out = np.empty((rows, w.shape[2]), a.dtype)
    blas.taps_product(a, w, out, dilation, blas.board_for_product(rows * w.size))
    return out


_ON_BLAS = (np.dtype(np.float32), np.dtype(np.float64))


def transposed_windows(sizes, kernel, strides, dilations, output_padding, output_shape, pads,
                       auto_pad):
    """``(begin pads, output sizes, strides, dilations)`` of a ConvTranspose
    over spatial sizes ``sizes``: input position ``i`` and tap ``k`` add to
    output position ``i * stride + k * dilation - begin``."""
    nd = len(sizes)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    extra = list(output_padding or [0] * nd)
    auto_pad = _decode(auto_pad)
    full = [s * (n - 1) + e + (k - 1) * d + 1
            for n, s, e, k, d in zip(sizes, strides, extra, kernel, dilations)]
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [n * s for n, s in zip(sizes, strides)]
    if output_shape is not None:
        outs = list(output_shape)[-nd:]
        total = [f - o for f, o in zip(full, outs)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    else:
        pads = list(pads or [0] * (2 * nd))
        begin = pads[:nd]
        outs = [f - b - e for f, b, e in zip(full, begin, pads[nd:])]
    return begin, outs, strides, dilations


@op("ConvTranspose", ["auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                      "output_shape", "pads", "strides"], in_step=False)
def _conv_transpose(ctx, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1,
                    kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                    strides=None):
    """Each kernel tap's product of ``x``'s channels by its weights (one per
    group) added to the output at ``i * stride + tap * dilation - pad``,
    positions the output does not hold left out. The reference's own runs
    one group only (a grouped one, as an enhancement model's decoder has,
    raises there)."""
    x, w = np.asarray(x), np.asarray(w)
    nd = x.ndim - 2
    if (nd < 1 or w.ndim != x.ndim or x.dtype.kind != "f" or w.dtype != x.dtype
            or x.shape[1] != w.shape[0] or w.shape[0] % group
            or kernel_shape is not None and list(kernel_shape) != list(w.shape[2:])):
        return NotImplemented
    kernel, sizes = list(w.shape[2:]), list(x.shape[2:])
    begin, outs, strides, dilations = transposed_windows(sizes, kernel, strides, dilations,
                                                         output_padding, output_shape, pads,
                                                         auto_pad)
    if min(outs) < 1:
        return NotImplemented
    N, C = x.shape[:2]
    Cg, Mg = C // group, w.shape[1]
    y = np.zeros((N, group, Mg, *outs), x.dtype)
    xg = x.reshape(N, group, Cg, *sizes)
    wg = w.reshape(group, Cg, Mg, *kernel)
    for tap in np.ndindex(*kernel):
        at_in, at_out = [slice(None)] * 3, [slice(None)] * 3
        for k, o, n, s, d, p in zip(tap, outs, sizes, strides, dilations, begin):
            first = max(0, -(-(p - k * d) // s))  # (the first input whose position is >= 0)
            last = min(n - 1, (o - 1 + p - k * d) // s)
            if last < first:
                break
            start = first * s + k * d - p
            at_in.append(slice(first, last + 1))
            at_out.append(slice(start, start + (last - first) * s + 1, s))
        else:
            taps = wg[(slice(None), slice(None), slice(None), *tap)]         # [G, Cg, Mg]
            part = np.einsum("ngc...,gcm->ngm...", xg[tuple(at_in)], taps)
            y[tuple(at_out)] += part
    y = y.reshape(N, group * Mg, *outs)
    if b is not None:
        y += np.asarray(b, x.dtype).reshape((-1,) + (1,) * nd)
    return y


def _pool_args(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    x = np.asarray(x)
    if ceil_mode or x.ndim < 3 or x.dtype.kind != "f" or ctx.num_outputs != 1:
        return None
    kernel = list(kernel_shape)
    begin, end, outs, strides, dilations = _spatial(x, kernel, strides, dilations, pads,
                                                    _decode(auto_pad))
    if min(outs, default=1) < 1:
        return None
    return x, kernel, strides, dilations, begin, end, outs


def _taps(x, kernel, strides, dilations, begin, end, outs, fill):
    """Each kernel tap's view of ``x`` padded with ``fill``: ``[N, C, *outs]``
    strided slices, one per position in the kernel."""
    if any(begin) or any(end):
        x = np.pad(x, [(0, 0), (0, 0)] + list(zip(begin, end)), constant_values=fill)
    for offset in np.ndindex(*kernel):
        index = (slice(None), slice(None)) + tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, n, s in zip(offset, dilations, outs, strides))
        yield x[index]


@op("MaxPool", ["auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "storage_order",
                "strides"], in_step=False)
def _max_pool(ctx, x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
              storage_order=0, strides=None):
    args = _pool_args(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    if args is None:
        return NotImplemented
    taps = _taps(*args, -np.inf)
    out = np.array(next(taps))
    for tap in taps:
        np.maximum(out, tap, out=out)
    return out


@op("AveragePool", ["auto_pad", "ceil_mode", "count_include_pad", "dilations", "kernel_shape",
                    "pads", "strides"], in_step=False)
def _average_pool(ctx, x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0,
                  dilations=None, pads=None, strides=None):
    args = _pool_args(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    if args is None:
        return NotImplemented
    x, kernel, strides, dilations, begin, end, outs = args
    total = sum(_taps(x, kernel, strides, dilations, begin, end, outs, 0))
    if count_include_pad:
        return (total / np.prod(kernel)).astype(x.dtype)
    ones = np.ones((1, 1) + x.shape[2:], x.dtype)
    count = sum(_taps(ones, kernel, strides, dilations, begin, end, outs, 0))
    return (total / count).astype(x.dtype)
