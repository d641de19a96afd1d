"""Floating-point edge cases of the compiled backends, judged through real step-nets.

- NaN in gives NaN out, and +-inf give what NumPy gives, for every elementwise
  op a backend generates code for (the ops are read from the registry, so a
  new op is checked as soon as it has code).
- float32 tanh and sigmoid (vectorized approximations in numba_runtime) stay
  within 1e-6 relative of float64 wherever the exact value is a normal
  float32, tails included.

One step-net applies every op to the same inputs: to the step inputs plus a
memory that stays 0 (the fused loop inside the time loop), and tanh and
sigmoid also to the step inputs themselves (work hoisted out of the loop).
"""

import numpy as np
import pytest
from scipy import special

import stepnet as sn
from stepnet import registry

F32 = np.finfo(np.float32)
# every kind of float32 value: NaN, infinities, zeros, extremes, subnormals,
# and ordinary numbers on both sides of the ops' thresholds
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 20.0, -20.0,
                     100.0, -100.0, 1e3, -1e3, F32.max, -F32.max, F32.tiny, -F32.tiny,
                     F32.smallest_subnormal, -F32.smallest_subnormal])
WIDTH = 16
LENGTHS = [5, 3, 2]  # three sequences (the last one takes the rest), so the batch shrinks


def generated_ops(backend):
    """The registered elementwise ops that have code for ``backend`` ("numba", "cuda");
    seq_expand, which needs a ragged operand, is checked in tests/test_attention.py."""
    return sorted(name for name, op in registry.all_ops().items()
                  if op.kind == "elementwise" and getattr(op, backend) is not None
                  and not op.takes_lod)


NUMBA_OPS = generated_ops("numba")


def _apply(name, x, y):
    """Every way the net applies op ``name`` to x (and y): [(label, value)]."""
    ops = sn.ops
    if name == "clip":  # (bounds of 0.0 meet -0.0; a NaN bound gives NaN, as np.clip)
        return [("clip", ops.clip(x, -1.0, 1.0)), ("clip_lo", ops.clip(x, lo=-1.0)),
                ("clip_hi", ops.clip(x, hi=1.0)), ("clip_zeros", ops.clip(x, 0.0, 0.0)),
                ("clip_nan", ops.clip(x, lo=float("nan")))]
    if name == "where":
        return [("where", ops.where(ops.greater(x, y), x, y))]
    arity = registry.get(name).num_inputs
    return [(name, getattr(ops, name)(*([x, y][:arity])))]


def every_op_net(X, Y, names, hoisted=("tanh", "sigmoid")):
    """A step-net whose outputs are every op of ``names`` on X (and Y) inside
    the time loop (the fused loop), then the ops of ``hoisted`` on X and Y
    themselves (work hoisted out of the time loop)."""
    dtype = X.data.dtype
    rnn = sn.create_rnn_op()
    labels = []
    with rnn.stepnet():
        x0 = rnn.add_input(X, name="x")
        y0 = rnn.add_input(Y, name="y")
        h = rnn.add_memory(shape=[WIDTH], name="h", dtype=dtype)
        zero = h.pre_state()
        h.update(zero)
        outputs = []
        for where, (x, y), ops in (("step", (x0 - zero, y0 - zero), names),  # (-0.0 stays)
                                   ("hoisted", (x0, y0), [n for n in names if n in hoisted])):
            applied = [a for name in ops for a in _apply(name, x, y)]
            labels += [f"{label} ({where})" for label, _ in applied]
            outputs += [value for _, value in applied]
        rnn.add_outputs(*outputs)
    return rnn, labels


