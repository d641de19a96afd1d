"""The threads stepnet runs compiled work on: a small pool of Python threads
calling ``nogil`` kernels, each kernel single-threaded (its BLAS calls too),
and one helper thread that takes a part of a kernel's work.

Nothing here uses Numba's parallel layer or a BLAS library's own thread pool,
so no step waits on a barrier and no idle pool spins beside the kernels. The
thread count is Numba's (``numba.set_num_threads``, ``NUMBA_NUM_THREADS``).

The helper is for runs too small for Python's threads (handing work to one
costs far more than such a run's work), not for a thread already spinning
in compiled code, which picks a job up almost at once:
a run of one group of sequences (a stream's chunk of 64 streams; one
sequence; with two threads, any run whose nets all cut their sequences:
``NumbaProgram.splits``). A job is a compiled function and its arguments
(``atomics.job_of``). A kernel given ``BOARD`` cuts its work in two (its
sequences: ``group_cut``; a product, by rows or columns: ``blas``) and calls
``run_jobs``: if the helper is spinning and free, or woken and on its way,
it claims it (a compare-exchange: one claimant at a time), posts the second
part, runs the first and waits for the helper's (a job the helper has not
started within ``PATIENCE`` cycles it takes back and runs itself, so a
helper without a core never holds a kernel up); else it runs both parts
(the own loop's product whole: ``run_parts_or_whole``). The cut depends on
the work's shape only, never on whether the helper was free: a call gives
the same bits whoever computes which part, with any library. A product cut
so is judged after it (``judge_sharing``): a class of products whose
handovers lose more than they win over a window of cycles runs on the
kernel's thread alone for a while (``sharing_paused``).
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
from numba import carray, njit

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
    threads take its core). An item no pool thread has started runs on the
    calling thread: a call from a pool thread (a direction run apart, cut in
    groups) never waits for a pool thread that waits for it."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    dismiss_helper()
    futures = [_pool(len(items) - 1).submit(fn, item) for item in items[1:]]
    results = [fn(items[0])]
    for item, future in zip(items[1:], futures):
        results.append(fn(item) if future.cancel() else future.result())
    return results


# a run of fewer data elements (rows by the widest value a step computes) than
# this stays on one Python thread: handing work to another costs more than
# a smaller run gains from it (NumbaProgram.splits; a layer's directions)
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

# a board's helper: asleep; spinning, free; claimed by a kernel writing a job;
# a job to run; that job running; that job done (the claimant sets IDLE
# again); woken, not spinning yet (a kernel may claim it and post a job: the
# helper runs it when it comes, or the claimant takes it back)
ABSENT, IDLE, CLAIMED, POSTED, RUNNING, DONE, WAKING = 0, 1, 2, 3, 4, 5, 6
CLASSES = 16  # classes of products judged apart (by the log2 of their multiply-adds)
# a board: int64 slots, which compiled code addresses by index (atomics work
# on an array's elements), laid out as this record: ``board.view(BOARD_RECORD)[0]``
# reads and writes them by name
BOARD_RECORD = np.dtype([
    ("state", np.int64), ("jobs", np.int64),  # the helper's state; the jobs it has run
    ("shares", np.int64),  # what kernels given the board share (bits: CUT ... PAUSING)
    ("taken_back", np.int64),  # jobs posted that their claimant took back and ran (run_jobs)
    ("balance", np.int64),  # the own loop's blocks of columns the kernels keep beyond half (blas)
    ("job", np.int64, 2),  # the job: the address of its C function, then of its record (job_of)
    ("pauses", np.int64),  # the pauses of sharing (judge_sharing)
    # from the second line, written by the kernels only (the helper's changes only
    # at a handover), per class of products: the cycle its window of judgment
    # started, its handovers won less those lost in it, the cycle until which
    # such products are not shared, the log2 of that pause's length in PAUSEs
    ("window_start", np.int64, CLASSES), ("net", np.int64, CLASSES),
    ("paused_until", np.int64, CLASSES), ("pause_level", np.int64, CLASSES),
    # until when the helper stays awake without a job (hold_helper: from a kernel's start)
    ("held_until", np.int64)])
STATE, JOBS, SHARES, TAKEN_BACK, BALANCE, JOB, PAUSES, WINDOW_START, NET, PAUSED_UNTIL, \
    PAUSE_LEVEL, HELD_UNTIL = (BOARD_RECORD.fields[name][1] // 8 for name in BOARD_RECORD.names)
BOARD_SIZE = BOARD_RECORD.itemsize // 8
assert WINDOW_START == 8  # (the kernels' slots start on the board's second cache line)


def _board():
    """A board's zeros, its first slot at the start of a cache line (the
    helper spins reading that line; a job's two slots are on it too)."""
    raw = np.zeros(BOARD_SIZE + 8, np.int64)
    start = (-raw.ctypes.data % 64) // 8
    return raw[start:start + BOARD_SIZE]


