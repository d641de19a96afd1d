"""Gradients (docs/gradients.md, DESIGN.md §6) against finite differences,
against PyTorch autograd, and between backends.

* Every op of ``sn.ops`` in a small step-net: on step values, Parameters
  (``[H]`` broadcast against ``[B, H]``), scalar literals, carried across
  steps by a memory; central differences (float64) of a random linear
  functional of all-steps and last-step outputs with respect to every
  Parameter, the step input, the memory's initial value and a static input.
  The step input's data lie in bands away from every kink the ops have
  (0, +-0.8, +-1), and whatever the memory and the static input add stays
  below the bands' margin, so no relu/abs/clip/where/max branch flips under
  a finite-difference step.
* Step-net features: reverse, variable lengths with an empty sequence and a
  shrinking batch, several memories and outputs with mixed
  ``output_all_steps`` flags, memories as outputs (updated and
  ``pre_state()``), static inputs, per-sequence and broadcast initial
  values, nested step-nets.
* Random step-nets (tests/stepnet_strategies.py).
* ``stepnet.nn`` layers built with ``from_torch`` against ``torch.autograd``.
* The API: ``accumulate``/``out``, ``sn.vjp``, ``keep_workspace``, errors,
  float16.

Numba's gradients are compared with the interpreter's (DESIGN.md §4
tolerances) and, in float64, with the finite differences too.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import assert_close
from gradient_checks import (
    as_tuple,
    assert_directional_fd,
    assert_fd_close,
    assert_grads_agree,
    data_of,
    describe,
    expected_shape,
    fd_gradients,
    random_cotangents,
    smooth_at,
)
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st
from nets import named_tanh_net, word_attention

import stepnet as sn
import stepnet_strategies

HAS_NUMBA = "numba" in sn.backends()
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="the numba backend is not available")
F64, F32 = np.dtype(np.float64), np.dtype(np.float32)

LENGTHS = [3, 1, 0, 2]  # a shrinking batch with an empty sequence
H = 3


def gradients(rnn, wrt, cotangents, flags, feeds, backend):
    return sn.gradients(rnn, wrt=wrt, grad_outputs=cotangents, output_all_steps=flags,
                        backend=backend, **feeds)


def check_gradients_shapes(rnn, wrt, grads, feeds, dtype=None):
    """One gradient per ``wrt``, shaped like it (docs/gradients.md), of the
    net's dtype when given."""
    assert len(grads) == len(wrt)
    for g, w in zip(grads, wrt):
        assert isinstance(g, np.ndarray), f"d/d{describe(w)}: {type(g).__name__}"
        assert g.shape == expected_shape(rnn, w, feeds), \
            f"d/d{describe(w)}: shape {g.shape}, expected {expected_shape(rnn, w, feeds)}"
        if dtype is not None:
            assert g.dtype == dtype, f"d/d{describe(w)}: dtype {g.dtype}, expected {dtype}"


def assert_depends_on_everything(expected, wrt):
    """Guard against a vacuous check: the functional moves with every input."""
    for e, w in zip(expected, wrt):
        assert e.size == 0 or np.any(np.abs(e) > 1e-6), \
            f"the functional does not depend on {describe(w)}; the test net is wrong"


def fd_check(rnn, wrt, flags, feeds=None, seed=0, backends=("interpreter",),
             require_dependence=True, cotangents=None):
    """Finite differences (interpreter forward, float64) against
    ``sn.gradients`` on each backend; numba also against the interpreter.
    ``cotangents``: the outputs' (default: random, from ``seed``)."""
    feeds = dict(feeds or {})
    if cotangents is None:
        outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter", **feeds))
        cotangents = random_cotangents(np.random.default_rng(seed), outs)
    expected = fd_gradients(rnn, wrt, cotangents, flags, feeds)
    if require_dependence:
        assert_depends_on_everything(expected, wrt)
    results = {}
    for backend in backends:
        got = gradients(rnn, wrt, cotangents, flags, feeds, backend)
        check_gradients_shapes(rnn, wrt, got, feeds, F64)
        assert_fd_close(got, expected, wrt, what=backend)
        results[backend] = got
    if "numba" in results and "interpreter" in results:
        assert_grads_agree(results["numba"], results["interpreter"], wrt,
                           what="numba vs interpreter")
    return results


def backends_agree(rnn, wrt, flags, feeds=None, seed=0, kinks_possible=False):
    """numba's gradients against the interpreter's (any dtype); in float64
    also against central differences of numba's own forward along random
    directions: with ``kinks_possible`` (a random net, whose memory may start
    at exactly 0 under a ``where``, ``relu`` or ``clip``) only where the
    functional is smooth (``smooth_at``), as no gradient equals the central
    difference at a kink."""
    feeds = dict(feeds or {})
    rng = np.random.default_rng(seed)
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter", **feeds))
    cots = random_cotangents(rng, outs)
    expected = gradients(rnn, wrt, cots, flags, feeds, "interpreter")
    got = gradients(rnn, wrt, cots, flags, feeds, "numba")
    check_gradients_shapes(rnn, wrt, expected, feeds)
    # the tolerance of the dtype the net computes in (a Python-scalar initial
    # value gives a float64 gradient of a float32 computation)
    dtype = min((data_of(o).dtype for o in outs), key=lambda d: d.itemsize)
    assert_grads_agree(got, expected, wrt, dtype, what="numba vs interpreter")
    if all(np.asarray(g).dtype == F64 for g in got) and (
            not kinks_possible or smooth_at(rnn, wrt, cots, flags, feeds)):
        assert_directional_fd(rnn, wrt, got, cots, flags, feeds, "numba", seed=seed,
                              what="numba")
    return got, expected


# ---------------------------------------------------------------------------
# 1. every op, in a step-net, against finite differences


def kink_free(rng, shape, dtype):
    """Values in +-[0.3, 0.45] or +-[1.25, 1.5]. With what is added below
    (at most 0.13 in size) they stay 0.1 or more from the kinks at 0, +-0.8
    and +-1, and 0.05 or more from the Parameter ``P`` in [0.6, 0.7]."""
    low = rng.uniform(0.3, 0.45, shape)
    high = rng.uniform(1.25, 1.5, shape)
    mags = np.where(rng.random(shape) < 0.5, low, high)
    return (mags * rng.choice([-1.0, 1.0], shape)).astype(dtype)


def _transposed_terms(o):
    """``[B, 3, 2]`` (the step value times a [3, 2] Parameter) transposed to
    ``[B, 2, 3]``, reduced over either feature axis and sliced."""
    u = sn.ops.transpose(sn.ops.broadcast_axis(o.a, 2, 2) * o.Q)
    return [sn.ops.sum(u, axis=1), sn.ops.sum(u, axis=-1),
            sn.ops.sum(sn.ops.slice(u, 0, 1, axis=1), axis=1)]


def _unary(f):
    return lambda o: [f(o.a), f(o.a + o.Z)]


# Each entry: operands -> list of terms ([B, w] or [B]). ``a`` is kink-free
# ([B, 3], it depends on the step input, the memory and the static input),
# ``b`` small (|b| <= 0.05, memory and static input), ``Z`` a [3] Parameter
# below 0.03 in size, ``P`` a [3] Parameter in [0.6, 0.7], ``M`` a [3, 4]
# Parameter, ``Pv`` a [3, 1] Parameter, ``Q`` a [3, 2] Parameter. (A
# one-dimensional matmul operand has no gradient: docs/gradients.md, "Not
# supported"; see test_documented_unsupported_gradients_raise.)
OP_TERMS = {
    "add": lambda o: [sn.ops.add(o.a, o.P), sn.ops.add(o.b, o.a), o.a + 0.5, 0.5 + o.b,
                      o.P + o.a],
    "sub": lambda o: [sn.ops.sub(o.a, o.P), sn.ops.sub(o.P, o.b), o.a - o.b, 0.5 - o.a,
                      o.a - 0.5],
    "mul": lambda o: [sn.ops.mul(o.a, o.P), o.P * o.b, o.a * o.b, 0.5 * o.a, o.a * 0.5],
    "div": lambda o: [sn.ops.div(o.b, o.a), o.a / o.P, o.P / o.a, 0.5 / o.a, o.a / 0.5],
    "maximum": lambda o: [sn.ops.maximum(o.a, o.b), sn.ops.maximum(o.b, o.a),
                          sn.ops.maximum(o.a, o.P), sn.ops.maximum(o.P, o.a),
                          sn.ops.maximum(o.a, 0.8), sn.ops.maximum(-0.8, o.a)],
    "minimum": lambda o: [sn.ops.minimum(o.a, o.b), sn.ops.minimum(o.b, o.a),
                          sn.ops.minimum(o.a, o.P), sn.ops.minimum(o.P, o.a),
                          sn.ops.minimum(o.a, 0.8), sn.ops.minimum(-0.8, o.a)],
    "neg": lambda o: [sn.ops.neg(o.a), -(o.a + o.Z)],
    "abs": lambda o: [sn.ops.abs(o.a), abs(o.a + o.Z)],
    "exp": _unary(sn.ops.exp),
    "log": lambda o: [sn.ops.log(sn.ops.abs(o.a)), sn.ops.log(o.a * o.a + o.P)],
    "sqrt": lambda o: [sn.ops.sqrt(sn.ops.abs(o.a)), sn.ops.sqrt(o.a * o.a + o.P)],
    "tanh": _unary(sn.ops.tanh),
    "sigmoid": _unary(sn.ops.sigmoid),
    "softplus": _unary(sn.ops.softplus),
    "erf": _unary(sn.ops.erf),
    "relu": _unary(sn.ops.relu),
    "clip": lambda o: [sn.ops.clip(o.a, -0.8, 0.8), sn.ops.clip(o.a + o.Z, None, 0.8),
                       sn.ops.clip(o.a, -1.0, None), sn.ops.clip(o.a * o.P, -0.55, 0.55)],
    "where": lambda o: [sn.ops.where(o.a > 0.0, o.a, o.b),
                        sn.ops.where(sn.ops.less(o.a, o.Z), o.P, o.a + o.Z),
                        sn.ops.where(o.a >= 0.0, 0.5, o.b * o.a),
                        sn.ops.where(sn.ops.greater(o.x, 1.0), o.a * o.a, -0.5)],
    "matmul": lambda o: [sn.ops.matmul(o.a, o.M), o.b @ o.M, o.a @ o.Pv],
    "sum": lambda o: [sn.ops.sum(o.a), sn.ops.sum(o.a * o.P, axis=1, keepdims=True),
                      sn.ops.sum(o.b, -1, True)],
    "mean": lambda o: [sn.ops.mean(o.a), sn.ops.mean(o.a * o.P, axis=1, keepdims=True),
                       sn.ops.mean(o.b, -1, True)],
    "concat": lambda o: [sn.ops.concat([o.a, o.b]), sn.ops.concat([o.b, o.a, o.a], axis=1)],
    "slice": lambda o: [sn.ops.slice(o.a, 0, 2), o.a[:, 1:], sn.ops.slice(o.b, 1, 2, axis=1),
                        sn.ops.slice(o.a, -2, 3)],
    "split": lambda o: sn.ops.split(o.a, 3) + sn.ops.split(o.b, [1, 2]),
    "pad": lambda o: [sn.ops.pad(o.a, 1, 2), sn.ops.pad(o.b * o.P, 0, 1, axis=1)],
    "broadcast_axis": lambda o: [
        sn.ops.sum(sn.ops.broadcast_axis(o.a, 1, 2) * o.P, axis=1),
        sn.ops.broadcast_axis(sn.ops.sum(o.a, -1, keepdims=True), 1, 4, insert=False)],
    "transpose": lambda o: _transposed_terms(o),
    "affine": lambda o: [sn.ops.affine(o.a), sn.ops.affine(o.a + o.Z, 0.7, -0.2)],
    "leaky_relu": lambda o: [sn.ops.leaky_relu(o.a), sn.ops.leaky_relu(o.a + o.Z, 0.1)],
    "thresholded_relu": lambda o: [sn.ops.thresholded_relu(o.a),
                                   sn.ops.thresholded_relu(o.a + o.Z, 0.8)],
    "scaled_tanh": lambda o: [sn.ops.scaled_tanh(o.a), sn.ops.scaled_tanh(o.a + o.Z, 0.7, 1.3)],
    "hard_sigmoid": lambda o: [sn.ops.hard_sigmoid(o.a),
                               sn.ops.hard_sigmoid(o.a + o.Z, 0.5, 0.5)],
    "elu": lambda o: [sn.ops.elu(o.a), sn.ops.elu(o.a + o.Z, 0.8)],
    "softsign": _unary(sn.ops.softsign),
}
OPS = list(OP_TERMS)

