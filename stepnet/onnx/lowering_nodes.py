"""Each node a compiled graph (:mod:`stepnet.onnx.lowering`) writes: a
function per op of the plan, given the graph's ``_Writer`` and the node,
that appends the node's lines and returns True, or False where it does not
take this node (the plan then runs node by node)."""

from __future__ import annotations

import numpy as np

RESHAPES = {"Squeeze", "Unsqueeze", "Reshape", "Flatten"}
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
LAYERS = ("GRU", "LSTM", "RNN")


def known(w, name):
    """The value of ``name`` where the key fixes it, else None."""
    return w.env.get(name) if name and name in w.fixed else None


# Numba's transpose by axes and its copy of an array into a slice each build
# error messages (f-strings of shapes) the first time a process compiles
# them, seconds each: a graph permutes axes by strides and copies by loops,
# and its first compile in a new compile worker costs its own code only


def permuted(src, perm, shape):
    """The text of ``src`` (of ``shape``) with its axes in the order
    ``perm``: a view, as ``np.transpose(src, perm)`` is."""
    if list(perm) == list(range(len(shape))):
        return src
    strides = ", ".join(f"{src}.strides[{a}]" for a in perm)
    return (f"np.lib.stride_tricks.as_strided({src}, {tuple(int(shape[a]) for a in perm)}, "
            f"({strides},))")


def nest(loops, depth=1):
    """The ``for`` lines of a loop nest, ``loops`` its ``(variable, count)``
    outermost first, the first at indentation ``depth``."""
    return [f"{'    ' * (depth + k)}for {v} in range({n}):" for k, (v, n) in enumerate(loops)]


def _copy(shape, dst, dst_at, src, src_at=list, depth=1):
    """Lines copying, for each index of ``shape``, an element of ``src`` into
    ``dst``: ``dst_at(counters)`` and ``src_at(counters)`` are their indices,
    a text per axis, given the loops' counters (a text per axis of ``shape``)."""
    counters = [f"c{k}" for k in range(len(shape))]
    to, at = ", ".join(dst_at(counters)) or "()", ", ".join(src_at(counters)) or "()"
    return nest(zip(counters, shape), depth) + [f"{'    ' * (depth + len(shape))}{dst}[{to}] = {src}[{at}]"]


def _empty(w, name):
    """A variable for value ``name``, a new C-contiguous array of its shape."""
    value, y = w.env[name], w.made(name)
    w.body.append(f"    {y} = np.empty({value.shape}, np.{value.dtype.name})")
    return y


def _slice(w, node):
    x = w.env[node.inputs[0]]
    parts = [known(w, n) for n in node.inputs[1:5]] + [None] * (5 - len(node.inputs))
    if node.attrs or parts[0] is None or parts[1] is None or any(
            n and p is None for n, p in zip(node.inputs[3:5], parts[2:4])):
        return False
    starts, ends = np.asarray(parts[0]).tolist(), np.asarray(parts[1]).tolist()
    axes = list(range(len(starts))) if parts[2] is None else np.asarray(parts[2]).tolist()
    steps = [1] * len(starts) if parts[3] is None else np.asarray(parts[3]).tolist()
    index, text = [slice(None)] * x.ndim, [":"] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = a + x.ndim if a < 0 else a
        lo, hi, step = slice(s, e, st).indices(x.shape[a])
        hi = hi if hi >= 0 else None  # (a negative step to the first element)
        index[a] = slice(lo, hi, step)
        text[a] = f"{lo}:{'' if hi is None else hi}:{step}"
    if not np.array_equal(x[tuple(index)], w.env[node.outputs[0]], equal_nan=True):
        return False
    src = w.ref(node.inputs[0])
    w.body.append(f"    {w.made(node.outputs[0])} = {src}[{', '.join(text)}]")
    if all(i.step == 1 for i in index if i != slice(None)):
        w.same_order(node.outputs[0], node.inputs[0], [i.start or 0 for i in index])
    else:
        w.same_order(node.outputs[0], node.inputs[0])
        w.memory.pop(node.outputs[0], None)
    return True


