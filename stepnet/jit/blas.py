"""The GEMMs the Numba backend calls, every one on the calling thread.

The library is the machine's fastest that stepnet can reach (measured once
and cached; ``STEPNET_BLAS`` overrides; see :mod:`stepnet.jit.blas_choice`):

- ``mkl``: MKL's CBLAS on its sequential threading layer; the recurrent
  weights are packed once per call (``cblas_?gemm_pack``) and every step runs
  ``cblas_?gemm_compute`` on the packed copy, as oneDNN's RNN does.
- ``openblas``: scipy's ``cython_blas`` ``sgemm``/``dgemm``, with OpenBLAS's
  thread-local thread count set to one around each call.
- ``numpy``: ``np.dot`` (when neither is reachable).

Parallelism is not in the BLAS: the Numba backend runs groups of sequences on
stepnet's threads (:mod:`stepnet.jit.threads`), each calling these
single-threaded GEMMs, so no step waits on a barrier and no two thread pools
compete; ``transposed_product`` (weight gradients) splits its reduction over
the same threads.

Small products (a batch of one, the last few sequences of a batch) spend
more time in a library's dispatch, packing or generic kernels than in
arithmetic: there a step runs ``small_gemm``, stepnet's own loop (a block
of ``out`` summed in registers, the weights read in place, once per 4 rows).
Up to how many rows, for weights of each size, is measured once per machine
and library (``SMALL_PRODUCT_ROWS``; :func:`stepnet.jit.blas_choice.
small_product_rows`; ``STEPNET_SMALL_PRODUCTS`` overrides): on the AMD EPYC
of the README MKL's packed product takes a generic kernel for one row, and
stepnet's loop is faster up to dozens of rows while the weights fit in L2.

``BLAS_NAME`` says which one is in use; it and ``SMALL_PRODUCT_ROWS`` are part
of the generated source, so kernels cached on disk never mix them.
"""

from __future__ import annotations

import os
import time

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir as llvm_ir
from numba import carray, njit
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import threads
from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)
from .blas_choice import choose, find_mkl, find_openblas, small_product_rows

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_N, _T = 78, 84  # ord("N"), ord("T"): Fortran BLAS's "no transpose", "transpose"


def _extern(symbol, argspec, returns_size=False, returns_int=False):
    """An njit-callable ``f((arg, ...))`` calling the C function ``symbol`` by
    name. ``argspec`` has one letter per argument: i (int32), z (size_t),
    p (pointer, given as an integer address), f (float), d (double); a capital
    I, F, D or C (char) passes the value by reference (Fortran BLAS). The symbol
    is resolved at link time, so kernels calling it can be cached on disk."""

    @intrinsic
    def call(typingctx, args):
        if not isinstance(args, types.BaseTuple) or len(args) != len(argspec):
            return None
        restype = types.uint64 if returns_size else types.int32 if returns_int else types.none
        sig = restype(args)

        def codegen(context, builder, signature, llargs):
            i32, i64 = llvm_ir.IntType(32), llvm_ir.IntType(64)
            i8p = llvm_ir.IntType(8).as_pointer()
            lltypes = {"i": i32, "z": i64, "p": i8p, "f": llvm_ir.FloatType(),
                       "d": llvm_ir.DoubleType(), "c": llvm_ir.IntType(8)}
            lltypes.update({c.upper(): lltypes[c].as_pointer() for c in "ifdc"})
            llret = i64 if returns_size else i32 if returns_int else llvm_ir.VoidType()
            fnty = llvm_ir.FunctionType(llret, [lltypes[c] for c in argspec])
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            values = []
            casts = {"i": types.int32, "z": types.int64, "f": types.float32,
                     "d": types.float64, "c": types.int8}
            for index, code in enumerate(argspec):
                value = builder.extract_value(llargs[0], index)
                argtype = signature.args[0][index]
                if code == "p":
                    value = builder.inttoptr(value, lltypes["p"])
                else:
                    value = context.cast(builder, value, argtype, casts[code.lower()])
                    if code.isupper():
                        value = cgutils.alloca_once_value(builder, value)
                values.append(value)
            result = builder.call(fn, values)
            return result if returns_size or returns_int else context.get_dummy_value()

        return sig, codegen

    return call


