"""The GEMMs the Numba backend calls.

``STEPNET_BLAS`` picks one (default ``openblas``):

- ``openblas``: scipy's own OpenBLAS (``libscipy_openblas``), called through
  its CBLAS entry points. Each call runs single-threaded (OpenBLAS's
  thread-local thread count) and a product is split by columns, or by rows when
  it is taller than wide, over Numba's OpenMP threads: one thread pool for the
  GEMMs and the fused ``prange`` loops, so no two pools spin against each other.
  OpenBLAS picks its kernels for the CPU (512-bit ones on AVX-512 machines)
  unless ``OPENBLAS_CORETYPE`` names a core; stepnet never overrides it.
- ``mkl``: MKL from the ``mkl`` wheel; the recurrent weights are packed once
  per call (``cblas_?gemm_pack``) and every step runs ``cblas_?gemm_compute``
  on the packed copy, as oneDNN's RNN does, on MKL's GNU-OpenMP threading layer.
- ``numpy``: ``np.dot`` inside the kernels (also the fallback when scipy's
  OpenBLAS library cannot be found); fused loops then stay serial.

Measured on a 2-core AMD Zen 5 (AVX-512), float32, per-step GEMM
64x256 @ 256x768 / hoisted 6400x128 @ 128x768, best of 30: ``openblas``
76 us / 3.0 ms (with ``OPENBLAS_CORETYPE=Haswell``: 136 us / 5.8 ms), ``mkl``
packed 154 us / 8.7 ms.

Small products (a shrinking batch near the end of its sequences, a batch of
one) spend more time in dispatch than in arithmetic: at or below
``SMALL_GEMM_WORK`` multiply-adds a step runs ``small_gemm``, a Numba loop over
the transposed weights (row dot products, four rows at a time), measured 1.6-2x
faster than MKL's packed GEMM there.

``BLAS_NAME`` says which one is in use; it is part of the generated source,
so kernels cached on disk never mix them.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir as llvm_ir
from numba import config as numba_config
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)


_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162


def _use_openmp():
    """Numba's parallel loops on OpenMP, the runtime MKL's GNU threading layer
    uses too, unless the user chose a threading layer. (Numba would take TBB
    first when the ``tbb`` wheel, which ``mkl`` depends on, is installed: two
    thread pools then spin against each other on every time step.)"""
    if not (os.environ.get("NUMBA_THREADING_LAYER")
            or os.environ.get("NUMBA_THREADING_LAYER_PRIORITY")):
        numba_config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


_use_openmp()
_GNU_THREADING = 3  # MKL_THREADING_GNU (0 Intel, 1 sequential, 2 PGI, 3 GNU, 4 TBB)


def _find_mkl():
    if os.environ.get("STEPNET_BLAS", "").lower() == "openblas":
        return None
    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    for root in roots:
        for name in ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"):
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                try:
                    lib = ctypes.CDLL(path)
                    llvm_binding.load_library_permanently(path)
                except (OSError, RuntimeError):
                    continue
                return lib
    return None


def _find_scipy_openblas():
    """scipy's bundled OpenBLAS, loaded for Numba to call by symbol name."""
    import scipy

    pattern = os.path.join(os.path.dirname(scipy.__file__), os.pardir, "scipy.libs",
                           "libscipy_openblas*.so*")
    for path in sorted(glob.glob(pattern)):
        try:
            lib = ctypes.CDLL(path)
            if not all(hasattr(lib, name) for name in
                       ("scipy_cblas_sgemm", "scipy_cblas_dgemm", "openblas_set_num_threads_local")):
                continue
            llvm_binding.load_library_permanently(path)
        except (OSError, RuntimeError):
            continue
        return lib
    return None


