"""Pad with NumPy, for whole arrays (graph level): constant, reflect and
edge padding, and negative pads, which crop.

``np.pad`` is slow on small arrays: reflect and edge padding join the
rows they repeat with one ``np.concatenate`` per axis instead. Wrap
padding, and pads given before opset 11 (as an attribute), run on the
reference; a reflection wider than its axis is refused, as onnxruntime
refuses it.
"""

from __future__ import annotations

import numpy as np

from .. import sizes
from .ops import UNKNOWN, _known_ints, binds, op


@op("Pad", ["mode"], in_step=False)
def _pad(ctx, x, pads=None, value=None, axes=None, mode="constant"):
    pad = _bind_pad(ctx, [x, pads, value, axes], mode=mode)
    return NotImplemented if pad is None else pad(x, pads, value, axes)


@binds("Pad")
def _bind_pad(ctx, known, mode="constant"):
    known = list(known) + [None] * (4 - len(known))
    pads, axes = _known_ints(known[1]), _known_ints(known[3])
    if (ctx.opset < 11 or UNKNOWN in (pads, axes) or pads is None
            or mode not in ("constant", "reflect", "edge")):
        return None
    n, crops = len(pads) // 2, min(pads, default=0) < 0
    plans = {}  # reflect and edge: input shape -> _pad_parts

    def widths_of(ndim):
        widths = [(0, 0)] * ndim
        for i, a in enumerate(range(ndim) if axes is None else axes):
            widths[a % ndim] = (pads[i], pads[i + n])
        return widths

    def pad(x, *rest):
        widths = widths_of(x.ndim)
        if not any(b or e for b, e in widths):  # (nothing to add: the input, not a copy)
            return x
        shape = tuple(d + b + e for d, (b, e) in zip(x.shape, widths))
        if min(shape, default=0) < 0:
            raise ctx.bad_input(f"pads {pads} crop more than the input's shape {list(x.shape)}")
        if crops:  # a negative pad crops: the input cut first, then padded
            x = x[tuple(slice(-min(b, 0), d + min(e, 0)) for d, (b, e) in zip(x.shape, widths))]
            widths = [(max(b, 0), max(e, 0)) for b, e in widths]
        sizes.check_large(f"ONNX node {ctx.node!r} (Pad): its output", shape, x.dtype)
        if mode != "constant":
            parts = plans.get(x.shape)
            if parts is None:
                if len(plans) > 64:
                    plans.clear()
                parts = plans[x.shape] = _pad_parts(x.shape, widths, mode)
            if parts is NotImplemented:
                raise ctx.bad_input(f"a {mode} pad of {widths} is wider than the input's shape "
                                    f"{list(x.shape)} allows")
            for a, before, after in parts:
                x = np.concatenate([x[before], x, x[after]], axis=a)
            return x
        fill = rest[1] if len(rest) > 1 and rest[1] is not None and np.size(rest[1]) else 0
        out = np.full(shape, np.asarray(fill).reshape(-1)[0], x.dtype)
        out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, widths))] = x
        return out

    return pad


def _pad_parts(shape, widths, mode):
    """Reflect or edge padding as ``[(axis, before, after)]``: per padded
    axis, the indices of the rows joined before and after the input.
    NotImplemented where a reflection is wider than its axis (or an edge has
    no row to repeat)."""
    parts = []
    for a, (b, e) in enumerate(widths):
        if not b and not e:
            continue
        n = shape[a]
        if mode == "reflect" and (b >= n or e >= n) or n == 0:
            return NotImplemented
        if mode == "reflect":
            stop = n - 2 - e if n - 2 - e >= 0 else None  # -1 would mean the last
            before, after = slice(b, 0, -1), slice(n - 2, stop, -1)
        else:  # edge: the first and the last row repeated
            before, after = [0] * b, [n - 1] * e
        parts.append((a, (slice(None),) * a + (before,), (slice(None),) * a + (after,)))
    return parts