# STEPNET_DETERMINISTIC=1: every product runs small_gemm without reassociation,
# so each row's result is a fixed sequential sum, whatever the other rows of the
# batch (a distributed run equals a single-process one bit for bit). Slower.
DETERMINISTIC = os.environ.get("STEPNET_DETERMINISTIC", "").strip() not in ("", "0")
# stepnet's own loop multiplies-adds in order, vectorized across columns: no
# reassociation is needed, only FMAs (none under STEPNET_DETERMINISTIC)
_SMALL_GEMM_FASTMATH = False if DETERMINISTIC else {"contract"}
# small_gemm's block of accumulators: 4 rows x 32 columns, or 1 row x 64
_ACCUMULATORS = 128


@intrinsic
def _stack_buffer(typingctx, size, dtype):
    """A pointer to ``size`` (a literal) elements of ``dtype`` on the stack:
    LLVM keeps such a block in registers across a loop that reads and writes
    only constant offsets of it."""
    if not isinstance(size, types.IntegerLiteral) or not isinstance(dtype, types.DType):
        return None
    count, element = size.literal_value, dtype.dtype

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(element), size=count)

    return types.CPointer(element)(size, dtype), codegen


@njit(inline="always", error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _sum_four_rows(a, b, acc, i, j0, width):
    """acc[32 r + jj] += sum over k of a[i + r, k] * b[k, j0 + jj], r < 4,
    jj < width (inlined into small_gemm: where width is the literal 32 the
    block stays in registers)."""
    for kk in range(b.shape[0]):
        x0, x1, x2, x3 = a[i, kk], a[i + 1, kk], a[i + 2, kk], a[i + 3, kk]
        for jj in range(width):
            w = b[kk, j0 + jj]
            acc[jj] += x0 * w
            acc[32 + jj] += x1 * w
            acc[64 + jj] += x2 * w
            acc[96 + jj] += x3 * w


@njit(inline="always", error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def _sum_one_row(a, b, acc, i, j0, width):
    """acc[jj] += sum over k of a[i, k] * b[k, j0 + jj], jj < width."""
    for kk in range(b.shape[0]):
        x = a[i, kk]
        for jj in range(width):
            acc[jj] += x * b[kk, j0 + jj]


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def small_gemm(a, b, out):
    """out[:m] = a[:m] @ b (``b`` [k, n] C-contiguous) as stepnet's own loop:
    a block of 4 rows x 32 columns (1 row x 64 for the last rows) of ``out``
    is summed in registers over k, each weight row loaded once per block and
    every sum taken in order of k. It needs no packing and no dispatch: where
    a product is small (a batch of one, the last sequences of a batch) it
    beats the libraries' (``SMALL_PRODUCT_ROWS``, measured)."""
    m = a.shape[0]
    n = b.shape[1]
    zero = out.dtype.type(0)
    acc = carray(_stack_buffer(_ACCUMULATORS, out.dtype), _ACCUMULATORS)
    i = 0
    while i + 4 <= m:
        j0 = 0  # (a while loop: LLVM then sees j0 >= 0, and loads rows, not gathers)
        while j0 < n:
            width = min(32, n - j0)
            for jj in range(128):
                acc[jj] = zero
            if width == 32:
                _sum_four_rows(a, b, acc, i, j0, 32)
            else:
                _sum_four_rows(a, b, acc, i, j0, width)
            for r in range(4):
                for jj in range(width):
                    out[i + r, j0 + jj] = acc[32 * r + jj]
            j0 += 32
        i += 4
    while i < m:
        j0 = 0
        while j0 < n:
            width = min(64, n - j0)
            for jj in range(64):
                acc[jj] = zero
            if width == 64:
                _sum_one_row(a, b, acc, i, j0, 64)
            else:
                _sum_one_row(a, b, acc, i, j0, width)
            for jj in range(width):
                out[i, j0 + jj] = acc[jj]
            j0 += 64
        i += 1


_choice = choose()
BLAS_NAME = _choice["name"]

if BLAS_NAME == "mkl":
    llvm_binding.load_library_permanently(find_mkl().path)
    _sgemm = _extern("cblas_sgemm", "iiiiiifpipifpi")
    _dgemm = _extern("cblas_dgemm", "iiiiiidpipidpi")
    _s_pack_size = _extern("cblas_sgemm_pack_get_size", "iiii", returns_size=True)
    _d_pack_size = _extern("cblas_dgemm_pack_get_size", "iiii", returns_size=True)
    _s_pack = _extern("cblas_sgemm_pack", "iiiiiifpip")
    _d_pack = _extern("cblas_dgemm_pack", "iiiiiidpip")
    _s_compute = _extern("cblas_sgemm_compute", "iiiiiipipifpi")
    _d_compute = _extern("cblas_dgemm_compute", "iiiiiipipidpi")

    _A, _A_T = _NO_TRANS, _TRANS  # CBLAS's codes for a and a.T

    @njit(cache=True, nogil=True)
    def _row_major_gemm(trans_a, m, n, k, a, lda, b, out, beta):
        """Row-major out [m, n] = op(a) @ b + beta * out (``b`` [k, n] rows of a
        C-contiguous array) on the calling thread."""
        args = (_ROW_MAJOR, trans_a, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, lda,
                b.ctypes.data, n, beta, out.ctypes.data, n)
        if a.itemsize == 4:
            _sgemm(args)
        else:
            _dgemm(args)

    @njit(cache=True)
    def pack(b, max_rows):
        """Weights ``b`` [k, n] prepared for ``gemm_packed``: MKL's packed form,
        and ``b`` itself for ``small_gemm``."""
        k, n = b.shape
        shape = (_B_MATRIX, max(max_rows, 1), n, k)
        size = _s_pack_size(shape) if b.itemsize == 4 else _d_pack_size(shape)
        packed = np.empty(size // b.itemsize + 1, b.dtype)
        args = (_ROW_MAJOR, _B_MATRIX, _NO_TRANS, max(max_rows, 1), n, k, 1.0,
                b.ctypes.data, n, packed.ctypes.data)
        if b.itemsize == 4:
            _s_pack(args)
        else:
            _d_pack(args)
        return packed, b

    @njit(cache=True)
    def _library_product(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack(b, ...)``: MKL's packed
        product."""
        m = a.shape[0]
        if m == 0:
            return
        args = (_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, a.ctypes.data, k,
                prepared[0].ctypes.data, n, 0.0, out.ctypes.data, n)
        if a.itemsize == 4:
            _s_compute(args)
        else:
            _d_compute(args)

elif BLAS_NAME == "openblas":
    _openblas = find_openblas()
    llvm_binding.add_symbol("stepnet_cython_sgemm", _openblas.sgemm)
    llvm_binding.add_symbol("stepnet_cython_dgemm", _openblas.dgemm)
    _sgemm = _extern("stepnet_cython_sgemm", "CCIIIFpIpIFpI")
    _dgemm = _extern("stepnet_cython_dgemm", "CCIIIDpIpIDpI")
    _THREAD_LOCAL = _openblas.set_threads_local is not None
    if _THREAD_LOCAL:
        llvm_binding.add_symbol("stepnet_openblas_threads_local", _openblas.set_threads_local)
        _set_threads_local = _extern("stepnet_openblas_threads_local", "i", returns_int=True)
    else:
        @njit(cache=True)
        def _set_threads_local(args):
            return 0

    _A, _A_T = _N, _T  # Fortran BLAS's codes for a and a.T

    @njit(cache=True, nogil=True)
    def _row_major_gemm(trans_a, m, n, k, a, lda, b, out, beta):
        """Row-major out [m, n] = op(a) @ b + beta * out on the calling thread:
        the column-major C^T = B^T op(A)^T."""
        previous = _set_threads_local((1,))
        args = (_N, trans_a, n, m, k, 1.0, b.ctypes.data, n, a.ctypes.data, lda, beta,
                out.ctypes.data, n)
        if a.itemsize == 4:
            _sgemm(args)
        else:
            _dgemm(args)
        _set_threads_local((previous,))

    @njit(cache=True)
    def pack(b, max_rows):
        """The weights themselves (OpenBLAS packs per call), for both."""
        return b, b

    @njit(cache=True)
    def _library_product(a, prepared, k, n, out):
        gemm(a, prepared[0], out)

else:

    _A, _A_T = 0, 1

    @njit(cache=True, nogil=True)
    def _row_major_gemm(trans_a, m, n, k, a, lda, b, out, beta):
        """out [m, n] = op(a) @ b + beta * out with NumPy's dot."""
        product = np.dot(a.T, b) if trans_a == _A_T else np.dot(a, b)
        if beta == 0.0:
            out[:m] = product
        else:
            out[:m] += product

    @njit(cache=True)
    def pack(b, max_rows):
        """The weights themselves, for both."""
        return b, b

    @njit(cache=True)
    def _library_product(a, prepared, k, n, out):
        np.dot(a, prepared[0], out)



@njit(cache=True)
def gemm(a, b, out):
    """out[:m] = a[:m] @ b for C-contiguous 2-D float32 or float64 arrays, on
    the calling thread."""
    m, k = a.shape
    if m > 0:
        _row_major_gemm(_A, m, b.shape[1], k, a, k, b, out, 0.0)


@njit(cache=True)
def gemm_acc(a, b, out):
    """out[:m] += a[:m] @ b (``a`` C-contiguous, ``b`` rows of a C-contiguous
    array), on the calling thread."""
    m, k = a.shape
    if m > 0:
        _row_major_gemm(_A, m, b.shape[1], k, a, k, b, out, 1.0)


@njit(cache=True, nogil=True)
def gemm_tn(a, b, out):
    """out = a.T @ b for C-contiguous 2-D a [k, m], b [k, n] of one dtype, on
    the calling thread."""
    k, m = a.shape
    n = b.shape[1]
    if m > 0 and n > 0:
        _row_major_gemm(_A_T, m, n, k, a, m, b, out, 0.0)


@njit(cache=True)
def rows_for(sizes, rows, size):
    """The small-product rows for weights of ``size`` elements: the entry of
    the next larger size measured (``sizes`` ascending), or of the largest."""
    index = len(sizes) - 1
    for i in range(len(sizes) - 1, -1, -1):
        if size <= sizes[i]:
            index = i
    return rows[index]


def _gemm_packed_with(limits):
    """``gemm_packed`` with the small-product limits as constants (closure
    variables: part of the key of Numba's disk cache). ``limits``: pairs
    (weight elements k * n, rows), by size."""
    sizes = tuple(size for size, _ in limits)
    rows = tuple(r for _, r in limits)

    @njit(cache=True)
    def gemm_packed(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack(b, ...)``: stepnet's own
        loop up to the rows measured for weights of this size, the library's
        product above."""
        if a.shape[0] <= rows_for(sizes, rows, k * n):
            small_gemm(a, prepared[1], out)
        else:
            _library_product(a, prepared, k, n, out)

    return gemm_packed


def _time_per_call(call, reps):
    call()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _time_small_and_library(m, k, n):
    """Seconds per product of ``small_gemm`` and of the library's, one thread."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), np.float32)
    b = rng.standard_normal((k, n), np.float32)
    out = np.empty((m, n), np.float32)
    prepared = pack(b, m)
    reps = max(4, min(400, 2_000_000 // (m * k * n)))
    return (_time_per_call(lambda: small_gemm(a, b, out), reps),
            _time_per_call(lambda: _library_product(a, prepared, k, n, out), reps))


if DETERMINISTIC:
    SMALL_PRODUCT_ROWS = ((1 << 62, 1 << 62),)

    @njit
    def gemm(a, b, out):
        """out[:m] = a[:m] @ b, every element a sequential sum (small_gemm)."""
        small_gemm(a, np.ascontiguousarray(b), out)

    @njit
    def pack(b, max_rows):
        return b, b

    @njit
    def gemm_packed(a, prepared, k, n, out):
        small_gemm(a, prepared[1], out)
else:
    SMALL_PRODUCT_ROWS = small_product_rows(_choice, _time_small_and_library)
    gemm_packed = _gemm_packed_with(SMALL_PRODUCT_ROWS)

# what a kernel's code depends on here (written into its generated source)
SIGNATURE = (f"{BLAS_NAME}" + (" (deterministic)" if DETERMINISTIC else "")
             + f", own loop up to (weights, rows) {SMALL_PRODUCT_ROWS}")


# a.T @ b over at least this many multiply-adds is split over threads
_SPLIT_TN_WORK = 1 << 22
# rows of b summed right after the product that read them, while they are in cache
_SUM_BLOCK = 1024


@njit(cache=True, nogil=True)
def _gemm_tn_column_sums(a, b, out, sums, block):
    """out = a.T @ b and sums = b.sum(0), ``block`` rows at a time: each
    block's column sums read it right after its product did."""
    k, m = a.shape
    n = b.shape[1]
    sums[:] = 0
    out[:] = 0
    for start in range(0, k, block):
        stop = min(start + block, k)
        if m > 0 and n > 0:
            _row_major_gemm(_A_T, m, n, stop - start, a[start:stop], m, b[start:stop], out, 1.0)
        for i in range(start, stop):
            for j in range(n):
                sums[j] += b[i, j]


def transposed_product(a, b, column_sums=False):
    """``a.T @ b`` (weight gradients: a long reduction over every token) on
    stepnet's threads, each reducing its share of the rows on the chosen BLAS;
    under ``STEPNET_DETERMINISTIC=1`` every element a sequential sum
    (``small_gemm``). With ``column_sums``, ``(a.T @ b, b.sum(0))``: the sums
    (a bias's gradient beside its weight's) read each block of ``b`` while the
    product has it in cache."""
    on_blas = a.dtype == b.dtype and a.dtype in (np.float32, np.float64) and a.ndim == b.ndim == 2
    if DETERMINISTIC or not on_blas:
        if on_blas:
            product = np.empty((a.shape[1], b.shape[1]), a.dtype)
            small_gemm(np.ascontiguousarray(a.T), np.ascontiguousarray(b), product)
        else:
            product = a.T @ b
        return (product, b.sum(0)) if column_sums else product
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    rows, m, n = a.shape[0], a.shape[1], b.shape[1]
    if rows == 0:
        product = np.zeros((m, n), a.dtype)
        return (product, np.zeros(n, b.dtype)) if column_sums else product
    parts = max(1, min(threads.count(), rows * m * n // _SPLIT_TN_WORK))
    cuts = [rows * i // parts for i in range(parts + 1)]

    def part(i):
        out = np.empty((m, n), a.dtype)
        if column_sums:
            sums = np.empty(n, b.dtype)
            _gemm_tn_column_sums(a[cuts[i]:cuts[i + 1]], b[cuts[i]:cuts[i + 1]], out, sums,
                                 _SUM_BLOCK)
            return out, sums
        gemm_tn(a[cuts[i]:cuts[i + 1]], b[cuts[i]:cuts[i + 1]], out)
        return out, None

    results = threads.run_each(part, range(parts))
    product, sums = results[0]
    for r, s in results[1:]:
        product += r
        if column_sums:
            sums += s
    return (product, sums) if column_sums else product