# The op on Parameters alone (traced inside a step: docs/gradients.md,
# "Decisions"), times the step value: a [3] or [] result scales it, a [3, k]
# one multiplies it. ``P`` stays away from every kink.
PARAMETER_TERMS = {
    "add": lambda o: sn.ops.add(o.P, o.Z),
    "sub": lambda o: sn.ops.sub(o.P, o.Z),
    "mul": lambda o: sn.ops.mul(o.P, o.Z),
    "div": lambda o: sn.ops.div(o.Z, o.P),
    "maximum": lambda o: sn.ops.maximum(sn.ops.neg(o.P), o.P),
    "minimum": lambda o: sn.ops.minimum(o.P, sn.ops.neg(o.P)),
    "log": lambda o: sn.ops.log(o.P),
    "clip": lambda o: sn.ops.clip(o.P, 0.0, 0.9),
    "where": lambda o: sn.ops.where(sn.ops.greater(o.P, 0.0), o.P, o.Z),
    "matmul": lambda o: sn.ops.matmul(o.Q, sn.ops.transpose(o.Q)),
    "sum": lambda o: sn.ops.sum(o.P),
    "mean": lambda o: sn.ops.mean(o.Q, axis=1),
    "concat": lambda o: sn.ops.concat([o.Q, o.M], axis=1),
    "slice": lambda o: sn.ops.slice(o.Q, 1, 2),
    "split": lambda o: sn.ops.split(o.Q, 2)[1],
    "pad": lambda o: sn.ops.pad(o.Q, 0, 1),
    "broadcast_axis": lambda o: sn.ops.broadcast_axis(o.P, 1, 2),
    "transpose": lambda o: sn.ops.transpose(o.M),
    "thresholded_relu": lambda o: sn.ops.thresholded_relu(o.P, 0.3),
}
PARAMETER_TERMS["sqrt"] = lambda o: sn.ops.sqrt(o.P)
for _op in ["neg", "abs", "exp", "tanh", "sigmoid", "softplus", "erf", "relu", "affine",
            "leaky_relu", "scaled_tanh", "hard_sigmoid", "elu", "softsign"]:
    PARAMETER_TERMS[_op] = (lambda f: lambda o: f(o.P))(getattr(sn.ops, _op))


def parameter_term(op, o):
    c = PARAMETER_TERMS[op](o)
    if len(c.shape) < 2:
        return o.a * c
    return (o.a @ o.M if c.shape[0] == 4 else o.a) @ c


