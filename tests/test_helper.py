"""The helper thread (stepnet.jit.threads): a run too small for groups of
sequences on Python's threads gives about half of its sequences to the
helper; a product of a one-sequence run is cut in two at a place fixed by
its shape, the helper spinning in compiled code takes the second part, and
the result is the same, bit for bit, whoever computes which part. A job is a
compiled function and its arguments (atomics.job_of)."""

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from numba import njit

import stepnet as sn
from conftest import assert_close
from nets import nested_encoder
from stepnet.jit import ahead, atomics, blas, cpu_codegen, own_loop, product_timing, threads


def slots(board):
    """``board``'s slots by name: a view that reads and writes the board."""
    return board.view(threads.BOARD_RECORD)[0]


pytestmark = pytest.mark.skipif(not atomics.SPINS, reason="the helper spins on x86-64 only")


@njit(nogil=True)
def _products(a, w, out, table, board, reps):
    """``reps`` per-step products of ``a @ w`` (``table``: small_rows), the
    own loop on the weights' panels."""
    prepared = blas.pack(w, a.shape[0], blas.PANEL_MIN_ROWS, table, board)
    for _ in range(reps):
        blas.gemm_packed(a, prepared, out)


@njit(nogil=True)
def _hoisted(a, w, out, table, board):
    blas.gemm_hoisted(a, w, out, table, board)


@pytest.fixture
def per_step_shared(monkeypatch):
    """``set(flag)``: the small-product table (a kernel's run-time argument)
    with every size's per-step products shared with the helper (``flag``) or
    never, whatever this machine measured."""
    table = product_timing.small_rows_table().copy()

    def set_sharing(flag):
        table[2] = int(flag)
        table.flags.writeable = False
        monkeypatch.setattr(product_timing, "_SMALL_ROWS", {"float32": table, "float64": table})

    return set_sharing


# one thread (NUMBA_NUM_THREADS=1): no helper thread runs (this module needs
# x86-64 already, pytestmark)
ONE_THREAD = threads.count() < 2
needs_helper = pytest.mark.skipif(ONE_THREAD, reason="one thread: no helper thread")


def _until_the_helper_helps(run, timeout=60.0):
    """Call ``run()`` with the helper awake until the helper has run a job of
    it; whether it did. Skips the test where no helper runs (``ONE_THREAD``)."""
    if ONE_THREAD:
        pytest.skip("one thread: no helper thread")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = slots(threads.BOARD)["jobs"]
        threads.wake_helper()
        while slots(threads.BOARD)["state"] == threads.ABSENT and time.monotonic() < deadline:
            time.sleep(0)  # (its thread starts, or compiles its jobs the first time)
            threads.wake_helper()
        run()
        if slots(threads.BOARD)["jobs"] > before:
            return True
    return False


def _shared_if_cut(run, cut):
    """``run()`` where the product is cut (``cut``), with the helper running
    a job of it; else once, computed whole here."""
    if cut:
        assert _until_the_helper_helps(run)
    else:
        run()


