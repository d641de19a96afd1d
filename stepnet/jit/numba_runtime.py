"""Scalar helpers the generated Numba code calls (inlined into its loops).

The float32 transcendentals are rational approximations that LLVM can
vectorize (libm calls do not vectorize in Numba). ``tanh32`` is Eigen's
13/6-degree rational tanh (``ptanh_float``); ``sigmoid32`` is
``0.5 + 0.5 * tanh32(0.5 * x)``. Measured maximum absolute error against
float64 over [-20, 20]: see tests/test_numba_backend.py (below 5e-7).
float64 uses libm (exact).
"""

import numpy as np
from numba import njit

from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)

# Cached on disk under STEPNET_CACHE_DIR, one folder per build (cache.py), so
# bounds-checked or deterministic builds never mix with the fast ones.
CACHE = True

_F = np.float32
_CLAMP = _F(7.90531110763549805)
_TINY = _F(0.0004)
_A1 = _F(4.89352455891786e-03)
_A3 = _F(6.37261928875436e-04)
_A5 = _F(1.48572235717979e-05)
_A7 = _F(5.12229709037114e-08)
_A9 = _F(-8.60467152213735e-11)
_A11 = _F(2.00018790482477e-13)
_A13 = _F(-2.76076847742355e-16)
_B0 = _F(4.89352518554385e-03)
_B2 = _F(2.26843463243900e-03)
_B4 = _F(1.18534705686654e-04)
_B6 = _F(1.19825839466702e-06)
_HALF32 = _F(0.5)
_ZERO32 = _F(0.0)
_ONE32 = _F(1.0)


@njit(cache=CACHE)
def tanh32(x):
    c = min(_CLAMP, x)
    c = max(-_CLAMP, c)
    x2 = c * c
    p = x2 * _A13 + _A11
    p = x2 * p + _A9
    p = x2 * p + _A7
    p = x2 * p + _A5
    p = x2 * p + _A3
    p = x2 * p + _A1
    p = c * p
    q = x2 * _B6 + _B4
    q = x2 * q + _B2
    q = x2 * q + _B0
    r = p / q
    return x if (x < _TINY and x > -_TINY) else r


@njit(cache=CACHE)
def sigmoid32(x):
    return _HALF32 + _HALF32 * tanh32(_HALF32 * x)


@njit(cache=CACHE)
def tanh64(x):
    return np.tanh(x)


@njit(cache=CACHE)
def sigmoid64(x):
    return 0.5 + 0.5 * np.tanh(0.5 * x)


@njit(cache=CACHE)
def softplus64(x):
    return np.log1p(np.exp(-abs(x))) + max(x, 0.0)


@njit(cache=CACHE)
def softplus32(x):
    return np.log1p(np.exp(-abs(x))) + (max(_ZERO32, x))


@njit(cache=CACHE)
def relu(x):
    return x if x > 0 else x - x


@njit(cache=CACHE)
def sort_by_length(seq_start, seq_len):
    """(order, sorted lengths, sorted starts): sequences longest first, ties in
    the caller's order (a stable counting sort; O(n + longest))."""
    n = seq_len.shape[0]
    longest = 0
    for i in range(n):
        longest = max(longest, seq_len[i])
    # first[l]: where the sequences of length l start in the sorted order
    first = np.zeros(longest + 2, np.int64)
    for i in range(n):
        first[seq_len[i]] += 1
    position = 0
    for length in range(longest, -1, -1):
        count = first[length]
        first[length] = position
        position += count
    order = np.empty(n, np.int64)
    for i in range(n):
        length = seq_len[i]
        order[first[length]] = i
        first[length] += 1
    slen = np.empty(n, np.int64)
    sstart = np.empty(n, np.int64)
    for b in range(n):
        slen[b] = seq_len[order[b]]
        sstart[b] = seq_start[order[b]]
    return order, slen, sstart


@njit(cache=CACHE)
def starts_and_lengths(offsets):
    """Each sequence's first entry and length, from one LoD level's offsets."""
    n = offsets.shape[0] - 1
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    for i in range(n):
        starts[i] = offsets[i]
        lengths[i] = offsets[i + 1] - offsets[i]
    return starts, lengths
