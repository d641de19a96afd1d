"""The CPU engine: sequence groups on threads, the BLAS chosen by measurement."""

import json
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

import stepnet as sn
from stepnet import cli
from conftest import assert_close, cache_with_helpers
from nets import nested_encoder
from stepnet.jit import blas_choice, numba_cpu, threads


def _gru(rng, lengths, features=8, hidden=16, levels=None):
    rows = sum(lengths[-1])
    X = sn.LoDTensor.from_lengths(rng.standard_normal((rows, features)).astype(np.float32),
                                  lengths)
    W = sn.Parameter(rng.standard_normal((features, hidden)).astype(np.float32) * 0.3, name="W")
    U = sn.Parameter(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=rng.standard_normal((len(lengths[0]), hidden)).astype(np.float32),
                           name="h")
        z = sn.ops.sigmoid(x @ W + h.pre_state() @ U)
        h.update(z * h.pre_state() + (1 - z) * sn.ops.tanh(x @ W))
        rnn.add_outputs(h)
    return rnn


@pytest.fixture
def split_everything(monkeypatch):
    """Every run with two or more sequences splits into groups."""
    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 0)
    previous = numba.get_num_threads()
    yield
    numba.set_num_threads(previous)


def _program_of(rnn):
    return rnn.compile("numba")._runner(rnn.all_steps_flags(True))


@pytest.mark.parametrize("threads", [2, 3])
def test_groups_cover_the_sequences_in_order_balanced_by_rows(rng, split_everything, threads):
    lengths = [[9, 1, 1, 1, 1, 1, 8, 0, 2]]
    rnn = _gru(rng, lengths)
    program = _program_of(rnn)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    groups = program._groups(rnn.bind())
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths[0])
    assert all(a < b and b == c for (a, b), (c, _) in zip(groups, groups[1:]))
    assert len(groups) == numba.get_num_threads()
    if len(groups) == 2:  # 24 rows: the first cut falls after the 12th row
        assert groups == [(0, 4), (4, 9)]


@pytest.mark.parametrize("lengths", [[[5, 0, 4, 7, 1]], [[2, 3, 0], [3, 2, 5, 4, 1]],
                                     [[0, 0, 3]], [[4]]])
def test_a_split_run_equals_one_group(rng, split_everything, lengths):
    """Sequence groups on threads give the interpreter's results, LoD
    included, for flat and nested batches, all-steps and last-step outputs."""
    if len(lengths) == 1:
        rnn = _gru(rng, lengths)
    else:
        rows = sum(lengths[1])
        X = sn.LoDTensor.from_lengths(rng.standard_normal((rows, 4)).astype(np.float32), lengths)
        W = sn.Parameter(rng.standard_normal((4, 5)).astype(np.float32), name="W")
        U = sn.Parameter(rng.standard_normal((5, 5)).astype(np.float32) * 0.3, name="U")
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            x = rnn.add_input(X, name="X")
            h = rnn.add_memory(shape=[5], name="h")
            inner = sn.create_rnn_op()
            with inner.stepnet():
                w = inner.add_input(x, name="w")
                g = inner.add_memory(init=h.pre_state(), name="g")
                g.update(sn.ops.tanh(w @ W + g.pre_state() @ U))
                inner.add_outputs(g)
            h.update(inner(output_all_steps=False) + h.pre_state() @ U)
            rnn.add_outputs(h, inner())
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    for all_steps in (True, False):
        expected = rnn(output_all_steps=all_steps, backend="interpreter")
        assert_close(rnn(output_all_steps=all_steps, backend="numba"), expected)


def test_a_flat_net_whose_kernel_cuts_its_sequences_runs_as_one_group_on_two_threads(
        rng, split_everything):
    """A GRU of 64 units (weights big enough for its kernel to give half of
    its sequences to the helper): on two threads a run is one group and the
    kernel cuts it, on three it is groups on Python's threads; a net whose
    step runs a nested net cuts the sequences of both (the nested one's run
    before the time loop). Every way equals the interpreter."""
    lengths = [[12, 3, 7, 0, 9, 5, 11, 2]]
    rnn = _gru(rng, lengths, hidden=64)
    program = _program_of(rnn)
    assert program.cuts_sequences
    rows, width = sum(lengths[0]), 8
    expected = rnn(backend="interpreter")
    for count in (2, 3):
        if count > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(count)
        splits = program.splits(rows, width, len(lengths[0]))
        assert splits == (count == 3 or not threads.SPINS)
        assert len(program._groups(rnn.bind())) == (count if splits else 1)
        assert_close(rnn(backend="numba"), expected)
    nested = _program_of(nested_encoder(rng, hidden=64, outputs=("h",)).rnn)
    assert nested.source.count("cut = group_cut(board") == 2 and nested.cuts_sequences


def test_gradients_of_a_split_run(rng, split_everything):
    rnn = _gru(rng, [[6, 2, 0, 5, 3]])
    W, U = rnn.parameters()
    dY = rng.standard_normal((16, 16)).astype(np.float32)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    got = sn.gradients(rnn, wrt=[W, U], grad_outputs=[dY], backend="numba")
    want = sn.gradients(rnn, wrt=[W, U], grad_outputs=[dY], backend="interpreter")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# the BLAS


