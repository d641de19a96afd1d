"""Random step-nets (tests/stepnet_strategies.py) on the interpreter and on
every other backend: finite outputs of the right shape and LoD, per-sequence
semantics (each sequence alone gives the rows it gets in the batch), the IR
checker and printer, and every backend against the interpreter."""

import collections
import copy
import dataclasses
import re

import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close, available_backends
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepnet_strategies import (
    broadcast_features,
    build_random_stepnet,
    random_stepnet_case,
    random_stepnets,
)

import stepnet as sn
from stepnet import ir

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _bound(case, run_feeds):
    """Every named input as it is bound in a run with ``run_feeds``."""
    return {**case.defined, **run_feeds}


def _lengths(values):
    X = values["x0"]
    return np.diff(np.asarray(X.levels[0]))


def _initial_rows(case, values, memory, num_seq):
    """A memory's initial value, one row per sequence."""
    init = np.asarray(values[memory], case.dtype)
    shape = case.memory_shapes[memory]
    if init.shape == (num_seq,) + shape and memory in case.per_sequence:
        return init
    return np.broadcast_to(init, (num_seq,) + shape)


def _runs(case):
    """(name, feeds) of the two runs of a case: as defined, and rebound."""
    return [("defined", {}), ("rebound", case.feeds)]


# ----------------------------------------------------------------------------
# (a) the interpreter: finite outputs, shapes, LoD, last steps


@SETTINGS
@given(st.data())
def test_interpreter_outputs_are_finite_with_the_right_shapes_and_lod(data):
    case = random_stepnet_case(data.draw)
    for run, feeds in _runs(case):
        values = _bound(case, feeds)
        lengths = _lengths(values)
        num_seq, rows = len(lengths), int(lengths.sum())
        offsets = [0] + np.cumsum(lengths).tolist()

        all_steps = _as_tuple(case.rnn(backend="interpreter", **feeds))
        last = _as_tuple(case.rnn(output_all_steps=False, backend="interpreter", **feeds))
        assert len(all_steps) == len(last) == len(case.outputs), run
        for i, (shape, dtype, memory) in enumerate(case.outputs):
            what = f"{run} output {i}"
            full, final = all_steps[i], last[i]
            assert isinstance(full, sn.LoDTensor), what
            assert full.lod == [offsets], f"{what}: LoD {full.lod}, X has {[offsets]}"
            assert full.data.shape == (rows,) + shape, what
            assert full.data.dtype == dtype, what
            assert isinstance(final, np.ndarray) and not isinstance(final, sn.LoDTensor), what
            assert final.shape == (num_seq,) + shape, what
            assert final.dtype == dtype, what
            assert np.all(np.isfinite(full.data.astype(np.float64))), what
            assert np.all(np.isfinite(final.astype(np.float64))), what

            # Each sequence's last step: the last one processed (position 0
            # when reversed), the same row the all-steps output holds.
            for s, n in enumerate(lengths):
                if n:
                    row = offsets[s] if case.reverse else offsets[s] + n - 1
                    np.testing.assert_array_equal(final[s], full.data[row], err_msg=what)
                elif memory is None:
                    assert not np.any(final[s]), f"{what}: empty sequence {s} is not zero"
                else:
                    init = _initial_rows(case, values, memory, num_seq)
                    np.testing.assert_array_equal(
                        final[s], init[s].astype(dtype),
                        err_msg=f"{what}: empty sequence {s} does not keep its own init",
                    )


def _single_sequence_feeds(case, values, s):
    """Feeds that run sequence ``s`` of the batch on its own."""
    feeds = {}
    for name in case.per_sequence:
        v = values[name]
        if isinstance(v, sn.LoDTensor):
            rows = v.sequence(s)
            feeds[name] = sn.LoDTensor.from_lengths(rows, [[len(rows)]])
        else:
            feeds[name] = v[s:s + 1]
    for name in case.memory_shapes:  # broadcast inits: as bound
        feeds.setdefault(name, values[name])
    return feeds


