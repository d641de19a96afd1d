"""Calls from many Python threads at once: each gives the bits of the same
call made alone (for a given thread setting), forward and training, and no
call's outputs, workspaces or gradients are another's.

The helper thread takes part of a call's work where it is free; calls
running beside each other keep it busy at times, so a call's work is cut
the same way whether or not the helper computes a part (``threads``)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import stepnet as sn

pytestmark = pytest.mark.skipif("numba" not in sn.backends(), reason="needs the Numba backend")

WORKERS = 8
BATCHES = (1, 2, 7, 16, 64)


def _batches(rng, width):
    out = []
    for b in BATCHES:
        lengths = rng.integers(5, 30, b).tolist()
        data = rng.standard_normal((sum(lengths), width)).astype(np.float32)
        out.append(sn.LoDTensor.from_lengths(data, [lengths]))
    return out


def _at_once(fn, items, rounds=3):
    """``fn(item)`` for every item, ``rounds`` times each, from ``WORKERS``
    threads at once (interleaved): the results, by item, round after round."""
    order = [i for _ in range(rounds) for i in range(len(items))]
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda i: fn(items[i]), order))
    return [[r for i, r in zip(order, results) if i == k] for k in range(len(items))]


def _assert_same_bits(got, want, what):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


@pytest.fixture(params=["measured", "own loop up to 4 rows"])
def small_products(request, monkeypatch):
    """The small-product table (a kernel's run-time argument): this
    machine's, or stepnet's own loop up to 4 rows and the library above, so
    that a run's sequences cut in two have products by another code than
    the run's whole (shared with the helper)."""
    if request.param != "measured":
        from stepnet.jit import product_timing

        table = np.array([[1 << 40], [4], [1]], np.int64)
        table.flags.writeable = False
        monkeypatch.setattr(product_timing, "_SMALL_ROWS", {"float32": table, "float64": table})


def test_a_layer_called_from_many_threads_gives_each_call_its_bits_alone(rng, small_products):
    """A GRU whose per-step products and sequences are worth sharing with the
    helper, forward and backward (its pullback's weight gradients), on
    batches of 1 to 64 sequences: every call at once equals the call alone."""
    layer = sn.nn.GRU(64, 128, seed=3)
    batches = _batches(rng, 64)

    def forward(X):
        Y, h_n = layer(X, backend="numba")
        return Y.data, h_n

    def training(X):
        (Y, h_n), pullback = sn.vjp(layer, X, backend="numba")
        dY = np.cos(np.arange(Y.data.size, dtype=np.float32)).reshape(Y.data.shape)
        return [Y.data, h_n] + list(pullback([dY, None], wrt=["X"] + layer.parameters()))

    for fn in (forward, training):
        alone = [fn(X) for X in batches]
        for b, calls, want in zip(BATCHES, _at_once(fn, batches), alone):
            for got in calls:
                _assert_same_bits(got, want, f"{fn.__name__}, {b} sequences")


def test_an_onnx_session_called_from_many_threads_gives_each_call_its_bits_alone(rng):
    onnx = pytest.importorskip("onnx")
    from stepnet.onnx import export

    lstm = sn.nn.LSTM(32, 64, seed=4)
    model = export(lstm)
    session = sn.onnx.InferenceSession(model.SerializeToString(), backend="numba")
    feeds = []
    for b in BATCHES:
        lengths = rng.integers(1, 12, b)
        X = rng.standard_normal((b, 12, 32)).astype(np.float32)
        feeds.append({"X": X, "lengths": lengths.astype(np.int64)})
    assert onnx.__version__  # (the exporter's dependency, imported)

    def run(feed):
        return session.run(None, feed)

    alone = [run(f) for f in feeds]
    for b, calls, want in zip(BATCHES, _at_once(run, feeds), alone):
        for got in calls:
            _assert_same_bits(got, want, f"ONNX session, {b} sequences")


@pytest.mark.slow
def test_with_a_library_whose_rows_differ_by_the_rows_beside_them():
    """OpenBLAS on its Haswell kernels computes a row differently with
    other rows beside it: its products are cut all the same (by their
    shapes), and calls at once still give each call its bits alone."""
    env = dict(os.environ, STEPNET_BLAS="openblas", OPENBLAS_CORETYPE="Haswell")
    code = ("import sys; sys.path.insert(0, 'tests'); import numpy as np, pytest, "
            "test_concurrent_calls as t; "
            "t.test_a_layer_called_from_many_threads_gives_each_call_its_bits_alone("
            "np.random.default_rng(5), None)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr


def test_threads_meeting_one_new_kernel_load_it_once(tmp_path, monkeypatch):
    """Threads of one process that meet the same new kernel at once: one
    writes its file and imports it, the others get that module (each wrote
    the same temporary file name, which another's os.replace had taken)."""
    import threading

    from stepnet.jit import loading

    monkeypatch.setattr(loading, "cache_dir", lambda: tmp_path)
    source = f"# a kernel of this test\nVALUE = {os.getpid()}\n"
    found, errors, start = [], [], threading.Barrier(8)

    def load():
        start.wait()
        try:
            found.append(loading.load_source(source))
        except Exception as exc:  # noqa: BLE001  (collected: the test names it)
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(found) == 8 and all(m is found[0] for m in found) and found[0].VALUE == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [f"stepnet_kernel_{loading.kernel_key(source)}.py"]
