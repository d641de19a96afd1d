"""Helpers for the gradient tests: random linear functionals of a step-net's
outputs, their central-difference gradients, and comparisons.

A step-net's outputs ``y_i`` (all-steps outputs as LoD data rows, last-step
outputs as ``[num_seq, ...]``) are reduced to one number with fixed random
cotangents ``r_i``: ``L = sum_i <r_i, y_i>``. Its gradient with respect to
any input is exactly what ``sn.gradients(rnn, wrt, grad_outputs=r, ...)``
returns, so a central difference of ``L`` checks it element by element::

    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter", **feeds))
    cots = random_cotangents(rng, outs)
    expected = fd_gradients(rnn, wrt, cots, flags, feeds)
    got = sn.gradients(rnn, wrt=wrt, grad_outputs=cots, output_all_steps=flags, **feeds)
    assert_fd_close(got, expected, wrt)
"""

from __future__ import annotations

import numpy as np

import stepnet as sn

EPS = 1e-6  # central-difference step (float64)
FD_RTOL = 1e-6
FD_ATOL = 1e-8


def as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def data_of(x):
    """The data of an output: a LoDTensor's rows, or the array itself."""
    return x.data if isinstance(x, sn.LoDTensor) else np.asarray(x)


def random_cotangents(rng, outputs):
    """One uniform [-1, 1) array per output, shaped and typed like its data."""
    out = []
    for o in outputs:
        d = data_of(o)
        out.append(rng.uniform(-1.0, 1.0, size=d.shape).astype(d.dtype))
    return out


def functional(rnn, cotangents, flags, feeds, backend="interpreter"):
    """``sum_i <r_i, y_i>`` in float64."""
    outs = as_tuple(rnn(output_all_steps=flags, backend=backend, **feeds))
    return float(sum(np.sum(data_of(o).astype(np.float64) * np.asarray(r, np.float64))
                     for o, r in zip(outs, cotangents)))


def _moved(f, array, eps):
    """``(index, f() above, f() below)`` for each element of ``array`` moved
    by ``+-eps`` in place (and restored)."""
    for i in np.ndindex(array.shape):
        old = array[i]
        array[i] = old + eps
        plus = f()
        array[i] = old - eps
        minus = f()
        array[i] = old
        yield i, plus, minus


def numeric_gradient(f, array, eps=EPS):
    """Central differences of ``f()`` with respect to every element of
    ``array`` (changed in place and restored)."""
    grad = np.zeros(array.shape, np.float64)
    for i, plus, minus in _moved(f, array, eps):
        grad[i] = (plus - minus) / (2 * eps)
    return grad


def bound_value(rnn, name, feeds):
    """The array bound to input ``name`` in a run with ``feeds`` (a memory
    given ``shape=`` alone: zeros of its shape, as docs/gradients.md says)."""
    b = rnn.bindings[name]
    if name not in feeds and b.zeros_of_shape:
        return np.zeros(b.memory_shape, b.value.dtype)
    value = feeds.get(name, b.value)
    return value.value if isinstance(value, sn.Parameter) else value


class _Input:
    """One ``wrt`` entry as an array that can be moved: ``array`` (float,
    moved in place by the caller) is what every run sees after ``bind()``."""

    def __init__(self, rnn, w, feeds):
        self.feeds = feeds
        self.name = None
        if isinstance(w, sn.Parameter):
            self.array = w.value
            return
        b = rnn.bindings[w]
        self.name = w
        self.saved = feeds.get(w, None)
        X = feeds.get(w, b.value)
        if b.kind == "sequence" or isinstance(X, sn.LoDTensor):  # (a ragged static input too)
            self.array, self.levels = np.array(X.data, order="C"), X.levels
        else:  # a static input or an initial memory, in the shape it was given
            value = np.asarray(bound_value(rnn, w, feeds))
            self.array = np.array(value, dtype=b.var.dtype, order="C")
            self.levels = None

    def bind(self):
        if self.name is not None:
            self.feeds[self.name] = (sn.LoDTensor(self.array.copy(), self.levels)
                                     if self.levels is not None else self.array.copy())

    def restore(self):
        if self.name is None:
            return
        if self.saved is None:
            self.feeds.pop(self.name, None)
        else:
            self.feeds[self.name] = self.saved