@SETTINGS
@given(st.data())
def test_each_sequence_alone_gives_the_rows_it_gets_in_the_batch(data):
    case = random_stepnet_case(data.draw)
    values = _bound(case, case.feeds)
    lengths = _lengths(values)
    offsets = [0] + np.cumsum(lengths).tolist()
    batch_all = _as_tuple(case.rnn(backend="interpreter", **case.feeds))
    batch_last = _as_tuple(case.rnn(output_all_steps=False, backend="interpreter",
                                         **case.feeds))
    for s, n in enumerate(lengths):
        if not n:
            continue
        feeds = _single_sequence_feeds(case, values, s)
        alone_all = _as_tuple(case.rnn(backend="interpreter", **feeds))
        alone_last = _as_tuple(case.rnn(output_all_steps=False, backend="interpreter", **feeds))
        for i in range(len(case.outputs)):
            what = f"sequence {s} output {i}"
            assert alone_all[i].lod == [[0, int(n)]], what
            assert_close(alone_all[i].data, batch_all[i].data[offsets[s]:offsets[s + 1]],
                         what=what)
            assert_close(alone_last[i], batch_last[i][s:s + 1], what=what)


# ----------------------------------------------------------------------------
# (b) every backend against the interpreter


def _check_backends_agree_with_the_interpreter(net, backends=None):
    rnn, feeds = net
    before = copy.deepcopy(feeds)
    for run_feeds in ({}, feeds):
        for all_steps in (True, False):
            expected = assert_backends_agree(rnn, output_all_steps=all_steps, backends=backends,
                                             **run_feeds)
            # The interpreter is deterministic and every backend is reached
            # through compile() as well, rebinding without re-tracing.
            again = rnn(output_all_steps=all_steps, backend="interpreter", **run_feeds)
            assert_close(again, expected, what="interpreter run twice")
            for backend in ["interpreter"] + available_backends():
                compiled = rnn.compile(backend)
                assert_close(compiled(output_all_steps=all_steps, **run_feeds), expected,
                             what=f"{backend} compiled vs interpreter")
    # Running never writes into the caller's arrays.
    for name, value in before.items():
        new = feeds[name]
        if isinstance(value, sn.LoDTensor):
            assert new.lod == value.lod
            new, value = new.data, value.data
        np.testing.assert_array_equal(new, value, err_msg=f"feed {name} was modified")


# Each example compiles a new kernel (a few seconds, in a warm cache too: the
# draws differ from run to run), so the default run draws a few and the slow
# run many. The default run leaves out the CUDA
# simulator (about 0.7 s a call on these nets; test_cuda_backend.py runs a few
# random step-nets on it); the slow run has it for every small run.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_stepnets())
def test_backends_agree_with_the_interpreter(net):
    _check_backends_agree_with_the_interpreter(net, backends=available_backends())


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_stepnets())
def test_backends_agree_with_the_interpreter_many(net):
    _check_backends_agree_with_the_interpreter(net)


def test_build_random_stepnet_works_with_a_plain_draw():
    @settings(max_examples=5, deadline=None)
    @given(st.data())
    def check(data):
        rnn, feeds = build_random_stepnet(data.draw)
        assert isinstance(rnn, sn.RNNOp)
        assert feeds and all(isinstance(k, str) for k in feeds)
        assert any(isinstance(v, sn.LoDTensor) for v in feeds.values())
        rnn(backend="interpreter", **feeds)  # (the backends: the test above)

    check()


# ----------------------------------------------------------------------------
# (c) the IR: check() and the printed form

_EQN_LINE = re.compile(r"^\s*(?:\S+:\S+ )*\S+:\S+ = (\w+)[\[ ]")


def _printed_ops(text):
    return [m.group(1) for line in text.splitlines() if (m := _EQN_LINE.match(line))]


@SETTINGS
@given(st.data())
def test_ir_checks_and_prints_one_line_per_op(data):
    case = random_stepnet_case(data.draw)
    rnn = case.rnn
    for all_steps in (True, False):
        program = rnn.program(all_steps)
        ir.check(program)
        assert program.eqn.attrs["all_steps"] == (all_steps,) * len(case.outputs)

    text = str(rnn)
    printed = _printed_ops(text)
    body = rnn.program(True).eqn.attrs["body"]
    assert printed.count("rnn") == 1, text
    assert collections.Counter(printed) - collections.Counter(["rnn"]) == \
        collections.Counter(eqn.op for eqn in body.eqns), text
    # Every primitive the generator called is there (composites add more).
    assert not collections.Counter(case.traced_ops) - collections.Counter(printed), text
    # Each value is defined on exactly one line.
    for eqn in body.eqns:
        defs = [line for line in text.splitlines()
                if line.strip().startswith(f"{eqn.outputs[0].name}:")]
        assert len(defs) == 1, (eqn.outputs[0].name, text)
    for memory in body.memories:
        assert f"memory {memory.name}: pre {memory.pre!r}" in text