def _gather(w, node):
    """A Gather by indices the key fixes: one index, a view without its
    axis (an exporter's ``x[0]``); several (of any rank), their rows copied."""
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    indices = known(w, node.inputs[1])
    axis = node.attrs.get("axis", 0)
    axis = axis + x.ndim if axis < 0 else axis
    if indices is None or not 0 <= axis < x.ndim:
        return False
    picked = np.asarray(indices).astype(np.int64)
    picked = np.where(picked < 0, picked + x.shape[axis], picked)
    if (picked.size and (picked.min() < 0 or picked.max() >= x.shape[axis])
            or not np.array_equal(np.take(x, picked, axis=axis), out, equal_nan=True)):
        return False
    src = w.ref(node.inputs[0])
    if picked.ndim == 0:
        at = ", ".join([":"] * axis + [str(int(picked))])
        w.body.append(f"    {w.made(node.outputs[0])} = {src}[{at}]")
        order = [a - (a > axis) for a in w.order.get(node.inputs[0], range(x.ndim)) if a != axis]
        if order != sorted(order):
            w.order[node.outputs[0]] = tuple(order)
        return True
    at, q = w.array(np.ascontiguousarray(picked)), picked.ndim
    w.body += _copy(out.shape, _empty(w, node.outputs[0]), list, src,
                    lambda c: [*c[:axis], f"{at}[{', '.join(c[axis:axis + q])}]", *c[axis + q:]])
    return True


def _expand(w, node):
    """Expand to a shape the key fixes: the input copied, broadcast."""
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    if node.inputs[1] not in w.fixed or x.ndim > out.ndim:
        return False
    lead = out.ndim - x.ndim
    src = w.ref(node.inputs[0])
    w.body += _copy(out.shape, _empty(w, node.outputs[0]), list, src, lambda c: [
        "0" if n == 1 else v for v, n in zip(c[lead:], x.shape)])
    return True


def _reshape(w, node):
    if any(n and n not in w.fixed for n in node.inputs[1:]):
        return False  # (a shape or axes fed with other values at each call of the key)
    shape = w.env[node.outputs[0]].shape
    src = w.ref(node.inputs[0])
    w.body.append(f"    {w.made(node.outputs[0])} = np.ascontiguousarray({src}).reshape({shape})")
    return True


def _transpose(w, node):
    x = w.env[node.inputs[0]]
    perm = tuple(node.attrs.get("perm", range(x.ndim - 1, -1, -1)))
    if x.transpose(perm).shape != w.env[node.outputs[0]].shape:
        return False
    src = w.ref(node.inputs[0])
    w.body.append(f"    {w.made(node.outputs[0])} = {permuted(src, perm, x.shape)}")
    order = tuple(perm.index(a) for a in w.order.get(node.inputs[0], range(x.ndim)))
    if order != tuple(range(x.ndim)):
        w.order[node.outputs[0]] = order
    return True


def _concat(w, node):
    out = w.env[node.outputs[0]]
    axis = node.attrs.get("axis", 0)
    axis = axis + out.ndim if axis < 0 else axis
    names = [n for n in node.inputs if n]
    parts = [w.ref(n) for n in names]
    y = _empty(w, node.outputs[0])
    at = 0
    for name, part in zip(names, parts):
        size = w.env[name].shape[axis]
        w.body += _copy(w.env[name].shape, y, lambda c, at=at: [
            f"{at} + {v}" if k == axis and at else v for k, v in enumerate(c)], part)
        at += size
    return at == out.shape[axis]


def _alias(w, node):
    if node.inputs[0] in w.order and node.outputs[0] in w.keep:  # (given back: C-contiguous)
        src = w.ref(node.inputs[0])
        w.body.append(f"    {w.made(node.outputs[0])} = np.ascontiguousarray({src})")
        return True
    w.var[node.outputs[0]] = w.ref(node.inputs[0])
    w.same_order(node.outputs[0], node.inputs[0])
    return True


def _cast(w, node):
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    if x.dtype not in FLOATS:
        return False
    if x.dtype == out.dtype:
        return _alias(w, node)
    src = w.ref(node.inputs[0])
    w.body.append(f"    {w.made(node.outputs[0])} = {src}.astype(np.{out.dtype.name})")
    return True


