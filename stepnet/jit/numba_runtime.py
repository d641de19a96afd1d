"""Scalar helpers the generated Numba code calls (inlined into its loops).

libm calls do not vectorize in Numba, so the float32 activations are written
out as polynomials and rationals that LLVM turns into SIMD code (every helper
is compiled with ``fastmath={"contract"}`` so multiply-adds become FMAs, and
nothing else is relaxed):

- ``tanh32``: Eigen's 13/6-degree odd rational tanh (``ptanh_float``) for
  |x| <= 7.905, +-1 beyond (tanh is within 2.7e-7 of +-1 there), and x
  itself where |x| < 4e-4.
- ``sigmoid32``: ``1 / (1 + exp32(-x))``, accurate in both tails.
  ``_exp32`` is Cephes' ``expf``: n = round(x / ln 2) by the 1.5 * 2**23
  trick, r = x - n * ln 2 with ln 2 split in a high and a low part, exp(r) by
  a degree-5 polynomial, times 2**n built from the float's exponent bits. Its
  argument is clamped to [-86.5, 88.8]: above, the result is +inf as it should
  be; below, exp32 is too large but 1 + exp32(-x) is 1 all the same.

Measured maximum relative error against float64, over all 2.24e9 float32 in
[-100, 100] whose exact result is a normal float32: tanh32 2.9e-7 (at
x = 5.126), sigmoid32 1.5e-7 (at x = -16.636); tests/test_numerics.py holds
both to 1e-6 through a compiled step-net.

float64 uses libm: ``np.tanh``, and sigmoid as ``1 / (1 + np.exp(-x))``
(a few ulp, in both tails). softplus uses libm in both precisions.

Every helper gives NaN for NaN and NumPy's float results for +-inf, by
construction: comparisons are written so that a NaN fails them and takes the
branch that carries it (``max``/``min`` of floats drop NaN in Numba and on
GPUs, so none is used here).
"""

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)


_F = np.float32
_ONE32 = _F(1.0)
_TWO32 = _F(2.0)
# multiply-adds may become FMAs (one rounding instead of two); nothing else
_FASTMATH = {"contract"}

# tanh32: Eigen's rational approximation
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

# _exp32: Cephes expf, its polynomial scaled by 2 (exact) so that the scale
# is 2**(n-1), finite for every n the clamp allows (-125 <= n <= 128)
_EXP_LO = _F(-86.5)
_EXP_HI = _F(88.8)
_LOG2E = _F(1.44269504088896341)
# t = x * log2(e) + _ROUNDER rounds to n + 126 + 1.5 * 2**23: n is t - _ROUNDER,
# and t's low mantissa bits hold n + 126, the biased exponent of 2**(n-1)
_ROUNDER = _F(12582912.0 + 126.0)
_LN2_HI = _F(0.693359375)
_LN2_LO = _F(-2.12194440e-4)
_P5 = _F(2 * 1.9875691500e-4)
_P4 = _F(2 * 1.3981999507e-3)
_P3 = _F(2 * 8.3334519073e-3)
_P2 = _F(2 * 4.1665795894e-2)
_P1 = _F(2 * 1.6666665459e-1)
_P0 = _F(2 * 5.0000001201e-1)


@intrinsic
def _exponent_bits_to_float(typingctx, t):
    """The float32 whose bits are t's bits shifted left by 23: from
    t = _ROUNDER + n, 2**(n-1) (a bit cast, so it vectorizes)."""
    if t != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = llvm_ir.IntType(32)
        bits = builder.shl(builder.bitcast(args[0], i32), i32(23))
        return builder.bitcast(bits, llvm_ir.FloatType())

    return types.float32(types.float32), codegen


@njit(cache=True, fastmath=_FASTMATH)
def _exp32(x):
    """exp(x) for x in [-86.5, 88.72] (within 1 ulp, 8.3e-8 relative, on 5e6
    points); +inf above, exp(-86.5) below; NaN for NaN."""
    # a NaN fails both comparisons and stays NaN (NaN bits make a NaN product)
    x = x if not (x < _EXP_LO) else _EXP_LO
    x = x if not (x > _EXP_HI) else _EXP_HI
    t = x * _LOG2E + _ROUNDER
    n = t - _ROUNDER
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _P5 * r + _P4
    p = p * r + _P3
    p = p * r + _P2
    p = p * r + _P1
    p = p * r + _P0
    p = p * (r * r) + (r + r) + _TWO32  # 2 * exp(r)
    return p * _exponent_bits_to_float(t)