def _extern(symbol, argspec, returns_size=False, returns_int=False):
    """An njit-callable ``f((arg, ...))`` calling the C function ``symbol`` by
    name. ``argspec`` has one letter per argument: i (int32), z (size_t),
    p (pointer, given as an integer address), f (float), d (double). The symbol is
    resolved at link time, so kernels calling it can be cached on disk."""

    @intrinsic
    def call(typingctx, args):
        if not isinstance(args, types.BaseTuple) or len(args) != len(argspec):
            return None
        restype = types.uint64 if returns_size else types.int32 if returns_int else types.none
        sig = restype(args)

        def codegen(context, builder, signature, llargs):
            i32, i64 = llvm_ir.IntType(32), llvm_ir.IntType(64)
            lltypes = {"i": i32, "z": i64, "p": llvm_ir.IntType(8).as_pointer(),
                       "f": llvm_ir.FloatType(), "d": llvm_ir.DoubleType()}
            llret = i64 if returns_size else i32 if returns_int else llvm_ir.VoidType()
            fnty = llvm_ir.FunctionType(llret, [lltypes[c] for c in argspec])
            fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)
            values = []
            for index, code in enumerate(argspec):
                value = builder.extract_value(llargs[0], index)
                argtype = signature.args[0][index]
                if code in "iz":
                    value = context.cast(builder, value, argtype,
                                         types.int32 if code == "i" else types.int64)
                elif code == "p":
                    value = builder.inttoptr(value, lltypes["p"])
                else:
                    value = context.cast(builder, value, argtype,
                                         types.float32 if code == "f" else types.float64)
                values.append(value)
            result = builder.call(fn, values)
            return result if returns_size or returns_int else context.get_dummy_value()

        return sig, codegen

    return call


# STEPNET_DETERMINISTIC=1: every product runs small_gemm without reassociation,
# so each row's result is a fixed sequential sum, whatever the other rows of the
# batch (a distributed run equals a single-process one bit for bit). Slower.
DETERMINISTIC = os.environ.get("STEPNET_DETERMINISTIC", "").strip() not in ("", "0")
SMALL_GEMM_WORK = (1 << 62) if DETERMINISTIC else 2_000_000  # m*k*n at or below: small_gemm
_SMALL_GEMM_FASTMATH = False if DETERMINISTIC else {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, error_model="numpy", fastmath=_SMALL_GEMM_FASTMATH)
def small_gemm(a, bt, out):
    """out[:m] = a[:m] @ bt.T, ``bt`` the C-contiguous transposed weights."""
    m = a.shape[0]
    n, k = bt.shape
    zero = out.dtype.type(0)
    i = 0
    while i + 4 <= m:
        for j in range(n):
            s0 = s1 = s2 = s3 = zero
            for kk in range(k):
                w = bt[j, kk]
                s0 += a[i, kk] * w
                s1 += a[i + 1, kk] * w
                s2 += a[i + 2, kk] * w
                s3 += a[i + 3, kk] * w
            out[i, j] = s0
            out[i + 1, j] = s1
            out[i + 2, j] = s2
            out[i + 3, j] = s3
        i += 4
    while i < m:
        for j in range(n):
            s = zero
            for kk in range(k):
                s += a[i, kk] * bt[j, kk]
            out[i, j] = s
        i += 1

_CHOICES = ("openblas", "mkl", "numpy")
_choice = os.environ.get("STEPNET_BLAS", "openblas").strip().lower() or "openblas"
if _choice not in _CHOICES:
    from ..errors import UnsupportedError

    raise UnsupportedError(f"STEPNET_BLAS={_choice!r}: expected one of {', '.join(_CHOICES)}")
_mkl = _find_mkl() if _choice == "mkl" else None
_openblas = _find_scipy_openblas() if _choice == "openblas" else None
if _mkl is not None:
    BLAS_NAME = "mkl"
elif _openblas is not None:
    BLAS_NAME = "openblas"
else:
    BLAS_NAME = "numpy"