# SHARES's bits (ALONE: none): a group's sequences cut (group_cut), the own
# loop's products by columns, a library's by rows, the chunk ahead (``ahead``),
# losing classes paused (``sharing_paused``); benchmarks/mechanisms.py clears each
CUT, COLUMNS, ROWS, AHEAD, PAUSING = 1, 2, 4, 8, 16
EVERY = CUT | COLUMNS | ROWS | AHEAD | PAUSING
BOARD = _board()
BOARD[SHARES] = EVERY
# a board that shares nothing (a run on every thread, or no use for the helper)
ALONE = _board()
# cycles the helper spins after its last job (under a millisecond)
HELPER_LINGER = 1 << 21
# cycles a kernel given the board holds the helper awake from its start
# (a few milliseconds): the work a kernel does before its first handover (its
# weights transposed and packed, the products before its time loop) took
# longer than HELPER_LINGER in the backward of a training step right after
# its forward (the helper spinning from the forward's job went to sleep
# before the backward's cut of its sequences, which then ran on one core)
HOLD = 1 << 23
# cycles a kernel done with its part waits for the helper to start the job
# before it runs the job itself (the helper's thread is not on a core: the
# machine has more threads running than cores); a job started and not done
# by then gets the core, yielded at each check
PATIENCE = 1 << 14


@njit(cache=True, nogil=True)
def _serve(board, linger):
    """The helper's loop: run each job posted, until ``linger`` cycles pass
    without one (and the hold, ``hold_helper``, has passed) or a dismissal."""
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
            now = cycles()
            idle = now - last
            if idle > linger and now > board[HELD_UNTIL]:
                if compare_exchange(board, STATE, IDLE, ABSENT):
                    return
            elif idle > linger >> 4:
                yield_core()  # (a while without a job: a thread waiting for a core goes first)
        pause()


# a class of products that lost more handovers than it won over a WINDOW of
# cycles (a millisecond or two) runs on the kernel's thread alone for PAUSE cycles
# (4 WINDOWs), then is shared again; one that loses again right after its
# pause pauses twice as long, up to 2**MAX_PAUSE_LEVEL times (a helper's
# core busy with another program's thread). A count, not a sum of cycles:
# a helper's thread off its core for a millisecond once in a while costs
# more than the window's handovers gain, and pausing would not help
WINDOW = 1 << 22
PAUSE = 1 << 24
MAX_PAUSE_LEVEL = 6


@njit(inline="always")
def work_class(work):
    """A product's class on a board: the log2 of its multiply-adds (from
    2**12: smaller ones are never shared)."""
    c = 0
    while work >= 1 << 13 and c < CLASSES - 1:
        work >>= 1
        c += 1
    return c


@njit(inline="always")
def sharing_paused(board, c, now):
    """Whether products of class ``c`` (``work_class``) run whole on the
    calling thread at cycle ``now``, the class having lost too many
    handovers lately (``judge_sharing``)."""
    return board[SHARES] & PAUSING != 0 and now < board[PAUSED_UNTIL + c]


@njit(inline="always")
def judge_sharing(board, c, own_cycles, waited, own_part, whole, now):
    """After a shared product of class ``c`` (``run_jobs``), at cycle
    ``now``: the calling thread took
    ``own_cycles`` for ``own_part`` of the ``whole`` (columns, rows), then
    ``waited`` for the rest. The handover is lost where the wait was longer
    than the rest would have taken here (a helper whose core is busy with
    another program's thread: its job started late or taken back). A class
    that lost more handovers than it won over a ``WINDOW`` pauses
    (``sharing_paused``): PAUSE cycles, or twice its last pause where that
    ended less than its length ago. What a handover costs beyond the wait
    (the lines each core then reads from the other's, dearest where the two
    cores share no cache) is not seen here."""
    _count_handover(board, c, waited * own_part <= own_cycles * (whole - own_part), now)


@njit(inline="always")
def _count_handover(board, c, won, now):
    """Count a handover of class ``c``, ``won`` or lost, at cycle ``now``
    (``judge_sharing``); at the end of a window, pause the class where it
    lost more than it won."""
    net = board[NET + c] + (1 if won else -1)
    start = board[WINDOW_START + c]
    if start > 0 and now - start < WINDOW:
        board[NET + c] = net
        return
    if start > 0 and net < 0:
        level = board[PAUSE_LEVEL + c]
        if now - board[PAUSED_UNTIL + c] > PAUSE << level:
            level = 0
        elif level < MAX_PAUSE_LEVEL:
            level += 1
        board[PAUSE_LEVEL + c] = level
        board[PAUSED_UNTIL + c] = now + (PAUSE << level)
        board[PAUSES] += 1
        now += PAUSE << level  # (the next window: from the pause's end)
    board[NET + c] = 0 if start > 0 else net
    board[WINDOW_START + c] = now


# what ``run_jobs`` returns where a part raised
RAISED = -2


@njit(inline="always")
def _claim(board):
    """Claim the helper for a job: spinning and free, or woken and on its way."""
    return (compare_exchange(board, STATE, IDLE, CLAIMED)
            or compare_exchange(board, STATE, WAKING, CLAIMED))


