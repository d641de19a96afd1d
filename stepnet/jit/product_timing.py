"""How long per-step products take on this machine, timed by the code the
kernels run (the library's calls and stepnet's own loop, alone and cut with
the helper), and what is chosen from it: up to how many rows, for weights of
each size, a product runs stepnet's own loop and whether it shares it with
the helper (``small_rows_table``, measured once per machine and library by
:func:`stepnet.jit.blas_choice.small_product_rows`); ``single_thread_seconds``
for the benchmarks' GEMM ceiling.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from numba import njit

from ..config import config
from . import blas, threads
from .blas import (BLAS_NAME, SHARE_OWN_WORK, _choice, _library_pack, _library_product, _own_product,
                   register_small_gemm)
from .blas_choice import EVERY_PRODUCT, find_mkl, find_openblas, measure, small_product_rows
from .own_loop import DETERMINISTIC, panels


@njit(cache=True)
def _repeat_products(a, prepared, out, own, reps, board, recur):
    """``reps`` per-step products, by stepnet's own loop's C entry (on the
    weights' panels) or the library's. ``recur``: as in a time loop, each
    product's left rows are made from the last one's every column on this
    thread (where the product is cut, the helper's columns come to this
    core and the new rows go to the helper's)."""
    m, k = a.shape
    n = out.shape[1]
    scale = a.dtype.type(1.0 / np.sqrt(k))  # (the rows keep their size)
    for _ in range(reps):
        if own:
            _own_product(a, prepared[4], out, board)
        else:
            _library_product(a, prepared, out)
        if recur:
            for i in range(m):
                for j0 in range(0, n, k):
                    for j in range(j0, min(n, j0 + k)):
                        a[i, j - j0] = out[i, j] * scale


def _products_in_turn(m, k, n, sides, reps, settle, recur=False, rounds=3):
    """Seconds per float32 product ``[m, k] @ [k, n]`` on the calling thread
    of each side ``(own, board_of)``: stepnet's own loop (on the weights'
    panels) or the library's, on the board ``board_of()`` gives before each
    run. The best of ``rounds`` runs of ``reps`` products of each, the sides
    taken in turn (a busy phase of the machine slows them alike), each run
    after ``settle`` products untimed (``recur``: ``_repeat_products``)."""
    register_small_gemm(np.float32)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), np.float32)
    b = rng.standard_normal((k, n), np.float32)
    b.flags.writeable = False  # (as a kernel's weights: the packing compiled once for both)
    out = np.empty((m, n), np.float32)
    prepared = (_library_pack(b, m), b, 0, threads.ALONE, panels(b))
    seconds = [float("inf")] * len(sides)
    for _ in range(rounds):
        for side, (own, board_of) in enumerate(sides):
            board = board_of()
            _repeat_products(a, prepared, out, own, settle, board, recur)
            t0 = time.perf_counter()
            _repeat_products(a, prepared, out, own, reps, board, recur)
            seconds[side] = min(seconds[side], (time.perf_counter() - t0) / reps)
    return tuple(seconds)


def _alone():
    return threads.ALONE


def _time_small_and_library(m, k, n):
    """Seconds per product of ``small_gemm`` and of the library's, one
    thread (``_products_in_turn``)."""
    reps = max(2, min(2000, 8_000_000 // (m * k * n)))  # (runs long enough for the clock)
    return _products_in_turn(m, k, n, ((True, _alone), (False, _alone)), reps, 1)


def _spinning_helper():
    """``threads.BOARD`` once the helper spins on it (woken; at most 50 ms:
    its thread may start late), or ``threads.ALONE`` where no helper spins."""
    board = threads.board_for_one_group()
    deadline = time.perf_counter() + 0.05
    while board[threads.STATE] in (threads.ABSENT, threads.WAKING) and time.perf_counter() < deadline:
        time.sleep(0)
        board = threads.board_for_one_group()
    return board


def _time_alone_and_shared(m, k, n):
    """Seconds per product of ``small_gemm`` on the calling thread alone and
    cut by columns with the helper, each product's rows made from the last
    one's on the calling thread as in a time loop (``_products_in_turn``
    with ``recur``: the data that crosses between the cores in a step
    crosses here too; without it, the cut of a one-row product by 128 x 384
    weights timed faster than alone where it ran W3's kernel markedly
    slower); the helper woken
    before each shared run, as it sleeps after half a millisecond without a
    job, and the balance of the cut settled), or None where it is never cut
    (weights under ``SHARE_OWN_WORK`` elements or 64 columns) or no helper
    spins (one thread; not x86-64)."""
    if k * n < SHARE_OWN_WORK or n < 64:  # (never cut: _own_shared)
        return None
    if _spinning_helper()[threads.SHARES] == 0:
        return None
    reps = max(50, min(5000, 40_000_000 // (m * k * n)))  # (runs of a few milliseconds)
    return _products_in_turn(m, k, n, ((True, _alone), (True, _spinning_helper)), reps, 3,
                             recur=True, rounds=5)


def single_thread_seconds(m, k, n, rounds=5):
    """Seconds per float32 product ``[m, k] @ [k, n]`` on the calling thread,
    by stepnet's own loop and by each BLAS library stepnet reaches (the best
    of ``rounds`` rounds that take them in turn): ``{name: seconds}``.
    ``benchmarks/run.py`` takes the machine's GEMM ceiling from it."""
    libraries = [lib for lib in (find_mkl(), find_openblas()) if lib is not None]
    reps = max(5, min(200, 50_000_000 // (m * k * n)))
    best = {}
    for _ in range(rounds):
        own, chosen = _time_small_and_library(m, k, n)  # (the chosen library's too)
        timed = [("stepnet's own loop", own), (BLAS_NAME, chosen)]
        timed += [(name, s[0]) for name, s in measure(libraries, ((m, k, n, reps, 1),)).items()]
        for name, seconds in timed:
            best[name] = min(best.get(name, float("inf")), seconds)
    return best


_SMALL_ROWS = []  # small_rows_table(), once measured or read
_SMALL_ROWS_LOCK = threading.Lock()


def small_rows_table():
    """The ``small_rows`` argument of ``pack``: [3, L], for weights of each
    size (row 0), the rows up to which per-step products run ``small_gemm``
    (row 1) and whether it shares them with the helper (row 2; measured at
    the first call, and kept: :func:`stepnet.jit.blas_choice.small_product_rows`).
    A run-time argument, so a kernel's code does not depend on it; under
    ``STEPNET_DETERMINISTIC`` every product runs ``small_gemm``."""
    if not _SMALL_ROWS:
        with _SMALL_ROWS_LOCK:
            if not _SMALL_ROWS:
                config.start_engine("small_products")
                # a kept table is checked by timing a float32 product: only where
                # that code is linked here already (a float32 kernel's), never
                # compiling it for the check
                limits = ((EVERY_PRODUCT, EVERY_PRODUCT, 1),) if DETERMINISTIC else \
                    small_product_rows(_choice, _time_small_and_library, _time_alone_and_shared,
                                       check="float32" in blas._own_entries)
                table = np.array(limits, np.int64).T.copy()
                table.flags.writeable = False
                _SMALL_ROWS.append(table)
    return _SMALL_ROWS[0]
