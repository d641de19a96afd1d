"""The threads stepnet runs compiled work on: a small pool of Python threads
calling ``nogil`` kernels, each kernel single-threaded (its BLAS calls too),
and one helper thread that takes a part of a kernel's work.

Nothing here uses Numba's parallel layer or a BLAS library's own thread pool,
so no step waits on a barrier and no idle pool spins beside the kernels. The
thread count is Numba's (``numba.set_num_threads``, ``NUMBA_NUM_THREADS``).

The helper is for runs too small for Python's threads (handing work to one
costs tens of microseconds on a virtual machine), not for a thread already
spinning in compiled code, which picks a job up in well under a microsecond:
a run of one group of sequences (a stream's chunk of 64 streams; one
sequence; with two threads, any run of a net without nested nets:
``NumbaProgram.splits``). A job is a compiled function and its arguments
(``atomics.job_of``). A kernel given ``BOARD`` cuts its work in two (its
sequences: ``group_cut``; a product, by rows or columns: ``blas``) and calls
``run_jobs``: if the helper is spinning and free, or woken and on its way,
it claims it (a compare-exchange: one claimant at a time), posts the second
part, runs the first and waits for the helper's (a job the helper has not
started within ``PATIENCE`` cycles it takes back and runs itself, so a
helper without a core never holds a kernel up); else it runs both parts.
The helper spins (``pause``) while jobs come, yields its core after a while
without one, and goes back to sleep ``HELPER_LINGER`` cycles after the last,
or when dismissed (``run_each`` dismisses it: Python's threads then take its
core). ``wake_helper()`` starts it (``board_for_one_group``).
x86-64 only (:data:`atomics.SPINS`): elsewhere kernels get ``ALONE``.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import numba
import numpy as np
from numba import carray, njit, types

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
    its heavy part); a spinning helper is sent to sleep first (the pool's
    threads take its core)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    dismiss_helper()
    futures = [_pool(len(items) - 1).submit(fn, item) for item in items[1:]]
    return [fn(items[0])] + [f.result() for f in futures]


# a run of fewer data elements (rows by the widest value a step computes) than
# this stays on one Python thread: handing work to another costs tens of
# microseconds on a virtual machine (NumbaProgram.splits; a layer's directions)
SPLIT_MIN_WORK = 1 << 16


def run_apart(fn, items, work):
    """``[fn(item) for item in items]``: at the same time, each on its own
    share of the threads (``count() // len(items)``: Numba's thread count is
    per thread, and kernels read it), where each runs over ``work`` elements
    (0: Python code, or a backend that stays on the calling thread) of at
    least ``SPLIT_MIN_WORK`` and there are as many threads as items; else
    one after the other, each with every thread."""
    items = list(items)
    if len(items) <= 1 or work <= 0 or work < SPLIT_MIN_WORK or count() < len(items):
        return [fn(item) for item in items]
    share = count() // len(items)

    def on_share(item):
        before = numba.get_num_threads()
        numba.set_num_threads(share)
        try:
            return fn(item)
        finally:
            numba.set_num_threads(before)

    return run_each(on_share, items)


# -- the helper ------------------------------------------------------------------

# a board's slots: the helper's state, the jobs it has run, whether kernels
# given the board share their work, the jobs posted that their claimant took
# back and ran (see ``run_jobs``), the blocks of columns of stepnet's own loop
# the kernels keep beyond half (blas: balanced by how long they wait), and
# the job (from JOB: the address of its C function, then of its record:
# ``atomics.job_of``)
STATE, JOBS, SHARES, TAKEN_BACK, BALANCE, JOB = 0, 1, 2, 3, 4, 5
# the states: asleep; spinning, free; claimed by a kernel writing a job; a job
# to run; that job running; that job done (the claimant sets IDLE again);
# woken, not spinning yet (a kernel may claim it and post a job: the helper
# runs it when it comes, or the claimant takes it back)
ABSENT, IDLE, CLAIMED, POSTED, RUNNING, DONE, WAKING = 0, 1, 2, 3, 4, 5, 6
BOARD_SIZE = 8  # (a cache line)
BOARD = np.zeros(BOARD_SIZE, np.int64)
BOARD[SHARES] = 1
# the board of a kernel that shares nothing (its run takes every thread
# already, or would not use the helper)
ALONE = np.zeros_like(BOARD)
# cycles the helper spins after its last job (about half a millisecond)
HELPER_LINGER = 1 << 21
# cycles a kernel done with its part waits for the helper to start the job
# before it runs the job itself (the helper's thread is not on a core: the
# machine has more threads running than cores); a job started and not done
# by then gets the core, yielded at each check
PATIENCE = 1 << 14


@njit(cache=True, nogil=True)
def _serve(board, linger):
    """The helper's loop: run each job posted, until ``linger`` cycles pass
    without one or a dismissal."""
    compare_exchange(board, STATE, WAKING, IDLE)  # (unless a job was posted already)
    last = cycles()
    while True:
        state = load_acquire(board, STATE)
        if state == WAKING:  # (woken again before this loop saw its dismissal)
            compare_exchange(board, STATE, WAKING, IDLE)
        elif state == POSTED and compare_exchange(board, STATE, POSTED, RUNNING):
            call_address(board[JOB], board[JOB + 1:JOB + 2])
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


# what ``run_jobs`` returns where a part raised
RAISED = -2


@njit(inline="always")
def _claim(board):
    """Claim the helper for a job: spinning and free, or woken and on its way."""
    return (compare_exchange(board, STATE, IDLE, CLAIMED)
            or compare_exchange(board, STATE, WAKING, CLAIMED))


_JOB = types.UniTuple(types.int64, 2)


# (one signature, compiled once: every caller's types)
@njit(types.int64(types.int64[::1], _JOB, _JOB, types.boolean), cache=True, nogil=True)
def run_jobs(board, own, other, both):
    """Run the job ``own`` (``atomics.job_of``) on this thread and, if
    ``both``, the job ``other``: on the helper where it is spinning and free
    or woken (claimed by a compare-exchange: one kernel at a time), else here
    after ``own``. A job the helper has not started within ``PATIENCE`` cycles of
    ``own``'s end this thread takes back and runs. The cycles this thread
    waited for the helper (-1 where the helper did not take ``other``), or
    ``RAISED`` where a part raised (the caller then calls its function
    itself, to raise)."""
    posted = both and _claim(board)
    if posted:
        board[JOB], board[JOB + 1] = other[0], other[1]
        store_release(board, STATE, POSTED)
    job = carray(stack_buffer(1, np.int64), 1)
    job[0] = own[1]
    call_address(own[0], job)
    waited = -1
    if posted:
        start = cycles()
        while True:
            state = load_acquire(board, STATE)
            if state == DONE:
                break
            if cycles() - start > PATIENCE:
                if state == POSTED and compare_exchange(board, STATE, POSTED, CLAIMED):
                    call_address(board[JOB], board[JOB + 1:JOB + 2])
                    board[TAKEN_BACK] += 1
                    break
                yield_core()  # (started, not done: the helper's thread may need this core)
            pause()
        store_release(board, STATE, IDLE)
        waited = cycles() - start
    elif both:
        job[0] = other[1]
        call_address(other[0], job)
    failed = carray(pointer_to(own[1], np.int64), 1)[0]
    if both:
        failed |= carray(pointer_to(other[1], np.int64), 1)[0]
    return RAISED if failed else waited


@njit(types.boolean(types.int64[::1], _JOB), cache=True, nogil=True)
def post_job(board, job):
    """Post ``job`` (``atomics.job_of``) to the helper where it is spinning
    and free (claimed as in ``run_jobs``) and return at once: whether it was
    posted (if not, the caller runs it). A job posted must be finished
    (``finish_job``) before its record, or what it writes, is used again or
    freed, and before anything else is posted on ``board``."""
    if board[SHARES] == 0 or not _claim(board):
        return False
    board[JOB], board[JOB + 1] = job[0], job[1]
    store_release(board, STATE, POSTED)
    return True


@njit(types.int64(types.int64[::1], _JOB), cache=True, nogil=True)
def finish_job(board, job):
    """Wait for ``job``, which ``post_job`` posted, to be done: by the
    helper, or here where the helper has not started it yet (its thread off
    the core); the board is free again after. ``RAISED`` where the job
    raised (the caller then calls its function itself, to raise), else 0."""
    start = cycles()
    while True:
        state = load_acquire(board, STATE)
        if state == DONE:
            break
        if state == POSTED and compare_exchange(board, STATE, POSTED, CLAIMED):
            call_address(board[JOB], board[JOB + 1:JOB + 2])
            board[TAKEN_BACK] += 1
            break
        if cycles() - start > PATIENCE:
            yield_core()  # (started, not done: the helper's thread may need this core)
        pause()
    store_release(board, STATE, IDLE)
    return RAISED if carray(pointer_to(job[1], np.int64), 1)[0] else 0


# a run of sequences is cut in two, one part for the helper, from this many
# rows by the multiply-adds of a row's products in a step (the caller gives
# such runs BOARD: NumbaProgram.board), and from this many rows (a handover
# costs well under a microsecond; this is a few)
GROUP_WORK = 1 << 18
GROUP_ROWS = 16


@njit(types.int64(types.int64[::1], types.int64[::1]), cache=True, nogil=True)
def group_cut(board, lengths):
    """Where a run of the sequences of ``lengths`` is cut: ``0:cut`` for the
    calling thread, ``cut:`` for the helper (``run_jobs``), about half the
    rows each, where there are two sequences or more and ``GROUP_ROWS``
    rows, the board shares and the helper is spinning and free or woken;
    else ``len(lengths)`` (not cut)."""
    n = lengths.shape[0]
    if n < 2 or board[SHARES] == 0:
        return n
    state = load_acquire(board, STATE)
    if state != IDLE and state != WAKING:
        return n
    total = 0
    for length in lengths:
        total += length
    if total < GROUP_ROWS:
        return n
    rows = 0
    for i in range(n - 1):
        rows += lengths[i]
        if 2 * rows >= total:
            return i + 1
    return n - 1


@njit(cache=True, nogil=True)
def _dismiss(board):
    if not compare_exchange(board, STATE, IDLE, ABSENT):
        compare_exchange(board, STATE, WAKING, ABSENT)


class _Helper:
    def __init__(self):
        self.thread = None
        self.wake = threading.Event()
        self.compiled = False

    def compile_once(self):
        """Compile (or load) the helper's loop on the thread that first wakes
        it (a compile on the helper's thread would hold the GIL against the
        caller's Python for its duration)."""
        if not self.compiled:
            _serve.compile((numba.typeof(BOARD), numba.typeof(HELPER_LINGER)))
            self.compiled = True

    def run(self):
        while True:
            self.wake.wait()
            self.wake.clear()
            _serve(BOARD, HELPER_LINGER)


_HELPER = _Helper()
_HELPER_LOCK = threading.Lock()


def wake_helper() -> None:
    """Start the helper spinning if it is asleep (where there is a second
    thread to give it and spinning is supported); a kernel run right after
    may find it there, or not yet."""
    if BOARD[STATE] != ABSENT or not SPINS:
        return
    with _HELPER_LOCK:
        if BOARD[STATE] != ABSENT or count() < 2:  # (woken meanwhile: only here leaves ABSENT)
            return
        _HELPER.compile_once()
        if _HELPER.thread is None:
            _HELPER.thread = threading.Thread(target=_HELPER.run, name="stepnet-helper",
                                              daemon=True)
            _HELPER.thread.start()
        BOARD[STATE] = WAKING  # (before the thread can come: it then sets IDLE)
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
    if BOARD[STATE] == IDLE or BOARD[STATE] == WAKING:
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