def _pad(w, node):
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    mode = node.attrs.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    pads = known(w, node.inputs[1]) if len(node.inputs) > 1 else None
    value = known(w, node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else 0
    if (pads is None or value is None or len(node.inputs) > 3 and node.inputs[3]
            or mode not in ("constant", "reflect", "edge")):
        return False
    pads = np.asarray(pads).tolist()
    nd = x.ndim
    begin, end = pads[:nd], pads[nd:]
    if (len(pads) != 2 * nd or min(pads) < 0
            or tuple(n + b + e for n, b, e in zip(x.shape, begin, end)) != out.shape
            or mode == "reflect" and any(b >= n or e >= n for n, b, e in zip(x.shape, begin, end))
            or mode == "edge" and x.size == 0):
        return False
    src, y, dt = w.ref(node.inputs[0]), w.made(node.outputs[0]), f"np.{out.dtype.name}"
    fill = float(np.asarray(value).reshape(-1)[0]) if np.size(value) else 0.0
    fill = repr(fill) if np.isfinite(fill) else "np.nan" if np.isnan(fill) else \
        "np.inf" if fill > 0 else "-np.inf"
    w.body.append(f"    {y} = np.full({out.shape}, {fill}, {dt})" if mode == "constant"
                  else f"    {y} = np.empty({out.shape}, {dt})")
    w.body += _copy(x.shape, y, lambda c: [f"{b} + {v}" if b else v for b, v in zip(begin, c)], src)
    for a, (n, b, e) in enumerate(zip(x.shape, begin, end)):
        if mode == "constant" or b + e == 0:
            continue
        # axis a's pads from the values on it so far (the earlier axes' pads too)
        rest = out.shape[:a] + out.shape[a + 1:]
        first, last = (f"{b} + 1 + i", f"{b + n} - 2 - i") if mode == "reflect" else (f"{b}", f"{b + n - 1}")
        for count, to, at in ((b, f"{b} - 1 - i", first), (e, f"{b + n} + i", last)):
            w.body += [f"    for i in range({count}):",
                       *_copy(rest, y, lambda c, a=a, to=to: [*c[:a], to, *c[a:]],
                              y, lambda c, a=a, at=at: [*c[:a], at, *c[a:]], depth=2)]
    return True


def _conv(w, node):
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    weight = known(w, node.inputs[1])
    bias = known(w, node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if (weight is None or x.ndim != 3 or weight.ndim != 3 or node.attrs.get("group", 1) != 1
            or weight.dtype != x.dtype
            or list(node.attrs.get("kernel_shape") or weight.shape[2:]) != list(weight.shape[2:])
            or len(node.inputs) > 2 and node.inputs[2] and bias is None):
        return False
    M, C, K = weight.shape
    windows = _windows(x, node, [K])
    if windows is None:
        return False
    (_, stride), (_, pad), (_, dilation), (_, out_len) = windows
    if C != x.shape[1] or out.shape != (x.shape[0], M, out_len):
        return False
    laid = weight.transpose(2, 1, 0) if stride == 1 else weight.reshape(M, C * K).T[None]
    weights = w.array(np.ascontiguousarray(laid))  # (conv1d's: by taps at stride 1, else columns)
    b = w.array(np.zeros(M, x.dtype) if bias is None else np.ascontiguousarray(bias, x.dtype))
    src = w.ref(node.inputs[0])
    board = w.product_board(x.shape[0] * out_len * C * K * M)
    y = w.made(node.outputs[0])
    w.order[node.outputs[0]] = (0, 2, 1)  # (a view of rows channels-last: conv1d)
    w.memory[node.outputs[0]] = (f"{y}m", (0, 0, 0))
    w.body.append(f"    {y}m = conv1d({src}, {weights}, {b}, {K}, {stride}, {dilation}, "
                  f"{pad}, {out_len}, {board})")
    w.body.append(f"    {y} = {permuted(f'{y}m[:, :{out_len}, :]', (0, 2, 1), (x.shape[0], out_len, M))}")
    return True


def _as_2d(w, name, x):
    """Value ``name`` (``x``: [N, C, L] or [N, C, H, W]) as the text of a
    4-D array: a 1-D one seen as of height 1 (a view)."""
    src = w.ref(name)
    if x.ndim == 4:
        return src
    return (f"np.lib.stride_tricks.as_strided({src}, ({x.shape[0]}, {x.shape[1]}, 1, {x.shape[2]}), "
            f"({src}.strides[0], {src}.strides[1], 0, {src}.strides[2]))")


def _windows(x, node, kernel):
    """``(strides, begin pads, dilations, output sizes)`` of a Conv's or a
    pool's windows over ``x``'s 1 or 2 spatial axes, each as two (a 1-D
    one of height 1), or None where its attributes are not ones the loops
    take (pads past a window, a ceil mode)."""
    from .conv import _spatial

    a = node.attrs
    auto_pad = a.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if a.get("ceil_mode", 0) or a.get("storage_order", 0) or len(node.outputs) > 1:
        return None
    begin, end, outs, strides, dilations = _spatial(x, kernel, a.get("strides"), a.get("dilations"),
                                                    a.get("pads"), auto_pad)
    if min(outs) < 1 or min(begin + end) < 0 or min(strides + dilations) < 1:
        return None
    return _in_2d(strides, begin, dilations, outs)


def _in_2d(strides, begin, dilations, outs):
    """The windows' ``(strides, begin pads, dilations, output sizes)``, each
    of two axes: a 1-D one's of height 1 (stride 1, pad 0, dilation 1, one row)."""
    if len(outs) == 2:
        return tuple(strides), tuple(begin), tuple(dilations), tuple(outs)
    return (1, *strides), (0, *begin), (1, *dilations), (1, *outs)


def _conv_loops(w, node):
    """A Conv of one or two spatial axes ``_conv`` does not take (grouped,
    2-D) by direct loops (``lowered.conv2d``)."""
    x, weight, out = (w.env[n] for n in (*node.inputs[:2], node.outputs[0]))
    bias = w.env[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    group = node.attrs.get("group", 1)
    if (x.ndim not in (3, 4) or weight.ndim != x.ndim or weight.dtype != x.dtype
            or bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype)
            or group < 1 or x.shape[1] != weight.shape[1] * group or weight.shape[0] % group
            or list(node.attrs.get("kernel_shape") or weight.shape[2:]) != list(weight.shape[2:])):
        return False
    windows = _windows(x, node, list(weight.shape[2:]))
    if windows is None or out.shape != (x.shape[0], weight.shape[0], *windows[3][4 - x.ndim:]):
        return False
    b = _bias(w, node, weight.shape[0], x.dtype)
    return _windowed(w, node, x, f"conv2d({_as_2d(w, node.inputs[0], x)}, "
                     f"{_as_2d(w, node.inputs[1], weight)}, {b}, {group}, {', '.join(map(str, windows))})")


def _bias(w, node, size, dtype):
    """A Conv's or ConvTranspose's bias (its third input), or zeros."""
    if len(node.inputs) > 2 and node.inputs[2]:
        return w.ref(node.inputs[2])
    return w.array(np.zeros(size, dtype))


def _max_pool(w, node):
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    kernel = list(node.attrs.get("kernel_shape", []))
    if x.ndim not in (3, 4) or x.dtype not in FLOATS or len(kernel) != x.ndim - 2:
        return False
    windows = _windows(x, node, kernel)
    if windows is None or out.shape != (*x.shape[:2], *windows[3][4 - x.ndim:]):
        return False
    return _windowed(w, node, x, f"max_pool2d({_as_2d(w, node.inputs[0], x)}, "
                     f"{tuple(([1] + kernel)[-2:])}, {', '.join(map(str, windows))})")


def _conv_transpose(w, node):
    """A ConvTranspose of one or two spatial axes by direct loops
    (``lowered.conv_transpose2d``), its windows as stepnet's NumPy's."""
    from .conv import transposed_windows

    x, weight, out = (w.env[n] for n in (*node.inputs[:2], node.outputs[0]))
    bias = w.env[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    a, group = node.attrs, node.attrs.get("group", 1)
    if (x.ndim not in (3, 4) or weight.ndim != x.ndim or weight.dtype != x.dtype
            or group < 1 or x.shape[1] != weight.shape[0] or weight.shape[0] % group
            or bias is not None and (bias.shape != (weight.shape[1] * group,) or bias.dtype != x.dtype)
            or list(a.get("kernel_shape") or weight.shape[2:]) != list(weight.shape[2:])):
        return False
    begin, outs, strides, dilations = transposed_windows(
        list(x.shape[2:]), list(weight.shape[2:]), a.get("strides"), a.get("dilations"),
        a.get("output_padding"), a.get("output_shape"), a.get("pads"), a.get("auto_pad", "NOTSET"))
    if out.shape != (x.shape[0], weight.shape[1] * group, *outs) or min(strides + dilations) < 1:
        return False
    windows = _in_2d(strides, begin, dilations, outs)
    b = _bias(w, node, out.shape[1], x.dtype)
    return _windowed(w, node, x, f"conv_transpose2d({_as_2d(w, node.inputs[0], x)}, "
                     f"{_as_2d(w, node.inputs[1], weight)}, {b}, {group}, "
                     f"{', '.join(map(str, windows))})")


def _scatter_nd(w, node):
    """ScatterND (no reduction) at indices the key fixes: the data copied,
    then each index's updates written in order (a later one wins)."""
    data, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    indices, updates = known(w, node.inputs[1]), w.env[node.inputs[2]]
    reduction = node.attrs.get("reduction", "none")
    if (indices is None or reduction not in ("none", b"none") or indices.ndim < 1
            or type(updates) is not np.ndarray or updates.dtype != data.dtype):
        return False
    k = indices.shape[-1]
    rows = indices.reshape(-1, k).astype(np.int64)
    rows = np.where(rows < 0, rows + np.array(data.shape[:k]), rows)
    if (not 1 <= k <= data.ndim or updates.shape != indices.shape[:-1] + data.shape[k:]
            or rows.size and (rows.min() < 0 or (rows >= np.array(data.shape[:k])).any())):
        return False
    src, upd = w.ref(node.inputs[0]), w.ref(node.inputs[2])
    at, y = w.array(np.ascontiguousarray(rows)), _empty(w, node.outputs[0])
    w.body += _copy(out.shape, y, list, src)
    flat = f"np.ascontiguousarray({upd}).reshape({(len(rows),) + data.shape[k:]})"
    w.body.append(f"    {y}u = {flat}")
    w.body.append(f"    for r in range({len(rows)}):")
    w.body += _copy(data.shape[k:], y, lambda c: [f"{at}[r, {j}]" for j in range(k)] + c,
                    f"{y}u", lambda c: ["r"] + c, depth=2)
    return True


def _windowed(w, node, x, call):
    """The node's output from ``call``, the text of a call of a loop over
    2-D windows (``x`` seen in 2-D: ``_as_2d``), in the output's own rank."""
    if x.ndim == 3:
        flat = w.made()
        w.body.append(f"    {flat} = {call}")
        call = f"{flat}.reshape({w.env[node.outputs[0]].shape})"
    w.body.append(f"    {w.made(node.outputs[0])} = {call}")
    return True


def _matmul(w, node):
    x, b, out = (w.env[n] for n in (*node.inputs[:2], node.outputs[0]))
    if b.ndim != 2 or x.ndim < 2 or x.dtype != b.dtype:
        return False
    rows = int(np.prod(x.shape[:-1]))
    src, right, y = w.ref(node.inputs[0]), w.ref(node.inputs[1]), w.made(node.outputs[0])
    board = w.product_board(rows * b.size)
    w.body += [f"    {y} = product(np.ascontiguousarray({src}).reshape(({rows}, {x.shape[-1]})), "
               f"np.ascontiguousarray({right}).reshape((1,) + {b.shape}), {board})",
               f"    {y} = {y}.reshape({out.shape})"]
    return True


def _gemm(w, node):
    """Gemm of 2-D values: ``alpha * A' @ B'`` on the chosen BLAS (B' laid
    out once where the key fixes it), then ``beta * C`` added, broadcast."""
    a, b, out = (w.env[n] for n in (*node.inputs[:2], node.outputs[0]))
    c = w.env[node.inputs[2]] if len(node.inputs) > 2 and node.inputs[2] else None
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    trans_a, trans_b = node.attrs.get("transA", 0), node.attrs.get("transB", 0)
    if (a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or out.dtype != a.dtype
            or c is not None and (type(c) is not np.ndarray or c.dtype != a.dtype or c.ndim > 2)
            or not (np.isfinite(alpha) and np.isfinite(beta))):
        return False
    rows, inner = a.shape[::-1] if trans_a else a.shape
    cols = out.shape[1]
    if known(w, node.inputs[1]) is not None:
        right = w.array(np.ascontiguousarray(b.T if trans_b else b).reshape(1, inner, cols))
    else:
        right = w.ref(node.inputs[1])
        right = permuted(right, (1, 0), b.shape) if trans_b else right
        right = f"np.ascontiguousarray({right}).reshape((1, {inner}, {cols}))"
    left = w.ref(node.inputs[0])
    left = permuted(left, (1, 0), a.shape) if trans_a else left
    y = w.made(node.outputs[0])
    w.body.append(f"    {y} = product(np.ascontiguousarray({left}), {right}, "
                  f"{w.product_board(rows * inner * cols)})")
    value = f"{y}[i, j] * {alpha!r}" if alpha != 1.0 else f"{y}[i, j]"
    if c is not None and beta != 0.0:  # (beta 0: C is not read, its NaN neither; onnxruntime's)
        at = [v if n != 1 else "0" for v, n in zip("ij"[2 - c.ndim:], c.shape)]
        term = f"{w.ref(node.inputs[2])}[{', '.join(at) or '()'}]"
        value += f" + {term} * {beta!r}" if beta != 1.0 else f" + {term}"
    if value != f"{y}[i, j]":
        w.body += [*nest([("i", rows), ("j", cols)]), f"            {y}[i, j] = {value}"]
    return True


def _split(w, node):
    """Split into parts the key fixes: each a view of the input, as a Slice's."""
    x = w.env[node.inputs[0]]
    axis = node.attrs.get("axis", 0)
    axis = axis + x.ndim if axis < 0 else axis
    if len(node.inputs) > 1 and node.inputs[1] and node.inputs[1] not in w.fixed:
        return False
    src, at = w.ref(node.inputs[0]), 0
    for name in node.outputs:
        part = w.env.get(name) if name else None
        if part is None:
            return False  # (a part nothing reads: its size is not known here)
        n = part.shape[axis]
        index = tuple(slice(at, at + n) if k == axis else slice(None) for k in range(x.ndim))
        if not np.array_equal(x[index], part, equal_nan=True):
            return False
        text = ", ".join(f"{at}:{at + n}" if k == axis else ":" for k in range(x.ndim))
        w.body.append(f"    {w.made(name)} = {src}[{text}]")
        w.same_order(name, node.inputs[0], [at if k == axis else 0 for k in range(x.ndim)])
        at += n
    return at == x.shape[axis]


def _reduce(w, node):
    x, out = w.env[node.inputs[0]], w.env[node.outputs[0]]
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        axes = known(w, node.inputs[1])
        if axes is None:
            return False
        axes = np.asarray(axes).tolist()
    if axes is None or len(axes) == 0:
        if node.attrs.get("noop_with_empty_axes"):
            return False
        axes = list(range(x.ndim))
    axes = sorted({a + x.ndim if a < 0 else a for a in axes})
    kept = [a for a in range(x.ndim) if a not in axes]
    inner = int(np.prod([x.shape[a] for a in axes]))
    if inner == 0:
        return False
    src = w.ref(node.inputs[0])
    moved = permuted(src, kept + axes, x.shape)
    w.body.append(f"    {w.made(node.outputs[0])} = reduce_rows(np.ascontiguousarray({moved}).reshape("
                  f"({x.size // inner}, {inner})), {node.op == 'ReduceMean'}).reshape({out.shape})")
    return True


def _recurrent(w, node):
    """A GRU, LSTM or RNN node of one direction or two: each direction's
    kernel called as its prepared call calls it, X's rows read by steps."""
    impl, ins = node.impl, node.inputs
    streaming = getattr(impl, "_streaming", None)
    if (streaming is None or impl.layout or impl.quantized or node.op not in LAYERS
            or len(ins) > 4 and ins[4] or len(ins) > 7 and ins[7]
            or any(n and n not in w.fixed for n in ins[1:4]) or impl.weights is None
            or any(n and w.env[n] is not kept for n, kept in zip(ins[1:4], impl.weights[:3]))):
        return False
    kernels, sizes = streaming[1], streaming[2]
    X, D = w.env[ins[0]], len(streaming[1])
    if X.ndim != 3 or any(X.dtype != kernel.dtype for kernel in kernels):
        return False
    T, B, I = X.shape
    if any(kernel.features != I or kernel._splits(np.empty((T * B, 0)), np.empty(B + 1))
           for kernel in kernels):
        return False
    H, dt = impl.layer.hidden_size, f"np.{X.dtype.name}"
    offsets = w.array(np.arange(0, (B + 1) * T, T, dtype=np.int64))
    data = w.made()  # (X's rows, read by every direction)
    w.body.append(f"    {data} = as_read_only(np.ascontiguousarray({w.ref(ins[0])}).reshape(({T * B}, {I})))")
    names = [ins[5 + s] if len(ins) > 5 + s else "" for s in range(len(sizes))]
    if any(n and (w.env[n].shape != (D, B, size) or w.env[n].dtype != X.dtype)
           for n, size in zip(names, sizes)):
        return False
    ys, lasts = [], []
    for d, kernel in enumerate(kernels):
        module = w.global_(lambda g, k=kernel: f"{g} = generated({k.program.module.__name__[15:]!r})")
        states = [f"as_read_only(np.ascontiguousarray({w.ref(n)}[{d}]))" if n
                  else f"as_read_only(np.zeros(({B}, {size}), {dt}))" for n, size in zip(names, sizes)]
        # a buffer for every final state the kernel writes, named by the node or not
        y, last = w.made(), [w.made() for _ in sizes]
        w.body.append(f"    {y} = np.empty(({T * B}, {H}), {dt})")
        w.body += [f"    {v} = np.empty(({B}, {size}), {dt})" for v, size in zip(last, sizes)]
        w.body.append(f"    {module}.program(*{w.array(tuple(kernel.const_args))}, "
                      f"{w.arg('board', (kernel, T * B, B))}, np.int64({B}), {data}, "
                      f"as_read_only({offsets}), {', '.join(states + [y] + last)})")
        if D > 1:  # (Y's rows by steps, seen as [T, B, H] to be copied into its direction)
            w.body.append(f"    {y}s = {y}.reshape(({T}, {B}, {H}))")
        ys.append(f"{y}s" if D > 1 else y)
        lasts.append(last)
    outputs = [(node.outputs[0], ys, 1, (T, D, B, H))] + [
        (name, [last[s] for last in lasts], 0, (D, B, size))
        for s, (name, size) in enumerate(zip(node.outputs[1:], sizes))]
    for name, parts, axis, shape in outputs:  # (each direction's on Y's second axis, a state's first)
        if not name:
            continue
        y = w.made(name)
        if D == 1:
            w.body.append(f"    {y} = {parts[0]}.reshape({shape})")
            continue
        w.body.append(f"    {y} = np.empty({shape}, {dt})")
        for d, part in enumerate(parts):
            w.body += _copy(shape[:axis] + shape[axis + 1:], y,
                            lambda c, d=d, axis=axis: [*c[:axis], str(d), *c[axis:]], part)
    return True


LOWER = {"Slice": _slice, "Transpose": _transpose, "Concat": _concat, "Identity": _alias,
          "If": _alias, "Cast": _cast, "Pad": _pad, "MaxPool": _max_pool,
          "ConvTranspose": _conv_transpose, "ScatterND": _scatter_nd, "Expand": _expand,
          "Conv": lambda w, node: _conv(w, node) or _conv_loops(w, node), "MatMul": _matmul,
          "ReduceMean": _reduce, "ReduceSum": _reduce, "Gather": _gather, "Gemm": _gemm,
          "Split": _split, "GRU": _recurrent, "LSTM": _recurrent, "RNN": _recurrent,
          **dict.fromkeys(RESHAPES, _reshape)}