def build_op_net(ops, dtype=np.float64, seed=0, lengths=LENGTHS, reverse=False):
    """A step-net whose memory carries the terms of ``ops`` across steps.

    Outputs: the memory (all steps), the projected terms (last step), the
    memory's pre-state (all steps) and, where an op gives ``[B]`` terms,
    their sum (all steps). Returns ``(rnn, flags)``."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    num_seq = len(lengths)

    def param(name, low, high, shape):
        return sn.Parameter(rng.uniform(low, high, shape).astype(dtype), name=name)

    X = sn.LoDTensor.from_lengths(kink_free(rng, (sum(lengths), H), dtype), [lengths])
    S = rng.uniform(-1, 1, (num_seq, H)).astype(dtype)
    h0 = rng.uniform(-1, 1, (num_seq, H)).astype(dtype)
    o = SimpleNamespace(Z=param("Z", -0.03, 0.03, H), P=param("P", 0.6, 0.7, H),
                        M=param("M", -0.5, 0.5, (H, 4)), Pv=param("Pv", -0.5, 0.5, (H, 1)),
                        Q=param("Q", -1.0, 1.0, (H, 2)))
    U = param("U", -0.5, 0.5, (H, H))
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        o.x = rnn.add_input(X, name="X")
        s = rnn.add_static_input(S, name="S")
        h = rnn.add_memory(init=h0, shape=[H], name="h")
        hp = h.pre_state()
        o.a = o.x + 0.05 * sn.ops.tanh(hp) + 0.05 * s
        o.b = 0.05 * sn.ops.tanh(hp + s)
        terms = [t for op in ops for t in OP_TERMS[op](o) + [parameter_term(op, o)]]
        v, scalars = None, None
        for i, t in enumerate(terms):
            if len(t.shape) == 1:
                scalars = t if scalars is None else scalars + t
                continue
            width = t.shape[1]
            proj = t @ param(f"W{i}", -1.0 / width, 1.0 / width, (width, H))
            v = proj if v is None else v + proj
        h.update(sn.ops.tanh(v + hp @ U))
        outputs, flags = [h, v, hp], [True, False, True]
        if scalars is not None:
            outputs.append(scalars)
            flags.append(True)
        rnn.add_outputs(*outputs)
    return rnn, tuple(flags)


def op_wrt(rnn):
    return rnn.parameters() + ["X", "h", "S"]


def test_every_op_has_a_case():
    public = {name for name in sn.ops.__all__ if callable(getattr(sn.ops, name))}
    comparisons = {"equal", "greater", "greater_equal", "less", "less_equal"}
    # the ops over a ragged static input: tests/test_attention.py checks their
    # gradients against finite differences and PyTorch
    segment = {"seq_sum", "seq_max", "seq_expand", "seq_softmax", "attention"}
    # the quantized products have no gradient (tests/test_quantize.py: refused)
    quantized = {"matmul_int8", "matmul_bf16"}
    assert public - comparisons - segment - quantized - {"registry"} == set(OPS)


@pytest.mark.parametrize("op", OPS)
def test_op_gradients_match_finite_differences(op):
    rnn, flags = build_op_net([op])
    fd_check(rnn, op_wrt(rnn), flags)


@pytest.mark.parametrize("op", ["tanh", "div", "where", "concat"])
def test_op_gradients_match_finite_differences_reversed(op):
    rnn, flags = build_op_net([op], reverse=True, seed=1)
    fd_check(rnn, op_wrt(rnn), flags)


# Compiling a step-net's backward takes Numba tens of seconds per few ops, so
# by default a few ops share one net; the slow run checks each op on its own.
NUMBA_SAMPLE = ["where", "transpose"]


@needs_numba
# (float32 gradients on Numba by default: TORCH_NUMBA_DEFAULT's LSTM)
@pytest.mark.parametrize("dtype", [np.float64, pytest.param(np.float32, marks=pytest.mark.slow)])
def test_some_ops_on_numba_agree_with_the_interpreter(dtype):
    rnn, flags = build_op_net(NUMBA_SAMPLE, dtype, seed=2)
    got, _ = backends_agree(rnn, op_wrt(rnn), flags)
    for g in got:
        assert g.dtype == dtype


@pytest.mark.slow
@needs_numba
@pytest.mark.parametrize("op", OPS)
def test_op_gradients_on_numba(op):
    rnn, flags = build_op_net([op], seed=4)
    fd_check(rnn, op_wrt(rnn), flags, backends=("interpreter", "numba"))
    rnn, flags = build_op_net([op], np.float32, seed=5)
    backends_agree(rnn, op_wrt(rnn), flags)


def _net_of_a_parameter(of_p, seed, lengths):
    """``h = tanh(x * of_p(P) + h_prev)``: a step reading a parameter ``P``
    [H] only through ``of_p``. Returns ``(rnn, P)``."""
    rng = np.random.default_rng(seed)
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (sum(lengths), H)), [lengths])
    P = sn.Parameter(rng.uniform(-1, 1, H), name="P")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[H], name="h")
        h.update(sn.ops.tanh(x * of_p(P) + h.pre_state()))
        rnn.add_outputs(h)
    return rnn, P


def test_op_on_a_parameter_alone_reads_the_parameter():
    """``tanh(P)`` inside a step reads P like ``x @ P`` does: a run sees
    P's current value (an optimizer changes it in place), and the gradient
    reaches P through it."""
    rnn, P = _net_of_a_parameter(sn.ops.tanh, 6, [3, 1])
    before = rnn(backend="interpreter").data.copy()
    P.value += 0.5
    after = rnn(backend="interpreter").data
    P.value -= 0.5
    assert not np.allclose(after, before), "the run did not see P's new value"
    fd_check(rnn, [P], (True,))


@needs_numba
def test_a_reduction_of_a_parameter_alone_compiles_and_agrees():
    """``sum(P)`` of a parameter is a 0-d value the compiled program computes
    once from its constants; its backward writes it too (the generated code
    once wrote ``v.item() = ...`` there: a SyntaxError at the first
    compiled backward)."""
    rnn, P = _net_of_a_parameter(sn.ops.sum, 7, [4, 2])
    fd_check(rnn, [P], (True,), backends=("interpreter", "numba"))


def test_a_step_net_without_a_memory_has_a_compiled_gradient():
    """Every gradient of ``tanh(x @ W)`` is per token: the backward's time
    loop computes nothing (its kernel once ended ``return (,)``: a
    SyntaxError at the first compiled backward)."""
    rng = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((3, 3)), [[2, 1]])
    W = sn.Parameter(rng.standard_normal((3, 4)), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        rnn.add_outputs(sn.ops.tanh(rnn.add_input(X, name="X") @ W))
    fd_check(rnn, [W, "X"], (True,), backends=("interpreter", "numba"))


# ---------------------------------------------------------------------------
# 2. step-net features


FEATURE_LENGTHS = [4, 0, 2, 5, 1]
REBOUND_LENGTHS = [2, 3, 0, 1]


def build_feature_net(reverse, init, seed=0, dtype=np.float64):
    """Two step inputs, a static input, two memories (``h`` with the given
    kind of initial value, ``c`` from zeros) and four outputs: ``h`` updated,
    ``c.pre_state()``, a value that is no memory, ``h.pre_state()``.
    Returns ``(rnn, feeds)``, the feeds rebinding every input to new data
    with a new LoD."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)

    def param(name, *shape):
        return sn.Parameter(rng.uniform(-0.8, 0.8, shape).astype(dtype), name=name)

    def data(lengths):
        n = len(lengths)
        return {
            "X": sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (sum(lengths), 2)).astype(dtype),
                                           [lengths]),
            "X2": sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (sum(lengths), 3)).astype(dtype),
                                            [lengths]),
            "S": rng.uniform(-1, 1, (n, 2)).astype(dtype),
            "h": {"per_sequence": rng.uniform(-1, 1, (n, 3)).astype(dtype),
                  "broadcast": rng.uniform(-1, 1, 3).astype(dtype),
                  "scalar": 0.25,
                  "zeros": None}[init],
        }

    defined, rebound = data(FEATURE_LENGTHS), data(REBOUND_LENGTHS)
    Wc, Pc, Vc = param("Wc", 2, 2), param("Pc", 2), param("Vc", 3, 2)
    W, U, Ch, b = param("W", 3, 3), param("U", 3, 3), param("Ch", 2, 3), param("b", 3)
    Sy = param("Sy", 2, 3)
    rnn = sn.create_rnn_op(output_num=4, reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(defined["X"], name="X")
        x2 = rnn.add_input(defined["X2"], name="X2")
        s = rnn.add_static_input(defined["S"], name="S")
        if init == "zeros":
            h = rnn.add_memory(shape=[3], name="h")
        else:
            h = rnn.add_memory(init=defined["h"], shape=[3], name="h")
        c = rnn.add_memory(shape=[2], name="c", dtype=dtype)
        hp, cp = h.pre_state(), c.pre_state()
        c.update(sn.ops.sigmoid(x @ Wc + cp * Pc) * sn.ops.tanh(x2 @ Vc + s) + 0.5 * cp)
        h.update(sn.ops.tanh(x2 @ W + hp @ U + c @ Ch + b))
        y = h * sn.ops.sigmoid(s @ Sy) - 0.5 * hp
        rnn.add_outputs(h, cp, y, hp)
    feeds = {k: v for k, v in rebound.items() if v is not None and
             not (k == "h" and init in ("scalar", "zeros"))}
    return rnn, feeds


FEATURE_WRT = ["X", "X2", "S", "h", "c"]
FLAG_SETS = [True, False, (True, False, False, True), (False, True, True, False)]


def feature_wrt(rnn):
    return rnn.parameters() + FEATURE_WRT


INITS = ["per_sequence", "broadcast", "scalar", "zeros"]
FEATURE_GRID = [(reverse, flags, init) for reverse in (False, True) for flags in FLAG_SETS
                for init in INITS]
# By default every flag set with per-sequence initial values, and every kind
# of initial value with mixed flags; the slow run takes the whole grid.
FEATURE_DEFAULT = [c for c in FEATURE_GRID if c[2] == "per_sequence" or c[1] == FLAG_SETS[2]]


def _feature_id(case):
    reverse, flags, init = case
    return f"{'reverse' if reverse else 'forward'}-{flags}-{init}"


def _check_features(case):
    reverse, flags, init = case
    rnn, feeds = build_feature_net(reverse, init)
    flags = rnn.all_steps_flags(flags)
    wrt = feature_wrt(rnn)
    # As defined, and with every input rebound (new LoD, new data).
    fd_check(rnn, wrt, flags)
    fd_check(rnn, wrt, flags, feeds, seed=1)


@pytest.mark.parametrize("case", FEATURE_DEFAULT, ids=_feature_id)
def test_stepnet_features_match_finite_differences(case):
    _check_features(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FEATURE_GRID if c not in FEATURE_DEFAULT],
                         ids=_feature_id)
def test_stepnet_features_match_finite_differences_all(case):
    _check_features(case)


def test_gradients_of_sequences_past_their_end_are_zero():
    """An empty sequence's last-step memory outputs (updated and
    ``pre_state()``) are its initial value: their cotangents are its
    gradient, and no step adds to it."""
    rnn, _ = build_feature_net(False, "per_sequence")
    flags = (False, False, False, False)
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter"))
    cots = [np.zeros_like(data_of(o)) for o in outs]
    cots[0][1] = [1.0, -2.0, 3.0]  # h's last step of sequence 1 (empty): its init
    cots[3][1] = [0.5, 0.5, 0.5]  # h.pre_state()'s last step of sequence 1: its init too
    (g,) = gradients(rnn, ["h"], cots, flags, {}, "interpreter")
    expected = np.zeros_like(g)
    expected[1] = [1.5, -1.5, 3.5]
    np.testing.assert_array_equal(g, expected)


def simple_net(lengths, width=2, seed=0, output=None, dtype=np.float64):
    """``h = tanh(x @ W + h_prev @ U + b)``; the output is ``h`` or
    ``output(h)``."""
    rng = np.random.default_rng(seed)
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (sum(lengths), width)).astype(dtype),
                                  [lengths])
    W = sn.Parameter(rng.uniform(-1, 1, (width, 2)).astype(dtype), name="W")
    U = sn.Parameter(rng.uniform(-1, 1, (2, 2)).astype(dtype), name="U")
    b = sn.Parameter(rng.uniform(-1, 1, 2).astype(dtype), name="b")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=rng.uniform(-1, 1, (len(lengths), 2)).astype(dtype),
                           shape=[2], name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state() @ U + b))
        rnn.add_outputs(h if output is None else output(h))
    return rnn


@pytest.mark.parametrize("lengths", [[0, 0], [], [0]], ids=str)
@pytest.mark.parametrize("flag", [True, False])
def test_every_sequence_empty(lengths, flag):
    """No step runs: weight gradients are zeros, a last-step memory output's
    cotangent is its initial value's gradient."""
    rnn = simple_net(lengths)
    wrt = rnn.parameters() + ["X", "h"]
    results = fd_check(rnn, wrt, (flag,), require_dependence=False)
    for g in results["interpreter"][:3]:
        np.testing.assert_array_equal(g, 0.0)


def test_last_step_output_without_feature_axis():
    """A ``[B]`` output (a sum over the features) as its last step."""
    rnn = simple_net([3, 0, 2], output=lambda h: sn.ops.sum(h, -1))
    fd_check(rnn, rnn.parameters() + ["X", "h"], (False,))


def _kink_net(op):
    """``op(x, s)`` at ties / kinks the data put exactly on."""
    X = sn.LoDTensor.from_lengths(np.array([[0.5, -0.5, 0.0, 0.25]]), [[1]])
    S = np.array([[0.5, -0.5, 0.0, 0.25]])  # equal to the step input: ties
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        s = rnn.add_static_input(S, name="S")
        h = rnn.add_memory(shape=[4], name="h")
        h.update(op(x, s) + h.pre_state())
        rnn.add_outputs(h)
    return rnn


