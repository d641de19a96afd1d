"""How long per-step products take on this machine, timed by the code the
kernels run (the library's calls and stepnet's own loop, alone and cut with
the helper), and what is chosen from it: up to how many rows, for weights of
each size, a product runs stepnet's own loop and whether it shares it with
the helper (``small_rows_table``, measured once per machine, library and
dtype by :func:`stepnet.jit.blas_choice.small_product_rows`).
"""

from __future__ import annotations

import threading
import time
from functools import partial

import numpy as np
from numba import njit

from . import blas, threads
from .atomics import as_read_only
from .blas import SHARE_OWN_WORK, _choice, _library_pack, _library_product, _own_product, register_small_gemm
from .blas_choice import EVERY_PRODUCT, small_product_rows
from .own_loop import DETERMINISTIC, panels


# how _repeat_products runs a product: a per-step product by the library or
# stepnet's own loop, or one outside the time loop (gemm_hoisted) by either
LIBRARY, OWN, OUTSIDE_LIBRARY, OUTSIDE_OWN = 0, 1, 2, 3


@njit(cache=True)
def _repeat_products(a, prepared, out, way, reps, board, recur):
    """``reps`` products run the ``way`` named: per-step by stepnet's own
    loop's C entry (on the weights' panels) or the library's, or as a
    kernel's product outside the time loop. ``recur``: as in a time loop,
    each product's left rows are made from the last one's every column on
    this thread (where the product is cut, the helper's columns come to
    this core and the new rows go to the helper's)."""
    m, k = a.shape
    n = out.shape[1]
    scale = a.dtype.type(1.0 / np.sqrt(k))  # (the rows keep their size)
    limits = np.full((3, 1), EVERY_PRODUCT, np.int64)  # (the own loop takes every product)
    limits[1, 0] = 0 if way == OUTSIDE_LIBRARY else EVERY_PRODUCT
    for _ in range(reps):
        if way == OWN:
            _own_product(a, prepared[4], out, board)
        elif way == LIBRARY:
            _library_product(a, prepared, out)
        else:
            # (typed as a kernel gives them: gemm_hoisted compiled once for both)
            blas.gemm_hoisted(as_read_only(a), prepared[1], out, as_read_only(limits), board)
        if recur:
            for i in range(m):
                for j0 in range(0, n, k):
                    for j in range(j0, min(n, j0 + k)):
                        a[i, j - j0] = out[i, j] * scale


def _products_in_turn(m, k, n, sides, reps, settle, recur=False, rounds=3, dtype="float32"):
    """Seconds per product ``[m, k] @ [k, n]`` of ``dtype`` on the calling thread
    of each side ``(way, board_of)`` (``_repeat_products``), on the board
    ``board_of()`` gives before each run. The best of ``rounds`` runs of ``reps`` products of each, the sides
    taken in turn (a busy phase of the machine slows them alike), each run
    after ``settle`` products untimed (``recur``: ``_repeat_products``)."""
    register_small_gemm(np.dtype(dtype))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    b.flags.writeable = False  # (as a kernel's weights: the packing compiled once for both)
    out = np.empty((m, n), dtype)
    prepared = (_library_pack(b, m), b, 0, threads.ALONE, panels(b))
    seconds = [float("inf")] * len(sides)
    for _ in range(rounds):
        for side, (way, board_of) in enumerate(sides):
            board = board_of()
            _repeat_products(a, prepared, out, way, settle, board, recur)
            t0 = time.perf_counter()
            _repeat_products(a, prepared, out, way, reps, board, recur)
            seconds[side] = min(seconds[side], (time.perf_counter() - t0) / reps)
    return tuple(seconds)


def _alone():
    return threads.ALONE