def feeds(x, y, dtype):
    """x, y as two step inputs with the same LoD, padded to whole rows."""
    rows = -(-x.size // WIDTH)
    rows = max(rows, sum(LENGTHS))
    lengths = LENGTHS[:-1] + [rows - sum(LENGTHS[:-1])]

    def tensor(v):
        data = np.resize(v.astype(dtype), rows * WIDTH).reshape(rows, WIDTH)
        return sn.LoDTensor.from_lengths(data, [lengths])

    return {"x": tensor(x), "y": tensor(y)}


def pairs(values):
    """Every (a, b) pair of ``values``: x and y for the binary ops."""
    return np.repeat(values, values.size), np.tile(values, values.size)


def specials_mismatch(actual, expected, tol):
    """'' if ``actual`` has NaN where the interpreter has NaN, the same
    infinities and finite values within DESIGN.md §4's tolerance, else what
    differs."""
    a, e = actual.data, expected.data
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} != {e.dtype}"
    if e.dtype == bool:
        bad = np.flatnonzero(a != e)
    else:
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            close = np.abs(a64 - e64) <= tol * np.maximum(1.0, np.abs(e64))
        same_special = (a64 == e64) | (np.isnan(a64) & np.isnan(e64))
        same_zero = (e64 != 0) | (np.signbit(a64) == np.signbit(e64))  # (0.0 and -0.0 differ)
        bad = np.flatnonzero(~np.where(np.isfinite(e64), np.isfinite(a64) & close & same_zero,
                                       same_special))
    if bad.size == 0:
        return ""
    return f"{bad.size} differ, e.g. got {a.ravel()[bad[:3]]} for {e.ravel()[bad[:3]]}"


def check_specials(backend, names, dtype, x, y):
    """Every op of ``names`` on x (and y) by ``backend`` against the interpreter."""
    feed = feeds(x, y, dtype)
    net, labels = every_op_net(feed["x"], feed["y"], names)
    with np.errstate(all="ignore"):
        expected = net(backend="interpreter")
        actual = net(backend=backend)
    if len(labels) == 1:
        expected, actual = (expected,), (actual,)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    wrong = [f"{label}: {why}" for label, a, e in zip(labels, actual, expected)
             if (why := specials_mismatch(a, e, tol))]
    assert not wrong, f"{backend} {np.dtype(dtype).name} vs interpreter:\n" + "\n".join(wrong)
    return net, labels


def max_relative_error(got, exact):
    """Where the exact value is a normal float32 (and its inputs finite)."""
    normal = np.isfinite(exact) & (np.abs(exact) >= F32.tiny)
    return np.max(np.abs(got.astype(np.float64)[normal] - exact[normal]) / np.abs(exact[normal]))


def check_activation_accuracy(net, backend, x):
    """tanh and sigmoid of x within 1e-6 relative of float64, through ``net``
    (an every_op_net), on both of its paths."""
    feed = feeds(x, x, np.float32)
    x64 = feed["x"].data.astype(np.float64)
    exact = {"tanh": np.tanh(x64), "sigmoid": special.expit(x64)}
    with np.errstate(all="ignore"):
        outputs = net[0](backend=backend, **feed)
    checked = 0
    for label, out in zip(net[1], outputs):
        name = label.split(" ")[0]
        if name in exact:
            err = max_relative_error(out.data, exact[name])
            assert err <= 1e-6, f"{backend} {label}: max relative error {err:.3g}"
            checked += 1
    assert checked == 4


def test_the_tables_cover_the_elementwise_primitives():
    must = {"add", "sub", "mul", "div", "maximum", "minimum", "neg", "abs", "exp", "log", "sqrt",
            "relu",
            "tanh", "sigmoid", "softplus", "clip", "where", "greater", "greater_equal", "less",
            "less_equal", "equal"}
    assert must <= set(NUMBA_OPS)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_nan_and_inf_match_the_interpreter_for_every_op(dtype):
    check_specials("numba", NUMBA_OPS, dtype, *pairs(SPECIALS))


def test_numba_float32_tanh_and_sigmoid_relative_error():
    # the kernel of the test above (same graph, so compiled once), rebound to
    # a fine sweep of [-100, 100], the float32 neighbours of the points where
    # the formulas change (tanh: |x| = 4e-4 and 7.905; exp's clamp) and the specials
    feed = feeds(*pairs(SPECIALS), np.float32)
    net = every_op_net(feed["x"], feed["y"], NUMBA_OPS)
    sweep = np.linspace(-100, 100, 200_001, dtype=np.float32)
    edges = np.array([4e-4, 7.90531110763549805, 86.5, 87.3, 88.72, 88.8], np.float32)
    near = np.concatenate([np.nextafter(edges, edges * s) for s in (0, 2)] + [edges])
    x = np.concatenate([sweep, near, -near, SPECIALS.astype(np.float32)])
    check_activation_accuracy(net, "numba", x)