@SETTINGS
@given(st.data())
def test_ir_check_rejects_a_program_missing_an_equation(data):
    case = random_stepnet_case(data.draw)
    program = case.rnn.program(True)
    body = program.eqn.attrs["body"]
    needed = {id(v) for v in body.outputs} | {id(m.post) for m in body.memories}
    victims = [i for i, eqn in enumerate(body.eqns) if id(eqn.outputs[0]) in needed]
    if not victims:  # every output is a step or static input
        return
    i = data.draw(st.sampled_from(victims))
    broken_body = dataclasses.replace(body, eqns=body.eqns[:i] + body.eqns[i + 1:])
    attrs = dict(program.eqn.attrs, body=broken_body)
    broken = dataclasses.replace(program, eqn=dataclasses.replace(program.eqn, attrs=attrs))
    with pytest.raises(sn.StepNetError, match="IR check"):
        ir.check(broken)


# ----------------------------------------------------------------------------
# the strategy's own helpers


def test_broadcast_features():
    assert broadcast_features((3,), (3,)) == (3,)
    assert broadcast_features((1,), (4,)) == (4,)
    assert broadcast_features((4,), (1,)) == (4,)
    assert broadcast_features((), ()) == ()
    assert broadcast_features((), (4,)) is None
    assert broadcast_features((2,), (3,)) is None


# ----------------------------------------------------------------------------
# minimal reproductions of bugs found here (fixed ones stay as regression tests)


def _memory_net(X, init, reverse=False, **memory_kw):
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(init=init, name="h", **memory_kw)
        h.update(sn.ops.tanh(x + h.pre_state()))
        rnn.add_outputs(h)
    return rnn


def test_empty_sequence_keeps_its_own_initial_memory():
    # Sequence 0 is empty, sequence 1 is longer, so sorting swaps them.
    X = sn.LoDTensor.from_lengths(np.ones((2, 2), np.float32), [[0, 2]])
    init = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    for backend in ["interpreter"] + available_backends():
        last = _memory_net(X, init, shape=[2])(output_all_steps=False, backend=backend)
        np.testing.assert_array_equal(last[0], init[0], err_msg=backend)  # was [3, 4]


def test_python_scalar_memory_init_keeps_the_step_dtype():
    X = sn.LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
    for backend in ["interpreter"] + available_backends():
        out = _memory_net(X, 0.5, shape=[2])(backend=backend)
        assert out.data.dtype == np.float32, backend  # was float64


def test_numpy_scalar_memory_init_keeps_the_step_dtype():
    X = sn.LoDTensor.from_lengths(np.ones((3, 2), np.float32), [[1, 2]])
    out = _memory_net(X, np.float32(0.5), shape=[2])()
    assert out.data.dtype == np.float32
    expected = np.tanh(1 + np.float32(0.5))
    np.testing.assert_allclose(out.data[0], [expected, expected], rtol=1e-6)


def test_pre_state_output_agrees_on_every_backend():
    X = sn.LoDTensor.from_lengths(np.array([[1.0], [2.0], [3.0]]), [[3]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[1], name="h")
        h.update(h.pre_state() + x)
        rnn.add_outputs(h.pre_state())
    expected = assert_backends_agree(rnn)  # numba gave [1, 3, 6] before c01d20f
    np.testing.assert_array_equal(expected.data.ravel(), [0.0, 1.0, 3.0])


@SETTINGS
@given(st.data())
def test_random_stepnets_include_pre_state_outputs_only_when_asked(data):
    for asked in (False, True):
        case = random_stepnet_case(data.draw, pre_state_outputs=asked)
        body = case.rnn.block
        pres = {id(m.pre) for m in body.memories}
        if not asked:
            assert not any(id(v) in pres for v in body.outputs)
        assert all(dtype.kind == "f" for _, dtype, _ in case.outputs)
