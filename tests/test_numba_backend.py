"""The Numba backend: agreement with the interpreter on the cases its code
generator treats specially, its caches, and its float32 transcendentals."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close, run_python
from nets import gru_net, lod, nested_encoder, small_gru, zero_width_net

import stepnet as sn

numba_cpu = pytest.importorskip("stepnet.jit.numba_cpu")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reverse", [False, True])
def test_gru_matches_interpreter(rng, dtype, reverse):
    X = lod(rng, [5, 0, 1, 7, 3], 4, dtype)
    rnn = gru_net(X, rng, reverse=reverse, dtype=dtype)
    assert_backends_agree(rnn, backends=["numba"])
    assert_backends_agree(rnn, output_all_steps=False, backends=["numba"])


@pytest.mark.parametrize("reverse", [False, True])
def test_input_product_by_chunks_of_steps_matches_interpreter(rng, reverse):
    # 40 sequences of 0-25 steps: chunks of 128 // 40 = 3 steps (or of 6 in a
    # group of half of them), which sequences end inside of; a NaN in one
    # token stays in its own sequence's rows
    lengths = list(rng.integers(0, 26, 40))
    X = lod(rng, lengths, 5)
    X.data[int(np.sum(lengths[:7])) + 2, 1] = np.nan
    rnn = gru_net(X, rng, hidden=96, reverse=reverse)
    source = rnn.compile("numba").source
    # the input product of every token (3 x 96 columns), read only by the
    # step's gates, runs by chunks of steps: one product per chunk (on the
    # helper a chunk ahead where it is free: ahead.gemm_steps_ahead)
    assert "gemm_hoisted(" not in source and source.count("gemm_steps_ahead(") == 1
    assert source.count("pack(") == 2 and "if cs == 0:" in source
    expected = rnn(backend="interpreter").data
    actual = rnn(backend="numba").data
    nan = np.isnan(expected)
    assert 0 < nan.sum() < nan.size and np.array_equal(np.isnan(actual), nan)
    assert_close(actual[~nan], expected[~nan])


@pytest.mark.parametrize("reverse_inner", [False, True])
def test_independent_nested_net_runs_its_input_product_by_chunks(rng, reverse_inner):
    # chapters of 0-4 paragraphs of 0-9 words; the word-level net reads only
    # its words (it runs once over every paragraph before the chapters' loop)
    # and its x @ W (256 columns) only its gates: by chunks of steps; a NaN
    # word stays in its paragraph's rows and its chapter's
    paragraphs = list(rng.integers(0, 5, 12))
    lengths = [paragraphs, list(rng.integers(0, 10, int(np.sum(paragraphs))))]
    net = nested_encoder(rng, lengths, features=6, hidden=256, reverse_inner=reverse_inner)
    source = net.rnn.compile("numba").source
    # (the step calls the word-level net twice: for its every step and its last)
    assert source.count("gemm_steps_ahead(") == 2 and "if cs == 0:" in source
    assert_backends_agree(net.rnn, backends=["numba"])
    net.X.data[int(np.sum(lengths[1][:5])) + 1, 2] = np.nan  # a word of paragraph 5 (or later)
    expected = net.rnn(backend="interpreter")
    actual = net.rnn(backend="numba")
    for e, a in zip(expected, actual):
        e, a = np.asarray(getattr(e, "data", e)), np.asarray(getattr(a, "data", a))
        nan = np.isnan(e)
        assert 0 < nan.sum() < nan.size and np.array_equal(np.isnan(a), nan)
        assert_close(a[~nan], e[~nan])


@pytest.mark.parametrize("reverse", [False, True])
def test_a_step_loop_writing_many_per_token_arrays_asks_for_the_next_rows(rng, reverse):
    # three all-steps outputs written by one loop: it asks for the next
    # sequence's rows (a hint: the same results, NaN kept in its own rows);
    # a loop writing fewer asks for none
    lengths = [5, 0, 1, 7, 3, 6]
    X = lod(rng, lengths, 4)
    X.data[7, 2] = np.nan  # (the sequence of 7 steps)
    W = sn.Parameter(rng.standard_normal((4, 32)).astype(np.float32) / 4)
    U = sn.Parameter(rng.standard_normal((32, 32)).astype(np.float32) / 4)
    rnn = sn.create_rnn_op(output_num=3, reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[32])
        pre = x @ W + h.pre_state() @ U
        new = sn.ops.tanh(pre)
        h.update(new)
        rnn.add_outputs(new, sn.ops.sigmoid(pre), pre * new)
    source = rnn.compile("numba").source
    asks = re.findall(r"\n\s+e = entries\[b\]\n\s+prefetch_rows\((\w+), (\d+), entries, b \+ 1, nb\)\n",
                      source)
    assert len(asks) == 1, source
    table, reads = asks[0]
    rows = re.findall(r"\(np\.int64\((\w+)\.ctypes\.data\), \1\.strides\[0\]\)",
                      re.search(rf"\n\s+{table} = np\.array\((.*)\)\n", source).group(1))
    written = rows[int(reads):]  # (the arrays read come first)
    assert len(written) == 3 and all(ident.startswith("o") for ident in written), source
    for expected, actual in zip(rnn(backend="interpreter"), rnn(backend="numba")):
        nan = np.isnan(expected.data)
        assert 0 < nan.sum() < nan.size and np.array_equal(np.isnan(actual.data), nan)
        assert_close(actual.data[~nan], expected.data[~nan])
    assert "entries, b + 1, nb)" not in gru_net(X, rng, reverse=reverse).compile("numba").source


def test_input_product_read_outside_the_gates_stays_before_the_loop(rng):
    # the product is an output too: computed once over every token
    X = lod(rng, [4, 2, 5], 3)
    W = sn.Parameter(rng.standard_normal((3, 256)).astype(np.float32) / 4)
    rnn = sn.create_rnn_op(output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[256])
        xw = x @ W
        h.update(sn.ops.tanh(xw + h.pre_state()))
        rnn.add_outputs(h, xw)
    source = rnn.compile("numba").source
    assert "gemm_hoisted(" in source and "chunk" not in source
    assert_backends_agree(rnn, backends=["numba"])


def test_values_computed_before_the_loop_are_computed_into_their_outputs(rng):
    """An all-steps output that is a value over every token (a product, an
    elementwise op of the step input) is computed into the output's buffer
    before the loop, not copied there step by step; the same value given
    twice fills the first and is copied into the second. One group and two
    (the run split over threads, each filling its rows of the buffers)."""
    W = sn.Parameter(rng.standard_normal((3, 64)).astype(np.float32) / 4, name="W")
    for lengths in ([4, 0, 2, 5], list(rng.integers(20, 60, 40))):
        X = lod(rng, lengths, 3)
        rnn = sn.create_rnn_op(output_num=4)
        with rnn.stepnet():
            x = rnn.add_input(X, name="x")
            h = rnn.add_memory(shape=[64], name="h")
            xw, ex = x @ W, sn.ops.exp(x)  # (ex: computed before the loop, for its product)
            h.update(sn.ops.tanh(xw + ex @ W + h.pre_state()))
            rnn.add_outputs(h, xw, ex, xw)
        source = rnn.compile("numba").source
        program = source[source.index("def program("):]
        product = re.search(r"gemm_hoisted\(as_read_only\(x\d+\), as_read_only\((c\d+)\), (o\d+), "
                            r"small_rows, board\)", program)
        assert product, program
        xw_out = product.group(2)
        exp_out = re.search(r"\n\s+(o\d+)\[r, i1\] = (?:np|math)\.exp\(x\d+\[r, i1\]\)", program)
        assert exp_out and (f"gemm_hoisted(as_read_only({exp_out.group(1)}), "
                            f"as_read_only({product.group(1)}), ") in program
        for ident in (xw_out, exp_out.group(1)):  # (not written again in the loop)
            assert not re.search(rf"{ident}\[e, i\d\] =", source), source
        assert source.count(f"= {xw_out}[e, ") == 1  # (the copy into the second)
        out = assert_backends_agree(rnn, backends=["numba"])
        assert_close(out[1], out[3])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_large_batch_takes_the_blas_path_then_the_small_one(dtype):
    # with stepnet's own loop up to 8 rows, the first steps (64 rows) run the
    # library's product (MKL's packed GEMM when it is the choice) and the last
    # ones, with 8 sequences left, stepnet's own loop
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from stepnet.jit import product_timing
        sys.path.insert(0, "tests")
        from conftest import assert_backends_agree
        from nets import gru_net, lod
        assert product_timing.small_rows_table().tolist() == [[1 << 62], [8], [1]]
        rng = np.random.default_rng(0)
        X = lod(rng, [4] * 8 + [2] * 56, 16, np.{dtype})
        assert_backends_agree(gru_net(X, rng, hidden=128, dtype=np.{dtype}), backends=["numba"])
        print("agree")
        """
    )
    env = dict(os.environ, STEPNET_SMALL_PRODUCTS="8")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.split() == ["agree"], out.stderr[-3000:]