def _python(code, tmp_path, **env):
    """``code``'s output in a new process, on a cache of no kernel but this
    process's helpers and measurements (``cache_with_helpers``)."""
    cache = cache_with_helpers(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, STEPNET_CACHE_DIR=str(cache), **env),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def libraries(monkeypatch, tmp_path):
    """``blas_choice._choose`` over the libraries a test names (found, or
    not), whatever this machine has, with a fresh cache directory and
    measurements a test sets (``seconds``; each call of ``measure`` is
    counted in ``measured``)."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STEPNET_BLAS", raising=False)
    state = {"found": {}, "seconds": {}, "measured": 0}
    for name in ("mkl", "openblas"):
        monkeypatch.setattr(blas_choice, f"find_{name}",
                            lambda name=name: state["found"].get(name))

    def measure(reachable, shapes=None):
        state["measured"] += 1
        seconds = state["seconds"]  # (a list: one call's figures each)
        seconds = seconds.pop(0) if isinstance(seconds, list) else seconds
        return {lib.name: seconds[lib.name] for lib in reachable}

    monkeypatch.setattr(blas_choice, "measure", measure)
    return state


def test_the_choice_is_measured_once_and_kept(libraries, tmp_path):
    """With two libraries the faster is measured once, kept, read back,
    and measured again where the kept file is corrupt or the library it
    names is gone."""
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    libraries["seconds"] = {"mkl": [2.0, 2.0], "openblas": [1.0, 1.0]}
    first, _ = blas_choice._choose()
    assert (first["name"], first["reason"]) == ("openblas", "measured")
    saved = json.loads((tmp_path / "blas.json").read_text())
    assert saved["name"] == "openblas" and set(saved["seconds"]) == {"mkl", "openblas"}
    libraries["seconds"] = {"mkl": [1.0, 1.0], "openblas": [2.0, 2.0]}  # (not asked again)
    second, _ = blas_choice._choose()
    assert (second["name"], second["reason"]) == ("openblas", "measured (cached)")
    assert libraries["measured"] == 2  # (twice: the same figures, steady)
    (tmp_path / "blas.json").write_text("{not json")  # measured again, never a crash
    third, _ = blas_choice._choose()
    assert (third["name"], third["reason"]) == ("mkl", "measured")
    assert libraries["measured"] == 4


def test_a_measurement_is_taken_again_until_steady_or_said_to_be_noisy(libraries, tmp_path):
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    mkl = [2.0, 2.0]
    # the second measurement far from the first, the third close to it: steady
    libraries["seconds"] = [{"mkl": mkl, "openblas": [1.0, 1.0]},
                            {"mkl": mkl, "openblas": [1.6, 1.0]},
                            {"mkl": mkl, "openblas": [1.05, 1.0]}]
    choice, _ = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("openblas", "measured")
    assert choice["seconds"]["openblas"] == [1.0, 1.0] and libraries["measured"] == 3
    # never two close: chosen on the best figures, and said to be noisy, kept so
    (tmp_path / "blas.json").unlink()
    libraries["seconds"] = [{"mkl": mkl, "openblas": [1.0, 1.0]},
                            {"mkl": mkl, "openblas": [1.6, 1.0]},
                            {"mkl": mkl, "openblas": [1.3, 1.0]}]
    choice, _ = blas_choice._choose()
    assert choice["name"] == "openblas" and libraries["measured"] == 6
    assert "noisy" in choice["reason"] and "openblas 64x256 @ 256x768" in choice["reason"]
    assert "stepnet info --measure" in choice["reason"]
    again, _ = blas_choice._choose()
    assert again["reason"] == choice["reason"] + " (cached)"


def test_one_library_or_none_is_taken_without_measuring(libraries, tmp_path):
    libraries["found"] = {"openblas": blas_choice.Library("openblas", "/lib/openblas.so", None)}
    choice, _ = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("openblas", "the only one found")
    libraries["found"] = {}
    with pytest.warns(RuntimeWarning, match="no BLAS found"):
        choice, _ = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("numpy", "no BLAS found")
    assert libraries["measured"] == 0 and not (tmp_path / "blas.json").exists()


def test_a_requested_library_is_taken_or_warned_about(libraries, monkeypatch):
    libraries["found"] = {"mkl": blas_choice.Library("mkl", "/lib/mkl.so", None)}
    monkeypatch.setenv("STEPNET_BLAS", "mkl")
    assert blas_choice._choose()[0]["name"] == "mkl"
    monkeypatch.setenv("STEPNET_BLAS", "openblas")
    with pytest.warns(RuntimeWarning, match="STEPNET_BLAS=openblas but"):
        assert blas_choice._choose()[0]["name"] == "numpy"
    monkeypatch.setenv("STEPNET_BLAS", "atlas")
    with pytest.raises(sn.UnsupportedError, match="STEPNET_BLAS='atlas'"):
        blas_choice._choose()
    assert libraries["measured"] == 0


def test_stepnet_blas_names_the_library(tmp_path):
    out = _python("from stepnet.jit import blas; print(blas.BLAS_NAME)", tmp_path,
                  STEPNET_BLAS="numpy")
    assert out.strip() == "numpy"


def test_the_small_product_rows_are_the_cheapest_measured(tmp_path, monkeypatch):
    """For each size of weights, stepnet's own loop is taken up to the rows
    where, over all rows measured, the time (each relative to the faster of
    the two) is least (every number of rows where that is the most rows
    measured), and shared with the helper where a one-row product took less
    time cut with it than alone (or where not measured; a cut that lost is
    measured twice); the limits are kept and read back."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_choice.time, "sleep", lambda s: None)
    # the machine's load unread: every cut counts (the other test processes
    # would otherwise make some of them crowded; that rule has its own test)
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: None)
    monkeypatch.delenv("STEPNET_SMALL_PRODUCTS", raising=False)
    choice = {"name": "mkl", "cpu": "a CPU", "libraries": {"mkl": "/lib/libmkl_rt.so"}}
    asked, asked_shared = [], []

    def time_both(m, k, n):  # the own loop is faster up to 4 rows, 16 for the smallest weights
        asked.append((m, k, n))
        return (1.0, 2.0) if m <= (16 if k * n < 20000 else 4) else (2.0, 1.0)

    def time_shared(m, k, n):  # never cut under 20000; cut is slower up to 200000
        asked_shared.append((m, k, n))
        return None if k * n < 20000 else (1.0, 1.5) if k * n <= 200000 else (2.0, 1.0)

    limits = blas_choice.small_product_rows(choice, time_both, time_shared)
    sizes = [k * n for k, n in blas_choice._STEP_WEIGHTS]
    assert limits == tuple((size, 16 if size < 20000 else 4, int(not 20000 <= size <= 200000))
                           for size in sizes)
    assert len(asked) == len(blas_choice._STEP_WEIGHTS) * len(blas_choice._STEP_ROWS)
    assert asked_shared == [(1, k, n) for k, n in blas_choice._STEP_WEIGHTS
                            for _ in range(2 if 20000 <= k * n <= 200000 else 1)]
    saved = json.loads((tmp_path / "small_products.json").read_text())
    assert [tuple(x) for x in saved["limits"]] == list(limits)
    assert blas_choice.small_product_rows(choice, None) == limits  # cached: nothing timed
    # another library is measured anew; a library faster everywhere gets 0 rows
    other = dict(choice, name="openblas", libraries={"openblas": "scipy"})
    assert {r for _, r, _ in blas_choice.small_product_rows(other, lambda m, k, n: (2.0, 1.0))} \
        == {0}
    # an own loop faster up to the most rows measured takes every product of
    # that size; nothing measured about the helper: every size shares
    third = dict(choice, name="numpy", libraries={})
    limits = blas_choice.small_product_rows(
        third, lambda m, k, n: (1.0, 2.0) if k * n < 20000 or m <= 64 else (2.0, 1.0))
    assert limits == tuple((size, (1 << 62) if size < 20000 else 64, 1) for size in sizes)
    # a library whose rows differ by part: the own loop takes every product
    # (the limits kept for the library, the sharing as measured)
    apart = dict(third, rows_alike=False)
    assert blas_choice.small_product_rows(apart, None) == tuple(
        (size, 1 << 62, shares) for size, _, shares in limits)
    assert "every product" in blas_choice._SMALL_PRODUCTS["reason"]
    monkeypatch.setenv("STEPNET_SMALL_PRODUCTS", "3")
    assert blas_choice.small_product_rows(choice, None) == ((1 << 62, 3, 1),)
    assert blas_choice.small_product_rows(apart, None) == ((1 << 62, 3, 1),)  # as asked
    monkeypatch.setenv("STEPNET_SMALL_PRODUCTS", "many")
    with pytest.raises(sn.UnsupportedError, match="STEPNET_SMALL_PRODUCTS='many'"):
        blas_choice.small_product_rows(choice, None)