@njit(cache=True, fastmath=_FASTMATH)
def tanh32(x):
    x2 = x * x
    p = x2 * _A13 + _A11
    p = x2 * p + _A9
    p = x2 * p + _A7
    p = x2 * p + _A5
    p = x2 * p + _A3
    p = x2 * p + _A1
    p = x * p
    q = x2 * _B6 + _B4
    q = x2 * q + _B2
    q = x2 * q + _B0
    r = p / q
    # saturated beyond the clamp (+-inf give +-1); a NaN fails both
    # comparisons and keeps its NaN r
    r = r if not (x > _CLAMP) else _ONE32
    r = r if not (x < -_CLAMP) else -_ONE32
    return x if (x < _TINY and x > -_TINY) else r


@njit(cache=True, fastmath=_FASTMATH)
def sigmoid32(x):
    # x -> -inf: exp32 is +inf and the result 0; x -> +inf: 1
    return _ONE32 / (_ONE32 + _exp32(-x))


@njit(cache=True)
def tanh64(x):
    return np.tanh(x)


@njit(cache=True)
def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x))


@njit(cache=True)
def relu(x):
    # not (x <= 0): a NaN stays NaN, and -inf gives 0 (x - x would be NaN)
    return x if not (x <= 0) else type(x)(0)


@njit(cache=True)
def softplus64(x):
    return np.log1p(np.exp(-abs(x))) + relu(x)


@njit(cache=True)
def softplus32(x):
    return np.log1p(np.exp(-abs(x))) + relu(x)


@njit(cache=True)
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


@njit(cache=True)
def rows_by_steps(starts, lengths, row_step, rows):
    """``starts`` of a call whose data rows are by steps (step t of sequence
    b at row ``t * row_step + b``: ONNX's time-major X, padded past each
    length): each sequence's index; ``row_step`` must be the number of
    sequences and every step of every sequence within the ``rows`` of each
    array of rows (the inputs' and the all-steps outputs' fewest)."""
    n = lengths.shape[0]
    if row_step != n:
        raise ValueError("rows by steps: row_step is not the number of sequences")
    for b in range(n):
        if lengths[b] * row_step > rows:
            raise ValueError("rows by steps: a sequence has more steps than the rows hold")
        starts[b] = b


def _prefetch_intrinsic(write):
    """An intrinsic asking the cache for the line at an address (an
    integer): to read it, or (``write``) to write it. A prefetch never
    faults, whatever the address."""

    @intrinsic
    def prefetch(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            i8p, i32 = llvm_ir.IntType(8).as_pointer(), llvm_ir.IntType(32)
            hint = cgutils.get_or_insert_function(
                builder.module, llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32]),
                "llvm.prefetch.p0i8")
            # (rw, locality 3: keep in every level, 1: a data cache)
            builder.call(hint, [builder.inttoptr(args[0], i8p), i32(int(write)), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(address), codegen

    return prefetch


_prefetch_read = _prefetch_intrinsic(False)
_prefetch_write = _prefetch_intrinsic(True)
# the most of a row that ``prefetch_rows`` asks for
_PREFETCH_BYTES = 4096


@njit(cache=True, nogil=True)
def prefetch_rows(rows, reads, entries, k, n):
    """Ask the cache for row ``entries[k]`` of some per-token arrays where
    ``k < n``: ``rows`` [arrays, 2] holds each array's address and row
    stride, the first ``reads`` of them arrays the loop reads, the others
    arrays it writes (their lines asked for in the state a write needs).
    A step's loop over its sequences (``entries[b]``, b < ``nb``) asks for
    the next sequence's rows while it computes this one's. A sequence's
    rows lie a sequence apart from the others' (the LoD's order), so each
    step reads and writes one row in as many places as it has sequences
    and arrays: more than the cores' prefetchers follow. (A prefetch never
    faults: an empty array's address is asked for harmlessly.)"""
    if k < n:
        e = entries[k]
        for a in range(rows.shape[0]):
            start = rows[a, 0] + e * rows[a, 1]
            size = min(rows[a, 1], _PREFETCH_BYTES)
            if a < reads:
                for offset in range(0, size, 64):
                    _prefetch_read(start + offset)
            else:
                for offset in range(0, size, 64):
                    _prefetch_write(start + offset)


@njit(cache=True)
def starts_and_lengths(offsets):
    """Each sequence's first entry and length, from one LoD level's offsets."""
    n = offsets.shape[0] - 1
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    for i in range(n):
        starts[i] = offsets[i]
        lengths[i] = offsets[i + 1] - offsets[i]
    return starts, lengths
