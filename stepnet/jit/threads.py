"""The threads stepnet runs compiled work on: a small pool of Python threads
calling ``nogil`` kernels, each kernel single-threaded (its BLAS calls too),
and one helper thread that takes a part of a single product.

Nothing here uses Numba's parallel layer or a BLAS library's own thread pool,
so no step waits on a barrier and no idle pool spins beside the kernels. The
thread count is Numba's (``numba.set_num_threads``, ``NUMBA_NUM_THREADS``).

The helper is for runs too small to split into groups of sequences (one
sequence; a stream's few frames): a product of such a step is too short for
Python's threads (handing work to one costs tens of microseconds on a
virtual machine), not for a thread already spinning in compiled code, which
picks a job up in well under a microsecond. A kernel given ``BOARD`` calls
``share``: if the helper is spinning and free, it claims it (a
compare-exchange: one claimant at a time), writes the job (the address of a
C function ``void f(int64 *job)`` and its arguments), runs its own part of
the same job and waits for the helper's (``finish``: a job the helper has
not started within ``PATIENCE`` cycles it takes back and runs itself, so a
helper without a core never holds a kernel up); else ``share`` says no and
the kernel computes both parts. The helper spins (``pause``) while jobs
come, yields its core after a while without one, and goes back to sleep
``HELPER_LINGER`` cycles after the last, or when dismissed.
``wake_helper()`` starts it (``board_for_one_group``). The protocol
(``_share``) and the job functions are compiled when it is first woken, on
the waking thread (cached on disk), so a kernel compiles none of it. x86-64 only
(:data:`atomics.SPINS`): elsewhere kernels get ``ALONE``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numba
import numpy as np
from numba import carray, cfunc, njit, types

from . import cache  # noqa: F401  (Numba's cache of _serve goes under STEPNET_CACHE_DIR)
from .atomics import SPINS, call_address, compare_exchange, cycles, load_acquire, pause, \
    pointer_to, stack_buffer, store_release, yield_core

_POOL = None


def count() -> int:
    """How many threads a call may use."""
    return numba.get_num_threads()


def _pool(workers):
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                      thread_name_prefix="stepnet")
    return _POOL


def run_each(fn, items):
    """``[fn(item) for item in items]``, the first on the calling thread and
    the others at the same time on the pool (``fn`` must release the GIL for
    its heavy part)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    futures = [_pool(len(items) - 1).submit(fn, item) for item in items[1:]]
    return [fn(items[0])] + [f.result() for f in futures]


# -- the helper ------------------------------------------------------------------

# a board's slots: the helper's state, the jobs it has run, whether kernels
# given the board share their products, the jobs posted that their claimant
# took back and ran (see ``finish``), the address of ``_share`` (0 until the
# helper has started once), the blocks of columns of stepnet's own loop the
# kernels keep beyond half (blas: balanced by how long they wait), the job
# (from JOB: the function's address, then its 8 arguments), and the
# addresses of the job functions registered (from ENTRIES, see ``entry``)
STATE, JOBS, SHARES, TAKEN_BACK, SHARE, BALANCE, JOB, ENTRIES = 0, 1, 2, 3, 4, 5, 8, 24
# the states: asleep; spinning, free; claimed by a kernel writing a job; a job
# to run; that job running; that job done (the claimant sets IDLE again)
ABSENT, IDLE, CLAIMED, POSTED, RUNNING, DONE = 0, 1, 2, 3, 4, 5
BOARD_SIZE = ENTRIES + 8
BOARD = np.zeros(BOARD_SIZE, np.int64)
BOARD[SHARES] = 1
# the board of a kernel that computes every product whole (its run takes
# every thread already)
ALONE = np.zeros_like(BOARD)
# cycles the helper spins after its last job (about half a millisecond)
HELPER_LINGER = 1 << 21
# cycles a kernel done with its share waits for the helper to start the job
# before it runs the job itself (the helper's thread is not on a core: the
# machine has more threads running than cores); a job started and not done
# by then gets the core, yielded at each check
PATIENCE = 1 << 14


@njit(cache=True, nogil=True)
def _serve(board, linger):
    """The helper's loop: run each job posted, until ``linger`` cycles pass
    without one or a dismissal."""
    store_release(board, STATE, IDLE)
    last = cycles()
    while True:
        state = load_acquire(board, STATE)
        if state == POSTED and compare_exchange(board, STATE, POSTED, RUNNING):
            call_address(board[JOB], board[JOB + 1:JOB + 9])
            board[JOBS] += 1
            store_release(board, STATE, DONE)
            last = cycles()
        elif state == ABSENT:
            return
        elif state == IDLE:
            idle = cycles() - last
            if idle > linger:
                if compare_exchange(board, STATE, IDLE, ABSENT):
                    return
            elif idle > linger >> 4:
                yield_core()  # (a while without a job: a thread waiting for a core goes first)
        pause()


@njit(cache=True, nogil=True)
def offer(board, entry, a, m, k, n, b, out, lo, hi) -> bool:
    """Give the helper the job ``f(a, m, k, n, b, out, lo, hi)`` of entry
    ``entry`` (see ``entry``) if it is spinning and free (claimed by a
    compare-exchange: one kernel at a time); whether it took it (the kernel
    then calls ``finish``)."""
    if not compare_exchange(board, STATE, IDLE, CLAIMED):
        return False
    job = board[JOB + 1:JOB + 9]
    job[0], job[1], job[2], job[3] = a, m, k, n
    job[4], job[5], job[6], job[7] = b, out, lo, hi
    board[JOB] = board[ENTRIES + entry]
    store_release(board, STATE, POSTED)
    return True