if _openblas is not None:
    _sgemm = _extern("scipy_cblas_sgemm", "iiiiiifpipifpi")
    _dgemm = _extern("scipy_cblas_dgemm", "iiiiiidpipidpi")
    _set_threads_local = _extern("openblas_set_num_threads_local", "i", returns_int=True)
    # blocks per product: Numba's thread count (a constant, so kernels stay
    # cacheable on disk; NUMBA_NUM_THREADS changes it)
    _THREADS = max(1, int(numba_config.NUMBA_NUM_THREADS))

    @njit(cache=True)
    def _single_threaded(size, args):
        """One CBLAS ?gemm call (``size``: 4 for sgemm, 8 for dgemm) on the
        calling thread: OpenBLAS's thread-local count is 1 during the call."""
        previous = _set_threads_local((1,))
        if size == 4:
            _sgemm(args)
        else:
            _dgemm(args)
        _set_threads_local((previous,))

    @njit(cache=True)
    def _block(a, b, out, i0, i1, j0, j1):
        """out[i0:i1, j0:j1] = a[i0:i1] @ b[:, j0:j1] on the calling thread."""
        k, n = b.shape
        size = a.itemsize
        _single_threaded(size, (_ROW_MAJOR, _NO_TRANS, _NO_TRANS, i1 - i0, j1 - j0, k, 1.0,
                                a.ctypes.data + size * i0 * k, k, b.ctypes.data + size * j0,
                                n, 0.0, out.ctypes.data + size * (i0 * n + j0), n))

    @njit(cache=True, parallel=True)
    def _split(a, b, out):
        """out[:m] = a[:m] @ b, one block per Numba thread: column blocks (16
        wide, a cache line of float32) or, for a tall product, row blocks."""
        m, k = a.shape
        n = b.shape[1]
        if m == 0:
            return
        threads = _THREADS
        if threads == 1 or m * k * n <= SMALL_GEMM_WORK:
            _block(a, b, out, 0, m, 0, n)
        elif n >= m:
            for t in prange(threads):
                j0 = (n * t // threads) // 16 * 16
                j1 = n if t == threads - 1 else (n * (t + 1) // threads) // 16 * 16
                if j1 > j0:
                    _block(a, b, out, 0, m, j0, j1)
        else:
            for t in prange(threads):
                _block(a, b, out, m * t // threads, m * (t + 1) // threads, 0, n)

    @njit(cache=True)
    def _gemm_packed_split(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack32(b, ...)`` (or pack64)."""
        if a.shape[0] * k * n <= SMALL_GEMM_WORK:
            small_gemm(a, prepared[1], out)
        else:
            _split(a, prepared[0], out)

    @njit(cache=True)
    def _pack(b, max_rows):
        """The weights themselves (OpenBLAS packs per call) and their
        transposed copy for ``small_gemm``."""
        return b, np.ascontiguousarray(b.T)

    @njit(cache=True)
    def _block_tn(a, b, out, j0, j1):
        """out[:, j0:j1] = a.T @ b[:, j0:j1] on the calling thread (a is [k, m])."""
        k, m = a.shape
        n = b.shape[1]
        size = a.itemsize
        _single_threaded(size, (_ROW_MAJOR, _TRANS, _NO_TRANS, m, j1 - j0, k, 1.0,
                                a.ctypes.data, m, b.ctypes.data + size * j0, n, 0.0,
                                out.ctypes.data + size * j0, n))

    @njit(cache=True, parallel=True)
    def _transposed_split(a, b, out):
        """out = a.T @ b, column blocks over Numba's threads (weight gradients:
        a long reduction over every token)."""
        n = b.shape[1]
        threads = _THREADS
        if threads == 1 or n < 32:
            _block_tn(a, b, out, 0, n)
        else:
            for t in prange(threads):
                j0 = (n * t // threads) // 16 * 16
                j1 = n if t == threads - 1 else (n * (t + 1) // threads) // 16 * 16
                if j1 > j0:
                    _block_tn(a, b, out, j0, j1)

    gemm32 = gemm64 = _split
    pack32 = pack64 = _pack
    gemm_packed32 = gemm_packed64 = _gemm_packed_split

elif _mkl is not None:
    _mkl.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
    _mkl.MKL_Set_Threading_Layer(_GNU_THREADING)
    _sgemm = _extern("cblas_sgemm", "iiiiiifpipifpi")
    _dgemm = _extern("cblas_dgemm", "iiiiiidpipidpi")
    _s_pack_size = _extern("cblas_sgemm_pack_get_size", "iiii", returns_size=True)
    _d_pack_size = _extern("cblas_dgemm_pack_get_size", "iiii", returns_size=True)
    _s_pack = _extern("cblas_sgemm_pack", "iiiiiifpip")
    _d_pack = _extern("cblas_dgemm_pack", "iiiiiidpip")
    _s_compute = _extern("cblas_sgemm_compute", "iiiiiipipifpi")
    _d_compute = _extern("cblas_dgemm_compute", "iiiiiipipidpi")

    @njit(cache=True)
    def _mkl_gemm(a, b, out):
        """out[:m] = a[:m] @ b for C-contiguous 2-D float32 or float64 arrays."""
        m, k = a.shape
        n = b.shape[1]
        if m > 0:
            args = (_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, k,
                    b.ctypes.data, n, 0.0, out.ctypes.data, n)
            if a.itemsize == 4:
                _sgemm(args)
            else:
                _dgemm(args)

    @njit(cache=True)
    def _mkl_pack(b, max_rows):
        """Weights ``b`` [k, n] prepared for ``gemm_packed32``/``64``: MKL's
        packed form and the transposed copy ``small_gemm`` reads."""
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
        return packed, np.ascontiguousarray(b.T)

    @njit(cache=True)
    def _mkl_gemm_packed(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack32(b, ...)`` (or pack64)."""
        m = a.shape[0]
        if m * k * n <= SMALL_GEMM_WORK:
            small_gemm(a, prepared[1], out)
            return
        args = (_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, a.ctypes.data, k,
                prepared[0].ctypes.data, n, 0.0, out.ctypes.data, n)
        if a.itemsize == 4:
            _s_compute(args)
        else:
            _d_compute(args)

    gemm32 = gemm64 = _mkl_gemm
    pack32 = pack64 = _mkl_pack
    gemm_packed32 = gemm_packed64 = _mkl_gemm_packed

else:

    @njit(cache=True)
    def _gemm(a, b, out):
        """out[:m] = a[:m] @ b for C-contiguous 2-D arrays."""
        if a.shape[0] > 0:
            np.dot(a, b, out)

    @njit(cache=True)
    def _pack(b, max_rows):
        """The weights themselves and their transposed copy for ``small_gemm``."""
        return b, np.ascontiguousarray(b.T)

    @njit(cache=True)
    def _gemm_packed(a, prepared, k, n, out):
        if a.shape[0] * k * n <= SMALL_GEMM_WORK:
            small_gemm(a, prepared[1], out)
        else:
            np.dot(a, prepared[0], out)

    gemm32 = gemm64 = _gemm
    pack32 = pack64 = _pack
    gemm_packed32 = gemm_packed64 = _gemm_packed


if DETERMINISTIC:
    @njit
    def _gemm_exact(a, b, out):
        """out[:m] = a[:m] @ b, every row a sequential sum (small_gemm)."""
        small_gemm(a, np.ascontiguousarray(b.T), out)

    @njit
    def _pack_exact(b, max_rows):
        return b, np.ascontiguousarray(b.T)

    @njit
    def _gemm_packed_exact(a, prepared, k, n, out):
        small_gemm(a, prepared[1], out)

    gemm32 = gemm64 = _gemm_exact
    pack32 = pack64 = _pack_exact
    gemm_packed32 = gemm_packed64 = _gemm_packed_exact


def transposed_product(a, b):
    """``a.T @ b`` for 2-D float arrays of one dtype, on the BLAS above (so on
    the same thread pool as the kernels); NumPy for anything else."""
    if a.dtype != b.dtype or a.dtype not in (np.float32, np.float64) or a.ndim != 2 \
            or b.ndim != 2:
        return a.T @ b
    out = np.empty((a.shape[1], b.shape[1]), a.dtype)
    if not out.size:
        return out
    if a.shape[0] == 0:
        out[...] = 0
    elif _openblas is not None:
        _transposed_split(np.ascontiguousarray(a), np.ascontiguousarray(b), out)
    else:
        at = np.ascontiguousarray(a.T)
        (gemm32 if a.dtype == np.float32 else gemm64)(at, np.ascontiguousarray(b), out)
    return out
