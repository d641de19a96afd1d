"""The GEMMs the Numba backend calls: MKL (packed) when the ``mkl`` wheel is
installed, else ``np.dot`` (scipy's OpenBLAS).

The recurrent matmul runs once per time step with the same weights, so with
MKL the weights are packed once per call (``cblas_?gemm_pack``) and every step
runs ``cblas_?gemm_compute`` on the packed copy, as oneDNN's RNN does.
MKL runs on its GNU-OpenMP threading layer, the runtime Numba's ``prange``
uses too, so two thread pools never spin against each other.

Small products (a shrinking batch near the end of its sequences, a batch of
one) spend more time in MKL's or OpenBLAS's dispatch than in arithmetic: below
``SMALL_GEMM_WORK`` multiply-adds a step runs ``small_gemm``, a Numba loop over
the transposed weights (row dot products, four rows at a time), measured 1.6-2x
faster than MKL's packed GEMM there.

``BLAS_NAME`` says which one is in use; it is part of the generated source,
so kernels cached on disk never mix the two. ``STEPNET_BLAS=openblas`` forces
the fallback.
"""

from __future__ import annotations

import ctypes
import os
import sys

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

_ROW_MAJOR, _NO_TRANS, _PACKED, _B_MATRIX = 101, 111, 151, 162
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


def _extern(symbol, argspec, returns_size=False):
    """An njit-callable ``f((arg, ...))`` calling the C function ``symbol`` by
    name. ``argspec`` has one letter per argument: i (int32), z (size_t),
    p (pointer, given as an integer address), f (float), d (double). The symbol is
    resolved at link time, so kernels calling it can be cached on disk."""

    @intrinsic
    def call(typingctx, args):
        if not isinstance(args, types.BaseTuple) or len(args) != len(argspec):
            return None
        sig = (types.uint64 if returns_size else types.none)(args)

        def codegen(context, builder, signature, llargs):
            i32, i64 = llvm_ir.IntType(32), llvm_ir.IntType(64)
            lltypes = {"i": i32, "z": i64, "p": llvm_ir.IntType(8).as_pointer(),
                       "f": llvm_ir.FloatType(), "d": llvm_ir.DoubleType()}
            fnty = llvm_ir.FunctionType(i64 if returns_size else llvm_ir.VoidType(),
                                        [lltypes[c] for c in argspec])
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
            return result if returns_size else context.get_dummy_value()

        return sig, codegen

    return call


SMALL_GEMM_WORK = 2_000_000  # m * k * n at or below which small_gemm runs


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract", "nsz", "arcp"})
def small_gemm(a, bt, out):
    """out[:m] = a[:m] @ bt.T, ``bt`` the C-contiguous transposed weights."""
    m = a.shape[0]
    n, k = bt.shape
    zero = np.zeros(1, out.dtype)[0]
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

_mkl = _find_mkl()
BLAS_NAME = "mkl" if _mkl is not None else "openblas"

if _mkl is not None:
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
    def gemm32(a, b, out):
        """out[:m] = a[:m] @ b for C-contiguous 2-D float32 arrays."""
        m, k = a.shape
        n = b.shape[1]
        if m > 0:
            _sgemm((_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, k,
                    b.ctypes.data, n, 0.0, out.ctypes.data, n))

    @njit(cache=True)
    def gemm64(a, b, out):
        """out[:m] = a[:m] @ b for C-contiguous 2-D float64 arrays."""
        m, k = a.shape
        n = b.shape[1]
        if m > 0:
            _dgemm((_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, k,
                    b.ctypes.data, n, 0.0, out.ctypes.data, n))

    @njit(cache=True)
    def pack32(b, max_rows):
        """Float32 weights ``b`` [k, n] prepared for ``gemm_packed32``: MKL's
        packed form and the transposed copy ``small_gemm`` reads."""
        k, n = b.shape
        size = _s_pack_size((_B_MATRIX, max(max_rows, 1), n, k))
        packed = np.empty(size // 4 + 1, np.float32)
        _s_pack((_ROW_MAJOR, _B_MATRIX, _NO_TRANS, max(max_rows, 1), n, k, 1.0,
                 b.ctypes.data, n, packed.ctypes.data))
        return packed, np.ascontiguousarray(b.T)

    @njit(cache=True)
    def pack64(b, max_rows):
        """Float64 weights ``b`` [k, n] prepared for ``gemm_packed64``."""
        k, n = b.shape
        size = _d_pack_size((_B_MATRIX, max(max_rows, 1), n, k))
        packed = np.empty(size // 8 + 1, np.float64)
        _d_pack((_ROW_MAJOR, _B_MATRIX, _NO_TRANS, max(max_rows, 1), n, k, 1.0,
                 b.ctypes.data, n, packed.ctypes.data))
        return packed, np.ascontiguousarray(b.T)

    @njit(cache=True)
    def gemm_packed32(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack32(b, ...)``."""
        m = a.shape[0]
        if m * k * n <= SMALL_GEMM_WORK:
            small_gemm(a, prepared[1], out)
        else:
            _s_compute((_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, a.ctypes.data, k,
                        prepared[0].ctypes.data, n, 0.0, out.ctypes.data, n))

    @njit(cache=True)
    def gemm_packed64(a, prepared, k, n, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack64(b, ...)``."""
        m = a.shape[0]
        if m * k * n <= SMALL_GEMM_WORK:
            small_gemm(a, prepared[1], out)
        else:
            _d_compute((_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, a.ctypes.data, k,
                        prepared[0].ctypes.data, n, 0.0, out.ctypes.data, n))

else:

    @njit(cache=True)
    def _gemm(a, b, out):
        """out[:m] = a[:m] @ b for C-contiguous 2-D arrays."""
        if a.shape[0] > 0:
            np.dot(a, b, out)

    @njit(cache=True)
    def _pack(b, max_rows):
        """Without MKL the "packed" weights are the weights themselves (and
        their transposed copy for ``small_gemm``)."""
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