@njit(cache=True, nogil=True)
def finish(board):
    """Wait for the posted job, then free the helper; run the job here if
    the helper has not started it within ``PATIENCE`` cycles. The cycles
    waited."""
    start = cycles()
    while True:
        state = load_acquire(board, STATE)
        if state == DONE:
            break
        if cycles() - start > PATIENCE:
            if state == POSTED and compare_exchange(board, STATE, POSTED, CLAIMED):
                call_address(board[JOB], board[JOB + 1:JOB + 9])
                board[TAKEN_BACK] += 1
                break
            yield_core()
        pause()
    store_release(board, STATE, IDLE)
    return cycles() - start


# _share's argument: the board's address, the job's entry, its 8 values
# (a, m, k, n, b, out, cut, hi), and the result
_SHARE_RECORD = 11


def _share(record):
    """The helper takes ``cut:hi`` of a job and this thread ``0:cut``, if the
    helper is free; the result (``record[10]``): the cycles this thread
    waited for the helper, or -1 where the helper was not free. A C function
    compiled when the helper is first woken, so that kernels, which call it
    by its address on the board (``share``), need not compile the helper's
    protocol."""
    r = carray(record, _SHARE_RECORD)
    board = carray(pointer_to(r[0], np.int64), BOARD_SIZE)
    if offer(board, r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9]):
        r[8], r[9] = 0, r[8]
        call_address(board[ENTRIES + r[1]], r[2:10])
        r[10] = finish(board)
    else:
        r[10] = -1


# (one signature: the arguments' literal and read-only types compile nothing new)
@njit(types.int64(types.int64[::1], types.int64, types.uint64, types.int64, types.int64,
                  types.int64, types.uint64, types.uint64, types.int64, types.int64),
      cache=True, nogil=True)
def share(board, entry, a, m, k, n, b, out, cut, hi):
    """Run the job of entry ``entry`` on ``(a, m, k, n, b, out)``, its part
    ``0:cut`` on this thread and ``cut:hi`` on the helper, if the helper is
    there and free: the cycles this thread waited for the helper's part, or
    -1 where it was not (then nothing is computed)."""
    address = board[SHARE]
    if address == 0 or board[ENTRIES + entry] == 0:
        return -1
    record = carray(stack_buffer(_SHARE_RECORD, np.int64), _SHARE_RECORD)
    record[0], record[1], record[2], record[3] = board.ctypes.data, entry, a, m
    record[4], record[5], record[6], record[7] = k, n, b, out
    record[8], record[9], record[10] = cut, hi, -1
    call_address(address, record)
    return record[10]


@njit(cache=True, nogil=True)
def _dismiss(board):
    compare_exchange(board, STATE, IDLE, ABSENT)


class _Helper:
    def __init__(self):
        self.thread = None
        self.wake = threading.Event()
        self.prepare = []  # callables run once before the helper first serves
        self.prepared = False

    def prepare_once(self):
        """Compile (or load) the protocol and the job functions, on the
        thread that first wakes the helper (a compile on the helper's thread
        would hold the GIL against the caller's Python for its duration)."""
        if self.prepared:
            return
        for prepare in self.prepare:
            prepare()
        _serve.compile((numba.typeof(BOARD), numba.typeof(HELPER_LINGER)))
        signature = types.void(types.CPointer(types.int64))
        self.share = cfunc(signature, cache=True, nogil=True)(_share)  # (kept alive)
        BOARD[SHARE] = self.share.address
        self.prepared = True

    def run(self):
        while True:
            self.wake.wait()
            self.wake.clear()
            _serve(BOARD, HELPER_LINGER)


_HELPER = _Helper()
_HELPER_LOCK = threading.Lock()


def entry(slot: int, address: int) -> None:
    """Register the job function at ``address`` as entry ``slot`` (a kernel
    shares it by ``share(board, slot, ...)``)."""
    BOARD[ENTRIES + slot] = address


def on_helper_start(prepare) -> None:
    """Run ``prepare()`` once before the helper first serves (it registers
    job functions: ``entry``)."""
    _HELPER.prepare.append(prepare)


def helper_prepared() -> bool:
    """Whether the helper's functions are compiled (it has been woken)."""
    return _HELPER.prepared


def wake_helper() -> None:
    """Start the helper spinning if it is asleep (where there is a second
    thread to give it and spinning is supported); a kernel run right after
    may find it there, or not yet."""
    if BOARD[STATE] != ABSENT or not SPINS:
        return
    with _HELPER_LOCK:
        if count() < 2:
            return
        _HELPER.prepare_once()
        if _HELPER.thread is None:
            _HELPER.thread = threading.Thread(target=_HELPER.run, name="stepnet-helper",
                                              daemon=True)
            _HELPER.thread.start()
        _HELPER.wake.set()


def board_for_one_group():
    """The board of a kernel run as one group of sequences: ``BOARD`` where
    the helper can help (and woken if asleep), else ``ALONE``."""
    if not SPINS or count() < 2:
        return ALONE
    if BOARD[STATE] == ABSENT:
        wake_helper()
    return BOARD


def dismiss_helper() -> None:
    """Send a spinning, free helper to sleep (before the calling thread's work
    takes every core)."""
    if BOARD[STATE] == IDLE:
        _dismiss(BOARD)


def _after_fork_in_child():
    # the parent's helper thread is not in this process (its compiled
    # functions, and their addresses on the board, are), nor any thread
    # that held the lock
    global _HELPER_LOCK
    BOARD[STATE] = ABSENT
    _HELPER.thread = None
    _HELPER.wake = threading.Event()
    _HELPER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
