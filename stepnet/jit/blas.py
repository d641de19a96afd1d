"""The GEMMs the Numba backend calls, each on the calling thread's core, or on
two cores with the helper thread (below).

The library is the machine's fastest that stepnet can reach (measured once
and cached; ``STEPNET_BLAS`` overrides; see :mod:`stepnet.jit.blas_choice`):

- ``mkl``: MKL's CBLAS on its sequential threading layer; the recurrent
  weights are packed once per call (``cblas_?gemm_pack``) where a step can
  have more rows than stepnet's own loop takes (below), and every such step
  runs ``cblas_?gemm_compute`` on the packed copy, as oneDNN's RNN does.
- ``openblas``: scipy's ``cython_blas`` ``sgemm``/``dgemm``, OpenBLAS's
  thread count held at one while any of them runs (``_openblas_calls``).
- ``numpy``: ``np.dot`` (when neither is reachable).

Parallelism is not in the BLAS (docs/internals.md, *The helper thread*):
these single-threaded GEMMs run on stepnet's threads, each group of
sequences on its own; a run of one sequence cuts each big enough product in
two at a place fixed by its shape, the helper computing the second part
(*products shared with the helper* below); ``taps_product`` does the same
for a convolution outside the kernels.

Small products (a batch of one, the last few sequences of a batch) spend
more time in a library's dispatch, packing or generic kernels than in
arithmetic: there a step runs stepnet's own loop (:mod:`stepnet.jit.own_loop`)
through a C entry compiled once (``register_small_gemm``). Up to how many
rows, for weights of each size, is measured once per machine, library and
dtype (:mod:`stepnet.jit.product_timing`; ``STEPNET_SMALL_PRODUCTS``
overrides): it differs widely between CPUs, and between float32 and float64
on one. A product outside the time loop takes the same limit
(``gemm_hoisted``).

``BLAS_NAME`` says which one is in use; it is part of the generated source,
so kernels cached on disk never mix them. The small-product rows are a
run-time argument of the kernels.
"""

from __future__ import annotations

import os
import threading

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir as llvm_ir
from numba import carray, cfunc, njit
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from ..config import config
from . import threads
from .atomics import compare_exchange, cycles, job_of, load_acquire, pause, pointer_to, \
    store_release, wide_vectors
from . import cache  # (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)
from .own_loop import DETERMINISTIC, _WIDE_ACCUMULATORS, _own_columns, \
    _panel_count, aligned_empty, panels, small_gemm
from .blas_choice import choose, find_mkl, find_openblas

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


def _symbol_address(symbol):
    """An njit-callable ``f()``: the address (an integer) of the data that
    ``llvm_binding.add_symbol`` gave the name ``symbol``, resolved at link
    time as ``_extern``'s functions are (kernels cached on disk find this
    process's)."""

    @intrinsic
    def address(typingctx):
        def codegen(context, builder, signature, llargs):
            i64 = llvm_ir.IntType(64)
            found = builder.module.globals.get(symbol)
            if found is None:  # (a declaration: no initializer)
                found = llvm_ir.GlobalVariable(builder.module, i64, symbol)
            return builder.ptrtoint(found, i64)

        return types.int64(), codegen

    return address