def test_nested_steps_wider_than_the_batch_take_the_library_product():
    # one chapter of three paragraphs: the word-level net runs once over all
    # three paragraphs, more rows than the one sequence its weights were
    # packed for; with stepnet's own loop up to one row, its steps run the
    # library's product (on MKL: weights packed for the rows that reach it)
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        sys.path.insert(0, "tests")
        from conftest import assert_backends_agree
        from nets import nested_encoder
        net = nested_encoder(np.random.default_rng(0), [[3], [4, 2, 5]], features=8, hidden=40)
        assert_backends_agree(net.rnn, backends=["numba"])
        print("agree")
        """
    )
    env = dict(os.environ, STEPNET_SMALL_PRODUCTS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.split() == ["agree"], out.stderr[-3000:]


def test_generated_source_merges_matmuls_and_hoists(rng):
    rnn = gru_net(lod(rng, [3, 2], 4), rng)
    source = rnn.compile("numba").source
    program = source[source.index("def program"):]
    # one GEMM over every token before the time loop, one packed GEMM per step
    # (a product of 18 columns is not run by chunks of steps)
    assert program.count("gemm_hoisted(") == 1
    assert source.count("gemm_packed(") == 1
    # (the own loop's C entry first, in the kernel; the packed product apart where it declines)
    assert re.search(r"\n\s+if not gemm_own\((\w+\[:nb\]), (wp\d+)\[4\], \2\[2\], \2\[5\], "
                     r"(\w+\[:nb\])\): gemm_packed\(\1, \2, \3\)\n", source), source
    assert "gemm_steps(" not in source
    assert "for step in range(num_steps)" in source
    # the six weights are read only joined by columns: program() and the rnn
    # function take the four biases and the two joined weights, not them
    params = [line[line.index("(") + 1:-2].split(", ") for line in source.splitlines()
              if line.startswith("def ")]
    assert [len([p for p in ps if re.fullmatch(r"c\d+", p)]) for ps in params] == [4, 4]


def test_weights_side_by_side_are_joined_as_a_view_of_them(rng):
    from stepnet.jit.numba_cpu import side_by_side

    base = rng.standard_normal((5, 12)).astype(np.float32)
    a, b, c = base[:, :4], base[:, 4:9], base[:, 9:]
    for parts, view in [([a, b, c], True), ([a, b], True), ([b, c], True),
                        ([b, a, c], False), ([a, c], False),
                        ([a, b.copy(), c], False), ([base[1:, :4], base[1:, 4:]], True),
                        ([base[:, :4][:, ::2], base[:, 4:9]], False),
                        ([np.ascontiguousarray(a), np.ascontiguousarray(b)], False),
                        ([np.asfortranarray(base)[:, :4], np.asfortranarray(base)[:, 4:]], False)]:
        joined = side_by_side(parts)
        assert (joined is not None) == view
        if view:
            np.testing.assert_array_equal(joined, np.concatenate(parts, axis=1))
            assert all(np.shares_memory(joined, p) for p in parts)
            assert joined.flags.c_contiguous == (joined.shape[1] == base.shape[1])


def test_rebinding_never_recompiles(rng):
    X = lod(rng, [3, 2], 4)
    rnn = gru_net(X, rng)
    f = rnn.compile("numba")
    f()
    from stepnet.jit import loading

    kernel = loading.load_source(f.source).program
    assert len(kernel.signatures) == 1
    for lengths in ([1], [7, 0, 0, 2, 9, 4, 4, 1], [0, 0], []):
        Y = lod(rng, lengths, 4)
        expected = rnn(x=Y, backend="interpreter")
        assert_close(f(x=Y), expected)
    assert len(kernel.signatures) == 1


def test_float16_in_float32_out_as_float16(rng):
    X = lod(rng, [3, 4], 4, np.float16)
    rnn = gru_net(X, rng)
    # each backend's output has the interpreter's dtype (assert_close checks)
    out = assert_backends_agree(rnn, backends=["numba"], dtype=np.float16)
    assert out.dtype == np.float16


def test_nested_independent_inner_rnn_runs_before_the_outer_loop(rng):
    outer = nested_encoder(rng, [[2, 3, 0], [3, 2, 5, 0, 4]], features=4, hidden=5).rnn
    assert_backends_agree(outer, backends=["numba"])
    assert_backends_agree(outer, output_all_steps=False, backends=["numba"])
    source = outer.compile("numba").source
    program = source[source.index("def program"):]
    # the word-level rnn is called from program(), not from the chapter loop
    inner_calls = [line for line in program.splitlines() if "rnn_" in line]
    assert len(inner_calls) == 3


def test_tanh32_and_sigmoid32_error_bound():
    from stepnet.jit import numba_runtime as rt

    x = np.concatenate([np.linspace(-20, 20, 10_001), np.linspace(-90, 90, 1_001)]).astype(np.float32)
    tanh = np.array([rt.tanh32(v) for v in x], np.float64)
    sigm = np.array([rt.sigmoid32(v) for v in x], np.float64)
    exact_tanh = np.tanh(x.astype(np.float64))
    exact_sigm = 1 / (1 + np.exp(-x.astype(np.float64)))
    # documented in numba_runtime (measured over every float32 in [-100, 100]:
    # 2.9e-7 and 1.5e-7 relative); tests/test_numerics.py checks the kernels
    normal = exact_sigm >= np.finfo(np.float32).tiny
    assert np.max(np.abs(tanh - exact_tanh) / np.maximum(np.abs(exact_tanh), 1e-30)) < 1e-6
    assert np.max(np.abs(sigm - exact_sigm)[normal] / exact_sigm[normal]) < 1e-6
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    assert np.isnan(rt.tanh32(nan)) and (rt.tanh32(inf), rt.tanh32(-inf)) == (1.0, -1.0)
    assert np.isnan(rt.sigmoid32(nan)) and (rt.sigmoid32(inf), rt.sigmoid32(-inf)) == (1.0, 0.0)


_EDGE_CASES = textwrap.dedent(
    """
    from conftest import assert_backends_agree
    import numpy as np, stepnet as sn
    from nets import nested_encoder
    from stepnet.jit import numba_cpu
    rng = np.random.default_rng(0)

    def check(rnn, backends=None):
        for all_steps in (True, False):
            assert_backends_agree(rnn, output_all_steps=all_steps, backends=backends)

    W = sn.Parameter(rng.standard_normal((3, 4)).astype(np.float32))
    U = sn.Parameter(rng.standard_normal((4, 4)).astype(np.float32))
    for lengths in ([0], [0, 0, 0], [1], [4], [0, 3, 0, 1], [], [2, 0, 5]):
        data = rng.standard_normal((sum(lengths), 3)).astype(np.float32)
        X = sn.LoDTensor.from_lengths(data, [lengths])
        S = rng.standard_normal((len(lengths), 4)).astype(np.float32)
        for reverse in (False, True):
            rnn = sn.create_rnn_op(reverse=reverse)
            with rnn.stepnet():
                x = rnn.add_input(X, name="x")
                s = rnn.add_static_input(S, name="s")
                h = rnn.add_memory(init=S, name="h")
                h.update(sn.ops.tanh(x @ W + h.pre_state() @ U + s))
                rnn.add_outputs(h, h.pre_state() * 2)
            check(rnn)
    # nested, with empty chapters and empty paragraphs; not on cuda, which
    # refuses a paragraph net starting from the chapter memory
    for lengths in ([[0, 2], [0, 3]], [[3], [1, 0, 2]], [[0, 0], []], [[1, 1], [0, 0]]):
        net = nested_encoder(rng, lengths, start_from_outer=True, outputs=("h", "words"))
        check(net.rnn, backends=["numba"])
    # backward kernels (a fused run storing into a concat's column blocks,
    # cotangents stored to their outputs alone): gradients on numba equal
    # the interpreter's, over empty and ragged batches
    for make in (lambda: sn.nn.GRU(3, 4), lambda: sn.nn.LSTM(3, 4, direction="bidirectional_concat")):
        for lengths in ([0, 3, 0, 1], [1], [2, 0, 5]):
            layer = make()
            X = sn.LoDTensor.from_lengths(
                rng.standard_normal((sum(lengths), 3)).astype(np.float32), [lengths])
            (Y, states), pullback = sn.vjp(layer, X, backend="numba")
            outs = [Y.data] + (list(states) if isinstance(states, tuple) else [states])
            cts = [rng.standard_normal(np.shape(o)).astype(np.float32) for o in outs]
            wrt = layer.parameters() + ["X"]
            got = pullback(cts, wrt=wrt)
            want = sn.vjp(layer, X, backend="interpreter")[1](cts, wrt=wrt)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    print("edge cases ok")
    """
)


@pytest.mark.slow
def test_lod_edge_cases_under_boundscheck(tmp_path):
    """Compiled with NUMBA_BOUNDSCHECK=1: any out-of-bounds index raises."""
    tests = os.path.dirname(os.path.abspath(__file__))  # conftest.py and nets.py
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", STEPNET_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _EDGE_CASES], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "edge cases ok" in result.stdout


def test_lod_edge_cases():
    namespace = {}
    exec(compile(_EDGE_CASES, "edge_cases", "exec"), namespace)


def test_bad_rebinding_raises_before_the_kernel(rng):
    X = lod(rng, [3, 2], 4)
    rnn = gru_net(X, rng)
    f = rnn.compile("numba")
    with pytest.raises(sn.ShapeError, match="feature shape"):
        f(x=lod(rng, [3, 2], 5))
    with pytest.raises(sn.ShapeError, match="dtype"):
        f(x=sn.LoDTensor.from_lengths(np.ones((5, 4), np.int32), [[3, 2]]))


def test_one_value_listed_as_two_all_steps_outputs(rng):
    # Both outputs are the same fused-loop value; each gets every row.
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)).astype(np.float32), [[1, 0, 5]])
    rnn = sn.create_rnn_op(output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[3], name="h")
        y = sn.ops.tanh(x - h.pre_state())
        h.update(y)
        rnn.add_outputs(y, y)
    first, second = assert_backends_agree(rnn)
    np.testing.assert_array_equal(first.data, second.data)
    assert np.all(first.data != 0)


def test_output_all_steps_per_output(rng):
    # One run gives every step of h and the last states of h and c.
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)).astype(np.float32), [[2, 0, 4]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(init=np.ones(3, np.float32), name="h")
        c = rnn.add_memory(shape=[3], name="c")
        c.update(c.pre_state() + x)
        h.update(sn.ops.tanh(x + h.pre_state() * c.pre_state()))
        rnn.add_outputs(h, h, c)
    y, h_last, c_last = assert_backends_agree(rnn, output_all_steps=(True, False, False))
    assert isinstance(y, sn.LoDTensor) and y.lod == [[0, 2, 2, 6]]
    np.testing.assert_array_equal(h_last[[0, 2]], y.data[[1, 5]])
    np.testing.assert_array_equal(h_last[1], np.ones(3, np.float32))  # empty: its init
    np.testing.assert_allclose(c_last[2], X.data[2:].sum(0), rtol=1e-6)
    with pytest.raises(sn.StepNetError, match="2 flags for 3 outputs"):
        rnn(output_all_steps=(True, False))


@pytest.mark.parametrize("choice", ["openblas", "mkl", "numpy"])
def test_each_blas_choice_gives_the_interpreters_results(choice):
    # STEPNET_BLAS picks the GEMMs (blas.py); "mkl" falls back to "numpy"
    # where the mkl wheel is missing. The product crosses the small-product
    # limit: 16 rows run the library's product, the last 8 rows stepnet's loop.
    script = textwrap.dedent(
        """
        import sys
        import numpy as np, stepnet as sn
        from stepnet.jit import blas
        rng = np.random.default_rng(0)
        X = sn.LoDTensor.from_lengths(rng.standard_normal((200, 32)), [[20] * 8 + [5] * 8])
        gru = sn.nn.GRU(32, 96, linear_before_reset=True, dtype=np.float64, seed=0)
        Y, h = gru(X, backend="numba")
        Yi, hi = gru(X, backend="interpreter")
        print(blas.BLAS_NAME, np.abs(Y.data - Yi.data).max(), np.abs(h - hi).max())
        """
    )
    from stepnet.jit import cache

    # (this process's cache: helpers compiled for each library are kept
    # apart there, and a later run finds them)
    env = dict(os.environ, STEPNET_BLAS=choice, STEPNET_CACHE_DIR=str(cache.cache_dir()),
               STEPNET_SMALL_PRODUCTS="8")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] in ({choice} if choice != "mkl" else {"mkl", "numpy"})
    assert float(out[1]) < 1e-12 and float(out[2]) < 1e-12


def test_products_with_no_terms_or_no_columns_match_the_interpreter(rng):
    """A width of 0 reaches no library call with a leading dimension of 0
    (MKL refuses it, leaving the output as it was)."""
    rnn, weights = zero_width_net(rng, [20] * 40 + [60])
    want = assert_backends_agree(rnn, backends=["numba"])
    grads = {backend: sn.gradients(rnn, wrt=weights, backend=backend,
                                   grad_outputs=[np.ones_like(want[0].data), None])
             for backend in ("numba", "interpreter")}
    for got, expected in zip(grads["numba"], grads["interpreter"]):
        assert_close(got, expected)


def test_an_unknown_blas_choice_is_refused():
    env = dict(os.environ, STEPNET_BLAS="atlas")
    proc = subprocess.run([sys.executable, "-c", "import stepnet.jit.numba_cpu"], env=env,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "STEPNET_BLAS='atlas': expected one of openblas, mkl, numpy" in proc.stderr


def test_bounds_checked_code_is_never_cached_with_the_fast_code():
    # Numba's disk cache ignores NUMBA_BOUNDSCHECK: bounds-checked helpers get
    # a cache folder of their own, and kernels a key of their own
    script = textwrap.dedent(
        """
        from stepnet.jit import cache
        print(cache.build_key(), cache.helpers_fingerprint())
        """
    )
    checked = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=dict(os.environ, NUMBA_BOUNDSCHECK="1"), check=True)
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "NUMBA_BOUNDSCHECK"},
                           check=True)
    checked_build, checked_kernels = checked.stdout.split()
    plain_build, plain_kernels = plain.stdout.split()
    assert checked_build != plain_build
    assert checked_kernels != plain_kernels


def test_importing_stepnet_leaves_numbas_threading_alone(tmp_path):
    out = run_python("import numba; before = numba.config.THREADING_LAYER_PRIORITY; "
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


def test_stepnet_loops_are_vectorized_with_the_widest_vectors(rng):
    """A function that calls ``wide_vectors`` carries LLVM's
    ``prefer-vector-width`` of 512 (and, compiled for a CPU with AVX-512,
    its loop uses 512-bit registers); a function that does not keeps LLVM's choice;
    the generated kernels and the own loop call it."""
    from stepnet.jit import atomics, own_loop

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
    if "avx512f" in own_loop.compiled_features():  # (the CPU Numba compiles for)
        assert "zmm" in wide.inspect_asm(wide.signatures[0])
    own = numba.njit(own_loop._own_columns.py_func)  # (compiled here, not read from the cache)
    b = rng.standard_normal((8, 64)).astype(np.float32)
    out = np.empty((6, 64), np.float32)
    own(b[:6, :8], b.reshape(b.size), 64, 0, out, 0, 64)
    assert attribute in own.inspect_llvm(own.signatures[0])
    source = small_gru(rng, [[3, 2]]).compile("numba").source
    assert source.count("    wide_vectors()\n") == source.count("@njit")


def test_a_compiled_step_net_pickles_and_copies_as_its_step_net(rng):
    """``rnn.compile(backend)`` goes to another process (or a copy) as its
    step-net and backend: the copy compiles its own runs, and its weights
    are its own."""
    import copy
    import pickle

    rnn = small_gru(rng, [[3, 1]])
    f = rnn.compile("numba")
    expected = f()
    for other in (pickle.loads(pickle.dumps(f)), copy.deepcopy(f)):
        assert other.backend == "numba" and other.rnn is not rnn
        assert_close(other(), expected)
        other.rnn.parameters()[0].value[...] = 0.0  # (the copy's own weights)
    assert_close(f(), expected)