def fd_gradients(rnn, wrt, cotangents, flags, feeds, eps=EPS, backend="interpreter"):
    """Central-difference gradients of the functional for every entry of
    ``wrt``: a Parameter, or the name of a step input (gradient shaped like
    its data rows), a static input or a memory (shaped like the value bound:
    ``[num_seq, ...]`` per sequence, or the broadcast value's own shape)."""
    feeds = dict(feeds)
    grads = []
    for w in wrt:
        inp = _Input(rnn, w, feeds)

        def f(inp=inp):
            inp.bind()
            return functional(rnn, cotangents, flags, feeds, backend)

        try:
            grads.append(numeric_gradient(f, inp.array, eps))
        finally:
            inp.restore()
    return grads


def smooth_at(rnn, wrt, cotangents, flags, feeds, eps=EPS, tol=1e-3):
    """Whether the functional has one slope through every element of
    ``wrt`` where it is bound: its one-sided differences agree (within
    ``tol`` times the slope's scale). At a kink (``relu``, ``where(x >= 0,
    ...)`` at exactly 0: a memory that starts at zero) the central
    difference is the mean of two slopes, which no gradient is."""
    feeds = dict(feeds)
    base = functional(rnn, cotangents, flags, feeds)
    for w in wrt:
        inp = _Input(rnn, w, feeds)

        def f(inp=inp):
            inp.bind()
            return functional(rnn, cotangents, flags, feeds)

        try:
            for _, plus, minus in _moved(f, inp.array, eps):
                up, down = (plus - base) / eps, (base - minus) / eps
                if abs(up - down) > tol * max(1.0, abs(up), abs(down)):
                    return False
        finally:
            inp.restore()
    return True


def assert_directional_fd(rnn, wrt, grads, cotangents, flags, feeds, backend, seed=0,
                          eps=EPS, rtol=1e-6, atol=1e-8, what=""):
    """For each ``wrt``, ``<gradient, d>`` against the central difference of
    the functional (run on ``backend``) along a random direction ``d``: two
    runs per entry instead of two per element."""
    rng = np.random.default_rng(seed)
    feeds = dict(feeds)
    for w, g in zip(wrt, grads):
        inp = _Input(rnn, w, feeds)
        base = inp.array.copy()
        d = rng.uniform(-1.0, 1.0, base.shape)
        values = []
        try:
            for sign in (1.0, -1.0):
                inp.array[...] = base + sign * eps * d
                inp.bind()
                values.append(functional(rnn, cotangents, flags, feeds, backend))
        finally:
            inp.array[...] = base
            inp.restore()
        fd = (values[0] - values[1]) / (2 * eps)
        exact = float(np.sum(np.asarray(g, np.float64) * d))
        scale = max(1.0, float(np.sum(np.abs(np.asarray(g, np.float64) * d))))
        assert abs(exact - fd) <= atol * scale + rtol * abs(fd), (
            f"{what} d/d{describe(w)}: <gradient, d> = {exact!r}, central difference along d "
            f"= {fd!r}")


def describe(w):
    return repr(w.name or w) if isinstance(w, sn.Parameter) else repr(w)


def expected_shape(rnn, w, feeds):
    if isinstance(w, sn.Parameter):
        return w.value.shape
    value = bound_value(rnn, w, feeds)
    if rnn.bindings[w].kind == "sequence":
        return value.data.shape
    return np.shape(value)


def assert_fd_close(actual, expected, wrt, rtol=FD_RTOL, atol=FD_ATOL, what=""):
    """Each gradient within ``atol + rtol * |fd|`` of its finite difference,
    ``atol`` scaled by the largest |fd| of that gradient when above 1."""
    assert len(actual) == len(expected) == len(wrt), (len(actual), len(expected), len(wrt))
    for a, e, w in zip(actual, expected, wrt):
        name = f"{what} d/d{describe(w)}"
        a = np.asarray(a)
        assert a.shape == e.shape, f"{name}: shape {a.shape}, expected {e.shape}"
        a64 = a.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        err = np.abs(a64 - e)
        bound = atol * scale + rtol * np.abs(e)
        if not np.all(err <= bound):
            i = np.unravel_index(int(np.argmax(err - bound)), e.shape)
            raise AssertionError(
                f"{name}: gradient {a64[i]!r} vs finite difference {e[i]!r} at index {i} "
                f"(max error {err.max():.3g}, {int(np.sum(err > bound))} of {e.size} "
                f"elements off)")


def assert_grads_agree(actual, expected, wrt, dtype=None, what=""):
    """Two backends' gradients: same shapes and dtypes, and
    ``|a - b| <= tol * max(1, |b|)`` (DESIGN.md §4: 1e-5 float32, 1e-12 float64)."""
    from conftest import assert_close

    assert len(actual) == len(expected) == len(wrt)
    for a, e, w in zip(actual, expected, wrt):
        assert_close(np.asarray(a), np.asarray(e), dtype, what=f"{what} d/d{describe(w)}")
