"""Parameter initializers for YAML models: ``init: xavier`` and friends.

``fan_in`` is a weight's first dimension and ``fan_out`` its second, because
step-nets multiply rows by weights (``x @ W`` with ``W`` of shape ``[in, out]``).
Each parameter draws from its own generator, seeded by the model seed and the
parameter's name, so adding a parameter does not change the others.
"""

from __future__ import annotations

import zlib

import numpy as np

from .. import sizes
from ..errors import SizeError

# name -> {option: default}; None = required
INITIALIZERS = {
    "zeros": {},
    "ones": {},
    "constant": {"value": None},
    "normal": {"mean": 0.0, "std": "1/sqrt(fan_in)"},
    "uniform": {"low": "-1/sqrt(fan_in)", "high": "1/sqrt(fan_in)"},
    "xavier": {"gain": 1.0},
    "orthogonal": {"gain": 1.0},
}


class InitError(Exception):
    """A bad initializer; the caller adds file, line and key (``key``: the
    option at fault, or None for the initializer itself)."""

    def __init__(self, message, key=None, size=False):
        super().__init__(message)
        self.key, self.size = key, size  # size: the array would not fit (sizes.check)


def generator(seed, name):
    """The generator for parameter ``name`` of a model seeded with ``seed``."""
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def initialize(kind, shape, dtype, options, rng, name=None):
    """An array of ``shape`` and ``dtype`` drawn by initializer ``kind`` with
    ``options`` (its size is checked by the caller first)."""
    if not isinstance(kind, str) or kind not in INITIALIZERS:
        raise InitError(f"unknown initializer {kind!r}; expected one of {', '.join(INITIALIZERS)}")
    allowed = INITIALIZERS[kind]
    for key, value in options.items():
        if key not in allowed:
            takes = ", ".join(allowed) or "no options"
            raise InitError(f"initializer {kind!r} has no option {key!r} (it takes {takes})", key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise InitError(f"option {key!r} of {kind!r} must be a finite number, got {value!r}", key)
    for key, default in allowed.items():
        if default is None and key not in options:
            raise InitError(f"initializer {kind!r} needs option {key!r}")
    try:
        sizes.check("parameter" if name is None else f"parameter {name!r}", shape, dtype)
    except SizeError as exc:
        raise InitError(str(exc), "shape", size=True) from None
    fan_in = shape[0] if shape else 1
    fan_out = shape[1] if len(shape) > 1 else fan_in
    scale = 1.0 / np.sqrt(fan_in)
    if kind == "zeros":
        return np.zeros(shape, dtype)
    if kind == "ones":
        return np.ones(shape, dtype)
    if kind == "constant":
        return np.full(shape, float(options["value"]), dtype)
    if kind == "normal":
        mean, std = options.get("mean", 0.0), options.get("std", scale)
        if std < 0:
            raise InitError(f"normal needs std >= 0, got std={std}", "std")
        return _drawn(lambda size: rng.normal(mean, std, size=size), shape, dtype)
    if kind == "uniform":
        low, high = options.get("low", -scale), options.get("high", scale)
        if not low < high:
            raise InitError(f"uniform needs low < high, got low={low}, high={high}",
                            "high" if "high" in options else "low")
        return _drawn(lambda size: rng.uniform(low, high, size=size), shape, dtype)
    if kind == "xavier":
        if len(shape) != 2:
            raise InitError(f"xavier needs a 2-D shape [fan_in, fan_out], got {list(shape)}")
        limit = options.get("gain", 1.0) * np.sqrt(6.0 / (fan_in + fan_out))
        return _drawn(lambda size: rng.uniform(-limit, limit, size=size), shape, dtype)
    if len(shape) != 2:  # orthogonal
        raise InitError(f"orthogonal needs a 2-D shape, got {list(shape)}")
    rows, cols = shape
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))  # a uniformly distributed orthogonal matrix
    return np.ascontiguousarray(options.get("gain", 1.0) * (q if rows >= cols else q.T), dtype)


def _drawn(draw, shape, dtype, block=1 << 20):
    """``draw(size)``'s float64 values as a new array of ``shape`` and
    ``dtype``, drawn ``block`` values at a time: the same values as one draw
    of the whole shape (a generator's draws follow one another), without a
    float64 array of the whole size beside a float32 one."""
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, block):
        flat[start:start + block] = draw(min(block, flat.size - start))
    return out
