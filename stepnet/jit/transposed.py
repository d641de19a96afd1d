"""The weight gradients' products ``a.T @ b``: long reductions over every
token of a call, by the library or stepnet's own loop (the faster, measured
once per machine, library and dtype:
:func:`stepnet.jit.blas_choice.transposed_by_own_loop`), a backward's
products run together on stepnet's threads, their work cut into pieces.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from numba import njit

from . import threads
from .blas import _A_T, _choice, _row_major_gemm, gemm_tn
from .blas_choice import transposed_by_own_loop
from .own_loop import DETERMINISTIC, _columns_outer, _panel_count, aligned_empty, fill_panels, small_gemm


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


# rows of a.T @ b that stepnet's own loop takes at a time: the chunk's rows
# of a and its panels of b (256 x 256 floats each, 256 KiB) stay in the
# second-level cache while every block of the product passes over them
# (chunks of 256 rows ran a long reduction by 256 x 256 weights faster than
# chunks of 128 or 512)
_TN_ROWS = 256


@njit(cache=True, nogil=True)
def _own_tn(a, b, out, sums, column_sums):
    """out = a.T @ b (``column_sums``: and sums = b.sum(0)) for C-contiguous
    2-D a [r, m >= 6], b [r, n >= 32] of one dtype by stepnet's own loop
    (``_columns_outer``: its blocks of 4 rows and more, none of the paths for
    fewer rows, which nearly doubled its cold compile),
    ``_TN_ROWS`` rows at a time: the chunk of ``b`` as ``panels``, the
    chunk of ``a`` read transposed (a block's 6 values of a step are side
    by side in a row of ``a``: no copy), its product added to ``out`` and
    its rows of ``b`` summed while they are in cache. Every element a sum
    in order of the rows, by chunks."""
    rows, m = a.shape
    n = b.shape[1]
    out[:] = 0
    sums[:] = 0
    if rows == 0 or m == 0 or n == 0:
        return
    chunk = min(rows, _TN_ROWS)
    count = _panel_count(n)
    flat = aligned_empty(count * chunk * 32, b)
    part = np.empty((m, n), out.dtype)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        k = stop - start
        fill_panels(b[start:stop], flat[:count * k * 32].reshape((count, k, 32)))
        _columns_outer(a[start:stop].T, flat, 32, 32 * k, part, 0, n)
        for i in range(m):
            for j in range(n):
                out[i, j] += part[i, j]
        if column_sums:
            for i in range(start, stop):
                for j in range(n):
                    sums[j] += b[i, j]


def _time_transposed(rows, m, n, dtype, rounds=3):
    """Seconds per product ``[rows, m].T @ [rows, n]`` of ``dtype`` on the
    calling thread by stepnet's own loop (``_own_tn``) and by the library's
    (``gemm_tn``): the best of ``rounds`` runs of each, taken in turn."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, m)).astype(dtype)
    b = rng.standard_normal((rows, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    sums = np.empty(n, dtype)
    sides = (lambda: _own_tn(a, b, out, sums, False), lambda: gemm_tn(a, b, out))
    seconds = [float("inf")] * len(sides)
    for _ in range(rounds + 1):  # (the first round untimed: compiles, warms up)
        for side, run in enumerate(sides):
            t0 = time.perf_counter()
            run()
            seconds[side] = min(seconds[side], time.perf_counter() - t0)
    return tuple(seconds)


_TN_OWN = {}  # dtype name -> transposed_by_own_loop(), once measured or read
_TN_LOCK = threading.Lock()


def _tn_by_own_loop(dtype):
    """Whether ``transposed_product`` runs stepnet's own loop on ``dtype``:
    measured once per machine, library and dtype
    (:func:`stepnet.jit.blas_choice.transposed_by_own_loop`)."""
    name = np.dtype(dtype).name
    if name not in _TN_OWN:
        with _TN_LOCK:
            if name not in _TN_OWN:
                _TN_OWN[name] = transposed_by_own_loop(_choice, _time_transposed, name)
    return _TN_OWN[name]


def prepare_transposed_products(dtype) -> None:
    """Measure (``_tn_by_own_loop``) and compile the ``transposed_product``
    of ``dtype`` into the disk cache, on tiny operands (the compile worker
    does this while a new backward's first calls run on the interpreter)."""
    a, b = np.ones((8, 8), dtype), np.ones((8, 32), dtype)  # (big enough for the own loop)
    transposed_product(a, b)
    transposed_product(a, b, column_sums=True)


def transposed_product(a, b, column_sums=False):
    """``a.T @ b`` (weight gradients: a long reduction over every token);
    with ``column_sums``, ``(a.T @ b, b.sum(0))``: ``transposed_products``
    of this one product."""
    return transposed_products([(a, b, column_sums)])[0]


# rows where the products of ``transposed_products`` are cut between threads
# fall on multiples of this (or on a product's end)
_TN_CUT_ROWS = 64


def _tn_pieces(works, sizes, parts):
    """The products of ``transposed_products`` shared out over ``parts``
    threads: per thread, its pieces ``(product, first row, end row)``. The
    products' work (``works``: multiply-adds; ``sizes``: multiply-adds a
    row) laid end to end and cut in ``parts`` equal spans, each product
    whole on one thread but where a cut falls inside it (at a row, a
    multiple of ``_TN_CUT_ROWS``)."""
    total = sum(works)
    pieces = [[] for _ in range(parts)]
    start = 0  # the work before the product
    for i, (work, size) in enumerate(zip(works, sizes)):
        rows = work // size if size else 0
        first = 0
        for t in range(parts):
            cut = (t + 1) * total // parts - start  # where thread t's span ends, in this product
            end = rows if t == parts - 1 or cut >= work else max(
                first, min(rows, cut // size // _TN_CUT_ROWS * _TN_CUT_ROWS))
            if end > first:
                pieces[t].append((i, first, end))
                first = end
        start += work
    return pieces


def transposed_products(products):
    """``a.T @ b`` for each ``(a, b, column_sums)`` of ``products`` (a
    backward's weight gradients: long reductions over every token), with
    ``column_sums`` as ``(a.T @ b, b.sum(0))`` (the sums, a bias's gradient
    beside its weight's, read each block of ``b`` while the product has it
    in cache). Run together on stepnet's threads: their work laid end to
    end and cut in as many equal spans as threads (``_tn_pieces``), so each
    product is whole on one thread but one at a cut, whose parts are summed
    after (one handover for them all, and each thread's products as long
    as the whole ones: in the backwards of W8 and W9, faster than cutting
    each product in two). Each piece by stepnet's
    own loop (``_own_tn``) or the chosen BLAS, whichever was measured faster
    on this machine (``_tn_by_own_loop``, for each dtype; the library for a
    product under 6 x 32); under ``STEPNET_DETERMINISTIC=1`` every element
    a sequential sum (``small_gemm``), product by product."""
    results = [None] * len(products)
    prepared, works, sizes = [], [], []
    for i, (a, b, column_sums) in enumerate(products):
        on_blas = a.dtype == b.dtype and a.dtype in (np.float32, np.float64) and a.ndim == b.ndim == 2
        if DETERMINISTIC or not on_blas:
            if on_blas:
                product = np.empty((a.shape[1], b.shape[1]), a.dtype)
                small_gemm(np.ascontiguousarray(a.T), np.ascontiguousarray(b), product)
            else:
                product = a.T @ b
            results[i] = (product, b.sum(0)) if column_sums else product
            continue
        rows, m, n = a.shape[0], a.shape[1], b.shape[1]
        if rows * m * n == 0:  # (nothing to share out)
            product = np.zeros((m, n), a.dtype)
            results[i] = (product, b.sum(0)) if column_sums else product
            continue
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        prepared.append((i, a, b, column_sums, m >= 6 and n >= 32 and _tn_by_own_loop(a.dtype)))
        works.append(rows * m * n)
        sizes.append(m * n)
    if not prepared:
        return results
    parts = max(1, min(threads.count(), sum(works) // _SPLIT_TN_WORK))
    pieces = _tn_pieces(works, sizes, parts)

    def piece(i, first, end):
        _, a, b, column_sums, own = prepared[i]
        a, b = a[first:end], b[first:end]
        out = np.empty((a.shape[1], b.shape[1]), a.dtype)
        sums = np.empty(b.shape[1], b.dtype) if column_sums else None
        if own:
            _own_tn(a, b, out, np.empty(b.shape[1], b.dtype) if sums is None else sums,
                    column_sums)
        elif column_sums:
            _gemm_tn_column_sums(a, b, out, sums, _SUM_BLOCK)
        else:
            gemm_tn(a, b, out)
        return i, out, sums

    def thread(t):
        return [piece(*p) for p in pieces[t]]

    done = {}
    for part in threads.run_each(thread, [t for t in range(parts) if pieces[t]]):
        for i, out, sums in part:
            if i in done:
                done[i][0][...] += out
                if sums is not None:
                    done[i][1][...] += sums
            else:
                done[i] = (out, sums)
    for k, (i, _, _, column_sums, _) in enumerate(prepared):
        out, sums = done[k]
        results[i] = (out, sums) if column_sums else out
    return results