def _time_small_and_library(m, k, n, dtype="float32"):
    """Seconds per product of ``small_gemm`` and of the library's, one
    thread (``_products_in_turn``)."""
    reps = max(2, min(2000, 8_000_000 // (m * k * n)))  # (runs long enough for the clock)
    return _products_in_turn(m, k, n, ((OWN, _alone), (LIBRARY, _alone)), reps, 1, dtype=dtype)


def _spinning_helper():
    """``threads.BOARD`` once the helper spins on it (woken; at most 50 ms:
    its thread may start late), or ``threads.ALONE`` where no helper spins."""
    board = threads.board_for_one_group()
    deadline = time.perf_counter() + 0.05
    while board[threads.STATE] in (threads.ABSENT, threads.WAKING) and time.perf_counter() < deadline:
        time.sleep(0)
        board = threads.board_for_one_group()
    return board


def _time_alone_and_shared(m, k, n, dtype="float32"):
    """Seconds per product of ``small_gemm`` on the calling thread alone and
    cut by columns with the helper (woken before each run), each product's
    rows made from the last one's as in a time loop (``recur``: the data
    that crosses between the cores in a step crosses here too), or None
    where it is never cut (weights under ``SHARE_OWN_WORK`` elements or 64
    columns) or no helper spins (one thread; not x86-64)."""
    if k * n < SHARE_OWN_WORK or n < 64:  # (never cut: _own_shared)
        return None
    if _spinning_helper()[threads.SHARES] == 0:
        return None
    reps = max(50, min(5000, 40_000_000 // (m * k * n)))  # (runs of a few milliseconds)
    return _products_in_turn(m, k, n, ((OWN, _alone), (OWN, _spinning_helper)), reps, 3,
                             recur=True, rounds=5, dtype=dtype)


def _time_many(m, k, n, dtype="float32"):
    """Seconds per product ``[m, k] @ [k, n]`` outside the time loop by the
    own loop and by the library's, as the kernels run it: on the helper's
    board where it spins (the own loop cut by columns, the library's by rows)."""
    reps = max(1, min(20, 100_000_000 // (m * k * n)))  # (runs of a few milliseconds)
    return _products_in_turn(m, k, n, ((OUTSIDE_OWN, _spinning_helper),
                                       (OUTSIDE_LIBRARY, _spinning_helper)), reps, 1, dtype=dtype)


_SMALL_ROWS = {}  # dtype -> its [3, L] small_rows table, once measured or read; "both": joined
_SMALL_ROWS_LOCK = threading.Lock()


def _frozen(table):
    table = np.ascontiguousarray(table)
    table.flags.writeable = False
    return table


def _table(dtype, measure):
    """The [3, L] table of products of ``dtype`` (``small_rows_table``), or None."""
    if dtype not in _SMALL_ROWS:
        with _SMALL_ROWS_LOCK:
            if dtype not in _SMALL_ROWS:
                # a kept table is checked by timing a product: only where that
                # code is linked here already (a kernel's of that dtype), never
                # compiling it for the check
                limits = ((EVERY_PRODUCT, EVERY_PRODUCT, 1),) if DETERMINISTIC else small_product_rows(
                    _choice, partial(_time_small_and_library, dtype=dtype),
                    partial(_time_alone_and_shared, dtype=dtype), check=dtype in blas._own_entries,
                    time_many=partial(_time_many, dtype=dtype), measure=measure, dtype=dtype)
                if limits is None:
                    return None
                _SMALL_ROWS[dtype] = _frozen(np.array(limits, np.int64).T)
    return _SMALL_ROWS[dtype]


def small_rows_table(measure=True, float64=False):
    """The ``small_rows`` argument of ``pack``: [3, L], for weights of each
    size (row 0), the rows up to which per-step float32 products run
    ``small_gemm`` (row 1) and whether it shares them with the helper (row
    2); with ``float64`` float64's below ([6, L]: ``blas.rows_for``). Each
    dtype's is measured at its first call, and kept
    (:func:`stepnet.jit.blas_choice.small_product_rows`). A run-time
    argument, so a kernel's code does not depend on it; under
    ``STEPNET_DETERMINISTIC`` every product runs ``small_gemm``. (Where one
    is not kept and not ``measure``: None for float32's, float32's alone for
    float64's.)"""
    first = _table("float32", measure)
    second = _table("float64", measure) if float64 and first is not None else None
    if second is None:
        return first
    if "both" not in _SMALL_ROWS:
        _SMALL_ROWS["both"] = _frozen(np.concatenate([first, second]))
    return _SMALL_ROWS["both"]