# docs/gradients.md, "Decisions": a tie's gradient goes to maximum's and
# minimum's first operand; abs and relu have gradient 0 at 0; clip passes the
# gradient at its bounds.
KINK_CASES = {
    "maximum": (sn.ops.maximum, [1, 1, 1, 1], [0, 0, 0, 0]),
    "minimum": (sn.ops.minimum, [1, 1, 1, 1], [0, 0, 0, 0]),
    "abs": (lambda x, s: sn.ops.abs(x) + 0.0 * s, [1, -1, 0, 1], [0, 0, 0, 0]),
    "relu": (lambda x, s: sn.ops.relu(x) + 0.0 * s, [1, 0, 0, 1], [0, 0, 0, 0]),
    "clip": (lambda x, s: sn.ops.clip(x, -0.5, 0.5) + 0.0 * s, [1, 1, 1, 1], [0, 0, 0, 0]),
}


@pytest.mark.parametrize("op", list(KINK_CASES))
def test_gradient_at_ties_and_kinks(op):
    f, dx, ds = KINK_CASES[op]
    rnn = _kink_net(f)
    gX, gS = gradients(rnn, ["X", "S"], [np.ones((1, 4))], True, {}, "interpreter")
    np.testing.assert_array_equal(gX, [dx])
    np.testing.assert_array_equal(gS, [ds])


def _unsupported_one_dimensional_matmul():
    rnn = simple_net([2, 1], output=lambda h: h @ sn.Parameter(np.ones(2), name="v"))
    return rnn, (True,)


def _nested_unsupported(outputs=lambda hw: [hw], calls=1, static_lod=False):
    """An outer net whose step runs ``calls`` nested nets over its ragged
    step value (or, with ``static_lod``, over a LoDTensor static input) and
    adds their last-step ``outputs``."""
    W = sn.Parameter(np.full((2, 2), 0.5), name="W")
    if static_lod:
        X = sn.LoDTensor.from_lengths(np.ones((2, 2)), [[1, 1]])
    else:
        X = sn.LoDTensor.from_lengths(np.ones((3, 2)), [[1, 1], [2, 1]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        if static_lod:
            ragged = rnn.add_static_input(
                sn.LoDTensor.from_lengths(np.ones((3, 2)), [[2, 1]]), name="M")
        else:
            ragged = x
        h = rnn.add_memory(shape=[2], name="h")
        total = h.pre_state() + x @ W if static_lod else h.pre_state()
        for k in range(calls):
            inner = sn.create_rnn_op()
            with inner.stepnet():
                w = inner.add_input(ragged, name=f"w{k}")
                hw = inner.add_memory(shape=[2], name=f"hw{k}")
                hw.update(sn.ops.tanh(w @ W + hw.pre_state()))
                inner.add_outputs(*outputs(hw))
            for v in as_tuple(inner(output_all_steps=False)):
                total = total + v
        h.update(total)
        rnn.add_outputs(h)
    return rnn, (True,)


def _unsupported_mixed_dtypes():
    # a float32 memory, scaled by a float64 Parameter into a float64 output
    X = sn.LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[2, 1]])
    W = sn.Parameter(np.full((2, 2), 0.5, np.float32), name="W")
    P = sn.Parameter(np.full(2, 0.5, np.float64), name="P")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[2], name="h")
        h.update(sn.ops.tanh(h.pre_state() + x @ W))
        rnn.add_outputs(h * P)
    return rnn, (True,)


