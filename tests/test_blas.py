"""stepnet's own product loop, and products on threads (stepnet.jit.blas)."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from stepnet.jit import blas, own_loop, threads, transposed


def test_the_own_loop_shares_only_the_sizes_the_table_says(rng):
    """``pack`` gives the own loop the kernel's board for weights whose size
    shares (the table's third row, or a table of two rows), and a board that
    shares nothing for the others; the library's products keep the board."""

    blas.register_small_gemm(np.float32)
    board = threads.BOARD.copy()  # (a stand-in: only its SHARES slot is read here)
    table = np.array([[100, 1000, 1 << 62], [1 << 62] * 3, [1, 0, 1]], np.int64)
    assert [blas.shares_with_helper(table, size, 4) for size in (50, 100, 101, 1000, 10**6)] == \
        [True, True, False, False, True]
    assert blas.shares_with_helper(table[:2], 500, 4)
    for (k, n), shares in [((5, 10), True), ((10, 64), False), ((40, 64), True)]:
        prepared = blas.pack(rng.standard_normal((k, n)).astype(np.float32), 4, 1000, table, board)
        assert prepared[3][threads.SHARES] == threads.EVERY
        assert prepared[5][threads.SHARES] == (threads.EVERY if shares else 0)
        assert (prepared[5] == board).all() if shares else not prepared[5].any()


def test_panels_start_on_a_cache_line(rng):
    """The own loop's panels (and MKL's packed weights) are 64-byte aligned,
    whatever the allocator gave (``aligned_empty``)."""

    for k, n in [(1, 5), (3, 40), (128, 384), (7, 33)]:
        b = rng.standard_normal((k, n)).astype(np.float32)
        assert own_loop.panels(b).ctypes.data % 64 == 0
        for size in range(1, 40):
            assert own_loop.aligned_empty(size, b).ctypes.data % 64 == 0
            assert own_loop.aligned_empty(size, b.astype(np.float64)).ctypes.data % 64 == 0


def test_a_product_takes_the_rows_of_the_next_larger_weights_measured():

    table = np.array([[100, 1000, 4000], [8, 2, 1]], np.int64)
    assert [blas.rows_for(table, size, 4) for size in (1, 100, 101, 1000, 4000, 10**7)] == \
        [8, 8, 2, 2, 1, 1]


def test_float64_products_take_the_float64_limits_where_measured(rng):
    """A table of six rows holds float64's limits below float32's: a float64
    product takes those (its limit and whether it shares), a float32 one the
    first three rows; a table of three rows gives float64 the float32 ones."""

    table = np.array([[100, 1000], [8, 2], [1, 1], [100, 1000], [3, 0], [0, 1]], np.int64)
    assert [blas.rows_for(table, size, 4) for size in (50, 500)] == [8, 2]
    assert [blas.rows_for(table, size, 8) for size in (50, 500)] == [3, 0]
    assert [blas.rows_for(table[:3], size, 8) for size in (50, 500)] == [8, 2]
    assert [blas.shares_with_helper(table, 50, itemsize) for itemsize in (4, 8)] == [True, False]
    board = threads.BOARD.copy()
    for dtype, rows in ((np.float32, 8), (np.float64, 3)):
        blas.register_small_gemm(dtype)
        prepared = blas.pack(rng.standard_normal((2, 40)).astype(dtype), 16, 1000, table, board)
        assert prepared[2] == (1 << 62 if blas.DETERMINISTIC else rows), dtype


def test_products_of_under_32_columns_take_the_library(rng):
    """Under 32 columns stepnet's own loop takes one sum at a time: such a
    product runs the library's, at any rows the table gives (every product
    under STEPNET_DETERMINISTIC, whose sums have a fixed order)."""

    blas.register_small_gemm(np.float32)
    every = np.array([[1 << 62], [1 << 62]], np.int64)
    assert blas.own_rows(every, 256, 32, 4) == 1 << 62
    assert blas.own_rows(every, 256, 31, 4) == (1 << 62 if blas.DETERMINISTIC else 0)
    b = rng.standard_normal((64, 10)).astype(np.float32)
    prepared = blas.pack(b, 16, 1000, every, threads.ALONE)
    assert prepared[2] == (1 << 62 if blas.DETERMINISTIC else 0)
    assert prepared[4].shape[0] == (1 if blas.DETERMINISTIC else 0)  # (no panels for no own loop)
    a = rng.standard_normal((300, 64)).astype(np.float32)
    out = np.empty((300, 10), np.float32)
    blas.gemm_hoisted(a, b, out, every, threads.ALONE)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_gemm_equals_numpy_on_every_block_shape(rng, dtype):
    """Row blocks of 6 and 4 (every remainder of a panel of rows: 8 = 4 + 4,
    10 = 6 + 4, 13 = 6 + 4 + 4 overlapping by one, 32, a last panel of 8 or
    of 5 rows after 192), a few rows by 4 and 1, column blocks of 32 (one
    row: 192, 128 or 64, the last overlapping the one before) and the
    columns after them, an empty reduction; NaN and inf reach only their
    row."""

    for m, k, n in [(0, 5, 7), (1, 0, 9), (1, 3, 64), (2, 17, 130), (4, 8, 32), (5, 33, 95),
                    (9, 64, 200), (12, 1, 1), (1, 7, 144), (1, 9, 100), (3, 5, 300), (1, 4, 96),
                    (6, 0, 40), (6, 3, 32), (7, 20, 33), (11, 9, 70), (17, 40, 130), (64, 64, 256),
                    (8, 9, 64), (10, 6, 40), (13, 7, 70), (15, 5, 33), (32, 20, 96),
                    (200, 6, 40), (197, 9, 64), (1, 11, 390), (1, 5, 161)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        out = np.full((m, n), 7, dtype)
        own_loop.small_gemm(a, b, out)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    a = rng.standard_normal((6, 8)).astype(dtype)
    b = rng.standard_normal((8, 70)).astype(dtype)
    a[1, 3], a[4, 0] = np.nan, np.inf
    out = np.empty((6, 70), dtype)
    own_loop.small_gemm(a, b, out)
    with np.errstate(invalid="ignore"):
        expected = a @ b
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))
    fine = np.isfinite(expected)
    np.testing.assert_allclose(out[fine], expected[fine], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_gemm_rows_equal_each_row_alone_bit_for_bit(rng, dtype):
    """A row's values do not depend on the block of rows it falls in (6, 4
    or 1) nor on the rows beside it: each sum is taken in order of k."""

    for m, k, n in [(13, 37, 100), (64, 256, 96), (6, 5, 32), (10, 128, 384), (32, 64, 96),
                    (200, 16, 64), (9, 40, 70), (11, 33, 64), (12, 8, 48), (17, 40, 130)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        whole = np.empty((m, n), dtype)
        own_loop.small_gemm(a, b, whole)
        for i in range(m):
            alone = np.empty((1, n), dtype)
            own_loop.small_gemm(a[i:i + 1], b, alone)
            np.testing.assert_array_equal(whole[i], alone[0], err_msg=(m, k, n, i))
        tail = np.empty((m - 2, n), dtype)
        own_loop.small_gemm(np.ascontiguousarray(a[2:]), b, tail)
        np.testing.assert_array_equal(whole[2:], tail)


def test_kernels_call_small_gemm_by_its_c_entry_on_any_layout(rng):
    """gemm_packed's own-loop path (small_gemm's C entry, registered by symbol)
    on C-contiguous operands, and on strided ones through contiguous copies."""
    from numba import njit


    blas.register_small_gemm(np.float64)

    @njit
    def own(a, b, out):
        blas._own_product(a, b, out, threads.ALONE)

    a = rng.standard_normal((6, 20))
    b = rng.standard_normal((20, 70))
    out = np.zeros((6, 140))
    own(a, b, out[:, :70])  # a row block of a wider array: not C-contiguous
    own(np.asfortranarray(a), b, out[:, 70:])
    np.testing.assert_allclose(out, np.hstack([a @ b, a @ b]), rtol=1e-12, atol=1e-12)
    contiguous = np.empty((6, 70))
    own(a, b, contiguous)
    np.testing.assert_allclose(contiguous, a @ b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("own_rows", [0, 1 << 20])
def test_hoisted_products_of_joined_values_add_each_part(rng, own_rows):
    """``gemm_hoisted`` then ``gemm_hoisted_acc`` (a product of values joined
    by columns, ``sum a_i @ W_i``) on the library (no rows for the own loop)
    and on stepnet's own loop (every row), alone and shared with the helper:
    the product of the joined values."""
    from numba import njit


    blas.register_small_gemm(np.float32)

    @njit
    def split_product(parts, w, out, table, board):
        row = 0
        for i, part in enumerate(parts):
            k = part.shape[1]
            if i == 0:
                blas.gemm_hoisted(part, w[row:row + k], out, table, board)
            else:
                blas.gemm_hoisted_acc(part, w[row:row + k], out, table, board)
            row += k

    table = np.array([[1 << 40], [own_rows]], np.int64)
    parts = [rng.standard_normal((300, k)).astype(np.float32) for k in (64, 32, 96)]
    w = rng.standard_normal((192, 256)).astype(np.float32)
    expected = np.hstack(parts).astype(np.float64) @ w
    for board in (threads.ALONE, threads.board_for_one_group()):
        out = np.full((300, 256), np.nan, np.float32)
        split_product(tuple(parts), w, out, table, board)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_packed_weights_take_any_number_of_rows(rng):
    """``pack`` makes the library's form only for products of more rows than
    the own loop takes, and the own loop's panels only for a call of
    ``PANEL_MIN_ROWS`` rows; a product of more rows than it was told still
    gets ``a @ b`` (the library's plain product), and so does one under the
    limit, from the panels or from the weights as they are."""
    from numba import njit


    blas.register_small_gemm(np.float32)

    @njit
    def packed_product(a, b, max_rows, call_rows, table, out):
        prepared = blas.pack(b, max_rows, call_rows, table, threads.ALONE)
        blas.gemm_packed(a, prepared, out)
        return prepared[0].shape[0], prepared[4].shape[0]

    b = rng.standard_normal((24, 40)).astype(np.float32)
    table = np.array([[1 << 40], [4]], np.int64)  # the own loop up to 4 rows, any weights
    for m, max_rows, library_form in ((3, 4, False), (9, 4, False), (9, 16, True), (3, 16, True)):
        for call_rows in (blas.PANEL_MIN_ROWS - 1, blas.PANEL_MIN_ROWS):
            a = rng.standard_normal((m, 24)).astype(np.float32)
            out = np.empty((m, 40), np.float32)
            size, count = packed_product(a, b, max_rows, call_rows, table, out)
            assert (size > 0) == library_form or blas.BLAS_NAME != "mkl", (m, max_rows, size)
            assert count == (2 if call_rows >= blas.PANEL_MIN_ROWS else 0)
            np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5, err_msg=f"{m} rows")


@pytest.mark.parametrize("cols", [16, 32], ids=["avx2", "avx512"])
def test_each_block_of_the_own_loop_reads_its_columns_of_the_panels(monkeypatch, cols):
    """The own loop's blocks are sized to the CPU's vector registers
    (``_COLS``: 16 float32 columns with AVX2, 32 with AVX-512); for either
    size, every block it takes over a range of columns (from a multiple of
    32 to one, or to n) reads from the weights' ``panels`` exactly the
    columns it computes (``_block_start``; here on the host whatever its
    registers: the arithmetic of the offsets, not the vectors)."""

    monkeypatch.setattr(own_loop, "_COLS", cols)
    start = own_loop._block_start.py_func
    k = 2
    for n in range(cols, 200):
        b = np.arange(k * n, dtype=np.float32).reshape(k, n)
        flat = own_loop.panels(b).reshape(-1)
        for lo in range(0, n - cols + 1, 32):
            for hi in sorted({n} | set(range(lo + 32, n, 32))):
                if hi - lo < cols:
                    continue
                end = lo + cols
                while end < hi + cols:
                    j0 = min(end, hi) - cols
                    s = start(j0, 32, 32 * k, n)
                    for kk in range(k):
                        np.testing.assert_array_equal(flat[s + 32 * kk:s + 32 * kk + cols],
                                                      b[kk, j0:j0 + cols], err_msg=(n, lo, hi, j0))
                    end += cols


def test_the_own_loop_is_sized_to_the_registers_of_the_cpu_numba_compiles_for(monkeypatch):
    """AVX-512's 32 registers of 64 bytes where the CPU Numba compiles for
    has ``avx512f`` (the host, or ``NUMBA_CPU_FEATURES`` / ``NUMBA_CPU_NAME``
    where set), AVX2's 16 of 32 elsewhere; the own loop's blocks are two
    float32 vectors wide."""
    import llvmlite.binding as llvm_binding
    from numba.core import config as numba_config


    host = llvm_binding.get_host_cpu_features().get("avx512f", False)
    if numba_config.CPU_FEATURES is None:
        assert own_loop.vector_registers() == ((64, 32) if host else (32, 16))
    assert own_loop._COLS == 2 * own_loop.vector_registers()[0] // 4
    for name, expected in [("haswell", (32, 16)), ("znver3", (32, 16)),
                           ("skylake-avx512", (64, 32)), ("znver5", (64, 32))]:
        # (NUMBA_CPU_NAME alone tunes for the CPU: Numba compiles the host's
        # instructions; with NUMBA_CPU_FEATURES set, empty, the CPU's own)
        monkeypatch.setattr(numba_config, "CPU_NAME", name)
        monkeypatch.setattr(numba_config, "CPU_FEATURES", None)
        assert own_loop.vector_registers() == ((64, 32) if host else (32, 16)), name
        monkeypatch.setattr(numba_config, "CPU_FEATURES", "")
        assert own_loop.vector_registers() == expected, name
    monkeypatch.setattr(numba_config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert own_loop.vector_registers() == (32, 16)
    monkeypatch.setattr(numba_config, "CPU_FEATURES", "+avx2,+avx512f")
    assert own_loop.vector_registers() == (64, 32)


def test_one_row_on_the_weights_rows_equals_the_panels_bit_for_bit(rng):
    """Where stepnet's own loop takes one row a product (float32,
    ``_WIDE_ACCUMULATORS`` columns or more: 384 with AVX-512, 96 with AVX2),
    ``pack`` gives it the weights as one panel of every column (``b`` on a
    cache line) and the row runs that many columns at a time
    (``_one_row_wide``): the same bits as six blocks of ``panels`` at a time,
    for any range of columns and through the C entry; elsewhere the panels
    are made as before."""
    from numba import njit


    blas.register_small_gemm(np.float32)

    @njit
    def own(a, w, out, board):
        blas._own_product(a, w, out, board)

    one_row = np.array([[1 << 40], [1]], np.int64)  # (the own loop: one row, any size)
    for k, n in [(128, 384), (64, 400), (256, 1024), (7, 769), (1, 383)]:
        a = rng.standard_normal((1, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        p = own_loop.panels(b)
        whole = np.empty((1, n), np.float32)
        own_loop._own_columns(a, p.reshape(-1), 32, 32 * k, whole, 0, n)
        prepared = blas.pack(b, 1, blas.PANEL_MIN_ROWS, one_row, threads.ALONE)
        rows_of_b = prepared[4]
        wide = n >= own_loop._WIDE_ACCUMULATORS
        assert rows_of_b.shape == ((1, k, n) if wide else (-(-n // 32), k, 32)), (k, n)
        assert rows_of_b.ctypes.data % 64 == 0
        got = np.full((1, n), np.nan, np.float32)
        own(a, rows_of_b, got, threads.ALONE)
        np.testing.assert_array_equal(got, whole, err_msg=(k, n))
        for lo, hi in [(0, n), (32, n), (0, 32 * (n // 64)), (n - 32 * (n // 32), n)]:
            part = np.full((1, n), np.nan, np.float32)
            own_loop._own_columns(a, b.reshape(-1), n, 0, part, lo, hi)
            np.testing.assert_array_equal(part[:, lo:hi], whole[:, lo:hi], err_msg=(k, n, lo, hi))
            assert np.isnan(part[:, :lo]).all() and np.isnan(part[:, hi:]).all()
    # float64, or an own loop of two rows: panels
    b = rng.standard_normal((16, 400))
    assert blas.pack(b, 1, blas.PANEL_MIN_ROWS, one_row, threads.ALONE)[4].shape == (13, 16, 32)
    two_rows = np.array([[1 << 40], [2]], np.int64)
    b32 = b.astype(np.float32)
    assert blas.pack(b32, 2, blas.PANEL_MIN_ROWS, two_rows, threads.ALONE)[4].shape == (13, 16, 32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_kernel_s_own_loop_call_takes_what_gemm_packed_would(rng, dtype):
    """``blas.gemm_own`` (the call of the own loop's C entry a kernel's
    product makes first) computes, bit for bit, what ``gemm_packed`` does
    where the own loop takes the rows and ``pack`` made panels (of 32
    columns, or one of every column), and leaves ``out`` alone (False)
    where it has more rows or no panels."""
    from numba import njit


    blas.register_small_gemm(dtype)

    @njit
    def own(a, prepared, out):
        return blas.gemm_own(a, prepared[4], prepared[2], prepared[5], out)

    @njit
    def packed(a, prepared, out):
        blas.gemm_packed(a, prepared, out)

    for own_rows in (3, 1):  # (the own loop up to 3 rows, or one: b's rows as one panel)
        table = np.array([[1 << 40], [own_rows]], np.int64)
        for k, n in [(16, 40), (24, 384), (8, 70)]:
            b = rng.standard_normal((k, n)).astype(dtype)
            for call_rows in (blas.PANEL_MIN_ROWS, 1):  # (panels, and none: a stream's call)
                prepared = blas.pack(b, 5, call_rows, table, threads.ALONE)
                for m in (0, 1, 3, 4):
                    a = rng.standard_normal((m, k)).astype(dtype)
                    want = np.full((m, n), np.nan, dtype)
                    packed(a, prepared, want)
                    got = np.full((m, n), np.nan, dtype)
                    taken = own(a, prepared, got)
                    assert taken == (m <= own_rows and prepared[4].shape[0] > 0), (
                        k, n, call_rows, m)
                    if taken:
                        np.testing.assert_array_equal(got, want)
                    else:
                        assert np.isnan(got).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_own_loop_on_panels_equals_it_on_the_weights_bit_for_bit(rng, dtype):
    """The weights' ``panels`` (32 columns each, the last overlapping the one
    before where 32 does not divide n; one padded panel under 32 columns)
    give the same bits as the weights as they are, for every block shape of
    rows and columns, any range of whole blocks of columns, and the C entry
    (both layouts, cut with the helper's board or not)."""
    from numba import njit


    blas.register_small_gemm(dtype)

    @njit
    def own(a, w, out, board):
        blas._own_product(a, w, out, board)

    for m, k, n in [(1, 7, 5), (3, 16, 31), (1, 9, 32), (1, 9, 100), (2, 17, 130), (4, 8, 64),
                    (5, 33, 95), (9, 64, 200), (13, 7, 70), (32, 64, 256), (200, 6, 40),
                    (7, 0, 40), (33, 128, 1024)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        p = own_loop.panels(b)
        assert p.shape == (max(1, -(-n // 32)), k, 32)
        whole = np.empty((m, n), dtype)
        own_loop.small_gemm(a, b, whole)
        np.testing.assert_allclose(whole, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
        ld, panel = 32, 32 * k
        for lo, hi in [(0, n)] + ([(32, n), (0, 32 * (n // 64))] if n >= 64 else []):
            part = np.full((m, n), np.nan, dtype)
            own_loop._own_columns(a, p.reshape(-1), ld, panel, part, lo, hi)
            np.testing.assert_array_equal(part[:, lo:hi], whole[:, lo:hi], err_msg=(m, k, n, lo))
            assert np.isnan(part[:, :lo]).all() and np.isnan(part[:, hi:]).all()
        for board in (threads.ALONE, threads.board_for_one_group()):
            for weights in (b, p):
                out = np.full((m, n), np.nan, dtype)
                own(a, weights, out, board)
                np.testing.assert_array_equal(out, whole, err_msg=(m, k, n, weights.ndim))


@pytest.mark.parametrize("own", [False, True], ids=["library", "own-loop"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [0, 1, 7, 5000])
def test_transposed_product_on_threads_equals_numpy(rng, monkeypatch, dtype, rows, own):
    """Weight gradients ``a.T @ b``: the reduction split over stepnet's threads
    (every split forced), on the chosen BLAS or stepnet's own loop (by chunks
    of rows; under 6 columns of ``a``, and a last block of ``b``'s columns
    that overlaps the one before), agrees with NumPy's product."""

    monkeypatch.setattr(transposed, "_SPLIT_TN_WORK", 1)
    monkeypatch.setattr(transposed, "_TN_OWN", {"float32": own, "float64": own})
    previous = numba.get_num_threads()
    tol = 1e-4 if dtype == np.float32 else 1e-11
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            for m, n in ((13, 21), (13, 45), (4, 70), (7, 32)):
                a = rng.standard_normal((rows, m)).astype(dtype)
                b = rng.standard_normal((rows, n)).astype(dtype)
                got = transposed.transposed_product(a, b)
                want = a.astype(np.float64).T @ b.astype(np.float64)
                assert got.dtype == dtype and got.shape == (m, n)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
                # with the column sums of b (a bias's gradient), over several blocks of rows
                monkeypatch.setattr(transposed, "_SUM_BLOCK", 3)
                got, sums = transposed.transposed_product(a, b, column_sums=True)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
                assert sums.dtype == dtype and sums.shape == (n,)
                np.testing.assert_allclose(sums, b.astype(np.float64).sum(0), rtol=tol,
                                           atol=tol * max(1, rows) ** 0.5)
            # strided operands (a column slice) are read correctly too
            wide = rng.standard_normal((rows, 30)).astype(dtype)
            got = transposed.transposed_product(wide[:, 3:16], b)
            want = wide[:, 3:16].astype(np.float64).T @ b.astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("own", [False, True], ids=["library", "own-loop"])
def test_transposed_products_together_equal_numpy(rng, monkeypatch, own):
    """Several weight gradients at once (``transposed.transposed_products``): their
    work cut between the threads wherever it falls (inside a product, at
    its start, with the cut rows rounded; a product of no rows or no
    columns; column sums), each result equals NumPy's, in its order."""

    monkeypatch.setattr(transposed, "_TN_OWN", {"float32": own, "float64": own})
    previous = numba.get_num_threads()
    shapes = [(2000, 13, 40, True), (0, 8, 32, True), (7, 13, 45, False), (513, 6, 33, True),
              (64, 0, 32, True), (129, 9, 64, False)]
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            for split in (1, 1 << 30):  # (every product shared out; none)
                monkeypatch.setattr(transposed, "_SPLIT_TN_WORK", split)
                products = [(rng.standard_normal((r, m)).astype(np.float32),
                             rng.standard_normal((r, n)).astype(np.float32), sums)
                            for r, m, n, sums in shapes]
                results = transposed.transposed_products(products)
                assert len(results) == len(products)
                for (a, b, sums), got in zip(products, results):
                    want = a.astype(np.float64).T @ b.astype(np.float64)
                    product = got[0] if sums else got
                    assert product.dtype == np.float32 and product.shape == want.shape
                    np.testing.assert_allclose(product, want, rtol=1e-4, atol=1e-3)
                    if sums:
                        np.testing.assert_allclose(got[1], b.astype(np.float64).sum(0),
                                                   rtol=1e-4, atol=1e-3)
    finally:
        numba.set_num_threads(previous)
    # the pieces: each product whole on one thread but where a cut falls in it
    pieces = transposed._tn_pieces([6400 * 128 * 256] * 4 + [6400 * 256 * 256] * 3,
                             [128 * 256] * 4 + [256 * 256] * 3, 2)
    assert pieces == [[(0, 0, 6400), (1, 0, 6400), (2, 0, 6400), (3, 0, 6400), (4, 0, 3200)],
                      [(4, 3200, 6400), (5, 0, 6400), (6, 0, 6400)]]


def test_input_gradients_are_the_same_bits_for_any_batch_in_deterministic_mode():
    """STEPNET_DETERMINISTIC=1: the input's gradient of a GRU (its backward
    sums ``dgates_i @ W_i^T`` over the gates: a product of values joined by
    columns, one part added after another) gives each sequence the same
    bits whether it runs alone or in a batch."""
    code = """
import numpy as np, stepnet as sn
from stepnet.jit import blas
assert blas.DETERMINISTIC
rng = np.random.default_rng(0)
lengths = [30, 1, 25, 2, 40, 12, 33, 21]
for layer in (sn.nn.GRU(48, 64, seed=1),):
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 48)).astype("float32"),
                                  [lengths])
    dY = rng.standard_normal((sum(lengths), 64)).astype("float32")
    def d_input(first, last):
        rows = slice(X.levels[0][first], X.levels[0][last])
        part = sn.LoDTensor.from_lengths(X.data[rows], [lengths[first:last]])
        _, pullback = layer.vjp(part, backend="numba")
        states = [None] * (len(layer.state_widths()))
        return pullback([sn.LoDTensor.from_lengths(dY[rows], [lengths[first:last]])] + states,
                        wrt=["X"])[0]
    whole = d_input(0, len(lengths))
    for first, last in ((0, 1), (1, 2), (3, 4), (1, 4), (7, 8)):
        rows = slice(X.levels[0][first], X.levels[0][last])
        assert np.array_equal(d_input(first, last), whole[rows]), (type(layer), first, last)
print("bit for bit")
"""
    env = dict(os.environ, STEPNET_DETERMINISTIC="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bit for bit" in out.stdout



_ONE_OPENBLAS_THREAD = """
import ctypes
import numpy as np
from stepnet.jit import blas
assert blas.BLAS_NAME == "openblas", blas.BLAS_NAME
if not blas._COUNT_SETTER:
    print("no thread count setter")
    raise SystemExit
count = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(blas._openblas.set_threads_local)
def now():
    before = count(1)
    count(before)
    return before
rng = np.random.default_rng(0)
users = blas._OPENBLAS_USERS
a = rng.standard_normal((1100, 384)).astype(np.float32)
b = rng.standard_normal((384, 64)).astype(np.float32)
count(2)
out = np.empty((1100, 64), np.float32)
blas._row_major_gemm(blas._A, 1100, 64, 384, a, 384, b, out, 0.0)
assert now() == 2 and users[0] == 0, (now(), users)
count(1)
one_thread = np.empty_like(out)
blas._row_major_gemm(blas._A, 1100, 64, 384, a, 384, b, one_thread, 0.0)
assert np.array_equal(out, one_thread)  # (on two threads: other bits here)
count(2)
blas._openblas_calls(users, 1)  # a first call starts, then a second
blas._openblas_calls(users, 1)
assert now() == 1 and users[0] == 2, (now(), users)
blas._openblas_calls(users, -1)  # the first ends: the second still runs on one
assert now() == 1 and users[0] == 1, (now(), users)
blas._openblas_calls(users, -1)
assert now() == 2 and users[0] == 0, (now(), users)
import os
users[0] = -1  # a call setting the count when the process forks: the child has none
pid = os.fork()
if pid == 0:
    os._exit(0 if users[0] == 0 else 1)
users[0] = 0
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
print("one thread while any runs")
"""


def test_openblas_runs_on_one_thread_while_any_of_stepnets_products_runs():
    """OpenBLAS's thread count is the process's (its "local" setter's too),
    and its products on two threads give other bits than on one: the count
    is one from the first of stepnet's library calls running at once to the
    last, and the count before comes back after the last (a call giving it
    back while another ran let that one's product run on two threads: calls
    at once then differed in bits from the call alone); a forked child
    starts with none running."""
    from stepnet.jit import blas_choice

    if blas_choice.find_openblas() is None:
        pytest.skip("no OpenBLAS through scipy")
    env = dict(os.environ, STEPNET_BLAS="openblas")
    out = subprocess.run([sys.executable, "-c", _ONE_OPENBLAS_THREAD], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if "no thread count setter" in out.stdout:
        pytest.skip("this OpenBLAS has no thread count setter: stepnet cannot set its count")
    assert "one thread while any runs" in out.stdout
