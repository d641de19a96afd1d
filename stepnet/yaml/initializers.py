"""Parameter initializers for YAML models: ``init: xavier`` and friends.

``fan_in`` is a weight's first dimension and ``fan_out`` its second, because
step-nets multiply rows by weights (``x @ W`` with ``W`` of shape ``[in, out]``).
Each parameter draws from its own generator, seeded by the model seed and the
parameter's name, so adding a parameter does not change the others.
"""

from __future__ import annotations

import zlib

import numpy as np

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

    def __init__(self, message, key=None):
        super().__init__(message)
        self.key = key


def generator(seed, name):
    """The generator for parameter ``name`` of a model seeded with ``seed``."""
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def initialize(kind, shape, dtype, options, rng):
    """An array of ``shape`` drawn by initializer ``kind`` with ``options``."""
    if kind not in INITIALIZERS:
        raise InitError(f"unknown initializer {kind!r}; expected one of {', '.join(INITIALIZERS)}")
    allowed = INITIALIZERS[kind]
    for key, value in options.items():
        if key not in allowed:
            takes = ", ".join(allowed) or "no options"
            raise InitError(f"initializer {kind!r} has no option {key!r} (it takes {takes})", key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InitError(f"option {key!r} of {kind!r} must be a number, got {value!r}", key)
    for key, default in allowed.items():
        if default is None and key not in options:
            raise InitError(f"initializer {kind!r} needs option {key!r}")
    fan_in = shape[0] if shape else 1
    fan_out = shape[1] if len(shape) > 1 else fan_in
    scale = 1.0 / np.sqrt(fan_in)
    if kind == "zeros":
        out = np.zeros(shape)
    elif kind == "ones":
        out = np.ones(shape)
    elif kind == "constant":
        out = np.full(shape, float(options["value"]))
    elif kind == "normal":
        out = rng.normal(options.get("mean", 0.0), options.get("std", scale), size=shape)
    elif kind == "uniform":
        low, high = options.get("low", -scale), options.get("high", scale)
        if not low < high:
            raise InitError(f"uniform needs low < high, got low={low}, high={high}",
                            "high" if "high" in options else "low")
        out = rng.uniform(low, high, size=shape)
    elif kind == "xavier":
        if len(shape) != 2:
            raise InitError(f"xavier needs a 2-D shape [fan_in, fan_out], got {list(shape)}")
        limit = options.get("gain", 1.0) * np.sqrt(6.0 / (fan_in + fan_out))
        out = rng.uniform(-limit, limit, size=shape)
    else:  # orthogonal
        if len(shape) != 2:
            raise InitError(f"orthogonal needs a 2-D shape, got {list(shape)}")
        rows, cols = shape
        a = rng.standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))  # a uniformly distributed orthogonal matrix
        out = options.get("gain", 1.0) * (q if rows >= cols else q.T)
    return np.ascontiguousarray(out, dtype=dtype)