def _unsupported_ragged_rows_of_two_axes_by_a_constant():
    M = sn.LoDTensor.from_lengths(np.ones((5, 2, 3)), [[3, 2]])
    X = sn.LoDTensor.from_lengths(np.ones((3, 4)), [[2, 1]])
    W = sn.Parameter(np.full((3, 4), 0.5), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        rnn.add_input(X, name="X")
        rnn.add_outputs(sn.ops.seq_sum(rnn.add_static_input(M, name="M") @ W))
    return rnn, (True,)


def _unsupported_constant_of_the_enclosing_step():
    # weights the outer step computes from a Parameter, read by the nested net
    X = sn.LoDTensor.from_lengths(np.ones((4, 3)), [[2, 1], [1, 2, 1]])
    W = sn.Parameter(np.full((3, 2), 0.5), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        weights = sn.ops.tanh(W)
        inner = sn.create_rnn_op()
        with inner.stepnet():
            h = inner.add_memory(shape=[2], name="h", init=np.zeros(2))
            h.update(sn.ops.tanh(inner.add_input(x, name="word") @ weights + h.pre_state()))
            inner.add_outputs(h)
        rnn.add_outputs(inner(output_all_steps=False))
    return rnn, (True,)


UNSUPPORTED = {
    "one-dimensional matmul": _unsupported_one_dimensional_matmul,
    "a constant of the enclosing step in a nested net": _unsupported_constant_of_the_enclosing_step,
    "ragged rows of two feature axes by a constant": _unsupported_ragged_rows_of_two_axes_by_a_constant,
    "nested last step of a pre-state": lambda: _nested_unsupported(lambda hw: [hw.pre_state()]),
    "nested memory as two last steps": lambda: _nested_unsupported(lambda hw: [hw, hw]),
    "float32 and float64 in one path": _unsupported_mixed_dtypes,
}


def test_the_nested_net_of_the_unsupported_forms_is_supported():
    """The base the nested forms above change has a gradient; so has a
    nested net over a LoDTensor static input, on the interpreter."""
    rnn, flags = _nested_unsupported()
    fd_check(rnn, rnn.parameters() + ["X", "h"], flags)
    rnn, flags = _nested_unsupported(static_lod=True)
    fd_check(rnn, rnn.parameters() + ["X", "M"], flags)


@needs_numba
@pytest.mark.parametrize("from_outer", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_hierarchical_attention_networks_gradients(from_outer):
    """The word attention over a nested net's every step: its words read
    by three ops (the attention's score, its query, the weighted sum), their
    cotangents summed into the nested backward net's step input; the
    weights given out (a ragged output computed by ops from them) have a
    cotangent too, read by entry in the backward."""
    rnn, _ = word_attention(np.random.default_rng(3), dtype=np.float64, from_outer=from_outer)
    wrt = rnn.parameters() + ["X"]
    h, a = rnn(backend="interpreter")
    rng = np.random.default_rng(4)
    cotangents = [rng.uniform(-1, 1, h.data.shape), rng.uniform(-1, 1, a.data.shape)]
    fd_check(rnn, wrt, (True, True), backends=("interpreter", "numba"), cotangents=cotangents)


@needs_numba
def test_a_ragged_value_read_by_two_nested_nets():
    """Two nested nets over one step input (a bidirectional word encoder's
    two directions): its cotangent is the sum of theirs."""
    rnn, flags = _nested_unsupported(calls=2)
    fd_check(rnn, rnn.parameters() + ["X", "h"], flags, backends=("interpreter", "numba"))


@pytest.mark.parametrize("form", list(UNSUPPORTED))
def test_documented_unsupported_gradients_raise(form):
    """docs/gradients.md, "Not supported": UnsupportedError when the
    gradient is built, never a wrong gradient or another exception."""
    rnn, flags = UNSUPPORTED[form]()
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter"))
    cots = random_cotangents(np.random.default_rng(0), outs)
    with pytest.raises(sn.UnsupportedError):
        gradients(rnn, rnn.parameters(), cots, flags, {}, "interpreter")


@needs_numba
def test_stepnet_features_numba():
    rnn, feeds = build_feature_net(True, "per_sequence", seed=2)
    flags = rnn.all_steps_flags(FLAG_SETS[2])
    fd_check(rnn, feature_wrt(rnn), flags, feeds, backends=("interpreter", "numba"),
             require_dependence=False)
    fd_check(rnn, feature_wrt(rnn), flags, backends=("interpreter", "numba"),
             require_dependence=False)


@pytest.mark.slow
@needs_numba
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("flags", FLAG_SETS, ids=str)
@pytest.mark.parametrize("init", ["per_sequence", "broadcast", "scalar", "zeros"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_stepnet_features_numba_all(reverse, flags, init, dtype):
    rnn, feeds = build_feature_net(reverse, init, seed=3, dtype=dtype)
    flags = rnn.all_steps_flags(flags)
    backends_agree(rnn, feature_wrt(rnn), flags, feeds)
    backends_agree(rnn, feature_wrt(rnn), flags, seed=1)


# -- nested step-nets ---------------------------------------------------------

NESTED_LENGTHS = [[2, 0, 3], [3, 0, 2, 1, 4]]  # an empty chapter, an empty paragraph
NESTED_REBOUND = [[1, 2, 1, 0], [2, 3, 1, 0]]


def build_nested_net(outer_reverse=False, inner_reverse=False, ragged_output=False,
                     seed=0, dtype=np.float64):
    """Chapters of paragraphs of words: the inner net runs over each
    paragraph's words, its memory starts from the outer memory's pre-state and
    it reads the outer static input; the outer memory takes the inner last
    step. With ``ragged_output`` the inner all-steps output is an output of
    the outer net too (a two-level LoD output). Returns ``(rnn, flags, feeds)``."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)

    def param(name, *shape):
        return sn.Parameter(rng.uniform(-0.8, 0.8, shape).astype(dtype), name=name)

    def data(lengths):
        n = len(lengths[0])
        return {
            "X": sn.LoDTensor.from_lengths(
                rng.uniform(-1, 1, (sum(lengths[1]), 2)).astype(dtype), lengths),
            "S": rng.uniform(-1, 1, (n, 2)).astype(dtype),
            "h": rng.uniform(-1, 1, (n, 3)).astype(dtype),
        }

    defined, feeds = data(NESTED_LENGTHS), data(NESTED_REBOUND)
    Wi, Ui, Si = param("Wi", 2, 3), param("Ui", 3, 3), param("Si", 2, 3)
    A, U, bo = param("A", 3, 3), param("U", 3, 3), param("bo", 3)
    rnn = sn.create_rnn_op(reverse=outer_reverse)
    with rnn.stepnet():
        x = rnn.add_input(defined["X"], name="X")
        s = rnn.add_static_input(defined["S"], name="S")
        h = rnn.add_memory(init=defined["h"], shape=[3], name="h")
        hp = h.pre_state()
        inner = sn.create_rnn_op(reverse=inner_reverse)
        with inner.stepnet():
            w = inner.add_input(x, name="words")
            hw = inner.add_memory(init=hp, name="hw")
            hw.update(sn.ops.tanh(w @ Wi + hw.pre_state() @ Ui + s @ Si))
            inner.add_outputs(hw, hw)
        last, words = inner(output_all_steps=(False, True))
        h.update(sn.ops.tanh(last @ A + hp @ U + bo))
        if ragged_output:
            rnn.add_outputs(h, words)
            flags = (True, True)
        else:
            rnn.add_outputs(h, last)
            flags = (True, False)
    return rnn, flags, feeds


NESTED_CASES = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize("outer_reverse,inner_reverse", NESTED_CASES)
def test_nested_stepnet_matches_finite_differences(outer_reverse, inner_reverse):
    rnn, flags, feeds = build_nested_net(outer_reverse, inner_reverse)
    wrt = rnn.parameters() + ["X", "S", "h"]
    fd_check(rnn, wrt, flags)
    fd_check(rnn, wrt, flags, feeds, seed=1)


def test_nested_stepnet_with_a_ragged_output_matches_finite_differences():
    rnn, flags, feeds = build_nested_net(ragged_output=True)
    wrt = rnn.parameters() + ["X", "S", "h"]
    fd_check(rnn, wrt, flags, require_dependence=False)
    fd_check(rnn, wrt, flags, feeds, seed=1, require_dependence=False)


@needs_numba
def test_nested_stepnet_numba():
    rnn, flags, feeds = build_nested_net(True, True, seed=1)
    wrt = rnn.parameters() + ["X", "S", "h"]
    fd_check(rnn, wrt, flags, feeds, backends=("interpreter", "numba"))


@needs_numba
@pytest.mark.parametrize("outer_reverse,inner_reverse", NESTED_CASES[:1] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in NESTED_CASES[1:]])
def test_a_nested_nets_every_step_given_out_has_its_gradient_on_numba(outer_reverse, inner_reverse):
    """A ragged output that is a nested net's every step (a word tagger
    over paragraphs): its cotangent is the backward nested net's step input."""
    rnn, flags, feeds = build_nested_net(outer_reverse, inner_reverse, ragged_output=True, seed=4)
    backends_agree(rnn, rnn.parameters() + ["X", "S", "h"], flags, feeds)  # (and directional differences)


@pytest.mark.slow
@needs_numba
@pytest.mark.parametrize("outer_reverse,inner_reverse", NESTED_CASES)
def test_nested_stepnet_numba_all(outer_reverse, inner_reverse):
    rnn, flags, feeds = build_nested_net(outer_reverse, inner_reverse, seed=2)
    wrt = rnn.parameters() + ["X", "S", "h"]
    fd_check(rnn, wrt, flags, feeds, backends=("interpreter", "numba"),
             require_dependence=False)
    rnn, flags, feeds = build_nested_net(outer_reverse, inner_reverse, seed=3, dtype=np.float32)
    backends_agree(rnn, wrt_of(rnn), flags, feeds)


@needs_numba
def test_a_nested_nets_input_product_its_sibling_reads_is_kept_whole():
    """A forward inner product wide enough to be computed by chunks of steps
    (``kernel_plan._chunked_products``) whose values the backward's inner net,
    a sibling in the gradient program, reads: it stays an array of every
    token, not a chunk's ring buffer of the forward's function."""
    rng = np.random.default_rng(4)
    width = 256
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (9, 2)).astype(F32), [[2, 1], [3, 4, 2]])
    Wi = sn.Parameter(rng.uniform(-0.5, 0.5, (2, width)).astype(F32), name="Wi")
    Ui = sn.Parameter(rng.uniform(-0.1, 0.1, (width, width)).astype(F32), name="Ui")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[width], name="h")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            w = inner.add_input(x, name="words")
            hw = inner.add_memory(shape=[width], name="hw")  # (reads nothing of the step)
            # (the product rule: the backward reads w @ Wi itself)
            hw.update(sn.ops.tanh((w @ Wi) * (hw.pre_state() @ Ui) + w @ Wi))
            inner.add_outputs(hw)
        h.update(sn.ops.tanh(inner(output_all_steps=False) + h.pre_state()))
        rnn.add_outputs(h)
    backends_agree(rnn, rnn.parameters() + ["X"], (False,))


def wrt_of(rnn):
    return rnn.parameters() + list(rnn.bindings)


# ---------------------------------------------------------------------------
# 3. random step-nets


def float64_case(draw):
    """A random step-net case forced to float64 (the strategy's dtype draw
    is answered with float64, every other draw goes to Hypothesis)."""
    def draw64(strategy):
        if strategy is stepnet_strategies.float_dtypes:
            return F64
        return draw(strategy)
    return stepnet_strategies.random_stepnet_case(draw64)


def has_one_dimensional_matmul(rnn):
    """A ``matmul`` with a ``[n]`` operand (the strategy's ``x @ v``): its
    gradient is documented as not supported."""
    return any(e.op == "matmul" and any(len(getattr(v, "shape", (0, 0))) == 1
                                        and v.shape[0] is not None for v in e.inputs)
               for e in rnn.block.eqns)


def _random_fd(data):
    case = float64_case(data.draw)
    rnn = case.rnn
    feeds = case.feeds if data.draw(st.booleans(), label="rebound") else {}
    flags = data.draw(st.lists(st.booleans(), min_size=len(case.outputs),
                               max_size=len(case.outputs)), label="output_all_steps")
    flags = tuple(flags)
    note(f"{rnn.ir()}\noutput_all_steps={flags} rebound={bool(feeds)}")
    assume(not has_one_dimensional_matmul(rnn))
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter", **feeds))
    assume(all(np.all(np.isfinite(data_of(o))) for o in outs))
    cotangents = random_cotangents(np.random.default_rng(data.draw(st.integers(0, 2**16))), outs)
    # (a point where the functional has a kink has no gradient for finite
    # differences to check)
    assume(smooth_at(rnn, wrt_of(rnn), cotangents, flags, feeds))
    fd_check(rnn, wrt_of(rnn), flags, feeds, require_dependence=False, cotangents=cotangents)


def _random_backends_agree(data):
    case = stepnet_strategies.random_stepnet_case(data.draw)
    rnn = case.rnn
    feeds = case.feeds if data.draw(st.booleans(), label="rebound") else {}
    flags = tuple(data.draw(st.lists(st.booleans(), min_size=len(case.outputs),
                                     max_size=len(case.outputs)), label="output_all_steps"))
    note(f"{rnn.ir()}\noutput_all_steps={flags} rebound={bool(feeds)}")
    assume(not has_one_dimensional_matmul(rnn))
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter", **feeds))
    assume(all(np.all(np.isfinite(data_of(o))) for o in outs))
    backends_agree(rnn, wrt_of(rnn), flags, feeds, seed=data.draw(st.integers(0, 2**16)),
                   kinks_possible=True)


_MANY = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
_FEW = {**_MANY, "derandomize": True}
# Every numba example compiles new kernels (seconds each): no shrinking there;
# a failure's net is printed (note) and shrinks on the interpreter tests.
_NO_SHRINK = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}

test_random_stepnets_match_finite_differences = settings(max_examples=6, **_FEW)(
    given(st.data())(_random_fd))
test_random_stepnets_match_finite_differences_many = pytest.mark.slow(
    settings(max_examples=80, **_MANY)(given(st.data())(_random_fd)))
test_random_stepnets_numba_agrees = needs_numba(settings(max_examples=1, **_FEW, **_NO_SHRINK)(
    given(st.data())(_random_backends_agree)))
test_random_stepnets_numba_agrees_many = pytest.mark.slow(needs_numba(
    settings(max_examples=40, **_MANY, **_NO_SHRINK)(given(st.data())(_random_backends_agree))))


# ---------------------------------------------------------------------------
# 4. stepnet.nn against PyTorch autograd


TORCH_LENGTHS = [4, 1, 6, 3]


def torch_module(kind, num_layers, bidirectional, dtype, input_size=3, hidden=4, seed=0):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    cls, extra = {"rnn_tanh": ("RNN", {"nonlinearity": "tanh"}),
                  "rnn_relu": ("RNN", {"nonlinearity": "relu"}),
                  "lstm": ("LSTM", {}), "gru": ("GRU", {})}[kind]
    module = getattr(torch.nn, cls)(input_size, hidden, num_layers=num_layers,
                                    bidirectional=bidirectional, **extra)
    return module.to({F32: torch.float32, F64: torch.float64}[np.dtype(dtype)])


def stepnet_layer(kind, module):
    cls = {"rnn_tanh": sn.nn.RNN, "rnn_relu": sn.nn.RNN, "lstm": sn.nn.LSTM,
           "gru": sn.nn.GRU}[kind]
    return cls.from_torch(module)