def test_small_gemm_columns_equal_the_whole_product_bit_for_bit(rng):
    """Any range of at least 32 columns equals those columns of the whole
    product (every block's sums in order of k): the helper's cut changes
    nothing."""
    for m, k, n in [(1, 128, 384), (3, 40, 100), (4, 64, 64), (5, 17, 300), (9, 8, 96)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        whole = np.empty((m, n), np.float32)
        own_loop.small_gemm(a, b, whole)
        for lo, hi in [(0, 32), (32, n), (n - 32, n), ((n // 2 + 16) // 32 * 32, n),
                       (0, (n // 2 + 16) // 32 * 32), (7, 7 + 32)]:
            part = np.full((m, n), np.nan, np.float32)
            own_loop.small_gemm_columns(a, b, part, lo, hi)
            np.testing.assert_array_equal(part[:, lo:hi], whole[:, lo:hi], err_msg=(m, k, n, lo))
            assert np.isnan(part[:, :lo]).all() and np.isnan(part[:, hi:]).all()


@pytest.mark.parametrize("m, k, n, own", [(1, 128, 384, True), (4, 96, 192, True),
                                          (200, 64, 256, False)])
def test_a_shared_product_is_the_same_whoever_computes_its_parts(rng, m, k, n, own):
    """stepnet's own loop cut by columns, the library's by rows: the helper
    runs the second part (its job counter moves); with the helper asleep
    the calling thread computes both parts, to the same bits (any library:
    the cut is the product's shape's, not the helper's). stepnet's own loop
    also equals the product computed whole (ALONE: not cut), its columns
    being computed alike in any part."""
    blas.register_small_gemm(np.float32)
    table = np.array([[1 << 40], [10**6 if own else 0]], np.int64)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    alone = np.empty((m, n), np.float32)
    _products(a, w, alone, table, threads.ALONE, 1)
    shared = np.full((m, n), np.nan, np.float32)
    _shared_if_cut(lambda: _products(a, w, shared, table, threads.BOARD, 20), True)
    np.testing.assert_allclose(shared, a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    if own:
        np.testing.assert_array_equal(shared, alone)
    threads.dismiss_helper()  # both parts computed here: the same bits
    time.sleep(0.01)
    again = np.full((m, n), np.nan, np.float32)
    _products(a, w, again, table, threads.BOARD, 1)
    np.testing.assert_array_equal(again, shared)


def test_a_library_product_is_cut_by_rows_by_its_shape_only():
    """``blas.row_cut``: a library's product big enough is cut in half on a
    board that shares, whatever the helper's state and whatever the
    library; never on ALONE, nor under 16 rows."""
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    for state in (threads.ABSENT, threads.IDLE, threads.RUNNING):
        slots(board)["state"] = state
        assert blas.row_cut(200, 200 * 64 * 256, board) == 100
    assert blas.row_cut(15, 15 * 1024 * 1024, board) == 0
    assert blas.row_cut(200, 200 * 64 * 256, threads.ALONE) == 0


def test_a_hoisted_product_is_shared_by_rows(rng):
    blas.register_small_gemm(np.float32)  # (the own loop's symbol, before a caller compiles)
    a = rng.standard_normal((1000, 64)).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    table = np.array([[1 << 40], [4]], np.int64)
    out = np.full((1000, 96), np.nan, np.float32)
    _shared_if_cut(lambda: _hoisted(a, w, out, table, threads.BOARD), True)
    np.testing.assert_allclose(out, a.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def _helper_never_comes(rng):
    """A board whose helper is free but never comes (its thread off the
    core), a product's row and weights ``[1, 128] @ [128, 384]`` (cut by
    columns), and their product computed whole."""
    blas.register_small_gemm(np.float32)
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    slots(board)["state"] = threads.IDLE
    a = rng.standard_normal((1, 128)).astype(np.float32)
    w = rng.standard_normal((128, 384)).astype(np.float32)
    whole = np.empty((1, 384), np.float32)
    own_loop.small_gemm(a, w, whole)
    return board, a, w, whole


def test_a_job_the_helper_never_starts_is_run_by_the_kernel(rng):
    """A board whose helper is free but never comes (its thread off the
    core): the kernel waits ``PATIENCE`` cycles, takes its job back and runs
    it; the board is free again and no job counts as the helper's; and the
    kernel keeps more columns for itself the next time."""
    board, a, w, whole = _helper_never_comes(rng)
    slots(board)["window_start"][3] = 1 << 62  # (no window of its class ends here: no pause)
    out = np.full((1, 384), np.nan, np.float32)
    _products(a, w, out, np.array([[1 << 40], [8]]), board, 3)
    np.testing.assert_array_equal(out, whole)
    assert slots(board)["state"] == threads.IDLE and slots(board)["jobs"] == 0
    assert slots(board)["taken_back"] == 3
    # each wait was longer than a block of columns takes: the kernel keeps a
    # block more each time (the balance), and the result is the same bits
    assert slots(board)["balance"] == 3
    _products(a, w, out, np.array([[1 << 40], [8]]), board, 1)
    np.testing.assert_array_equal(out, whole)


@njit
def _judge(board, work, own_cycles, waited, own_part, whole):
    threads.judge_sharing(board, threads.work_class(work), own_cycles, waited, own_part, whole,
                          atomics.cycles())


@njit
def _count(board, c, won, now):
    threads._count_handover(board, c, won, now)


@njit
def _now():
    return atomics.cycles()


def _handovers(board, c, start, end, lost_every=0, step=1000):
    """Count handovers of class ``c`` every ``step`` cycles from ``start`` to
    ``end`` (each ``lost_every``-th lost, or every one where -1), where the
    class is not paused at that cycle (as ``blas.share_rows``); the cycle
    after."""
    i, now = 0, start
    while now < end:
        i += 1
        if now >= slots(board)["paused_until"][c]:
            _count(board, c, not (lost_every == -1 or (lost_every and i % lost_every == 0)), now)
        now += step
    return now


def test_a_handover_is_lost_where_the_wait_is_longer_than_the_rest_here():
    """``judge_sharing`` counts a handover won where the kernel waited no
    longer than the helper's part would have taken on its own thread (its
    own part's cycles scaled by the parts' sizes), lost otherwise; it finds
    a product's class by the log2 of its multiply-adds."""
    for waited, own_part, whole, won in [(900, 1, 2, True), (1100, 1, 2, False),
                                        (2900, 1, 4, True), (3100, 1, 4, False),
                                        (0, 3, 4, True), (400, 3, 4, False)]:
        board = np.zeros_like(threads.BOARD)
        _judge(board, 1 << 16, 1000, waited, own_part, whole)  # (a window's first: it starts it)
        assert slots(board)["net"][4] == (1 if won else -1), (waited, own_part, whole)
        assert slots(board)["window_start"][4] > 0 and slots(board)["paused_until"][4] == 0
    for work, c in [(1 << 12, 0), ((1 << 14) - 1, 1), (1 << 14, 2), (49152, 3), (1 << 40, 15)]:
        board = np.zeros_like(threads.BOARD)
        _judge(board, work, 1000, 0, 1, 2)
        assert slots(board)["net"][c] == 1, (work, c)


def test_a_class_of_products_whose_handovers_lose_runs_alone_for_a_while():
    """Sharing is counted per class of products over windows of
    ``WINDOW`` cycles: a window that won more handovers than it lost
    changes nothing, even with one lost in five; one that lost more pauses
    its class (not the others) for ``PAUSE`` cycles; losing again right
    after the pause pauses twice as long, up to ``2**MAX_PAUSE_LEVEL``
    times; a long good spell between pauses starts them over at ``PAUSE``.
    (The clock is the test's: ``_count_handover`` takes the cycle.)"""
    W, P = threads.WINDOW, threads.PAUSE
    board = np.zeros_like(threads.BOARD)
    now = _handovers(board, 4, 10**12, 10**12 + 3 * W, lost_every=5)
    assert slots(board)["pauses"] == 0 and slots(board)["paused_until"][4] == 0
    start = now
    now = _handovers(board, 4, now, now + 3 * W, lost_every=-1)
    assert slots(board)["pauses"] == 1 and slots(board)["pause_level"][4] == 0
    until = slots(board)["paused_until"][4]
    assert start + W <= until - P <= start + 2 * W  # (at the end of the first window lost)
    assert slots(board)["paused_until"][8] == 0  # (another class: not paused)
    for level in range(1, threads.MAX_PAUSE_LEVEL + 2):  # (losing right after each pause)
        now = _handovers(board, 4, until, until + 3 * W, lost_every=-1)
        expected = min(level, threads.MAX_PAUSE_LEVEL)
        assert slots(board)["pause_level"][4] == expected
        assert slots(board)["paused_until"][4] - until <= W + (P << expected) + 1000
        until = slots(board)["paused_until"][4]
    pauses = slots(board)["pauses"]
    now = _handovers(board, 4, until, until + (P << threads.MAX_PAUSE_LEVEL) + 2 * P,
                     step=100_000)  # (a long good spell)
    assert slots(board)["pauses"] == pauses
    _handovers(board, 4, now, now + 3 * W, lost_every=-1)
    assert slots(board)["pauses"] == pauses + 1 and slots(board)["pause_level"][4] == 0


def test_a_product_whose_helper_never_comes_stops_posting_to_it(rng):
    """A board whose helper is free but never comes: each handover waits
    ``PATIENCE`` cycles and is taken back, a loss; after a window of them
    the product's class (``[1, 128] @ [128, 384]``: class 3) pauses, and
    while paused runs the whole product here (no job posted: taken back stops
    counting); the result stays the same bits."""
    board, a, w, whole = _helper_never_comes(rng)
    out = np.full((1, 384), np.nan, np.float32)
    table = np.array([[1 << 40], [8]])
    deadline = time.monotonic() + 30
    while slots(board)["pauses"] == 0 and time.monotonic() < deadline:
        _products(a, w, out, table, board, 10)
    np.testing.assert_array_equal(out, whole)
    assert slots(board)["pauses"] == 1 and slots(board)["state"] == threads.IDLE
    taken = slots(board)["taken_back"]
    assert taken >= 1
    slots(board)["paused_until"][3] = 1 << 62  # (the pause held while these run)
    _products(a, w, out, table, board, 10)
    assert slots(board)["taken_back"] == taken
    np.testing.assert_array_equal(out, whole)
    slots(board)["paused_until"][3] = 0  # (the pause over: posted, taken back)
    _products(a, w, out, table, board, 1)
    assert slots(board)["taken_back"] == taken + 1
    np.testing.assert_array_equal(out, whole)


def test_a_one_sequence_gru_shares_its_step_with_the_helper(rng, monkeypatch):
    """A GRU of 128 units over one sequence: its step's product [1, 128] @
    [128, 384] goes half to the helper; the kernel equals the interpreter,
    and a batch of many sequences (groups on threads) gives every sequence
    the same result. (The own loop is told to take products of one row, as
    it is measured to on most machines: only its products are cut by
    columns.)"""
    one_row = np.array([[1 << 40], [1]], np.int64)
    monkeypatch.setattr(product_timing, "_SMALL_ROWS", {"float32": one_row, "float64": one_row})
    H, T, features = 128, 40, 16
    X = sn.LoDTensor.from_lengths(rng.standard_normal((T, features)).astype(np.float32), [[T]])
    layer = sn.nn.GRU(features, H, seed=3)
    expected = layer(X, backend="interpreter")
    before = slots(threads.BOARD)["jobs"]
    assert _until_the_helper_helps(lambda: layer(X, backend="numba"))
    got = layer(X, backend="numba")
    assert slots(threads.BOARD)["jobs"] > before
    assert_close(got, expected)


def test_a_small_lstm_over_many_sequences_gives_half_of_them_to_the_helper(rng):
    """64 sequences of an LSTM of 32 units (as 64 VAD streams): too few rows
    for groups on Python's threads, enough for the helper, which runs the
    time loop of the second half of the sequences (one job a call, not one a
    step; the product of all steps' inputs is too small to share); the
    kernel equals the interpreter, and the ragged lengths (some sequences
    empty) stay each sequence's own."""
    H, features = 32, 2
    lengths = rng.integers(0, 9, 64)
    lengths[[0, 40]] = 8, 0
    X = sn.LoDTensor.from_lengths(
        rng.standard_normal((int(lengths.sum()), features)).astype(np.float32), [lengths])
    layer = sn.nn.LSTM(features, H, seed=5)
    expected = layer(X, backend="interpreter")
    layer(X, backend="numba")  # (compiled)
    before = slots(threads.BOARD)["jobs"]
    assert _until_the_helper_helps(lambda: layer(X, backend="numba"))
    jobs = slots(threads.BOARD)["jobs"] - before
    got = layer(X, backend="numba")
    assert_close(got, expected)
    one = slots(threads.BOARD)["jobs"]
    layer(X, backend="numba")
    assert slots(threads.BOARD)["jobs"] - one <= 1 <= jobs


@pytest.mark.parametrize("flags", [{}, {"static": True, "init": True},
                                   {"inner_reads_outer": True, "reverse_outer": True},
                                   {"start_from_outer": True, "reverse_inner": True},
                                   {"outputs": ("h", "words", "last")}])
def test_a_nested_net_gives_half_of_its_chapters_to_the_helper(flags):
    """Chapters of paragraphs of words (weights of 64 x 64: too small to
    share a product, and too few words for groups on Python's threads): the
    helper takes half of the chapters' time loops, inner nets and all (an
    output of every word, ragged, keeps the chapters on this thread; a
    word-level net run before their time loop is cut apart); the kernel
    equals the interpreter whoever runs which chapters, empty chapters and
    paragraphs included."""
    rng = np.random.default_rng(11)
    chapters = rng.integers(0, 8, 24)
    chapters[[0, 5]] = 0, 7
    paragraphs = rng.integers(0, 4, int(chapters.sum())).tolist()
    flags = {"outputs": ("h", "last"), **flags}
    net = nested_encoder(rng, [chapters.tolist(), paragraphs], features=2, hidden=64, **flags)
    expected = net.rnn(backend="interpreter")
    net.rnn(backend="numba")  # (compiled)
    shares = "words" not in flags["outputs"]
    if shares:
        assert _until_the_helper_helps(lambda: net.rnn(backend="numba"))
    got = net.rnn(backend="numba")
    assert_close(got, expected)
    # every chapter on this thread where an output is ragged (a nested net
    # run before the chapters' time loop is cut all the same), else every
    # net program() runs cut: no groups on Python's threads
    assert cpu_codegen.generate_source(net.rnn.program(True))[1].plan.cuts_sequences == shares
    assert "group_cut(" in net.rnn.compile("numba").source


@njit(nogil=True)
def _fails_on_negative(x, out):
    if x < 0:
        raise ValueError("negative")
    out[0] = x


@njit(nogil=True)
def _two_jobs(board, a, b, out_a, out_b, both):
    return threads.run_jobs(board, atomics.job_of(_fails_on_negative, (a, out_a)),
                            atomics.job_of(_fails_on_negative, (b, out_b)), both)


def test_a_job_that_raises_says_so_and_one_that_does_not_runs(rng):
    """``run_jobs`` runs both jobs (here or on the helper) and says when one
    raised (``RAISED``), so the caller can call the function itself to raise
    its error."""
    out_a, out_b = np.zeros(1), np.zeros(1)
    assert _two_jobs(threads.ALONE, 1.0, 2.0, out_a, out_b, True) == -1  # (not shared)
    assert out_a[0] == 1.0 and out_b[0] == 2.0
    assert _two_jobs(threads.ALONE, 3.0, -1.0, out_a, out_b, True) == threads.RAISED
    assert out_a[0] == 3.0
    assert _two_jobs(threads.ALONE, -1.0, 5.0, out_a, out_b, True) == threads.RAISED
    assert out_b[0] == 5.0
    assert _two_jobs(threads.ALONE, 4.0, -1.0, out_a, out_b, False) == -1  # (b not run)
    assert _until_the_helper_helps(lambda: _two_jobs(threads.BOARD, 6.0, -1.0, out_a, out_b, True)
                                   == threads.RAISED)
    assert out_a[0] == 6.0


@njit(nogil=True)
def _parts(board, a, b, out):
    """``run_jobs`` of two jobs writing ``out[0]`` and ``out[1]``."""
    return threads.run_jobs(board, atomics.job_of(_fails_on_negative, (a, out[0:1])),
                            atomics.job_of(_fails_on_negative, (b, out[1:2])), True)


def test_a_product_whose_helper_is_busy_runs_both_parts_here():
    """``run_jobs``: where the helper is not free (asleep, claimed, running
    another job: the other half of a run's sequences, say) both parts run
    here (-1, or ``RAISED``), the board left as it was; where it is free
    they run too (a helper that never comes: posted, taken back after
    ``PATIENCE``). ``run_both_here`` runs both here, whatever the board."""
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    for state in (threads.ABSENT, threads.CLAIMED, threads.POSTED, threads.RUNNING, threads.DONE):
        slots(board)["state"] = state
        out = np.zeros(2)
        assert _parts(board, 1.0, 2.0, out) == -1
        assert out.tolist() == [1.0, 2.0] and slots(board)["state"] == state
        assert _parts(board, 1.0, -2.0, out) == threads.RAISED
    slots(board)["state"] = threads.IDLE
    out = np.zeros(2)
    assert _parts(board, 1.0, 2.0, out) >= 0
    assert out.tolist() == [1.0, 2.0]
    assert slots(board)["taken_back"] == 1 and slots(board)["state"] == threads.IDLE
    assert _parts(board, 1.0, -2.0, out) == threads.RAISED


@njit(nogil=True)
def _parts_or_whole(board, a, b, whole, out):
    """``run_parts_or_whole`` of three jobs writing ``out[0]``, ``out[1]``
    and ``out[2]`` (the whole)."""
    return threads.run_parts_or_whole(board, atomics.job_of(_fails_on_negative, (a, out[0:1])),
                                      atomics.job_of(_fails_on_negative, (b, out[1:2])),
                                      atomics.job_of(_fails_on_negative, (whole, out[2:3])))


def test_a_product_whose_helper_is_busy_runs_whole_here():
    """``run_parts_or_whole``: where the helper is not free (asleep, claimed,
    running another job: the other half of a run's sequences, say) the whole
    job runs here and neither part (-1, or ``RAISED``); where it is free the
    two parts run (a helper that never comes: posted, taken back after
    ``PATIENCE``) and not the whole."""
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    for state in (threads.ABSENT, threads.CLAIMED, threads.POSTED, threads.RUNNING, threads.DONE):
        slots(board)["state"] = state
        out = np.zeros(3)
        assert _parts_or_whole(board, 1.0, 2.0, 3.0, out) == -1
        assert out.tolist() == [0.0, 0.0, 3.0] and slots(board)["state"] == state
        assert _parts_or_whole(board, 1.0, 2.0, -3.0, out) == threads.RAISED
    slots(board)["state"] = threads.IDLE
    out = np.zeros(3)
    assert _parts_or_whole(board, 1.0, 2.0, 3.0, out) >= 0
    assert out.tolist() == [1.0, 2.0, 0.0]
    assert slots(board)["taken_back"] == 1 and slots(board)["state"] == threads.IDLE
    assert _parts_or_whole(board, 1.0, -2.0, 3.0, out) == threads.RAISED


def _serving(board, linger):
    """``threads._serve(board, linger)`` on a thread of its own (started)."""
    thread = threading.Thread(target=threads._serve, args=(board, linger), daemon=True)
    thread.start()
    return thread


def test_a_kernel_holds_the_helper_awake_through_its_first_work():
    """The helper goes back to sleep ``linger`` cycles after its last job,
    but not before the hold a kernel given the board sets at its start
    (``hold_helper``, from ``board_for_one_group``): a kernel whose work
    before its first handover outlasts the linger still finds it spinning
    (a training step's backward right after its forward cut nothing and ran
    on one core)."""
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    slots(board)["state"] = threads.WAKING
    start = _now()
    threads.hold_helper(board)
    assert slots(board)["held_until"] >= start + threads.HOLD
    slots(board)["held_until"] = _now() + (1 << 50)  # (held for good, until released below)
    serving = _serving(board, 1 << 10)  # (a linger of well under a microsecond)
    deadline = time.monotonic() + 60
    while slots(board)["state"] == threads.WAKING and time.monotonic() < deadline:
        time.sleep(0.001)  # (its loop compiled or loaded on its thread, the first time)
    time.sleep(0.05)
    assert serving.is_alive() and slots(board)["state"] == threads.IDLE
    slots(board)["held_until"] = 0
    serving.join(10)
    assert not serving.is_alive() and slots(board)["state"] == threads.ABSENT
    slots(board)["state"] = threads.WAKING  # not held: asleep once the linger passes
    serving = _serving(board, 1 << 10)
    serving.join(10)
    assert not serving.is_alive() and slots(board)["state"] == threads.ABSENT
    if not ONE_THREAD:
        start = _now()
        assert threads.board_for_one_group() is threads.BOARD
        assert slots(threads.BOARD)["held_until"] >= start + threads.HOLD


def test_a_job_posted_to_a_woken_helper_runs_there_or_is_taken_back():
    """A helper woken but not spinning yet (``WAKING``: its thread is on its
    way) may be given a job: where it never comes (a board no helper serves)
    the kernel takes the job back after ``PATIENCE`` cycles and the board is
    free after; the real helper, woken from sleep right before, runs it or
    has it taken back, and the results are the same. A dismissal sends a
    woken helper back to sleep."""
    out_a, out_b = np.zeros(1), np.zeros(1)
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    slots(board)["state"] = threads.WAKING
    assert threads.group_cut(board, np.array([8, 8, 8, 8], np.int64)) == 2
    assert _two_jobs(board, 1.0, 2.0, out_a, out_b, True) >= 0  # (posted, then taken back)
    assert (out_a[0], out_b[0]) == (1.0, 2.0)
    assert slots(board)["taken_back"] == 1 and slots(board)["jobs"] == 0
    assert slots(board)["state"] == threads.IDLE
    slots(board)["state"] = threads.WAKING
    threads._dismiss(board)
    assert slots(board)["state"] == threads.ABSENT
    # (the cut is the lengths', asleep or not: the caller then runs both parts)
    assert threads.group_cut(board, np.array([8, 8, 8, 8], np.int64)) == 2
    if ONE_THREAD:
        return
    for x in (3.0, 4.0, 5.0):
        threads.dismiss_helper()
        deadline = time.monotonic() + 10
        while slots(threads.BOARD)["state"] != threads.ABSENT and time.monotonic() < deadline:
            time.sleep(0.001)
        before = slots(threads.BOARD)["jobs"] + slots(threads.BOARD)["taken_back"]
        threads.wake_helper()
        # (posted: the helper, woken or spinning, was claimed; not posted only
        # where this thread lost its core for longer than the helper lingers)
        waited = _two_jobs(threads.BOARD, x, x + 10, out_a, out_b, True)
        assert waited != threads.RAISED and (out_a[0], out_b[0]) == (x, x + 10)
        posted = waited >= 0
        assert slots(threads.BOARD)["jobs"] + slots(threads.BOARD)["taken_back"] == before + posted
        assert slots(threads.BOARD)["state"] in (threads.IDLE, threads.ABSENT)


@njit(nogil=True)
def _posted_then_finished(board, x, out):
    """A job posted (``post_job``), then finished (``finish_job``): what
    each returned."""
    job = atomics.job_of(_fails_on_negative, (x, out))
    posted = threads.post_job(board, job)
    finished = threads.finish_job(board, job) if posted else 0
    return posted, finished


def test_a_job_posted_ahead_is_done_by_the_helper_or_taken_back(rng):
    """``post_job`` posts only on a board that shares and whose helper is
    free; ``finish_job`` waits for the helper, or, where the helper never
    started the job (a board no helper serves), takes it back and runs it
    at once; the board is free again after, and a job that raised says so."""
    out = np.zeros(1)
    assert _posted_then_finished(threads.ALONE, 1.0, out) == (False, 0)
    assert out[0] == 0.0  # (not posted: the caller runs it)
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    slots(board)["state"] = threads.IDLE
    assert _posted_then_finished(board, 2.0, out) == (True, 0)
    assert out[0] == 2.0 and slots(board)["taken_back"] == 1
    assert slots(board)["state"] == threads.IDLE and slots(board)["jobs"] == 0
    assert _posted_then_finished(board, -1.0, out) == (True, threads.RAISED)
    assert slots(board)["state"] == threads.IDLE
    assert _until_the_helper_helps(lambda: _posted_then_finished(threads.BOARD, 3.0, out)
                                   == (True, 0))
    assert out[0] == 3.0


@pytest.mark.parametrize("direction, shared", [("forward", False), ("reverse", False),
                                               ("forward", True)])
def test_a_one_sequence_runs_its_input_products_a_chunk_ahead_on_the_helper(rng, direction, shared,
                                                                          per_step_shared):
    """A GRU of 96 units over one sequence of 300 steps: its input product
    [300, 16] @ [16, 288] runs by chunks of 128 steps, each posted to the
    helper a chunk ahead where its per-step products are not shared with
    the helper (``ahead_posts``, from its per-step weights' boards: where
    they are, the two took turns on the helper and lost); the helper helps,
    the kernel equals the interpreter, and gives the same bits call after
    call, whoever computes which chunk or part of a product."""
    per_step_shared(shared)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((300, 16)).astype(np.float32), [[300]])
    layer = sn.nn.GRU(16, 96, direction=direction, seed=4)
    source = layer.step_net(0, 0).compile("numba").source
    assert "gemm_steps_ahead(" in source
    assert re.search(r"ahead_posts = wp\w+\[5\]\[SHARES\] & COLUMNS == 0", source)
    expected = layer(X, backend="interpreter")
    first = layer(X, backend="numba")
    assert_close(first, expected)
    assert _until_the_helper_helps(lambda: layer(X, backend="numba"))
    for _ in range(20):
        got = layer(X, backend="numba")
        np.testing.assert_array_equal(got[0].data, first[0].data)
        np.testing.assert_array_equal(got[1], first[1])


@njit
def _chunk_ahead(left, sstart, slen, step, gathered, out, gathered_ahead, out_ahead, state, posts,
                 prepared):
    """A kernel's call of ``gemm_steps_ahead`` (chunks of 4 steps, one sequence)."""
    return ahead.gemm_steps_ahead(left, 0, sstart, slen, 1, step, 4, 1, False, gathered,
                                  prepared, out, gathered_ahead, out_ahead, state, posts)


@njit
def _chunk_ahead_of(left, sstart, slen, step, nb, gathered, out, gathered_ahead, out_ahead, state,
                    prepared):
    """``_chunk_ahead`` over ``nb`` sequences, posting the next chunk."""
    return ahead.gemm_steps_ahead(left, 0, sstart, slen, 1, step, 4, nb, False, gathered,
                                  prepared, out, gathered_ahead, out_ahead, state, True)


def test_a_chunk_posted_ahead_has_the_rows_of_the_callers_chunk(rng):
    """The next chunk's product posted ahead is over the sequences still
    running at that chunk (the caller's own product of it would be: a
    library's rows differ by the rows beside them), not over those of the
    chunk before: two sequences of 12 and 4 steps, chunks of 4; the chunk of
    steps 4-7 is one sequence's 4 rows, the rows after them not written."""
    blas.register_small_gemm(np.float32)
    left = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    sstart, slen = np.array([0, 12]), np.array([12, 4])
    board = np.zeros_like(threads.BOARD)
    slots(board)["shares"] = threads.EVERY
    slots(board)["state"] = threads.IDLE
    prepared = blas.pack(w, 16, 16, product_timing.small_rows_table(), board)
    buffers = [np.zeros((8, 8), np.float32), np.zeros((8, 64), np.float32)]
    ahead_buffers = [np.zeros((8, 8), np.float32), np.full((8, 64), np.nan, np.float32)]
    state = np.zeros(ahead.AHEAD_WORDS, np.int64)
    assert not _chunk_ahead_of(left, sstart, slen, 0, 2, *buffers, *ahead_buffers, state, prepared)
    assert state[0] != 0  # (posted; no helper serves this board: taken back below)
    assert _chunk_ahead_of(left, sstart, slen, 4, 1, *buffers, *ahead_buffers, state, prepared)
    np.testing.assert_allclose(ahead_buffers[1][:4], left[4:8] @ w, rtol=1e-5, atol=1e-5)
    assert np.isnan(ahead_buffers[1][4:]).all()


def test_the_chunk_ahead_is_posted_only_where_it_may_be(rng):
    """``gemm_steps_ahead`` on a board that shares and whose helper is free
    (none serves it here: a posted job is taken back) posts the next chunk
    where ``posts`` says so, and not otherwise; both give each chunk's
    product."""
    blas.register_small_gemm(np.float32)  # (the own loop's symbol, before a caller compiles)
    left = rng.standard_normal((40, 8)).astype(np.float32)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    sstart, slen = np.zeros(1, np.int64), np.array([40])
    for posts in (False, True):
        board = np.zeros_like(threads.BOARD)
        slots(board)["shares"] = threads.EVERY
        slots(board)["state"] = threads.IDLE
        prepared = blas.pack(w, 16, 40, product_timing.small_rows_table(), board)
        buffers = [np.zeros((4, 8), np.float32), np.zeros((4, 64), np.float32)]
        ahead_buffers = [np.zeros((4, 8), np.float32), np.zeros((4, 64), np.float32)]
        state = np.zeros(ahead.AHEAD_WORDS, np.int64)
        assert not _chunk_ahead(left, sstart, slen, 0, *buffers, *ahead_buffers, state, posts, prepared)
        assert (state[0] != 0) == posts  # (the next chunk posted)
        np.testing.assert_allclose(buffers[1], left[:4] @ w, rtol=1e-5, atol=1e-5)
        # the next chunk: the posted one taken back, in the ahead buffers
        assert _chunk_ahead(left, sstart, slen, 4, *buffers, *ahead_buffers, state, False, prepared) == posts
        np.testing.assert_allclose((ahead_buffers if posts else buffers)[1], left[4:8] @ w,
                                   rtol=1e-5, atol=1e-5)
        assert state[0] == 0 and slots(board)["taken_back"] == int(posts)
        assert slots(board)["state"] == threads.IDLE


def test_ragged_sequences_run_their_input_products_a_chunk_ahead(rng):
    """One chapter of 12 paragraphs of 0-40 words, 256 units: the word-level
    net runs once over every paragraph (one group of ragged sequences: a
    chunk is 10 steps of each, fewer paragraphs every few chunks), its input
    product a chunk ahead on the helper; the kernel equals the interpreter
    call after call."""
    paragraphs = rng.integers(0, 41, 12)
    paragraphs[[0, 3]] = 40, 0
    net = nested_encoder(rng, [[12], paragraphs.tolist()], features=3, hidden=256,
                         outputs=("h", "last"))
    source = net.rnn.compile("numba").source
    assert source.count("gemm_steps_ahead(") == 1  # (the word-level net's; the outer one calls it)
    expected = net.rnn(backend="interpreter")
    assert _until_the_helper_helps(lambda: net.rnn(backend="numba"))
    for _ in range(10):
        assert_close(net.rnn(backend="numba"), expected)


@pytest.mark.parametrize("dtype, dilation", [(np.float32, 1), (np.float64, 2)])
def test_a_convolution_by_taps_shared_by_rows_equals_numpy(rng, dtype, dilation):
    """``blas.taps_product``: the sum over taps of shifted rows' products
    (an ONNX Conv of stride 1 over channels-last rows), its rows cut in two
    and shared; float32 and float64, dilation 1 and 2."""
    rows, C, M, K = 1500, 33, 16, 3
    a = rng.standard_normal((rows + (K - 1) * dilation, C)).astype(dtype)
    w = rng.standard_normal((K, C, M)).astype(dtype)
    expected = sum(a[k * dilation:k * dilation + rows].astype(np.float64) @ w[k]
                   for k in range(K))
    out = np.full((rows, M), np.nan, dtype)
    _shared_if_cut(lambda: blas.taps_product(a, w, out, dilation, threads.BOARD), True)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    alone = np.full((rows, M), np.nan, dtype)
    blas.taps_product(a, w, alone, dilation, threads.ALONE)
    np.testing.assert_allclose(alone, expected, rtol=1e-4, atol=1e-4)


def _conv_reference(x, W, bias, stride, dilation, pad, out_len):
    """An ONNX Conv of one group (``W`` [M, C, K]) over ``x`` [N, C, L] padded
    with ``pad`` zeros on the left, in float64: [N, M, out_len]."""
    N, C, L = x.shape
    M, _, K = W.shape
    padded = np.zeros((N, C, pad + L + K * dilation + out_len * stride))
    padded[:, :, pad:pad + L] = x
    y = np.empty((N, M, out_len))
    for o in range(out_len):
        taps = padded[:, :, o * stride + dilation * np.arange(K)]  # [N, C, K]
        y[:, :, o] = np.einsum("nck,mck->nm", taps, W) + bias
    return y


@pytest.mark.parametrize("stride, dilation, dtype", [(1, 1, np.float32), (1, 2, np.float64),
                                                     (32, 1, np.float32)])
def test_a_convolution_cut_by_samples_is_the_same_whoever_computes_its_parts(rng, stride,
                                                                             dilation, dtype):
    """``lowered.conv1d`` of 5 samples, big enough to be cut: the first two
    here, the other three on the helper (its job counter moves); with the
    helper asleep this thread computes both parts, to the same bits; both
    equal the Conv computed in float64, as does the convolution on ALONE
    (not cut: its product whole); float32 and float64."""
    from stepnet.onnx import lowered

    N, C, L, M, K, pad = 5, (1 if stride > 1 else 33), 544, 66, (64 if stride > 1 else 3), 16
    out_len = (pad + L - (K - 1) * dilation - 1) // stride + 1
    x = rng.standard_normal((N, C, L)).astype(dtype)
    W = rng.standard_normal((M, C, K)).astype(dtype)
    bias = rng.standard_normal(M).astype(dtype)
    w = np.ascontiguousarray(W.transpose(2, 1, 0) if stride == 1
                             else W.reshape(M, C * K).T[None])  # (by taps, or as columns)
    assert blas.row_cut(N, N * out_len * C * K * M, threads.BOARD, 2) == 2
    expected = _conv_reference(x, W, bias, stride, dilation, pad, out_len)
    got = []

    def conv(board):  # (the output: a view of the rows conv1d lays out channels-last)
        rows = lowered.conv1d(x, w, bias, K, stride, dilation, pad, out_len, board)
        assert rows.flags.c_contiguous and rows.shape[::2] == (N, M)
        return rows[:, :out_len, :].transpose(0, 2, 1)

    def run():
        got.append(conv(threads.BOARD))

    assert _until_the_helper_helps(run)
    np.testing.assert_allclose(got[-1], expected, rtol=1e-4, atol=1e-3)
    threads.dismiss_helper()  # both parts computed here: the same bits
    time.sleep(0.01)
    np.testing.assert_array_equal(conv(threads.BOARD), got[-1])
    alone = conv(threads.ALONE)
    np.testing.assert_allclose(alone, expected, rtol=1e-4, atol=1e-3)


@needs_helper
def test_a_forked_child_does_not_wait_for_its_parents_helper(tmp_path):
    """After a fork the child has no helper thread: its board says so, and a
    shared product in the child runs (and a helper of its own starts)."""
    code = """
import os, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
from test_helper import _products, _until_the_helper_helps, slots
from stepnet.jit import blas, threads
blas.register_small_gemm(np.float32)
a = np.ones((1, 128), np.float32); w = np.ones((128, 384), np.float32)
out = np.empty((1, 384), np.float32); table = np.array([[1 << 40], [8]])
assert _until_the_helper_helps(lambda: _products(a, w, out, table, threads.BOARD, 50))
threads.wake_helper()
pid = os.fork()
if pid == 0:
    ok = slots(threads.BOARD)["state"] == threads.ABSENT
    _products(a, w, out, table, threads.BOARD, 50)
    ok = ok and (out == 128).all()
    ok = ok and _until_the_helper_helps(lambda: _products(a, w, out, table, threads.BOARD, 50))
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    proc = subprocess.run([sys.executable, "-c", code.format(tests=os.path.dirname(__file__))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"], proc.stdout + proc.stderr


@needs_helper
def test_one_thread_wakes_no_helper_and_shares_nothing():
    """``numba.set_num_threads(1)`` keeps a run on one core, even while a
    helper woken before is still spinning."""
    import numba

    threads.wake_helper()
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert threads.board_for_one_group() is threads.ALONE
    finally:
        numba.set_num_threads(before)
    assert threads.board_for_one_group() is threads.BOARD


@needs_helper
def test_a_board_that_shares_nothing_takes_no_helper():
    """With no bit of ``threads.SHARES`` set a run's plan takes no helper
    (none is woken for it); with any bit, a run worth sharing takes it."""
    from types import SimpleNamespace

    from stepnet.jit import plan

    kernel = SimpleNamespace(largest_weights=1 << 20)
    assert plan.shares(kernel, 64, 1, count=2)
    try:
        slots(threads.BOARD)["shares"] = threads.COLUMNS
        assert plan.shares(kernel, 64, 1, count=2)
        slots(threads.BOARD)["shares"] = 0
        assert not plan.shares(kernel, 64, 1, count=2)
    finally:
        slots(threads.BOARD)["shares"] = threads.EVERY