def test_gru_update_gate_keeps_float32_resolution_near_one():
    # 1 - sigmoid(x) for x around 16: float32 resolves 1 - z down to 6e-8,
    # which ONNX's GRU cases check (test_gru_seq_length)
    x = np.array([15.0, 16.0, 16.5], np.float32)
    X = sn.LoDTensor.from_lengths(np.repeat(x[:, None], WIDTH, 1), [[3]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        xt = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[WIDTH], name="h", dtype=np.float32)
        h.update(1 - sn.ops.sigmoid(xt + h.pre_state() * 0))
        rnn.add_outputs(h)
    got = rnn(backend="numba").data[:, 0].astype(np.float64)
    exact = 1 - special.expit(x.astype(np.float64))
    assert np.all(np.abs(got - exact) <= 6e-8), (got, exact)


# ----------------------------------------------------------------------------
# the CUDA backend: on the simulator (no GPU), whose threads run in Python


def _cuda_ops():
    pytest.importorskip("stepnet.jit.numba_cuda")
    if "cuda" not in sn.backends():
        pytest.skip("no CUDA GPU and no CUDA simulator")
    return generated_ops("cuda")


def _simulated():
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy scalars warn
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_nan_and_inf_match_the_interpreter_for_every_op(dtype):
    names = _cuda_ops()
    if _simulated():
        # fewer pairs: the simulator runs every thread in Python
        # (exp, log and sqrt among them: Python's math, which the simulator
        # runs, raises where CUDA gives inf and NaN, and their code does not
        # call it there)
        check_specials("cuda", names, dtype,
                       *pairs(SPECIALS[[0, 1, 2, 3, 4, 5, 6, 9, 10, 15, 16, 17, 19]]))
    else:
        check_specials("cuda", names, dtype, *pairs(SPECIALS))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cuda_float32_tanh_and_sigmoid_relative_error():
    _cuda_ops()
    feed = feeds(*pairs(SPECIALS[:4]), np.float32)
    net = every_op_net(feed["x"], feed["y"], ["tanh", "sigmoid"])
    # the simulator runs every thread in Python: a coarser sweep
    n = 801 if _simulated() else 200_001
    x = np.concatenate([np.linspace(-100, 100, n, dtype=np.float32), SPECIALS.astype(np.float32)])
    check_activation_accuracy(net, "cuda", x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segment_ops_over_special_values_match_the_interpreter(dtype):
    """seq_sum and seq_max over rows of NaN, infinities and zeros of either
    sign, and a row of none: the same values and the same signs of zeros on
    every backend (a sum from +0.0, as ``np.sum``: rows of -0.0 alone give
    +0.0; a maximum's tie of 0.0 and -0.0 goes to the later row)."""
    rows = [[-0.0], [-0.0], [0.0], [-0.0], [np.nan], [1.0], [np.inf], [-np.inf], [np.inf],
            [-0.0], [0.0], [-1.0], [1.0]]
    M = sn.LoDTensor.from_lengths(np.array(rows, dtype), [[2, 2, 2, 0, 3, 2, 2]])
    X = sn.LoDTensor.from_lengths(np.ones((7, 1), dtype), [[1] * 7])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        m = rnn.add_static_input(M, name="M")
        rnn.add_outputs(sn.ops.seq_sum(m) * x, sn.ops.seq_max(m) * x)
    expected = [out.data for out in rnn(backend="interpreter")]
    assert np.signbit(expected[0][0, 0]) == 0 and np.signbit(expected[1][0, 0]) == 1
    for backend in sn.backends():
        for got, want in zip(rnn(backend=backend), expected):
            np.testing.assert_array_equal(got.data, want)  # (NaN equals NaN)
            assert (np.signbit(got.data) == np.signbit(want)).all(), backend