def torch_reference(module, padded, lengths, states, cotangents):
    """torch.autograd of ``sum(Y * R1) + sum(h_n * R2) (+ sum(c_n * R3))``
    over a PackedSequence of ``padded`` ``[B, T, I]``: the gradients of the
    module's parameters (by name), of the padded input and of each initial
    state."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    dtype = next(module.parameters()).dtype
    module.zero_grad()
    x = torch.tensor(padded, dtype=dtype, requires_grad=True)
    st_ = [torch.tensor(s, dtype=dtype, requires_grad=True) for s in states]
    packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                  enforce_sorted=False)
    out, hidden = module(packed, tuple(st_) if len(st_) == 2 else st_[0])
    Y, _ = pad_packed_sequence(out, batch_first=True, total_length=padded.shape[1])
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)
    loss = (Y * torch.tensor(cotangents[0], dtype=dtype)).sum()
    for h, r in zip(hidden, cotangents[1:]):
        loss = loss + (h * torch.tensor(r, dtype=dtype)).sum()
    loss.backward()
    params = {name: p.grad.numpy().copy() for name, p in module.named_parameters()}
    return params, x.grad.numpy().copy(), [s.grad.numpy().copy() for s in st_]


def as_torch_layout(layer, grads):
    """stepnet's parameter gradients in PyTorch's names and layout.

    ``to_torch`` maps the layer's Parameters to PyTorch's tensors by gate
    reordering and transposition only, so setting each Parameter's value to
    its gradient (for the call) and converting gives the gradients in
    PyTorch's layout exactly."""
    params = layer.parameters()
    saved = [p.value for p in params]
    try:
        for p, g in zip(params, grads):
            assert g.shape == p.value.shape and g.dtype == p.value.dtype, describe(p)
            p.value = g
        module = layer.to_torch()
    finally:
        for p, v in zip(params, saved):
            p.value = v
    return {name: t.detach().numpy().copy() for name, t in module.named_parameters()}


TORCH_TOL = {F64: (1e-10, 1e-12), F32: (1e-4, 2e-5)}  # rtol, atol


def compare_with_torch(kind, num_layers, bidirectional, dtype, padded_input, backend, seed=0):
    dtype = np.dtype(dtype)
    module = torch_module(kind, num_layers, bidirectional, dtype, seed=seed)
    layer = stepnet_layer(kind, module)
    rng = np.random.default_rng(seed)
    D = 2 if bidirectional else 1
    B, T, I, Hs = len(TORCH_LENGTHS), max(TORCH_LENGTHS), 3, 4
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (sum(TORCH_LENGTHS), I)).astype(dtype),
                                  [TORCH_LENGTHS])
    padded, _ = X.to_padded()
    states = [rng.uniform(-1, 1, (num_layers * D, B, Hs)).astype(dtype)
              for _ in range(2 if kind == "lstm" else 1)]
    dY_padded = rng.uniform(-1, 1, (B, T, D * Hs)).astype(dtype)
    dY_rows = sn.LoDTensor.from_padded(dY_padded, TORCH_LENGTHS).data
    dstates = [rng.uniform(-1, 1, s.shape).astype(dtype) for s in states]
    # torch: padding positions of dY multiply zeros, exactly as in stepnet
    t_params, t_dx, t_dstates = torch_reference(module, padded, TORCH_LENGTHS, states,
                                                [dY_padded] + dstates)

    state_names = ["h0", "c0"][:len(states)]
    wrt = layer.parameters() + ["X"] + state_names
    inputs = {"X": (padded, TORCH_LENGTHS) if padded_input else X}
    if kind == "lstm":
        inputs["initial"] = tuple(states)
    else:
        inputs["h0"] = states[0]
    dY = dY_padded if padded_input else dY_rows
    grads = sn.gradients(layer, wrt=wrt, grad_outputs=[dY] + dstates, backend=backend,
                         **inputs)
    assert len(grads) == len(wrt)
    n = len(layer.parameters())
    rtol, atol = TORCH_TOL[dtype]
    got = as_torch_layout(layer, grads[:n])
    assert set(got) == set(t_params)
    for name in t_params:
        np.testing.assert_allclose(got[name], t_params[name], rtol=rtol, atol=atol,
                                   err_msg=f"{kind} {backend}: d/d{name}")
    dX = grads[n]
    if padded_input:
        assert dX.shape == padded.shape
        np.testing.assert_allclose(dX, t_dx, rtol=rtol, atol=atol, err_msg=f"{backend}: dX")
    else:
        assert dX.shape == X.data.shape
        np.testing.assert_allclose(dX, sn.LoDTensor.from_padded(t_dx, TORCH_LENGTHS).data,
                                   rtol=rtol, atol=atol, err_msg=f"{backend}: dX rows")
    for name, g, e in zip(state_names, grads[n + 1:], t_dstates):
        assert g.shape == e.shape, name
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{backend}: d/d{name}")
    return grads


TORCH_KINDS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]
TORCH_GRID = [(kind, layers, bi, dtype, padded)
              for kind in TORCH_KINDS for layers in (1, 2) for bi in (False, True)
              for dtype in (np.float64, np.float32) for padded in (False, True)]


def _torch_id(case):
    kind, layers, bi, dtype, padded = case
    return (f"{kind}-{layers}l-{'bi' if bi else 'fwd'}-{np.dtype(dtype).name}-"
            f"{'padded' if padded else 'lod'}")


@pytest.mark.parametrize("case", TORCH_GRID, ids=_torch_id)
def test_layers_match_torch_autograd_interpreter(case):
    compare_with_torch(*case, backend="interpreter")


TORCH_NUMBA_DEFAULT = [("gru", 1, True, np.float64, False), ("lstm", 1, False, np.float32, True)]


@needs_numba
@pytest.mark.parametrize("case", TORCH_NUMBA_DEFAULT, ids=_torch_id)
def test_layers_match_torch_autograd_numba(case):
    compare_with_torch(*case, backend="numba")


@pytest.mark.slow
@needs_numba
@pytest.mark.parametrize("case", TORCH_GRID, ids=_torch_id)
def test_layers_match_torch_autograd_numba_all(case):
    compare_with_torch(*case, backend="numba")


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("numba", marks=[
    needs_numba, pytest.mark.slow])])
def test_gru_without_linear_before_reset_matches_finite_differences(backend):
    """ONNX's default GRU (PyTorch has none): central differences of the
    layer's outputs."""
    rng = np.random.default_rng(7)
    layer = sn.nn.GRU(2, 3, direction="bidirectional_concat", dtype=np.float64, seed=7)
    lengths = [3, 0, 2]
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (5, 2)), [lengths])
    h0 = rng.uniform(-1, 1, (2, 3, 3))
    Y, h_n = layer(X, h0, backend="interpreter")
    dY, dh = rng.uniform(-1, 1, Y.data.shape), rng.uniform(-1, 1, h_n.shape)

    def loss():
        Y, h_n = layer(sn.LoDTensor(Xd.copy(), X.levels), h0v, backend="interpreter")
        return float(np.sum(Y.data * dY) + np.sum(h_n * dh))

    from gradient_checks import numeric_gradient

    Xd, h0v = X.data.copy(), h0.copy()
    params = layer.parameters()
    expected = [numeric_gradient(loss, p.value) for p in params]
    expected.append(numeric_gradient(loss, Xd))
    expected.append(numeric_gradient(loss, h0v))
    wrt = params + ["X", "h0"]
    grads = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X, h0=h0, backend=backend)
    assert_fd_close(grads, expected, wrt, what=f"GRU {backend}")


def test_mgu_matches_finite_differences():
    """MGU (no PyTorch counterpart): central differences of its outputs with
    respect to its weights, X and h0, two layers both ways."""
    rng = np.random.default_rng(9)
    layer = sn.nn.MGU(2, 3, num_layers=2, direction="bidirectional_concat", dtype=np.float64,
                      seed=9)
    lengths = [3, 0, 2]
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (5, 2)), [lengths])
    h0 = rng.uniform(-1, 1, (4, 3, 3))
    Y, h_n = layer(X, h0, backend="interpreter")
    dY, dh = rng.uniform(-1, 1, Y.data.shape), rng.uniform(-1, 1, h_n.shape)
    Xd, h0v = X.data.copy(), h0.copy()

    def loss():
        Y, h_n = layer(sn.LoDTensor(Xd.copy(), X.levels), h0v, backend="interpreter")
        return float(np.sum(Y.data * dY) + np.sum(h_n * dh))

    from gradient_checks import numeric_gradient

    params = layer.parameters()
    expected = [numeric_gradient(loss, p.value) for p in params]
    expected += [numeric_gradient(loss, Xd), numeric_gradient(loss, h0v)]
    wrt = params + ["X", "h0"]
    grads = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X, h0=h0,
                         backend="interpreter")
    assert_fd_close(grads, expected, wrt, what="MGU")


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("numba", marks=[
    needs_numba, pytest.mark.slow])])
def test_augru_matches_finite_differences(backend):
    """AUGRU (no PyTorch counterpart): central differences of its outputs
    with respect to its weights, X, h0 and the attention scores ([N, 1])."""
    rng = np.random.default_rng(8)
    layer = sn.nn.AUGRU(2, 3, dtype=np.float64, seed=8)
    lengths = [3, 0, 2]
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (5, 2)), [lengths])
    A = sn.LoDTensor.from_lengths(rng.uniform(0, 1, (5, 1)), [lengths])
    h0 = rng.uniform(-1, 1, (1, 3, 3))
    Y, h_n = layer(X, A, h0, backend="interpreter")
    dY, dh = rng.uniform(-1, 1, Y.data.shape), rng.uniform(-1, 1, h_n.shape)
    Xd, Ad, h0v = X.data.copy(), A.data.copy(), h0.copy()

    def loss():
        Y, h_n = layer(sn.LoDTensor(Xd.copy(), X.levels), sn.LoDTensor(Ad.copy(), A.levels),
                       h0v, backend="interpreter")
        return float(np.sum(Y.data * dY) + np.sum(h_n * dh))

    from gradient_checks import numeric_gradient

    params = layer.parameters()
    expected = [numeric_gradient(loss, p.value) for p in params]
    expected += [numeric_gradient(loss, Xd), numeric_gradient(loss, h0v),
                 numeric_gradient(loss, Ad)]
    wrt = params + ["X", "h0", "attention"]
    grads = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X, attention=A, h0=h0,
                         backend=backend)
    assert grads[-1].shape == (5, 1)
    assert_fd_close(grads, expected, wrt, what=f"AUGRU {backend}")


# ---------------------------------------------------------------------------
# 5. the API


