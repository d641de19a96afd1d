"""stepnet's own product loop (``_own_columns``), which :mod:`stepnet.jit.blas`
runs where it is measured faster than the library. It calls no library: its
compiled code is cached before the library is chosen, for every choice.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import llvmlite.binding as llvm_binding
import numpy as np
from numba import carray, njit
from numba.core import config as numba_config

from ..config import config
from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)
from .atomics import stack_buffer, wide_vectors

# LLVM's names of x86-64 CPUs, by the features stepnet's kernels choose by
# (their defaults, where ``NUMBA_CPU_FEATURES`` is set and ``NUMBA_CPU_NAME``
# names one)
_AVX512BW_CPUS = frozenset({
    "skylake-avx512", "skx", "cascadelake", "cooperlake", "cannonlake", "icelake-client",
    "icelake-server", "tigerlake", "rocketlake", "sapphirerapids", "emeraldrapids",
    "graniterapids", "graniterapids-d", "diamondrapids", "znver4", "znver5", "x86-64-v4"})
_CPUS = {
    "avx512f": _AVX512BW_CPUS | {"knl", "knm"},
    "avx512bw": _AVX512BW_CPUS,
    "avx512vnni": _AVX512BW_CPUS - {"skylake-avx512", "skx", "cannonlake", "x86-64-v4"},
    "avx512bf16": frozenset({"cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids",
                             "graniterapids-d", "diamondrapids", "znver4", "znver5"}),
    "avxvnni": frozenset({"alderlake", "raptorlake", "meteorlake", "arrowlake", "arrowlake-s",
                         "lunarlake", "pantherlake", "gracemont", "sierraforest", "grandridge",
                         "clearwaterforest"}),
}
# AMX's tiles (``amx-int8``: int8 products; ``amx-bf16``: bfloat16 ones)
_CPUS["amx-int8"] = _CPUS["amx-bf16"] = frozenset({
    "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "diamondrapids"})
_CPUS["avx2"] = _CPUS["avx512f"] | _CPUS["avxvnni"] | frozenset({
    "haswell", "broadwell", "skylake", "core-avx2", "bdver4", "znver1", "znver2", "znver3",
    "x86-64-v3"})


def compiled_features() -> frozenset:
    """Which of ``_CPUS``'s features the code Numba compiles has, as Numba
    sets them: the host's where ``NUMBA_CPU_FEATURES`` is not set
    (``NUMBA_CPU_NAME`` alone changes the tuning, not the instructions; no
    AVX with ``NUMBA_ENABLE_AVX=0``); else the defaults of the CPU that
    ``NUMBA_CPU_NAME`` names (the host's where it names none) changed by
    the features listed (``NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=``:
    code as for a Haswell); none off x86-64. AMX's only where this
    process may use its tiles (``_tiles_permitted``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    return frozenset(_features() - (set() if _tiles_permitted() else {"amx-int8", "amx-bf16"}))


def host_features() -> set:
    """Which of ``_CPUS``'s features the CPU offers, as LLVM sees it."""
    return {f for f in _llvm_host_features() if f in _CPUS}


@functools.cache
def _llvm_host_features() -> frozenset:
    # (asked once: the measurements' key reads them at each call of a product's limits)
    return frozenset(f for f, on in llvm_binding.get_host_cpu_features().items() if on)


def _features() -> set:
    """``compiled_features``, AMX's whether or not this process may use its tiles."""
    found = host_features()
    listed = numba_config.CPU_FEATURES
    if listed is None:
        return found if numba_config.ENABLE_AVX else set()
    name = numba_config.CPU_NAME
    if name and name != "host":
        found = {f for f, cpus in _CPUS.items() if name in cpus}
    for item in listed.split(","):
        item = item.strip()
        if item[1:] in _CPUS:
            (found.add if item[0] == "+" else found.discard)(item[1:])
    return found


@functools.cache
def _tiles_permitted() -> bool:
    """Whether this process may run AMX's tile instructions: Linux grants
    them to a process that asks (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``); without that, or on a CPU without AMX, the first
    one raises SIGILL. Asked once, for every thread; a forked child keeps it."""
    if platform.system() != "Linux" or not {"amx-int8", "amx-bf16"} & _features():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_ulong(18)) == 0
    except (OSError, AttributeError):
        return False


def vector_registers() -> tuple:
    """``(bytes, count)`` of the vector registers of the CPU that Numba
    compiles stepnet's kernels for (``compiled_features``): (64, 32) with
    AVX-512 (``avx512f``), else (32, 16), AVX2's (and, narrower, older
    x86-64's)."""
    return (64, 32) if "avx512f" in compiled_features() else (32, 16)


# STEPNET_DETERMINISTIC=1: every product runs small_gemm, each row's result a
# fixed sequential sum whatever the other rows (a distributed run equals one
# process's bit for bit); the loop sums in order, with FMAs except then
DETERMINISTIC = config.start_engine("deterministic")
_SMALL_GEMM_FASTMATH = False if DETERMINISTIC else {"contract"}
# the widest vectors the kernels are compiled for (``vector_registers``)
_AVX512 = vector_registers()[0] == 64
# the columns of one block of small_gemm's accumulators: two vectors of
# float32 a row (and four of float64: 6 rows of them fit AVX-512's 32
# registers, not AVX2's 16)
_COLS = 32 if _AVX512 else 16
_UCOLS = np.uint64(_COLS)
# the rows of a block of small_gemm's sums (from 6 rows on): 6 with AVX-512;
# with AVX2, 5 of float32: 10 vectors of sums cover the multiply-adds' latency
# times their two units where 4 rows' 8 do not, and 6 rows' 12 sums with
# their 6 values of a and 2 of the weights outgrow 16 registers (LLVM spills
# sums); 4 of float64 (4 vectors a row)
_BLOCK_ROWS = 6 if _AVX512 else 5
# small_gemm's buffer of sums: 6 blocks of _COLS (6 rows, or one row's 6 blocks)
_ACCUMULATORS = 6 * _COLS
# one row's sums in float32 at once where the weights are rows of b: 24
# vectors of 16 on AVX-512, 12 of 8 on AVX2 (with the weights' vector and
# the row's value, what the registers hold)
_WIDE_ACCUMULATORS = 384 if _AVX512 else 96
# rows of a panel of small_gemm's left operand that every block of weights'
# columns passes over before the next panel (192 x 256 floats: 192 KiB)
_PANEL_ROWS = 192


@njit(cache=True, nogil=True)
def small_gemm(a, b, out):
    """out[:m] = a[:m] @ b (``b`` [k, n] C-contiguous): ``small_gemm_columns``
    over every column."""
    small_gemm_columns(a, b, out, 0, b.shape[1])


@njit(cache=True, nogil=True)
def small_gemm_columns(a, b, out, lo, hi):
    """out[:m, lo:hi] = a[:m] @ b[:, lo:hi] (``b`` [k, n] C-contiguous) by
    stepnet's own loop (``_own_columns``) on ``b`` as it is."""
    _own_columns(a, b.reshape(b.size), b.shape[1], 0, out, lo, hi)


@njit(inline="always")
def _panel_count(n):
    """How many ``panels`` weights of ``n`` columns make (one at least)."""
    return max(1, (n + 31) // 32)


# bytes: a cache line, and a 512-bit vector
_ALIGN = 64


@njit(cache=True, nogil=True)
def aligned_empty(size, like):
    """A new 1-D array of ``size`` elements of ``like``'s dtype starting on a
    64-byte boundary (Numba aligns to 32 bytes: a 64-byte vector read
    across two cache lines takes two loads)."""
    extra = _ALIGN // like.itemsize
    buffer = np.empty(size + extra, like.dtype)
    start = (-buffer.ctypes.data) % _ALIGN // like.itemsize
    return buffer[start:start + size]


@njit(cache=True, nogil=True)
def panels(b):
    """Weights ``b`` [k, n] as stepnet's own loop reads them fastest: panels
    [P, k, 32] of 32 columns each, panel p holding columns 32p to 32p + 31,
    the last one the last 32 columns (overlapping the one before where 32
    does not divide n; one panel of under 32 columns padded with zeros),
    each contiguous and on a cache line: in ``b`` a block's rows are a row
    apart and fall into the same few sets of the first-level cache."""
    k, n = b.shape
    count = _panel_count(n)
    out = aligned_empty(count * k * 32, b).reshape((count, k, 32))
    fill_panels(b, out)
    return out


@njit(cache=True, nogil=True)
def fill_panels(b, out):
    """``out`` [P, k, 32] = the ``panels`` of ``b`` [k, n] (P of them)."""
    k, n = b.shape
    if n < 32:
        out[:] = 0
    for p in range(out.shape[0]):
        first = max(0, min(32 * p, n - 32))
        for kk in range(k):
            for jj in range(min(32, n)):
                out[p, kk, jj] = b[kk, first + jj]


@njit(inline="always")
def _block_start(j0, ld, panel, n):
    """Where the weights of the block of ``_COLS`` columns from column ``j0``
    start in the flat weights ``w`` of ``_own_columns``: ``b`` itself
    (``panel`` 0: row ``kk`` of the block at ``j0 + kk * ld``, ``ld`` = n),
    or its ``panels`` (``panel`` = 32 k, ``ld`` = 32; ``j0`` a multiple of
    ``_COLS`` or n - ``_COLS``): in the panel holding the block's last
    column, whose first column is 32 p (n - 32 for the last panel)."""
    if panel == 0:
        return j0
    p = min((j0 + _COLS - 1) // 32, _panel_count(n) - 1)
    return p * panel + j0 - max(0, min(32 * p, n - 32))


@njit(inline="always", error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _four_rows(a, w, ld, start, out, acc, i, j0):
    """out[i:i + 4, j0:j0 + _COLS] = a[i:i + 4] @ the block of weights at
    ``start`` (``_block_start``), summed in ``acc`` (registers) in order of
    k (inlined into its callers). ``_block_rows`` is the same loop written
    out for 5 or 6 rows: one helper over ``rows`` rows (a constant at each
    call) ran slower than the two written out, and far slower with its
    loop over the rows innermost."""
    zero = out.dtype.type(0)
    for jj in range(4 * _COLS):
        acc[jj] = zero
    for kk in range(a.shape[1]):
        x0, x1, x2, x3 = a[i, kk], a[i + 1, kk], a[i + 2, kk], a[i + 3, kk]
        row = np.uint64(start + kk * ld)
        for jj in range(_UCOLS):
            wk = w[row + jj]
            acc[jj] += x0 * wk
            acc[_COLS + jj] += x1 * wk
            acc[2 * _COLS + jj] += x2 * wk
            acc[3 * _COLS + jj] += x3 * wk
    for r in range(4):
        for jj in range(_UCOLS):
            out[i + r, j0 + jj] = acc[_COLS * r + jj]


@njit(inline="always", error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _block_rows(a, w, ld, start, out, acc, i, j0):
    """out[i:i + _BLOCK_ROWS, j0:j0 + _COLS] as ``_four_rows``: 6 rows with
    AVX-512, 5 with AVX2 (the sixth row's lines fold away)."""
    six = _BLOCK_ROWS == 6
    zero = out.dtype.type(0)
    for jj in range(_BLOCK_ROWS * _COLS):
        acc[jj] = zero
    for kk in range(a.shape[1]):
        x0, x1, x2 = a[i, kk], a[i + 1, kk], a[i + 2, kk]
        x3, x4 = a[i + 3, kk], a[i + 4, kk]
        x5 = a[i + 5, kk] if six else zero
        row = np.uint64(start + kk * ld)
        for jj in range(_UCOLS):
            wk = w[row + jj]
            acc[jj] += x0 * wk
            acc[_COLS + jj] += x1 * wk
            acc[2 * _COLS + jj] += x2 * wk
            acc[3 * _COLS + jj] += x3 * wk
            acc[4 * _COLS + jj] += x4 * wk
            if six:
                acc[5 * _COLS + jj] += x5 * wk
    for r in range(_BLOCK_ROWS):
        for jj in range(_UCOLS):
            out[i + r, j0 + jj] = acc[_COLS * r + jj]


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _columns_outer(a, w, ld, panel, out, lo, hi):
    """_own_columns for 6 rows or more: by panels of ``_PANEL_ROWS`` rows
    (kept in cache while the weights pass over them), each block of
    ``_COLS`` columns (the last one ending at ``hi``) in turn over the
    panel's rows in blocks of ``_BLOCK_ROWS``; with AVX-512, blocks of 6
    and of 4 where 6 would leave rows over (the 7 or 8 rows left, or 4 and
    fewer): 32 rows are 4 blocks of 6 and 2 of 4, where blocks of 6 alone
    would compute 36, rows thrown away (the mix runs faster than blocks of
    6 alone, and as fast as they do on rows that they fill; AVX2's blocks
    of 4 rows run at 0.8 of its blocks of 5: there rows computed twice cost
    no more). float64 with AVX2 goes by blocks of 4 (5 rows' 20 vectors of
    sums do not fit 16 registers). A block past the panel's last row ends at
    it instead: it writes the rows it shares with the one before again,
    with the same values."""
    wide_vectors()
    m, k = a.shape
    n = out.shape[1]
    acc = carray(stack_buffer(_ACCUMULATORS, out.dtype), _ACCUMULATORS)
    fours = not _AVX512 and out.itemsize == 8  # (float64 with AVX2: blocks of 4 only)
    for rows in range(0, m, _PANEL_ROWS):
        last = min(rows + _PANEL_ROWS, m)
        first = min(rows, last - 6)  # (a last panel of under 6 rows: in the one before)
        end = lo + _COLS
        while end < hi + _COLS:
            j0 = np.uint64(min(end, hi) - _COLS)
            start = _block_start(min(end, hi) - _COLS, ld, panel, n)
            i = first
            while i < last:
                left = last - i
                if fours or _AVX512 and (left <= 4 or left == 7 or left == 8):
                    i = min(i, last - 4)
                    _four_rows(a, w, ld, start, out, acc, i, j0)
                    i += 4
                    continue
                i = min(i, last - _BLOCK_ROWS)
                _block_rows(a, w, ld, start, out, acc, i, j0)
                i += _BLOCK_ROWS
            end += _COLS


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _one_row_wide(a, w, ld, out, i, j0):
    """out[i, j0:j0 + _WIDE_ACCUMULATORS] = a[i] @ the weights ``w`` (flat:
    ``b`` [k, n] C-contiguous, ``ld`` = n) at those columns, float32: the
    sums in registers over k, in order of k as every block of
    ``_own_columns`` (the same bits), the weights read as one stream a row.
    For a one-row product whose weights come from the second-level cache
    (W3's call, ``[1, 128] @ [128, 384]`` a step, weights of 192 KiB) it
    runs faster than reading the weights' ``panels`` six blocks at a time;
    twelve blocks of ``panels`` at a time ran no faster than six in the
    kernel."""
    wide_vectors()
    acc = carray(stack_buffer(_WIDE_ACCUMULATORS, out.dtype), _WIDE_ACCUMULATORS)
    zero = out.dtype.type(0)
    for jj in range(_WIDE_ACCUMULATORS):
        acc[jj] = zero
    for kk in range(a.shape[1]):
        x = a[i, kk]
        row = np.uint64(kk * ld) + j0
        for jj in range(np.uint64(_WIDE_ACCUMULATORS)):
            acc[jj] += x * w[row + jj]
    for jj in range(np.uint64(_WIDE_ACCUMULATORS)):
        out[i, j0 + jj] = acc[jj]


@njit(inline="always", error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _one_row_blocks(a, w, ld, panel, out, acc, i, end, hi, j0, j1, s0, s1):
    """Row ``i`` of ``out`` by blocks of ``_COLS`` columns from the block
    ending at ``end`` (``j0``, ``j1``: the first two blocks' columns, ``s0``,
    ``s1``: where their weights start) as ``_own_columns`` takes it: six
    blocks at a time where more than four are left, four where three or four
    are, else two. The end of the next block."""
    C = _COLS
    k = a.shape[1]
    n = out.shape[1]
    zero = out.dtype.type(0)
    if hi - end > 3 * C:  # more than four blocks left: six at a time
        j2 = np.uint64(min(end + 2 * C, hi) - C)
        j3 = np.uint64(min(end + 3 * C, hi) - C)
        j4 = np.uint64(min(end + 4 * C, hi) - C)
        j5 = np.uint64(min(end + 5 * C, hi) - C)
        s2 = _block_start(min(end + 2 * C, hi) - C, ld, panel, n)
        s3 = _block_start(min(end + 3 * C, hi) - C, ld, panel, n)
        s4 = _block_start(min(end + 4 * C, hi) - C, ld, panel, n)
        s5 = _block_start(min(end + 5 * C, hi) - C, ld, panel, n)
        for jj in range(6 * C):
            acc[jj] = zero
        for kk in range(k):
            x = a[i, kk]
            r0, r1 = np.uint64(s0 + kk * ld), np.uint64(s1 + kk * ld)
            r2, r3 = np.uint64(s2 + kk * ld), np.uint64(s3 + kk * ld)
            r4, r5 = np.uint64(s4 + kk * ld), np.uint64(s5 + kk * ld)
            for jj in range(_UCOLS):
                acc[jj] += x * w[r0 + jj]
                acc[C + jj] += x * w[r1 + jj]
                acc[2 * C + jj] += x * w[r2 + jj]
                acc[3 * C + jj] += x * w[r3 + jj]
                acc[4 * C + jj] += x * w[r4 + jj]
                acc[5 * C + jj] += x * w[r5 + jj]
        for jj in range(_UCOLS):
            out[i, j0 + jj] = acc[jj]
            out[i, j1 + jj] = acc[C + jj]
            out[i, j2 + jj] = acc[2 * C + jj]
            out[i, j3 + jj] = acc[3 * C + jj]
            out[i, j4 + jj] = acc[4 * C + jj]
            out[i, j5 + jj] = acc[5 * C + jj]
        return end + 6 * C
    if hi - end > C:  # three or four blocks left: four at a time
        j2 = np.uint64(min(end + 2 * C, hi) - C)
        j3 = np.uint64(min(end + 3 * C, hi) - C)
        s2 = _block_start(min(end + 2 * C, hi) - C, ld, panel, n)
        s3 = _block_start(min(end + 3 * C, hi) - C, ld, panel, n)
        for jj in range(4 * C):
            acc[jj] = zero
        for kk in range(k):
            x = a[i, kk]
            r0, r1 = np.uint64(s0 + kk * ld), np.uint64(s1 + kk * ld)
            r2, r3 = np.uint64(s2 + kk * ld), np.uint64(s3 + kk * ld)
            for jj in range(_UCOLS):
                acc[jj] += x * w[r0 + jj]
                acc[C + jj] += x * w[r1 + jj]
                acc[2 * C + jj] += x * w[r2 + jj]
                acc[3 * C + jj] += x * w[r3 + jj]
        for jj in range(_UCOLS):
            out[i, j0 + jj] = acc[jj]
            out[i, j1 + jj] = acc[C + jj]
            out[i, j2 + jj] = acc[2 * C + jj]
            out[i, j3 + jj] = acc[3 * C + jj]
        return end + 4 * C
    for jj in range(2 * C):
        acc[jj] = zero
    for kk in range(k):
        x = a[i, kk]
        r0, r1 = np.uint64(s0 + kk * ld), np.uint64(s1 + kk * ld)
        for jj in range(_UCOLS):
            acc[jj] += x * w[r0 + jj]
            acc[C + jj] += x * w[r1 + jj]
    for jj in range(_UCOLS):
        out[i, j0 + jj] = acc[jj]
        out[i, j1 + jj] = acc[C + jj]
    return end + 2 * C


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _own_columns(a, w, ld, panel, out, lo, hi):
    """out[:m, lo:hi] = a[:m] @ the weights ``w`` (flat: ``b`` [k, n]
    C-contiguous, ``ld`` = n, ``panel`` = 0; or its ``panels``, ``ld`` = 32,
    ``panel`` = 32 k, ``lo`` a multiple of 32 and ``hi`` one or n) as
    stepnet's own loop, in blocks sized to the vector registers (``_COLS``
    columns: two vectors of float32):
    a block of ``_BLOCK_ROWS`` rows x ``_COLS`` columns of ``out`` (under 6
    rows, 4 x ``_COLS``; then one row x ``_WIDE_ACCUMULATORS`` in float32 from the
    rows of ``b`` (``_one_row_wide``), or x 6 blocks where more than four
    are left, x 4, or x 2 where no more are: enough independent sums to
    keep the FMA units busy, and for one row enough streams of weights
    from the second-level cache: a one-row product runs markedly faster by
    six blocks than by four) is summed in registers over k, each
    weight row loaded once per block and every sum taken in order of k (so a
    row's values do not depend on the block it falls in, nor on the weights'
    layout, nor on the blocks' size); the last block of a row ends at column
    ``hi`` (it overlaps the one before, which it writes again with the same
    values), so neither do they depend on the range of columns asked for: a
    product split by columns over threads equals the whole. From 6 rows on,
    each block of columns is taken in turn over every row of a panel of rows
    (``_columns_outer``): its weights (k x ``_COLS``) stay in cache while
    the rows pass, and the weights are read once a panel (faster than MKL's
    product for tens of rows by weights of 256 x 768 or 256 x 1024, where
    measured).
    It needs no dispatch, and no packing but the ``panels`` of the weights of
    a call's per-step products (``pack``): where a product is small (a batch
    of one, the last sequences of a batch) it beats the libraries'
    (``small_rows_table``, measured)."""
    wide_vectors()
    m, k = a.shape
    n = out.shape[1]
    zero = out.dtype.type(0)
    acc = carray(stack_buffer(_ACCUMULATORS, out.dtype), _ACCUMULATORS)
    if hi - lo < _COLS:  # narrower than a block: one sum at a time
        for i in range(m):
            for j in range(lo, hi):
                s = zero
                for kk in range(k):
                    s += a[i, kk] * w[kk * ld + j]
                out[i, j] = s
        return
    if m >= 6:
        _columns_outer(a, w, ld, panel, out, lo, hi)
        return
    C = _COLS
    i = 0
    while i < m:
        rows = 4 if i + 4 <= m else 1
        end = lo + C
        while end < hi + C:
            # the block's columns (one row: two blocks), as unsigned integers:
            # Numba then adds no negative-index handling, and LLVM loads
            # rows, not gathers
            j0 = np.uint64(min(end, hi) - C)
            j1 = np.uint64(min(end + C, hi) - C)
            s0 = _block_start(min(end, hi) - C, ld, panel, n)
            s1 = _block_start(min(end + C, hi) - C, ld, panel, n)
            if rows == 4:
                _four_rows(a, w, ld, s0, out, acc, i, j0)
                end += C
            elif panel == 0 and out.itemsize == 4 and hi - end >= _WIDE_ACCUMULATORS - C:
                # (float32 rows of b, enough whole blocks left: side by side)
                _one_row_wide(a, w, ld, out, i, j0)
                end += _WIDE_ACCUMULATORS
            else:  # (one row, by blocks of columns)
                end = _one_row_blocks(a, w, ld, panel, out, acc, i, end, hi, j0, j1, s0, s1)
        i += rows