@njit(inline="always")
def _run(job):
    """Run ``job`` (``atomics.job_of``) on this thread."""
    record = carray(stack_buffer(1, np.int64), 1)
    record[0] = job[1]
    call_address(job[0], record)


@njit(inline="always")
def _raised(job):
    """Whether ``job``, run, raised (its record's first word)."""
    return carray(pointer_to(job[1], np.int64), 1)[0] != 0


@njit(inline="always")
def _post_and_wait(board, own, other):
    """``run_jobs``' work once it claimed the helper: ``other`` posted to it,
    ``own`` run here, then the helper's part waited for (taken back after
    ``PATIENCE`` cycles where the helper has not started it)."""
    board[JOB], board[JOB + 1] = other[0], other[1]
    store_release(board, STATE, POSTED)
    _run(own)
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
    return RAISED if _raised(own) or _raised(other) else waited


@njit(cache=True, nogil=True)
def run_here(job):
    """Run ``job`` on this thread: -1, or ``RAISED``."""
    _run(job)
    return RAISED if _raised(job) else -1


@njit(cache=True, nogil=True)
def run_both_here(own, other):
    """Run ``own``, then ``other``, on this thread: -1, or ``RAISED``."""
    _run(own)
    _run(other)
    return RAISED if _raised(own) or _raised(other) else -1


@njit(cache=True, nogil=True)
def run_jobs(board, own, other, both):
    """Run the job ``own`` (``atomics.job_of``) on this thread and, if
    ``both``, the job ``other``: on the helper where it is spinning and free
    or woken (claimed by a compare-exchange: one kernel at a time), else here
    after ``own``. A job the helper has not started within ``PATIENCE`` cycles of
    ``own``'s end this thread takes back and runs. The cycles this thread
    waited for the helper (-1 where the helper did not take ``other``), or
    ``RAISED`` where a part raised (the caller then calls its function
    itself, to raise)."""
    if both and _claim(board):
        return _post_and_wait(board, own, other)
    _run(own)
    if both:
        _run(other)
    return RAISED if _raised(own) or (both and _raised(other)) else -1


@njit(cache=True, nogil=True)
def run_parts_or_whole(board, own, other, whole):
    """``own`` here and ``other`` on the helper where it is spinning and free
    or woken, as ``run_jobs`` (the cycles waited, or ``RAISED``); else the
    job ``whole``, the work of both at once, here (-1, or ``RAISED``): for
    work whose whole gives its parts' bits (the own loop cut by columns)."""
    if _claim(board):
        return _post_and_wait(board, own, other)
    return run_here(whole)


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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
    return RAISED if _raised(job) else 0


# a run of sequences is cut in two, one part for the helper, from this many
# rows by the multiply-adds of a row's products in a step (the caller gives
# such runs BOARD: NumbaProgram.board), and from this many rows (a handover
# costs well under a microsecond; this is a few)
GROUP_WORK = 1 << 18
GROUP_ROWS = 16


@njit(cache=True, nogil=True)
def group_cut(board, lengths):
    """Where a run of the sequences of ``lengths`` is cut: ``0:cut`` for the
    calling thread, ``cut:`` for the helper where it is free (``run_jobs``;
    else both here), about half the rows each, where there are two sequences
    or more and ``GROUP_ROWS`` rows and the board shares; else
    ``len(lengths)``. Never by whether the helper is free: the same bits."""
    n = lengths.shape[0]
    if n < 2 or board[SHARES] & CUT == 0:
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


def compile_helpers() -> None:
    """Compile (into the disk cache) or load the helper's functions that Python
    calls, which no kernel's compile does: the compile worker does, with a
    kernel (none compiles at import: a tiered first call answers before)."""
    _HELPER.compile_once()
    hold_helper.compile((numba.typeof(BOARD),))
    _dismiss.compile((numba.typeof(BOARD),))


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
    the helper can help (woken if asleep, and held awake for the kernel's
    first ``HOLD`` cycles: ``hold_helper``), else ``ALONE``."""
    if not SPINS or count() < 2:
        return ALONE
    if BOARD[STATE] == ABSENT:
        wake_helper()
    hold_helper(BOARD)
    return BOARD


@njit(cache=True, nogil=True)
def hold_helper(board):
    """Keep the helper of ``board`` from going back to sleep for the next
    ``HOLD`` cycles, jobs or none (``_serve``)."""
    board[HELD_UNTIL] = max(board[HELD_UNTIL], cycles() + HOLD)


def dismiss_helper() -> None:
    """Send a spinning, free helper to sleep (before the calling thread's work
    takes every core)."""
    if BOARD[STATE] == IDLE or BOARD[STATE] == WAKING:
        _dismiss(BOARD)


def _after_fork_in_child():
    # the parent's helper thread is not in this process (its compiled
    # functions, and their addresses on the board, are), nor any thread
    # that held the lock
    global _HELPER_LOCK, _POOL
    _POOL = None  # (its threads are the parent's: a task given to it would never run)
    BOARD[STATE] = ABSENT
    _HELPER.thread = None
    _HELPER.wake = threading.Event()
    _HELPER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