def small_net(dtype=np.float64, seed=0):
    # the ops of the default Numba test: their kernels are compiled once
    return build_op_net(NUMBA_SAMPLE, dtype, seed=seed)


def small_case(seed, backend="interpreter", **feeds):
    """``small_net`` with random cotangents for its outputs in a run with
    ``feeds``: ``(rnn, flags, cotangents)``."""
    rnn, flags = small_net()
    outs = as_tuple(rnn(output_all_steps=flags, backend=backend, **feeds))
    return rnn, flags, random_cotangents(np.random.default_rng(seed), outs)


def assert_same_gradients(rnn, flags, wrt, cotangents, other, feeds=None, other_wrt=None):
    """The same gradients, bit for bit, from two ways of asking."""
    first = gradients(rnn, wrt, cotangents, flags, feeds or {}, "interpreter")
    second = gradients(rnn, other_wrt or wrt, other, flags, feeds or {}, "interpreter")
    for a, b, w in zip(first, second, wrt):
        np.testing.assert_array_equal(a, b, err_msg=describe(w))


def test_accumulate_adds_into_the_given_buffers():
    rnn, flags, cots = small_case(0)
    wrt = [rnn.parameters()[0], "X", "h", "S"]
    fresh = gradients(rnn, wrt, cots, flags, {}, "interpreter")
    bufs = [np.zeros_like(g) for g in fresh]
    for _ in range(2):
        got = sn.gradients(rnn, wrt=wrt, grad_outputs=cots, output_all_steps=flags,
                           backend="interpreter", accumulate=True, out=bufs)
        assert all(g is b for g, b in zip(got, bufs)), "accumulate must return the buffers"
    for b, g, w in zip(bufs, fresh, wrt):
        np.testing.assert_allclose(b, 2 * g, rtol=1e-14, atol=1e-15, err_msg=describe(w))
    # fresh arrays by default: a second call does not add to the first result
    again = gradients(rnn, wrt, cots, flags, {}, "interpreter")
    for a, g in zip(again, fresh):
        assert a is not g
        np.testing.assert_array_equal(a, g)


def test_accumulate_starts_from_what_the_buffers_hold():
    rnn, flags, cots = small_case(1)
    P = rnn.parameters()[0]
    (g,) = gradients(rnn, [P], cots, flags, {}, "interpreter")
    buf = np.full_like(g, 0.5)
    sn.gradients(rnn, wrt=[P], grad_outputs=cots, output_all_steps=flags,
                 backend="interpreter", accumulate=True, out=[buf])
    np.testing.assert_allclose(buf, g + 0.5, rtol=1e-14, atol=1e-15)


@needs_numba
def test_accumulate_on_numba():
    rnn, flags, cots = small_case(2, backend="numba")
    wrt = rnn.parameters()[:2]
    fresh = gradients(rnn, wrt, cots, flags, {}, "numba")
    bufs = [np.zeros_like(g) for g in fresh]
    for _ in range(2):
        sn.gradients(rnn, wrt=wrt, grad_outputs=cots, output_all_steps=flags,
                     backend="numba", accumulate=True, out=bufs)
    for b, g in zip(bufs, fresh):
        np.testing.assert_allclose(b, 2 * g, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("backend", ["interpreter"] + (["numba"] if HAS_NUMBA else []))
def test_vjp_pullback_can_be_called_again(backend):
    rnn, flags = small_net()
    feeds = {"X": sn.LoDTensor.from_lengths(
        kink_free(np.random.default_rng(3), (4, H), np.float64), [[1, 3, 0, 0]])}
    outputs, pullback = sn.vjp(rnn, output_all_steps=flags, backend=backend, **feeds)
    assert_close(outputs, rnn(output_all_steps=flags, backend="interpreter", **feeds),
                 what="vjp outputs")
    cots = random_cotangents(np.random.default_rng(4), as_tuple(outputs))
    wrt = rnn.parameters() + ["X", "h", "S"]
    first = pullback(cots, wrt=wrt)
    second = pullback(cots, wrt=wrt)
    expected = gradients(rnn, wrt, cots, flags, feeds, "interpreter")
    for a, b, e, w in zip(first, second, expected, wrt):
        np.testing.assert_array_equal(a, b, err_msg=describe(w))
        assert_close(a, e, what=f"vjp d/d{describe(w)}")
    # other cotangents through the same workspace
    cots2 = [2.0 * c for c in cots]
    for a, b in zip(pullback(cots2, wrt=wrt), first):
        np.testing.assert_allclose(a, 2.0 * b, rtol=1e-12, atol=1e-14)
    # wrt=None: the step-net's parameters
    default = pullback(cots)
    assert len(default) == len(rnn.parameters())
    for a, b in zip(default, first):
        np.testing.assert_array_equal(a, b)


def test_vjp_of_a_layer():
    rng = np.random.default_rng(5)
    layer = sn.nn.GRU(2, 3, num_layers=2, linear_before_reset=True, dtype=np.float64, seed=5)
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (6, 2)), [[4, 0, 2]])
    (Y, h_n), pullback = sn.vjp(layer, X, h0=None, backend="interpreter")
    Y_ref, h_ref = layer(X, backend="interpreter")
    assert_close(Y, Y_ref)
    assert_close(h_n, h_ref)
    dY, dh = rng.uniform(-1, 1, Y.data.shape), rng.uniform(-1, 1, h_n.shape)
    wrt = layer.parameters() + ["X", "h0"]
    first = pullback([dY, dh], wrt=wrt)
    second = pullback([dY, dh], wrt=wrt)
    expected = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X, backend="interpreter")
    for a, b, e in zip(first, second, expected):
        np.testing.assert_array_equal(a, b)
        assert_close(a, e)
    assert first[-1].shape == (2, 3, 3)


@pytest.mark.parametrize("backend", ["interpreter"] + (["numba"] if HAS_NUMBA else []))
def test_keep_workspace_then_gradients_equals_a_fresh_computation(backend):
    rnn, flags = small_net()
    rng = np.random.default_rng(6)
    feeds = {"X": sn.LoDTensor.from_lengths(kink_free(rng, (5, H), np.float64), [[2, 2, 1, 0]]),
             "S": rng.uniform(-1, 1, (4, H)), "h": rng.uniform(-1, 1, (4, H))}
    outputs = rnn(output_all_steps=flags, backend=backend, keep_workspace=True, **feeds)
    assert_close(outputs, rnn(output_all_steps=flags, backend="interpreter", **feeds))
    cots = random_cotangents(rng, as_tuple(outputs))
    wrt = rnn.parameters() + ["X", "h", "S"]
    kept = sn.gradients(rnn, wrt=wrt, grad_outputs=cots, output_all_steps=flags,
                        backend=backend)
    fresh = gradients(rnn, wrt, cots, flags, feeds, backend)
    for a, e, w in zip(kept, fresh, wrt):
        assert a.shape == e.shape, describe(w)
        np.testing.assert_allclose(a, e, rtol=1e-13, atol=1e-15, err_msg=describe(w))


def test_keep_workspace_of_a_layer():
    rng = np.random.default_rng(7)
    layer = sn.nn.LSTM(2, 3, dtype=np.float64, seed=7)
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (5, 2)), [[3, 2]])
    h0, c0 = rng.uniform(-1, 1, (1, 2, 3)), rng.uniform(-1, 1, (1, 2, 3))
    Y, (h_n, c_n) = layer(X, (h0, c0), backend="interpreter", keep_workspace=True)
    cots = [rng.uniform(-1, 1, Y.data.shape), rng.uniform(-1, 1, h_n.shape),
            rng.uniform(-1, 1, c_n.shape)]
    wrt = layer.parameters() + ["X", "h0", "c0"]
    kept = sn.gradients(layer, wrt=wrt, grad_outputs=cots, backend="interpreter")
    fresh = sn.gradients(layer, wrt=wrt, grad_outputs=cots, X=X, initial=(h0, c0),
                         backend="interpreter")
    for a, e in zip(kept, fresh):
        np.testing.assert_allclose(a, e, rtol=1e-13, atol=1e-15)


def test_grad_outputs_of_the_wrong_shape_name_the_output():
    rnn, flags, cots = small_case(8)
    bad = list(cots)
    bad[1] = np.zeros((bad[1].shape[0], bad[1].shape[1] + 1))
    with pytest.raises(sn.ShapeError, match=r"output\W*1|output.*" + rnn.block.outputs[1].name):
        sn.gradients(rnn, wrt=rnn.parameters(), grad_outputs=bad, output_all_steps=flags,
                     backend="interpreter")
    with pytest.raises(sn.StepNetError):
        sn.gradients(rnn, wrt=rnn.parameters(), grad_outputs=cots[:-1],
                     output_all_steps=flags, backend="interpreter")


def test_grad_outputs_none_stands_for_zeros():
    rnn, flags, cots = small_case(9)
    zeros = [cots[0]] + [np.zeros_like(c) for c in cots[1:]]
    nones = [cots[0]] + [None] * (len(cots) - 1)
    assert_same_gradients(rnn, flags, rnn.parameters() + ["X"], nones, zeros)


def test_grad_outputs_accept_a_lod_tensor():
    rnn, flags, cots = small_case(10)
    outs = as_tuple(rnn(output_all_steps=flags, backend="interpreter"))
    as_lod = [sn.LoDTensor(c, o.levels) if isinstance(o, sn.LoDTensor) else c
              for c, o in zip(cots, outs)]
    assert any(isinstance(c, sn.LoDTensor) for c in as_lod)
    assert_same_gradients(rnn, flags, rnn.parameters(), as_lod, cots)


def test_unknown_wrt_is_a_stepnet_error():
    rnn, flags, cots = small_case(11)
    with pytest.raises(sn.StepNetError, match="nope"):
        sn.gradients(rnn, wrt=["nope"], grad_outputs=cots, output_all_steps=flags,
                     backend="interpreter")
    stranger = sn.Parameter(np.zeros(3), name="stranger")
    with pytest.raises(sn.StepNetError):
        sn.gradients(rnn, wrt=[stranger], grad_outputs=cots, output_all_steps=flags,
                     backend="interpreter")