config.start_engine("blas")
_choice = choose()
BLAS_NAME = _choice["name"]
# the compiled helpers are compiled, and cached, per library (and it is
# written into every kernel's source: SIGNATURE)
cache.note_blas(BLAS_NAME)

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
        # (a leading dimension is at least 1, a width of 0 too: MKL refuses
        # the call otherwise and leaves ``out`` as it was)
        args = (_ROW_MAJOR, trans_a, _NO_TRANS, m, n, k, 1.0, a.ctypes.data, max(lda, 1),
                b.ctypes.data, max(n, 1), beta, out.ctypes.data, max(n, 1))
        if a.itemsize == 4:
            _sgemm(args)
        else:
            _dgemm(args)

    @njit(cache=True)
    def _library_pack(b, max_rows):
        """MKL's packed form of the weights ``b`` [k, n] (empty for no rows
        or no weights: ``gemm_packed`` then calls ``gemm``)."""
        k, n = b.shape
        if max_rows == 0 or k == 0 or n == 0:
            return np.empty(0, b.dtype)
        shape = (_B_MATRIX, max(max_rows, 1), n, k)
        size = _s_pack_size(shape) if b.itemsize == 4 else _d_pack_size(shape)
        packed = aligned_empty(size // b.itemsize + 1, b)  # (as mkl_malloc's)
        args = (_ROW_MAJOR, _B_MATRIX, _NO_TRANS, max(max_rows, 1), n, k, 1.0,
                b.ctypes.data, n, packed.ctypes.data)
        if b.itemsize == 4:
            _s_pack(args)
        else:
            _d_pack(args)
        return packed

    @njit(cache=True)
    def _library_product(a, prepared, out):
        """out[:m] = a[:m] @ b, with ``prepared = pack(b, ...)``: MKL's packed
        product."""
        k, n = prepared[1].shape
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
    _COUNT_SETTER = _openblas.set_threads_local is not None
    if _COUNT_SETTER:
        llvm_binding.add_symbol("stepnet_openblas_threads_local", _openblas.set_threads_local)
        _set_threads_local = _extern("stepnet_openblas_threads_local", "i", returns_int=True)
    else:
        @njit(cache=True)
        def _set_threads_local(args):
            return 0

    # OpenBLAS's thread count is the process's, whatever its setter's name
    # says (pthreads builds, scipy's among them), and a product on two of
    # its threads gives other bits than on one: it is one while any library
    # call of stepnet's runs, set by the first to start and given back by
    # the last to end. Each call setting it and giving it back let one
    # thread's product start after another had given back two.
    # [0]: the calls running (-1 while one sets or gives back), [1]: the count before
    _OPENBLAS_USERS = np.zeros(2, np.int64)
    llvm_binding.add_symbol("stepnet_openblas_users", _OPENBLAS_USERS.ctypes.data)
    # (a forked child has none of the parent's calls, nor one setting the count)
    os.register_at_fork(after_in_child=lambda: _OPENBLAS_USERS.fill(0))
    _openblas_users = _symbol_address("stepnet_openblas_users")

    @njit(inline="always")
    def _openblas_calls(users, step):
        """One more (``step`` 1) or one fewer (-1) of stepnet's library calls
        running: the first sets OpenBLAS's count to one, the last gives back the count before."""
        edge = 0 if step > 0 else 1
        while True:
            running = load_acquire(users, 0)
            if running > edge and compare_exchange(users, 0, running, running + step):
                return
            if running == edge and compare_exchange(users, 0, edge, -1):
                if step > 0:
                    users[1] = _set_threads_local((1,))
                else:
                    _set_threads_local((users[1],))
                store_release(users, 0, edge + step)
                return
            pause()

    _A, _A_T = _N, _T  # Fortran BLAS's codes for a and a.T

    @njit(cache=True, nogil=True)
    def _row_major_gemm(trans_a, m, n, k, a, lda, b, out, beta):
        """Row-major out [m, n] = op(a) @ b + beta * out on the calling thread
        (OpenBLAS on one thread: ``_openblas_calls``): the column-major
        C^T = B^T op(A)^T."""
        users = carray(pointer_to(_openblas_users(), np.int64), 2)
        _openblas_calls(users, 1)
        args = (_N, trans_a, n, m, k, 1.0, b.ctypes.data, max(n, 1), a.ctypes.data, max(lda, 1),
                beta, out.ctypes.data, max(n, 1))
        if a.itemsize == 4:
            _sgemm(args)
        else:
            _dgemm(args)
        _openblas_calls(users, -1)

    @njit(cache=True)
    def _library_pack(b, max_rows):
        return b  # OpenBLAS packs per call

    @njit(cache=True)
    def _library_product(a, prepared, out):
        gemm(a, prepared[0], out)

else:

    _A, _A_T = 0, 1

    @njit(cache=True, nogil=True)
    def _row_major_gemm(trans_a, m, n, k, a, lda, b, out, beta):
        """out [m, n] = op(a) @ b + beta * out with NumPy's dot."""
        product = np.dot(a.T, b) if trans_a == _A_T else np.dot(a, b)
        _store_rows(product, out, beta != 0.0)

    @njit(cache=True)
    def _library_pack(b, max_rows):
        return b

    @njit(cache=True)
    def _library_product(a, prepared, out):
        np.dot(a, prepared[0], out)



@njit(cache=True, nogil=True)
def _store_rows(part, out, add):
    """out[:m] = part (``add``: +=) for ``part`` [m, n], by loops: an array
    assignment compiles Numba's shape-mismatch error with its formatted
    message, which adds seconds to every cold compile of its caller."""
    for i in range(part.shape[0]):
        for j in range(part.shape[1]):
            out[i, j] = out[i, j] + part[i, j] if add else part[i, j]


@njit(cache=True, nogil=True)
def _library_gemm(a, b, out, beta):
    """out[:m] = a[:m] @ b + beta * out[:m] by the library (``a`` C-contiguous,
    ``b`` rows of a C-contiguous array), on the calling thread."""
    m, k = a.shape
    if m > 0:
        _row_major_gemm(_A, m, b.shape[1], k, a, k, b, out, beta)


@njit(cache=True)
def gemm(a, b, out):
    """out[:m] = a[:m] @ b for C-contiguous 2-D float32 or float64 arrays, on
    the calling thread."""
    _library_gemm(a, b, out, 0.0)


@njit(cache=True)
def gemm_acc(a, b, out):
    """out[:m] += a[:m] @ b (``a`` C-contiguous, ``b`` rows of a C-contiguous
    array), on the calling thread."""
    _library_gemm(a, b, out, 1.0)


@njit(cache=True, nogil=True)
def gemm_tn(a, b, out):
    """out = a.T @ b for C-contiguous 2-D a [k, m], b [k, n] of one dtype, on
    the calling thread."""
    k, m = a.shape
    n = b.shape[1]
    if m > 0 and n > 0:
        _row_major_gemm(_A_T, m, n, k, a, m, b, out, 0.0)


@njit(cache=True)
def _entry(small_rows, size):
    """The column of ``small_rows`` for weights of ``size`` elements: the
    next larger size measured, or the largest."""
    last = small_rows.shape[1] - 1
    index = last
    for i in range(last, -1, -1):
        if size <= small_rows[0, i]:
            index = i
    return index


@njit(cache=True)
def _part(small_rows, itemsize):
    """The first row of ``small_rows``' part for elements of ``itemsize``
    bytes: float64's (rows 3 to 5) where it has them, else float32's."""
    return 3 if itemsize == 8 and small_rows.shape[0] >= 6 else 0


@njit(cache=True)
def rows_for(small_rows, size, itemsize):
    """The rows up to which a product with weights of ``size`` elements of
    ``itemsize`` bytes runs ``small_gemm``: ``small_rows`` holds the weight
    sizes measured (ascending) over their rows (and whether the own loop
    shares them with the helper: ``shares_with_helper``), float64's below
    float32's where measured (``_part``); the entry of the next larger size
    measured is taken, or of the largest."""
    return small_rows[_part(small_rows, itemsize) + 1, _entry(small_rows, size)]


@njit(cache=True)
def shares_with_helper(small_rows, size, itemsize):
    """Whether stepnet's own loop cuts a product by weights of ``size``
    elements (of ``itemsize`` bytes: ``_part``) with the helper (where the
    kernel's board lets it): the third row of ``small_rows``, measured per
    machine (a one-row product alone against shared: handing half of it to
    another core and taking the result back can cost more than it saves),
    or yes for a table without it."""
    if small_rows.shape[0] < 3:
        return True
    return small_rows[_part(small_rows, itemsize) + 2, _entry(small_rows, size)] != 0


@njit(cache=True)
def own_rows(small_rows, k, n, itemsize):
    """The rows up to which a product by weights ``[k, n]`` of ``itemsize``-byte
    elements runs ``small_gemm``: the measured limit for weights of that size
    (``rows_for``); none under 32 columns, where the own loop takes one sum
    at a time (many times the library's time at any number of rows), except
    under ``STEPNET_DETERMINISTIC``, where it takes every product."""
    if n < 32 and not DETERMINISTIC:
        return 0
    return rows_for(small_rows, k * n, itemsize)


# a call whose per-step products by some weights take this many rows in all
# reads them from ``panels`` (faster), for one copy of the weights
PANEL_MIN_ROWS = 128


@njit(cache=True)
def pack(b, max_rows, call_rows, small_rows, board):
    """Weights ``b`` [k, n] of a per-step product over at most ``max_rows``
    rows a step and ``call_rows`` in the call, prepared for ``gemm_packed``:
    (the library's form, ``b`` itself, the rows up to which stepnet's own
    loop runs, the helper's ``board``, ``b``'s ``panels`` for the own loop,
    the own loop's board: ``board`` where it shares products of this size,
    ``shares_with_helper``, else one that shares nothing).
    The library's form is made only where a product can have more rows than
    the own loop takes (never under ``STEPNET_DETERMINISTIC``, where it
    takes every product), the panels only where the own loop takes some
    and the call has ``PANEL_MIN_ROWS`` (else no panel: the own loop reads
    ``b``): a stream's call of a few rows packs nothing. Where the own loop
    takes one row only (float32, 384 columns or more), its "panels" are
    one panel of every column: ``b`` on a cache line, whose rows
    ``_one_row_wide`` reads."""
    k, n = b.shape
    rows = own_rows(small_rows, k, n, b.itemsize)
    library = _library_pack(b, max_rows if max_rows > rows else 0)
    # the own loop's board: ``board``, or one that shares nothing (ALONE's)
    own_board = board if shares_with_helper(small_rows, k * n, b.itemsize) else np.zeros_like(board)
    if rows == 1 and b.itemsize == 4 and n >= _WIDE_ACCUMULATORS and call_rows >= PANEL_MIN_ROWS:
        # one row a product (``_one_row_wide``): b as one panel of all its
        # columns, starting on a cache line
        whole = aligned_empty(k * n, b)
        for i in range(k):  # (loops: a slice assignment compiles its error message)
            for j in range(n):
                whole[i * n + j] = b[i, j]
        return library, b, rows, board, whole.reshape((1, k, n)), own_board
    if rows > 0 and call_rows >= PANEL_MIN_ROWS:
        return library, b, rows, board, panels(b), own_board
    return library, b, rows, board, np.zeros((0, k, 32), b.dtype), own_board


# small_gemm as a C function per dtype, which kernels call by its symbol: it
# is compiled once (and cached on disk), not again inside every kernel
_OWN_SYMBOLS = {"float32": "stepnet_small_sgemm", "float64": "stepnet_small_dgemm"}
# (a, m, k, n, w, ld, panel, out, board): _own_shared, a board's address last
_own_calls = {name: _extern(symbol, "pzzzpzzpp") for name, symbol in _OWN_SYMBOLS.items()}
_OWN_LOCK = threading.Lock()
_own_entries = {}  # dtype name -> the cfunc, once its symbol is known to LLVM


def register_small_gemm(dtype) -> None:
    """Compile (or load from the disk cache) ``small_gemm``'s C entry for
    ``dtype`` and give LLVM its symbol: before a kernel calling
    ``gemm_packed`` on that dtype is compiled or loaded."""
    name = np.dtype(dtype).name
    if name in _own_entries or name not in _OWN_SYMBOLS:
        return
    with _OWN_LOCK:
        if name in _own_entries:
            return
        element = types.float32 if name == "float32" else types.float64
        pointer = types.CPointer(element)

        @cfunc(types.void(pointer, types.int64, types.int64, types.int64, pointer, types.int64,
                          types.int64, pointer, types.CPointer(types.int64)), cache=True)
        def entry(a, m, k, n, w, ld, panel, out, board):
            wide_vectors()
            size = _panel_count(n) * panel if panel > 0 else k * n
            _own_shared(carray(a, (m, k)), carray(w, size), ld, panel,
                        carray(out, (m, n)), carray(board, threads.BOARD_SIZE))

        llvm_binding.add_symbol(_OWN_SYMBOLS[name], entry.address)
        _own_entries[name] = entry


# -- products shared with the helper thread (docs/internals.md, *The helper
# thread*): cut where the product's shape says, the own loop by columns, a
# library's by rows; where the helper is not free, both parts here: the same bits.

# a product whose one row takes this many multiply-adds (weights of this many
# elements; and at least 64 columns) is cut by columns in stepnet's own loop
# (smaller ones share nothing even over many rows: for a VAD's products,
# `[64, 32] @ [32, 128]` a step over 64 streams, sharing gained little while
# the other core was free and lost much more while it was slowed)
SHARE_OWN_WORK = 1 << 14
# a library's product with this many multiply-adds (and at least 16 rows;
# in a step, with weights as big as above), by rows
_SHARE_LIBRARY_WORK = 1 << 17
# cycles of waiting for the helper under which it gets a block of 32 more
# columns of the own loop (over a block's time here, one fewer): each side's
# part takes about as long, whatever else slows the helper's core
_WAIT_BALANCED = 100


@njit(inline="always")
def share_rows(board, work, own, other, own_part, whole):
    """A library's product (``work`` multiply-adds) cut by rows at ``own_part``:
    ``own`` here, ``other`` on the helper where it is free, else here too."""
    c = threads.work_class(work)
    start = cycles()
    if threads.sharing_paused(board, c, start):
        return threads.run_both_here(own, other)
    return _judged(board, c, start, threads.run_jobs(board, own, other, True), own_part, whole)


@njit(inline="always")
def _shared_columns(board, work, own, other, whole_job, own_part, whole):
    """The own loop's product cut by columns: as ``share_rows``, but whole here."""
    c = threads.work_class(work)
    start = cycles()
    if threads.sharing_paused(board, c, start):
        return threads.run_here(whole_job)
    waited = threads.run_parts_or_whole(board, own, other, whole_job)
    return _judged(board, c, start, waited, own_part, whole)


@njit(inline="always")
def _judged(board, c, start, waited, own_part, whole):
    """``waited`` (cycles waited for the helper since ``start``), judged."""
    if waited >= 0:
        end = cycles()
        threads.judge_sharing(board, c, end - start - waited, waited, own_part, whole, end)
    return waited


@njit(cache=True, nogil=True)
def _own_shared(a, w, ld, panel, out, board):
    """out[:m] = a[:m] @ the weights ``w`` by stepnet's own loop
    (``_own_columns``), cut by columns on ``board`` (the body of its C entry:
    compiled once, not in every kernel)."""
    wide_vectors()
    m, k = a.shape
    n = out.shape[1]
    if board[threads.SHARES] & threads.COLUMNS == 0 or k * n < SHARE_OWN_WORK or n < 64:
        _own_columns(a, w, ld, panel, out, np.int64(0), n)  # (the types of the parts' jobs:
        return  # one compile)
    # whole blocks of 32 on each side: half, moved by the blocks the balance
    # says (a column's values do not depend on the side that computes it)
    half = (n // 2 + 16) // 32
    shift = board[threads.BALANCE]
    cut = 32 * min(max(half + shift, 1), (n - 32) // 32)
    waited = _shared_columns(board, m * k * n,
                             job_of(_own_columns, (a, w, ld, panel, out, 0, cut)),
                             job_of(_own_columns, (a, w, ld, panel, out, cut, n)),
                             job_of(_own_columns, (a, w, ld, panel, out, 0, n)), cut, n)
    if waited < 0:  # (not shared: the whole computed here)
        return
    if waited > 4 * m * k and shift < half:  # longer than a block of 32 takes here
        board[threads.BALANCE] = shift + 1  # (races between kernels only move it)
    elif waited < _WAIT_BALANCED and shift > -half:
        board[threads.BALANCE] = shift - 1


@njit(inline="always")
def _own_strides(b, k):
    """``_own_columns``' ``(ld, panel)`` for weights ``b``: [k, n], their
    ``panels`` [P, k, 32], or one panel of all of them [1, k, n] (``pack``:
    ``b``'s rows)."""
    width = b.shape[-1]
    if b.ndim == 3 and width == 32:
        return 32, 32 * k
    return width, 0


def _own_product(a, b, out, board):
    """out[:m] = a[:m] @ b by stepnet's own loop's C entry
    (``register_small_gemm``), cut by columns on ``board``; ``b`` is the
    weights [k, n] or their ``panels`` (n is ``out``'s width)."""


@overload(_own_product)
def _own_product_for(a, b, out, board):
    call = _own_calls.get(str(a.dtype))
    if call is None:
        return None

    if a.layout == "C" and b.layout == "C" and out.layout == "C":
        def own_product(a, b, out, board):
            m, k = a.shape
            if m > 0:
                ld, panel = _own_strides(b, k)
                call((a.ctypes.data, m, k, out.shape[1], b.ctypes.data, ld, panel,
                      out.ctypes.data, board.ctypes.data))
    else:  # (arrays not known to be C-contiguous: on C-contiguous copies)
        def own_product(a, b, out, board):
            m, k = a.shape
            if m > 0:
                ld, panel = _own_strides(b, k)
                a_c, b_c = np.ascontiguousarray(a), np.ascontiguousarray(b)
                out_c = np.empty((m, out.shape[1]), out.dtype)
                call((a_c.ctypes.data, m, k, out.shape[1], b_c.ctypes.data, ld, panel,
                      out_c.ctypes.data, board.ctypes.data))
                for i in np.ndindex(out_c.shape):  # (a loop, as in pack)
                    out[i] = out_c[i]

    return own_product


@njit(cache=True)
def row_cut(rows, work, board, least=16):
    """Where ``rows`` rows computed apart (a product's, a convolution's samples;
    ``work`` multiply-adds) are cut in two on ``board`` (0: not; nor under ``least``)."""
    if board[threads.SHARES] & threads.ROWS == 0 or rows < least or work < _SHARE_LIBRARY_WORK:
        return 0
    return rows // 2


@njit(cache=True)
def _hoisted(a, b, out, small_rows, board, add):
    """gemm_hoisted (``add``: gemm_hoisted_acc)."""
    if a.shape[0] <= own_rows(small_rows, b.shape[0], b.shape[1], b.itemsize):
        if add:  # (the own loop writes its product: added from a copy)
            part = np.empty_like(out[:a.shape[0]])
            _own_product(a, b, part, board)
            _store_rows(part, out, True)
        else:
            _own_product(a, b, out, board)
        return
    m, k = a.shape
    n = b.shape[1]
    beta = 1.0 if add else 0.0
    cut = row_cut(m, m * k * n, board)
    if cut == 0:
        _library_gemm(a, b, out, beta)
    else:  # (the library raises nothing)
        share_rows(board, m * k * n, job_of(_library_gemm, (a[:cut], b, out[:cut], beta)),
                   job_of(_library_gemm, (a[cut:], b, out[cut:], beta)), cut, m)


@njit(cache=True)
def gemm_hoisted(a, b, out, small_rows, board):
    """out[:m] = a[:m] @ b for a product outside the time loop (all steps'
    rows at once): stepnet's own loop where they are no more than it takes
    for a per-step product of these weights (a stream's chunk of a few
    frames, or any number of rows by weights as small as it measured
    faster for; under ``STEPNET_DETERMINISTIC`` every product), else the
    library's; shared with the helper on ``board``."""
    _hoisted(a, b, out, small_rows, board, False)


@njit(cache=True)
def gemm_hoisted_acc(a, b, out, small_rows, board):
    """out[:m] += a[:m] @ b, as ``gemm_hoisted`` (the parts after the first
    of a product of values joined by columns, ``sum a_i @ W_i``)."""
    _hoisted(a, b, out, small_rows, board, True)


@njit(cache=True, nogil=True)
def _taps_rows(a, w, out, dilation, lo, hi):
    """out[lo:hi] = the sum over k of a[lo + k * dilation:hi + k * dilation] @ w[k]."""
    if hi > lo:
        gemm(a[lo:hi], w[0], out[lo:hi])
        for k in range(1, w.shape[0]):
            gemm_acc(a[lo + k * dilation:hi + k * dilation], w[k], out[lo:hi])


@njit(cache=True, nogil=True)
def taps_product(a, w, out, dilation, board):
    """``out[r] = sum over k of a[r + k * dilation] @ w[k]`` for every row
    ``r`` of ``out`` (``a`` [rows + (K - 1) * dilation, C], ``w`` [K, C, M],
    C-contiguous floats of one dtype; K = 1: ``out = a @ w[0]``): a
    convolution by taps over rows laid out channels-last. Outside a kernel
    (an ONNX Conv, say), on the chosen BLAS; its rows cut in two where big
    enough (``row_cut``), the second part on the helper where it is free on
    ``board``."""
    rows = out.shape[0]
    cut = row_cut(rows, rows * a.shape[1] * w.shape[0] * out.shape[1], board)
    if cut == 0:
        _taps_rows(a, w, out, dilation, 0, rows)
    else:
        share_rows(board, rows * a.shape[1] * w.shape[0] * out.shape[1],
                   job_of(_taps_rows, (a, w, out, dilation, 0, cut)),
                   job_of(_taps_rows, (a, w, out, dilation, cut, rows)), cut, rows)


def board_for_product(multiply_adds):
    """The board for ``taps_product`` called from Python: ``threads.BOARD``
    (the helper woken) where a product of this many multiply-adds is cut,
    else ``threads.ALONE`` (no helper spins for it)."""
    return threads.board_for_one_group() if multiply_adds >= _SHARE_LIBRARY_WORK else threads.ALONE


@intrinsic
def gemm_own(typingctx, a, panels, rows, board, out):
    """``gemm_own(a, panels, rows, board, out)``: out[:m] = a[:m] @ b by
    stepnet's own loop on ``panels`` where ``pack`` made them and the own
    loop takes ``a``'s m rows (``pack``'s items: ``panels``, its 4th;
    ``rows``, its 2nd; the own loop's ``board``, its 5th; ``a``, ``out``
    C-contiguous): True; else nothing, and False (the kernel then calls
    ``gemm_packed``, apart, which reads ``b`` where there are no panels).
    A kernel's per-step product calls this first: a call of the own loop's
    C entry written into the kernel (it keeps the loop itself out of the
    kernel's compile), where passing ``pack``'s tuple of six arrays to a
    function, or a call apart, costs a noticeable share of a one-row
    product's time (W3's call), more through ``gemm_packed``. An intrinsic,
    not a function inlined by Numba: that lengthened each new kernel's
    compile, and a function linked into it both the compile and W3's
    run."""
    arrays = (a, panels, out, board)
    if not (all(isinstance(x, types.Array) and x.layout == "C" for x in arrays)
            and a.ndim == 2 and out.ndim == 2 and panels.ndim == 3 and board.ndim == 1
            and str(a.dtype) in _OWN_SYMBOLS and isinstance(rows, types.Integer)):
        return None
    symbol = _OWN_SYMBOLS[str(a.dtype)]

    def codegen(context, builder, signature, args):
        i64, i8p = llvm_ir.IntType(64), llvm_ir.IntType(8).as_pointer()
        a_v, p_v, _, b_v, o_v = (context.make_array(t)(context, builder, v) if i != 2 else None
                                 for i, (t, v) in enumerate(zip(signature.args, args)))
        m, k = cgutils.unpack_tuple(builder, a_v.shape, 2)
        count, _, width = cgutils.unpack_tuple(builder, p_v.shape, 3)
        n = cgutils.unpack_tuple(builder, o_v.shape, 2)[1]
        rows_v = context.cast(builder, args[2], signature.args[2], types.int64)
        taken = builder.and_(builder.icmp_signed("<=", m, rows_v),
                             builder.icmp_signed(">", count, i64(0)))
        with builder.if_then(builder.and_(taken, builder.icmp_signed(">", m, i64(0)))):
            in_panels = builder.icmp_signed("==", width, i64(32))
            ld = builder.select(in_panels, i64(32), width)
            panel = builder.select(in_panels, builder.mul(k, i64(32)), i64(0))
            fn = cgutils.get_or_insert_function(
                builder.module, llvm_ir.FunctionType(
                    llvm_ir.VoidType(), [i8p, i64, i64, i64, i8p, i64, i64, i8p, i8p]), symbol)
            builder.call(fn, [builder.bitcast(a_v.data, i8p), m, k, n,
                              builder.bitcast(p_v.data, i8p), ld, panel,
                              builder.bitcast(o_v.data, i8p), builder.bitcast(b_v.data, i8p)])
        return taken

    return types.boolean(a, panels, rows, board, out), codegen


@njit(cache=True)
def gemm_packed(a, prepared, out):
    """out[:m] = a[:m] @ b, with ``prepared = pack(b, ...)``: stepnet's own
    loop up to the rows measured for weights of this size (on the weights'
    panels where ``pack`` made them; shared with the helper where measured
    faster), the library's product above (its packed form, or, where
    ``pack`` made none, its plain product; shared with the helper on
    ``board``). The weights' shape is read from ``prepared``, not passed as
    the kernel's constants: Numba compiles a function once per literal
    argument, and every new width would compile this one again."""
    board = prepared[3]
    if a.shape[0] <= prepared[2]:
        if prepared[4].shape[0] > 0:
            _own_product(a, prepared[4], out, prepared[5])
        else:
            _own_product(a, prepared[1], out, prepared[5])
    elif prepared[0].shape[0] == 0:  # more rows than ``pack`` was told (a safety net)
        gemm(a, prepared[1], out)
    else:
        m = a.shape[0]
        k, n = prepared[1].shape
        cut = row_cut(m, m * k * n, board) if k * n >= SHARE_OWN_WORK else 0
        if cut == 0:
            _library_product(a, prepared, out)
        else:  # (the library's product raises nothing)
            share_rows(board, m * k * n, job_of(_library_product, (a[:cut], prepared, out[:cut])),
                       job_of(_library_product, (a[cut:], prepared, out[cut:])), cut, m)


@njit(cache=True)
def gather_steps(left, col, sstart, slen, row_step, step, chunk, nb, reverse, gathered):
    """At a chunk's first step ``step``: sequence b's row of ``left`` (from
    column ``col``) at step ``step + s`` (row ``sstart[b] + (step + s) *
    row_step``; from its end where ``reverse``) into row ``b * chunk + s`` of
    ``gathered``, for the ``nb`` active sequences and the steps they have
    (rows past a sequence's end keep what they held)."""
    k = gathered.shape[1]
    first = np.uint64(col)  # (unsigned: no wraparound, and the copy vectorizes)
    for b in range(nb):
        for s in range(min(chunk, slen[b] - step)):
            r = sstart[b] + (slen[b] - 1 - step - s if reverse else step + s) * row_step
            for q in range(np.uint64(k)):
                gathered[b * chunk + s, q] = left[r, first + q]


@njit(cache=True)
def gemm_steps(left, col, sstart, slen, row_step, step, chunk, nb, reverse, gathered, prepared,
               out):
    """A product by chunks of steps: ``gather_steps``, then ``out[:nb *
    chunk] = gathered[:nb * chunk] @ b`` with ``prepared = pack(b, ...)``."""
    gather_steps(left, col, sstart, slen, row_step, step, chunk, nb, reverse, gathered)
    gemm_packed(gathered[:nb * chunk], prepared, out[:nb * chunk])


if DETERMINISTIC:
    @njit
    def gemm(a, b, out):
        """out[:m] = a[:m] @ b, every element a sequential sum (small_gemm)."""
        small_gemm(a, np.ascontiguousarray(b), out)

# what a kernel's code depends on here (written into its generated source)
SIGNATURE = BLAS_NAME + (" (deterministic)" if DETERMINISTIC else "")