def test_a_library_is_checked_for_computing_each_row_alike_in_any_part():
    """``rows_alike``: a product whose rows are each computed by the same
    call holds; one whose rows depend on how many are computed with them
    does not; the chosen library is checked in every process."""
    def by_rows(a, b, c):
        for i in range(a.shape[0]):
            c[i] = a[i] @ b

    def by_count(a, b, c):
        c[...] = a @ b + np.float32(1e-3) * a.shape[0]

    assert blas_choice.rows_alike(by_rows)
    assert not blas_choice.rows_alike(by_count)
    assert isinstance(blas_choice.choose()["rows_alike"], bool)


def test_a_cut_is_not_measured_beside_another_process(tmp_path, monkeypatch):
    """A product cut with the helper is measured only while no other process
    keeps a core busy (its cut would lose however fast it is on a free
    core): where every try had company, it is not measured, and the sizes
    share by default; the file says how many were not measured."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STEPNET_SMALL_PRODUCTS", raising=False)
    monkeypatch.setattr(blas_choice.time, "sleep", lambda s: None)
    clock = iter(range(0, 10**6, 5))  # another process: 5 busy seconds a reading
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: float(next(clock)))
    assert blas_choice.measured_on_free_cores(lambda: 1.0, tries=2) == (None, False)
    choice = {"name": "mkl", "cpu": "a crowded CPU", "libraries": {"mkl": "/lib/libmkl_rt.so"}}
    limits = blas_choice.small_product_rows(choice, lambda m, k, n: (1.0, 2.0),
                                            lambda m, k, n: (1.0, 2.0))
    assert all(shares == 1 for _, _, shares in limits)
    saved = json.loads((tmp_path / "small_products.json").read_text())
    assert saved["crowded"] == len(blas_choice._STEP_WEIGHTS) and saved["shared"] == []
    # a quiet machine: measured (another CPU's key: not the file above)
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: 0.0)
    assert blas_choice.measured_on_free_cores(lambda: 1.0) == (1.0, True)
    quiet = dict(choice, cpu="a quiet CPU")
    limits = blas_choice.small_product_rows(quiet, lambda m, k, n: (1.0, 2.0),
                                            lambda m, k, n: (1.0, 2.0))
    assert all(shares == 0 for _, _, shares in limits)
    assert json.loads((tmp_path / "small_products.json").read_text())["crowded"] == 0


def test_the_own_loop_shares_only_the_sizes_the_table_says(rng):
    """``pack`` gives the own loop the kernel's board for weights whose size
    shares (the table's third row, or a table of two rows), and a board that
    shares nothing for the others; the library's products keep the board."""
    from stepnet.jit import blas, threads

    blas.register_small_gemm(np.float32)
    board = threads.BOARD.copy()  # (a stand-in: only its SHARES slot is read here)
    table = np.array([[100, 1000, 1 << 62], [1 << 62] * 3, [1, 0, 1]], np.int64)
    assert [blas.shares_with_helper(table, size) for size in (50, 100, 101, 1000, 10**6)] == \
        [True, True, False, False, True]
    assert blas.shares_with_helper(table[:2], 500)
    for (k, n), shares in [((5, 10), True), ((10, 64), False), ((40, 64), True)]:
        prepared = blas.pack(rng.standard_normal((k, n)).astype(np.float32), 4, 1000, table, board)
        assert prepared[3][threads.SHARES] == 1
        assert prepared[5][threads.SHARES] == int(shares)
        assert (prepared[5] == board).all() if shares else not prepared[5].any()


def test_panels_start_on_a_cache_line(rng):
    """The own loop's panels (and MKL's packed weights) are 64-byte aligned,
    whatever the allocator gave (``aligned_empty``)."""
    from stepnet.jit import blas

    for k, n in [(1, 5), (3, 40), (128, 384), (7, 33)]:
        b = rng.standard_normal((k, n)).astype(np.float32)
        assert blas.panels(b).ctypes.data % 64 == 0
        for size in range(1, 40):
            assert blas.aligned_empty(size, b).ctypes.data % 64 == 0
            assert blas.aligned_empty(size, b.astype(np.float64)).ctypes.data % 64 == 0


def test_a_product_takes_the_rows_of_the_next_larger_weights_measured():
    from stepnet.jit import blas

    table = np.array([[100, 1000, 4000], [8, 2, 1]], np.int64)
    assert [blas.rows_for(table, size) for size in (1, 100, 101, 1000, 4000, 10**7)] == \
        [8, 8, 2, 2, 1, 1]


def test_products_of_under_32_columns_take_the_library(rng):
    """Under 32 columns stepnet's own loop takes one sum at a time: such a
    product runs the library's, at any rows the table gives (every product
    under STEPNET_DETERMINISTIC, whose sums have a fixed order)."""
    from stepnet.jit import blas, threads

    blas.register_small_gemm(np.float32)
    every = np.array([[1 << 62], [1 << 62]], np.int64)
    assert blas.own_rows(every, 256, 32) == 1 << 62
    assert blas.own_rows(every, 256, 31) == (1 << 62 if blas.DETERMINISTIC else 0)
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
    from stepnet.jit import blas

    for m, k, n in [(0, 5, 7), (1, 0, 9), (1, 3, 64), (2, 17, 130), (4, 8, 32), (5, 33, 95),
                    (9, 64, 200), (12, 1, 1), (1, 7, 144), (1, 9, 100), (3, 5, 300), (1, 4, 96),
                    (6, 0, 40), (6, 3, 32), (7, 20, 33), (11, 9, 70), (17, 40, 130), (64, 64, 256),
                    (8, 9, 64), (10, 6, 40), (13, 7, 70), (15, 5, 33), (32, 20, 96),
                    (200, 6, 40), (197, 9, 64), (1, 11, 390), (1, 5, 161)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        out = np.full((m, n), 7, dtype)
        blas.small_gemm(a, b, out)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    a = rng.standard_normal((6, 8)).astype(dtype)
    b = rng.standard_normal((8, 70)).astype(dtype)
    a[1, 3], a[4, 0] = np.nan, np.inf
    out = np.empty((6, 70), dtype)
    blas.small_gemm(a, b, out)
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
    from stepnet.jit import blas

    for m, k, n in [(13, 37, 100), (64, 256, 96), (6, 5, 32), (10, 128, 384), (32, 64, 96),
                    (200, 16, 64)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        whole = np.empty((m, n), dtype)
        blas.small_gemm(a, b, whole)
        for i in range(m):
            alone = np.empty((1, n), dtype)
            blas.small_gemm(a[i:i + 1], b, alone)
            np.testing.assert_array_equal(whole[i], alone[0], err_msg=(m, k, n, i))
        tail = np.empty((m - 2, n), dtype)
        blas.small_gemm(np.ascontiguousarray(a[2:]), b, tail)
        np.testing.assert_array_equal(whole[2:], tail)


def test_kernels_call_small_gemm_by_its_c_entry_on_any_layout(rng):
    """gemm_packed's own-loop path (small_gemm's C entry, registered by symbol)
    on C-contiguous operands, and on strided ones through contiguous copies."""
    from numba import njit

    from stepnet.jit import blas, threads

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

    from stepnet.jit import blas, threads

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

    from stepnet.jit import blas, threads

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
    from stepnet.jit import blas

    monkeypatch.setattr(blas, "_COLS", cols)
    start = blas._block_start.py_func
    k = 2
    for n in range(cols, 200):
        b = np.arange(k * n, dtype=np.float32).reshape(k, n)
        flat = blas.panels(b).reshape(-1)
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

    from stepnet.jit import blas

    host = llvm_binding.get_host_cpu_features().get("avx512f", False)
    if not (numba_config.CPU_NAME or numba_config.CPU_FEATURES):
        assert blas.vector_registers() == ((64, 32) if host else (32, 16))
    assert blas._COLS == 2 * blas.vector_registers()[0] // 4
    for name, expected in [("haswell", (32, 16)), ("znver3", (32, 16)),
                           ("skylake-avx512", (64, 32)), ("znver5", (64, 32))]:
        monkeypatch.setattr(numba_config, "CPU_FEATURES", None)
        monkeypatch.setattr(numba_config, "CPU_NAME", name)
        assert blas.vector_registers() == expected, name
    monkeypatch.setattr(numba_config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert blas.vector_registers() == (32, 16)
    monkeypatch.setattr(numba_config, "CPU_FEATURES", "+avx2,+avx512f")
    assert blas.vector_registers() == (64, 32)


def test_one_row_on_the_weights_rows_equals_the_panels_bit_for_bit(rng):
    """Where stepnet's own loop takes one row a product (float32,
    ``_WIDE_ACCUMULATORS`` columns or more: 384 with AVX-512, 96 with AVX2),
    ``pack`` gives it the weights as one panel of every column (``b`` on a
    cache line) and the row runs that many columns at a time
    (``_one_row_wide``): the same bits as six blocks of ``panels`` at a time,
    for any range of columns and through the C entry; elsewhere the panels
    are made as before."""
    from numba import njit

    from stepnet.jit import blas, threads

    blas.register_small_gemm(np.float32)

    @njit
    def own(a, w, out, board):
        blas._own_product(a, w, out, board)

    one_row = np.array([[1 << 40], [1]], np.int64)  # (the own loop: one row, any size)
    for k, n in [(128, 384), (64, 400), (256, 1024), (7, 769), (1, 383)]:
        a = rng.standard_normal((1, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        p = blas.panels(b)
        whole = np.empty((1, n), np.float32)
        blas._own_columns(a, p.reshape(-1), 32, 32 * k, whole, 0, n)
        prepared = blas.pack(b, 1, blas.PANEL_MIN_ROWS, one_row, threads.ALONE)
        rows_of_b = prepared[4]
        wide = n >= blas._WIDE_ACCUMULATORS
        assert rows_of_b.shape == ((1, k, n) if wide else (-(-n // 32), k, 32)), (k, n)
        assert rows_of_b.ctypes.data % 64 == 0
        got = np.full((1, n), np.nan, np.float32)
        own(a, rows_of_b, got, threads.ALONE)
        np.testing.assert_array_equal(got, whole, err_msg=(k, n))
        for lo, hi in [(0, n), (32, n), (0, 32 * (n // 64)), (n - 32 * (n // 32), n)]:
            part = np.full((1, n), np.nan, np.float32)
            blas._own_columns(a, b.reshape(-1), n, 0, part, lo, hi)
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

    from stepnet.jit import blas, threads

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

    from stepnet.jit import blas, threads

    blas.register_small_gemm(dtype)

    @njit
    def own(a, w, out, board):
        blas._own_product(a, w, out, board)

    for m, k, n in [(1, 7, 5), (3, 16, 31), (1, 9, 32), (1, 9, 100), (2, 17, 130), (4, 8, 64),
                    (5, 33, 95), (9, 64, 200), (13, 7, 70), (32, 64, 256), (200, 6, 40),
                    (7, 0, 40), (33, 128, 1024)]:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        p = blas.panels(b)
        assert p.shape == (max(1, -(-n // 32)), k, 32)
        whole = np.empty((m, n), dtype)
        blas.small_gemm(a, b, whole)
        np.testing.assert_allclose(whole, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
        ld, panel = 32, 32 * k
        for lo, hi in [(0, n)] + ([(32, n), (0, 32 * (n // 64))] if n >= 64 else []):
            part = np.full((m, n), np.nan, dtype)
            blas._own_columns(a, p.reshape(-1), ld, panel, part, lo, hi)
            np.testing.assert_array_equal(part[:, lo:hi], whole[:, lo:hi], err_msg=(m, k, n, lo))
            assert np.isnan(part[:, :lo]).all() and np.isnan(part[:, hi:]).all()
        for board in (threads.ALONE, threads.board_for_one_group()):
            for weights in (b, p):
                out = np.full((m, n), np.nan, dtype)
                own(a, weights, out, board)
                np.testing.assert_array_equal(out, whole, err_msg=(m, k, n, weights.ndim))


def test_stepnet_info_prints_the_choice(tmp_path):
    cache = cache_with_helpers(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-m", "stepnet", "info"], capture_output=True,
                          text=True, env=dict(os.environ, STEPNET_CACHE_DIR=str(cache)),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BLAS: " in proc.stdout and "CPU: " in proc.stdout and "threads: " in proc.stdout
    assert "compile worker: none running" in proc.stdout
    assert re.search(r"stepnet's own loop: blocks of (6 rows x 32|4 rows x 16) columns", proc.stdout)
    # --measure: the kept measurements taken again, and what changed said
    kept = {name: (cache / name).read_text() for name in cli.MEASUREMENTS if (cache / name).exists()}
    assert "small_products.json" in kept
    (cache / "small_products.json").write_text(  # a point no measurement gives
        kept["small_products.json"].replace('"points": [', '"points": [[7777, 64, 192, 1, 1], ', 1))
    proc = subprocess.run([sys.executable, "-m", "stepnet", "info", "--measure"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, STEPNET_CACHE_DIR=str(cache)))
    assert proc.returncode == 0, proc.stderr
    assert "BLAS: " in proc.stdout and "changed by measuring again:" in proc.stdout, proc.stdout
    changed = proc.stdout.split("changed by measuring again:")[1]
    assert "-  rows x 64 @ 64x192" in changed and "7777: 1000000.0/1000000.0" in changed, changed
    assert "7777" not in (cache / "small_products.json").read_text()


def test_importing_stepnet_leaves_numbas_threading_alone(tmp_path):
    out = _python("import numba; before = numba.config.THREADING_LAYER_PRIORITY; "
                  "import stepnet; from stepnet.jit import blas; "
                  "print(numba.config.THREADING_LAYER_PRIORITY == before)", tmp_path)
    assert out.strip() == "True"


@pytest.mark.parametrize("env, tuned", [
    ({}, True),
    ({"STEPNET_MALLOC_TUNING": "0"}, False),
    ({"MALLOC_ARENA_MAX": "2"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, False),
])
def test_the_numba_backend_keeps_freed_memory_unless_told_not_to(monkeypatch, env, tuned):
    """glibc's mmap and trim thresholds are set (the next call reuses freed
    pages), except under STEPNET_MALLOC_TUNING=0 or the user's own malloc
    settings."""
    if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        pytest.skip("not glibc")
    calls = []

    class Libc:
        @staticmethod
        def mallopt(option, value):
            calls.append((option, value))
            return 1

    for k in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(numba_cpu.ctypes, "CDLL", lambda name: Libc)
    numba_cpu._keep_freed_memory()
    assert calls == (list(numba_cpu.GLIBC_MALLOC_OPTIONS.items()) if tuned else [])


@pytest.mark.parametrize("own", [False, True], ids=["library", "own-loop"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [0, 1, 7, 5000])
def test_transposed_product_on_threads_equals_numpy(rng, monkeypatch, dtype, rows, own):
    """Weight gradients ``a.T @ b``: the reduction split over stepnet's threads
    (every split forced), on the chosen BLAS or stepnet's own loop (by chunks
    of rows; under 6 columns of ``a``, and a last block of ``b``'s columns
    that overlaps the one before), agrees with NumPy's product."""
    from stepnet.jit import blas

    monkeypatch.setattr(blas, "_SPLIT_TN_WORK", 1)
    monkeypatch.setattr(blas, "_TN_OWN", {"float32": own, "float64": own})
    previous = numba.get_num_threads()
    tol = 1e-4 if dtype == np.float32 else 1e-11
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            for m, n in ((13, 21), (13, 45), (4, 70), (7, 32)):
                a = rng.standard_normal((rows, m)).astype(dtype)
                b = rng.standard_normal((rows, n)).astype(dtype)
                got = blas.transposed_product(a, b)
                want = a.astype(np.float64).T @ b.astype(np.float64)
                assert got.dtype == dtype and got.shape == (m, n)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
                # with the column sums of b (a bias's gradient), over several blocks of rows
                monkeypatch.setattr(blas, "_SUM_BLOCK", 3)
                got, sums = blas.transposed_product(a, b, column_sums=True)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
                assert sums.dtype == dtype and sums.shape == (n,)
                np.testing.assert_allclose(sums, b.astype(np.float64).sum(0), rtol=tol,
                                           atol=tol * max(1, rows) ** 0.5)
            # strided operands (a column slice) are read correctly too
            wide = rng.standard_normal((rows, 30)).astype(dtype)
            got = blas.transposed_product(wide[:, 3:16], b)
            want = wide[:, 3:16].astype(np.float64).T @ b.astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, rows) ** 0.5)
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("own", [False, True], ids=["library", "own-loop"])
def test_transposed_products_together_equal_numpy(rng, monkeypatch, own):
    """Several weight gradients at once (``blas.transposed_products``): their
    work cut between the threads wherever it falls (inside a product, at
    its start, with the cut rows rounded; a product of no rows or no
    columns; column sums), each result equals NumPy's, in its order."""
    from stepnet.jit import blas

    monkeypatch.setattr(blas, "_TN_OWN", {"float32": own, "float64": own})
    previous = numba.get_num_threads()
    shapes = [(2000, 13, 40, True), (0, 8, 32, True), (7, 13, 45, False), (513, 6, 33, True),
              (64, 0, 32, True), (129, 9, 64, False)]
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            for split in (1, 1 << 30):  # (every product shared out; none)
                monkeypatch.setattr(blas, "_SPLIT_TN_WORK", split)
                products = [(rng.standard_normal((r, m)).astype(np.float32),
                             rng.standard_normal((r, n)).astype(np.float32), sums)
                            for r, m, n, sums in shapes]
                results = blas.transposed_products(products)
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
    pieces = blas._tn_pieces([6400 * 128 * 256] * 4 + [6400 * 256 * 256] * 3,
                             [128 * 256] * 4 + [256 * 256] * 3, 2)
    assert pieces == [[(0, 0, 6400), (1, 0, 6400), (2, 0, 6400), (3, 0, 6400), (4, 0, 3200)],
                      [(4, 3200, 6400), (5, 0, 6400), (6, 0, 6400)]]


def test_the_transposed_products_loop_is_measured_once_and_kept(tmp_path, monkeypatch):
    """Whether weight gradients run stepnet's own loop is the faster of the
    two on this machine, measured once for each dtype and read back from
    the cache (both dtypes' records in one file)."""
    from stepnet.jit import blas, blas_choice

    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    for own_s, lib_s in ((1.0, 2.0), (2.0, 1.0)):
        calls = []

        def time_both(rows, m, n, dtype, own_s=own_s, lib_s=lib_s, calls=calls):
            calls.append((rows, m, n, dtype))
            # float64: the other way round
            return (own_s, lib_s) if dtype == "float32" else (lib_s, own_s)

        for f in tmp_path.glob("transposed_products.json"):
            f.unlink()
        for _ in range(2):  # (the second from the cache)
            assert blas_choice.transposed_by_own_loop(blas._choice, time_both) == (own_s < lib_s)
            assert blas_choice.transposed_by_own_loop(blas._choice, time_both, "float64") == \
                (lib_s < own_s)
        assert calls == [(*blas_choice._TN_SHAPE, "float32"), (*blas_choice._TN_SHAPE, "float64")]
        kept = json.loads((tmp_path / "transposed_products.json").read_text())
        assert kept["seconds"] == {"float32": [own_s, lib_s], "float64": [lib_s, own_s]}
    # a file of the earlier form (one pair of seconds): measured again
    (tmp_path / "transposed_products.json").write_text(json.dumps(
        {**kept, "seconds": [1.0, 2.0]}))
    calls.clear()
    assert blas_choice.transposed_by_own_loop(blas._choice, time_both, "float64") == \
        (lib_s < own_s)
    assert calls == [(*blas_choice._TN_SHAPE, "float64")]


def test_input_gradients_are_the_same_bits_for_any_batch_in_deterministic_mode():
    """STEPNET_DETERMINISTIC=1: the input's gradient of a layer (its backward
    sums ``dgates_i @ W_i^T`` over the gates: a product of values joined by
    columns, one part added after another) gives each sequence the same
    bits whether it runs alone or in a batch."""
    code = """
import numpy as np, stepnet as sn
from stepnet.jit import blas
assert blas.DETERMINISTIC
rng = np.random.default_rng(0)
lengths = [30, 1, 25, 2, 40, 12, 33, 21]
for layer in (sn.nn.GRU(48, 64, seed=1), sn.nn.LSTM(48, 64, seed=2)):
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


def test_run_apart_gives_each_item_its_share_of_the_threads():
    """threads.run_apart: the items at the same time, each seeing its share
    of Numba's (per-thread) thread count, the results in order, the count
    restored; with fewer threads than items, one after the other."""
    previous = numba.get_num_threads()
    try:
        for count, share in ((2, 1), (1, 1)):
            if count > numba.config.NUMBA_NUM_THREADS:
                continue
            numba.set_num_threads(count)
            seen = threads.run_apart(lambda i: (i, numba.get_num_threads()), range(2),
                                     threads.SPLIT_MIN_WORK)
            assert seen == [(0, share), (1, share)]
            assert numba.get_num_threads() == count
            small = threads.run_apart(lambda i: (i, numba.get_num_threads()), range(2),
                                      threads.SPLIT_MIN_WORK - 1)
            assert small == [(0, count), (1, count)]  # one after the other
        if numba.config.NUMBA_NUM_THREADS >= 2:
            numba.set_num_threads(2)

            def fails(i):
                if i == 1:
                    raise ValueError("direction 1")
                return i

            with pytest.raises(ValueError, match="direction 1"):
                threads.run_apart(fails, range(2), threads.SPLIT_MIN_WORK)
            assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("combine", ["per_layer", "final"])
def test_a_bidirectional_layer_runs_its_directions_apart(rng, monkeypatch, run_apart_calls,
                                                        combine):
    """On the Numba backend a bidirectional layer's two directions run at
    once (threads.run_apart), forward and backward, to the interpreter's
    results, where its rows are worth a thread (threads.SPLIT_MIN_WORK, set to
    0 here, then above them); on the interpreter one after the other."""
    calls = run_apart_calls
    layer = sn.nn.LSTM(3, 4, num_layers=2, direction="bidirectional_concat", combine=combine,
                       seed=1)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 3)).astype(np.float32), [[4, 0, 5]])
    dY = rng.standard_normal((9, 8)).astype(np.float32)
    results = {}
    for backend in ("interpreter", "numba"):
        calls.clear()
        (Y, (h, c)), pullback = sn.vjp(layer, X, backend=backend)
        grads = pullback([dY, None, None], wrt=["X"] + layer.parameters())
        results[backend] = [Y.data, h, c] + list(grads)
        expected = {"interpreter": 0, "numba": 2 if combine == "final" else 4}[backend]
        assert len(calls) == expected and all(items == [0, 1] for items in calls)
    for a, b in zip(results["numba"], results["interpreter"]):
        assert_close(a, b, what="numba against the interpreter")
    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 10 ** 9)  # too few rows: no thread handoff
    calls.clear()
    layer(X, backend="numba")
    assert calls == []


def test_stepnet_loops_are_vectorized_with_the_widest_vectors(rng):
    """A function that calls ``wide_vectors`` carries LLVM's
    ``prefer-vector-width`` of 512 (and, on a CPU with AVX-512, its loop
    uses 512-bit registers); a function that does not keeps LLVM's choice;
    the generated kernels and the own loop call it."""
    import llvmlite.binding as llvm_binding

    from stepnet.jit import atomics, blas

    def scale(x, y):
        for i in range(x.shape[0]):
            y[i] = 2.0 * x[i] + 1.0

    def wide_scale(x, y):
        atomics.wide_vectors()
        scale_loop(x, y)

    scale_loop = numba.njit(inline="always")(scale)
    plain, wide = numba.njit(scale), numba.njit(wide_scale)
    x = rng.standard_normal(1000).astype(np.float32)
    y1, y2 = np.empty_like(x), np.empty_like(x)
    plain(x, y1)
    wide(x, y2)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(y2, 2 * x + 1)
    attribute = '"prefer-vector-width"="512"'
    assert attribute in wide.inspect_llvm(wide.signatures[0])
    assert attribute not in plain.inspect_llvm(plain.signatures[0])
    if llvm_binding.get_host_cpu_features().get("avx512f"):
        assert "zmm" in wide.inspect_asm(wide.signatures[0])
    own = numba.njit(blas._own_columns.py_func)  # (compiled here, not read from the cache)
    b = rng.standard_normal((8, 64)).astype(np.float32)
    out = np.empty((6, 64), np.float32)
    own(b[:6, :8], b.reshape(b.size), 64, 0, out, 0, 64)
    assert attribute in own.inspect_llvm(own.signatures[0])
    source = _gru(rng, [[3, 2]]).compile("numba").source
    assert source.count("    wide_vectors()\n") == source.count("@njit")


def test_the_default_backend_is_numba_and_imports_no_other_backend(tmp_path):
    """A call without ``backend=`` runs on Numba where it is available, and
    choosing it imports no other backend (numba.cuda takes a tenth of a
    second to seconds to import, and a CPU user never needs it)."""
    code = """
import sys, numpy as np, stepnet as sn
layer = sn.nn.GRU(4, 8, seed=0)
layer(sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]]))
print(sn.default_backend(), "numba.cuda" in sys.modules)
"""
    out = _python(code, tmp_path, STEPNET_TIERED="0")
    assert out.split() == ["numba", "False"], out


def test_the_default_backend_is_the_interpreter_without_numba(monkeypatch):
    from stepnet import errors
    backends_module = sys.modules["stepnet.backends"]
    real = backends_module._module

    def without_numba(name):
        if name == "numba":
            raise errors.BackendError("backend 'numba' is not available here: (test)")
        return real(name)

    monkeypatch.setattr(backends_module, "_module", without_numba)
    monkeypatch.setattr(backends_module, "_default", None)
    assert sn.default_backend() == "interpreter"
    monkeypatch.setattr(backends_module, "_default", None)
    monkeypatch.setattr(backends_module, "_module", real)
    assert sn.default_backend() == "numba"