def test_defined_arrays_stand_for_their_names():
    rnn, flags, cots = small_case(12)
    S, h = rnn.bindings["S"].value, rnn.bindings["h"].value
    assert_same_gradients(rnn, flags, ["S", "h"], cots, cots, other_wrt=[S, h])


def test_rebound_arrays_stand_for_their_names():
    """Arrays given in ``**inputs`` are the ones bound in that call."""
    rng = np.random.default_rng(12)
    S, h = rng.uniform(-1, 1, (4, H)), rng.uniform(-1, 1, (4, H))
    rnn, flags, cots = small_case(13, S=S, h=h)
    assert_same_gradients(rnn, flags, ["S", "h"], cots, cots, feeds={"S": S, "h": h},
                          other_wrt=[S, h])


def test_float16_step_net():
    """float16 data are computed in float32 (DESIGN.md §4): the gradients
    are the float32 ones, a float16 Parameter's in float16."""
    rng = np.random.default_rng(13)
    lengths = [3, 0, 2]
    X32 = rng.uniform(-1, 1, (5, 2)).astype(np.float16).astype(np.float32)
    W32 = rng.uniform(-1, 1, (2, 3)).astype(np.float16).astype(np.float32)

    def net(dtype):
        W = sn.Parameter(W32.astype(dtype), name="W")
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            x = rnn.add_input(sn.LoDTensor.from_lengths(X32.astype(dtype), [lengths]), name="X")
            h = rnn.add_memory(shape=[3], name="h")
            h.update(sn.ops.tanh(x @ W + h.pre_state()))
            rnn.add_outputs(h)
        return rnn, W

    rnn16, W16 = net(np.float16)
    rnn32, W32p = net(np.float32)
    dY = rng.uniform(-1, 1, (5, 3)).astype(np.float32)
    g16 = sn.gradients(rnn16, wrt=[W16, "X"], grad_outputs=[dY], backend="interpreter")
    g32 = sn.gradients(rnn32, wrt=[W32p, "X"], grad_outputs=[dY], backend="interpreter")
    assert g16[0].dtype == np.float16 and g16[0].shape == (2, 3)
    assert g16[1].shape == (5, 2)
    for a, e in zip(g16, g32):
        assert_close(a.astype(np.float32), e, np.float16)


def test_float16_input_to_a_layer():
    rng = np.random.default_rng(14)
    layer = sn.nn.GRU(2, 3, dtype=np.float32, seed=14)
    X16 = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (5, 2)).astype(np.float16), [[3, 2]])
    X32 = X16.astype(np.float32)
    dY = rng.uniform(-1, 1, (5, 3)).astype(np.float32)
    dh = rng.uniform(-1, 1, (1, 2, 3)).astype(np.float32)
    wrt = layer.parameters() + ["X"]
    g16 = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X16, backend="interpreter")
    g32 = sn.gradients(layer, wrt=wrt, grad_outputs=[dY, dh], X=X32, backend="interpreter")
    for a, e in zip(g16[:-1], g32[:-1]):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, e)
    assert g16[-1].shape == (5, 2)
    assert_close(g16[-1].astype(np.float32), g32[-1], np.float16)


def _gated_net(rng):
    """W5's cell of benchmarks/workloads.py in float64 (a gate's input
    products and recurrent product summed with its bias; ``0.1 * (x @ P)``),
    and a recurrent product read twice."""
    I, Hd = 3, 4
    X = sn.LoDTensor.from_lengths(rng.uniform(-1, 1, (6, I)), [[3, 1, 2]])
    p = {name: sn.Parameter(rng.uniform(-0.5, 0.5, shape), name=name)
         for name, shape in [("Wz", (I, Hd)), ("Uz", (Hd, Hd)), ("bz", (Hd,)),
                             ("Wr", (I, Hd)), ("Ur", (Hd, Hd)), ("br", (Hd,)),
                             ("Wx", (I, Hd)), ("Wh", (Hd, Hd)), ("b", (Hd,)),
                             ("s", (Hd,)), ("P", (I, Hd)), ("V", (Hd, Hd))]}
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[Hd], name="h")
        hp = h.pre_state()
        z = sn.ops.sigmoid(x @ p["Wz"] + hp @ p["Uz"] + p["bz"])
        r = sn.ops.sigmoid(x @ p["Wr"] + hp @ p["Ur"] + p["br"])
        cand = p["s"] * sn.ops.tanh(x @ p["Wx"] + (r * hp) @ p["Wh"] + p["b"])
        twice = hp @ p["V"]
        h.update((1 - z) * hp + z * cand + 0.1 * (x @ p["P"]) + twice * sn.ops.tanh(twice))
        rnn.add_outputs(h)
    return rnn, X


def test_the_workspace_keeps_the_sums_that_recurrent_products_start():
    """A recurrent product's one use an ``add`` of its shape: the forward
    keeps the sum (a gate's pre-activation), so the backward recomputes no
    input product ``x @ W`` that went into it; a product read twice is kept
    itself. The gradients stay right (finite differences, both backends)."""
    from stepnet import autodiff, ir

    rnn, X = _gated_net(np.random.default_rng(11))
    program = rnn.program(rnn.all_steps_flags(True))
    body = program.eqn.attrs["body"]
    kept = autodiff.kept_values(body)
    made_by = {id(e.outputs[0]): e for e in body.eqns}
    assert kept[0] is body.memories[0].pre
    kinds = sorted(made_by[id(v)].op for v in kept[1:])
    assert kinds == ["add", "add", "add", "matmul"]  # three pre-activations, hp @ V
    backward, _ = autodiff.backward_program(program, (True,))
    weights = {id(c) for c in program.consts if c.name in ("Wz", "Wr", "Wx")}
    assert len(weights) == 3
    recomputed = [e for prog in backward for e in ir.iter_eqns(prog.eqn.attrs["body"])
                  if e.op == "matmul" and id(e.inputs[1]) in weights]
    assert recomputed == []

    rng = np.random.default_rng(12)
    feeds = {"x": X}
    cots = random_cotangents(rng, as_tuple(rnn(backend="interpreter", x=X)))
    wrt = rnn.parameters() + ["x"]
    expected = fd_gradients(rnn, wrt, cots, True, feeds)
    for backend in ["interpreter"] + (["numba"] if HAS_NUMBA else []):
        got = gradients(rnn, wrt, cots, True, feeds, backend)
        assert_fd_close(got, expected, wrt, what=backend)


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_a_memory_named_in_wrt_gets_a_gradient_shaped_like_its_bound_value(backend):
    """docs/gradients.md: a memory's gradient is shaped like the value bound
    to it: ``[num_seq, *shape]`` for a row per sequence, and one value
    shared by every sequence (the default zeros too) gets the sum of their
    rows."""
    rng = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)), [[2, 3]])
    W = sn.Parameter(rng.standard_normal((3, 4)), name="W")
    U = sn.Parameter(rng.standard_normal((4, 4)), name="U")
    h0 = np.full(4, 0.1)
    rnn = named_tanh_net(X, W, U, init=h0)
    G = rng.standard_normal((2, 4))
    kwargs = {"grad_outputs": [G], "output_all_steps": False, "backend": backend}
    shared, = sn.gradients(rnn, wrt=["h"], **kwargs)
    rows, = sn.gradients(rnn, wrt=["h"], h=np.tile(h0, (2, 1)), **kwargs)
    assert shared.shape == (4,) and rows.shape == (2, 4)
    assert_close(shared, rows.sum(0))
    default, = sn.gradients(named_tanh_net(X, W, U, shape=[4]), wrt=["h"], **kwargs)
    zeros, = sn.gradients(rnn, wrt=["h"], h=np.zeros(4), **kwargs)
    assert default.shape == (4,)
    assert_close(default, zeros)


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_a_pullback_is_its_forwards_after_an_optimizer_step(backend):
    """sn.vjp's pullback keeps the weights its forward read: an optimizer
    step in place before (or between) its calls changes nothing it gives."""
    rng = np.random.default_rng(0)
    W = sn.Parameter(rng.normal(0, 0.5, (2, 3)), name="W")
    U = sn.Parameter(rng.normal(0, 0.5, (3, 3)), name="U")
    X = sn.LoDTensor.from_lengths(rng.standard_normal((7, 2)), [[3, 0, 4]])
    rnn = named_tanh_net(X, W, U, shape=[3])
    g = rng.standard_normal((7, 3))
    _, pullback = sn.vjp(rnn, backend=backend, x=X)
    first = pullback([g])
    sn.optim.SGD([W, U], lr=0.5).step(first)
    for got, want in zip(pullback([g]), first):
        assert_close(got, want)


def test_a_kept_workspace_asked_on_another_backend_is_refused_without_inputs():
    """sn.gradients without inputs reads the workspace the last call kept;
    asked for another backend (or other output flags) it raises rather than
    run the forward again on the inputs bound at definition."""
    rng = np.random.default_rng(0)
    X1 = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)), [[2, 3]])
    W = sn.Parameter(rng.standard_normal((3, 4)), name="W")
    rnn = named_tanh_net(X1, W, shape=[4])
    X2 = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)), [[4, 1]])
    rnn(x=X2, output_all_steps=False, keep_workspace=True, backend="numba")
    kwargs = {"wrt": [W], "grad_outputs": [np.ones((2, 4))], "output_all_steps": False}
    with pytest.raises(sn.StepNetError, match="the workspace rnn kept is of backend 'numba'"):
        sn.gradients(rnn, backend="interpreter", **kwargs)
    kept, = sn.gradients(rnn, **kwargs)
    again, = sn.gradients(rnn, backend="interpreter", x=X2, **kwargs)
    assert_close(kept, again)
