"""The schedule executor (stepnet/executor.py), the first tier while a new
kernel compiles: against the interpreter on the random step-nets, the
layers' forward and backward programs, uneven and empty sequences, reverse
nets, per-sequence statics and memories, NaN and inf; on one thread and in
sequence groups on two; its elementwise runs on its compiled loop and op by
op."""

import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close
from hypothesis import HealthCheck, given, settings
from stepnet_strategies import random_stepnets
from nets import attention_prior, document_attention, word_attention, zero_width_net

import stepnet as sn
from stepnet import executor, executor_loop, executor_program, interpreter
from stepnet.jit import loading, numba_cpu

def _both(rnn, all_steps=True, **feeds):
    """The executor's outputs (one worker, then two; then one worker with
    the time loop in Python, step by step) and the interpreter's, for
    ``rnn`` called with ``feeds``; None where the executor does not run the
    program."""
    program = rnn.program(rnn.all_steps_flags(all_steps))
    run = executor.compile_program(program)
    if run is None:
        assert executor.why_not(program)
        return None
    args, consts = rnn.bind(**feeds), rnn.const_values()
    expected = interpreter.compile_program(program)(args, consts)
    found = [run(args, consts, workers=w) for w in (1, 2)]
    assert run.how == ("one call" if run.why_apart is None else f"step by step: {run.why_apart}")
    run.why_apart = "asked to run step by step"
    found.append(run(args, consts))
    assert run.how == "step by step: asked to run step by step"
    return found, expected


def _agree(rnn, all_steps=True, what="output", **feeds):
    found = _both(rnn, all_steps, **feeds)
    assert found is not None, executor.why_not(rnn.program(rnn.all_steps_flags(all_steps)))
    (one, two, by_steps), expected = found
    assert_close(one, expected, what=f"{what}, one worker")
    assert_close(two, expected, what=f"{what}, two workers")
    assert_close(by_steps, expected, what=f"{what}, step by step")
    return one


@pytest.fixture(scope="module", autouse=True)
def _loops():
    """The executor's loops compiled here (the tests' STEPNET_TIERED=0)."""
    assert not loading.tiered()
    for dtype in (np.float32, np.float64):
        assert executor_loop.loop(np.dtype(dtype)) is not None


def test_products_with_no_terms_or_no_columns_agree_with_the_interpreter():
    rnn, _ = zero_width_net(np.random.default_rng(4), [20] * 40 + [60])
    program = rnn.program(rnn.all_steps_flags(True))
    run = executor.compile_program(program)
    args, consts = rnn.bind(), rnn.const_values()
    expected = interpreter.compile_program(program)(args, consts)
    for workers in (1, 2):
        assert_close(run(args, consts, workers=workers), expected)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_stepnets())
def test_random_stepnets_agree_with_the_interpreter(net):
    rnn, feeds = net
    for run_feeds in ({}, feeds):
        for all_steps in (True, False):
            found = _both(rnn, all_steps, **run_feeds)
            if found is None:  # (a form it leaves to the interpreter: why_not says so)
                continue
            found, expected = found
            for got, how in zip(found, ("one worker", "two workers", "step by step")):
                assert_close(got, expected, what=f"executor, {how}")


def _gated(X, H, rng, reverse=False, dtype=np.float32, static=None):
    """A gated cell (W5's kind): two sigmoid gates and a tanh candidate."""
    I = X.data.shape[1]

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)

    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[H], name="h", init=np.zeros(H, dtype))
        z = sn.ops.sigmoid(sn.ops.matmul(x, w(I, H)) + sn.ops.matmul(h.pre_state(), w(H, H)) + 0.1)
        r = sn.ops.sigmoid(sn.ops.matmul(x, w(I, H)) + sn.ops.matmul(h.pre_state(), w(H, H)))
        n = sn.ops.tanh(sn.ops.matmul(x, w(I, H)) + sn.ops.matmul(r * h.pre_state(), w(H, H)))
        if static is not None:
            n = n + rnn.add_static_input(static, name="s")
        h.update((1.0 - z) * h.pre_state() + z * n * 0.5)
        rnn.add_outputs(h)
    return rnn


@pytest.mark.parametrize("reverse", [False, True])
def test_a_gated_cell_over_uneven_and_empty_sequences(rng, reverse, monkeypatch):
    """Its elementwise runs on the loop (no op of theirs on NumPy)."""
    on_numpy = []
    evaluate = executor._eval
    monkeypatch.setattr(executor, "_eval", lambda e, env: on_numpy.append(e.op) or evaluate(e, env))
    lengths = [5, 0, 9, 1, 9, 3, 7, 2]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 6)).astype(np.float32),
                                  [lengths])
    static = rng.standard_normal((len(lengths), 8)).astype(np.float32)
    rnn = _gated(X, 8, rng, reverse=reverse, static=static)
    assert executor.compile_program(rnn.program(rnn.all_steps_flags(True))).why_apart is None
    _agree(rnn, all_steps=True, x=X)
    _agree(rnn, all_steps=False, x=X)
    assert not {"sigmoid", "tanh", "mul", "sub"} & set(on_numpy), on_numpy


@pytest.mark.parametrize("chunk_rows", [4, 16])
def test_hoisted_stages_by_chunks_of_steps(rng, chunk_rows, monkeypatch):
    """The hoisted stages computed a chunk of steps at a time into buffers
    of one chunk's rows, reused by every chunk: one step a chunk, and two
    (rows leaving the chunks as sequences end), forward and reverse."""
    monkeypatch.setattr(executor_program, "CHUNK_ROWS", chunk_rows)
    lengths = [9, 3, 0, 7, 9, 1, 5, 8]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 5)).astype(np.float32),
                                  [lengths])
    for reverse in (False, True):
        rnn = _gated(X, 6, rng, reverse=reverse)
        assert executor.compile_program(rnn.program(rnn.all_steps_flags(True))).whole
        _agree(rnn, all_steps=True, x=X)




@pytest.mark.parametrize("lengths", [[40], [9, 3, 0, 7, 9, 1, 5, 8]], ids=["one", "uneven"])
def test_a_lone_groups_hoisted_product_computed_a_chunk_ahead_on_the_helper(rng, lengths,
                                                                            monkeypatch):
    """A lone group's hoisted product, each chunk's posted to the helper a
    chunk ahead into the other half of its buffers (its left rows, the
    caller's, copied together first): the helper runs the jobs (or they are
    taken back), and the results are the interpreter's, forward and reverse."""
    from stepnet.jit import plan, threads

    if not threads.SPINS or threads.count() < 2:
        pytest.skip("no helper thread: one thread only")
    monkeypatch.setattr(executor_program, "CHUNK_ROWS", 8)
    monkeypatch.setattr(plan, "shares", lambda *a, **k: True)
    # (its per-step products not cut with the helper, which would keep the
    # chunks ahead off it: the kernels' ahead_posts)
    shares = threads.BOARD[threads.SHARES]
    threads.BOARD[threads.SHARES] = threads.EVERY & ~threads.COLUMNS
    try:
        _chunks_ahead(rng, lengths)
    finally:
        threads.BOARD[threads.SHARES] = shares


def _chunks_ahead(rng, lengths):
    from stepnet.jit import threads

    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 5)).astype(np.float32),
                                  [lengths])
    for reverse in (False, True):
        rnn = _gated(X, 6, rng, reverse=reverse)
        program = rnn.program(rnn.all_steps_flags(True))
        run = executor.compile_program(program)
        args, consts = rnn.bind(x=X), rnn.const_values()
        expected = interpreter.compile_program(program)(args, consts)
        # (a job is posted where the helper is awake: it may go to sleep
        # before a call's loop starts, a first call's most of all)
        for _ in range(10):
            jobs = threads.BOARD[threads.JOBS] + threads.BOARD[threads.TAKEN_BACK]
            assert_close(run(args, consts, workers=2), expected)
            if threads.BOARD[threads.JOBS] + threads.BOARD[threads.TAKEN_BACK] > jobs:
                break
        else:
            raise AssertionError("no chunk's product was posted to the helper in 10 calls")


def test_a_groups_loop_runs_again_pointed_at_a_later_calls_arrays(rng):
    """A later call of as many sequences runs the loop an earlier one built
    (Steps.of), its table pointed at the new call's inputs, constants,
    outputs and states; a call of other lengths builds its own; a constant
    the loop would read as a copy (rows apart) is never kept."""
    H, lengths = 6, [5, 3, 8]

    def inputs(lengths):
        data = rng.standard_normal((sum(lengths), 4)).astype(np.float32)
        return sn.LoDTensor.from_lengths(data, [lengths])

    X = inputs(lengths)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[H], name="h", init=np.zeros(H, np.float32))
        bias = rng.standard_normal(H).astype(np.float32)
        h.update(sn.ops.tanh(sn.ops.matmul(x, rng.standard_normal((4, H)).astype(np.float32))
                             + sn.ops.matmul(h.pre_state(), np.eye(H, dtype=np.float32) * 0.5)
                             + bias) * 0.9)
        rnn.add_outputs(h)
    program = rnn.program(rnn.all_steps_flags(True))
    run, expect = executor.compile_program(program), interpreter.compile_program(program)

    def new_consts(apart=False):
        consts = {v: rng.standard_normal(a.shape).astype(a.dtype) for v, a in
                  rnn.const_values().items()}
        if apart:  # (the bias's values every other one of an array)
            consts = {v: np.repeat(a, 2)[::2] if a.ndim == 1 else a for v, a in consts.items()}
        return consts

    found = []
    for feed, consts in [(X, new_consts()), (inputs(lengths), new_consts()),
                         (inputs([9, 1, 2]), new_consts()), (inputs([9, 1, 2]), new_consts(True)),
                         (inputs([9, 1, 2]), new_consts(True))]:
        args = rnn.bind(x=feed)
        assert_close(run(args, consts, workers=1), expect(args, consts))
        assert run.how == "one call"
        found.append((run.kept_steps.get(3) or [None])[-1])
    first, again, other, apart, _ = found
    assert first is not None and again is first  # (built once, pointed at the second call's)
    assert other is not None and other is not first  # (other lengths: other tokens' rows)
    assert apart is None and found[4] is None  # (a copy of a constant: built at each call)
    # calls of ever new numbers of sequences keep the loops of a few of them
    consts = new_consts()
    for count in range(1, 2 * executor_program.KEPT_SIZES + 2):
        args = rnn.bind(x=inputs([3] * count))
        assert_close(run(args, consts, workers=1), expect(args, consts))
        assert count in run.kept_steps and len(run.kept_steps) <= executor_program.KEPT_SIZES


def test_a_loop_reading_values_of_one_buffer_is_not_kept(rng):
    """A constant whose values lie inside a step input's (views of one
    buffer): the loop that read them is not kept (a later call's input is
    an array of its own), and a later call gives the interpreter's results."""
    H, lengths = 4, [6, 4]
    buffer = rng.standard_normal(40).astype(np.float32)
    X = sn.LoDTensor.from_lengths(buffer.reshape(10, 4), [lengths])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[H], name="h")
        bias = buffer[3:3 + H]  # (inside the input's rows)
        h.update(sn.ops.tanh(sn.ops.matmul(x, np.eye(4, H, dtype=np.float32)) + h.pre_state()
                             * 0.5 + bias))
        rnn.add_outputs(h)
    program = rnn.program(rnn.all_steps_flags(True))
    run, expect = executor.compile_program(program), interpreter.compile_program(program)
    consts = rnn.const_values()
    assert any(np.shares_memory(a, buffer) for a in consts.values())
    for feed in (X, sn.LoDTensor.from_lengths(rng.standard_normal((10, 4)).astype(np.float32),
                                              [lengths])):
        args = rnn.bind(x=feed)
        assert_close(run(args, consts, workers=1), expect(args, consts))
        assert run.how == "one call"
        if feed is X:
            assert not run.kept_steps.get(2)


def test_groups_of_as_many_sequences_each_run_a_loop_kept_for_them(rng, monkeypatch):
    """Two groups of two sequences at once: each takes a loop kept by the
    last call (neither builds one), and the results agree."""
    from stepnet.jit import threads

    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 0)
    # (the groups one after the other, each keeping its loop only after both
    # ran: as two groups running at once, whatever the threads' timing)
    keep, run_each = executor_program.Steps.keep, threads.run_each

    def at_once(fn, items):
        later = []
        monkeypatch.setattr(executor_program.Steps, "keep",
                            lambda steps, ex: later.append((steps, ex)))
        try:
            return run_each(fn, items)
        finally:
            monkeypatch.setattr(executor_program.Steps, "keep", keep)
            for steps, ex in later:
                keep(steps, ex)
    monkeypatch.setattr(threads, "run_each", at_once)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((20, 3)).astype(np.float32), [[6, 4, 5, 5]])
    rnn = _gated(X, 5, rng)
    program = rnn.program(rnn.all_steps_flags(True))
    run, expect = executor.compile_program(program), interpreter.compile_program(program)
    args, consts = rnn.bind(x=X), rnn.const_values()
    kept = []
    for _ in range(3):
        assert_close(run(args, consts, workers=2), expect(args, consts))
        kept.append({id(steps) for steps in run.kept_steps[2]})
    assert len(kept[0]) == 2 and kept[0] == kept[1] == kept[2]


def test_the_groups_take_big_runs(rng, monkeypatch):
    """Over enough work (threads.SPLIT_MIN_WORK) and with two workers, the
    sequences run in two groups on two threads; the results agree."""
    from stepnet.jit import threads

    groups = []
    run_each = threads.run_each
    monkeypatch.setattr(threads, "run_each",
                        lambda fn, items: groups.append(len(list(items))) or run_each(fn, items))
    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 0)
    lengths = [4, 6, 2, 5, 5]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 3)).astype(np.float64),
                                  [lengths])
    rnn = _gated(X, 5, rng, dtype=np.float64)
    _agree(rnn, x=X)
    assert groups == [1, 2, 1]  # (one worker, two, then one step by step)


@pytest.mark.parametrize("cell", ["GRU", "LSTM", "RNN"])
def test_the_layers_forward_and_backward_programs(rng, cell, monkeypatch):
    """A layer's forward and its gradients with a tier that never gets its
    kernel: every program the executor runs answers from it, to the
    interpreter's results; the forward and the backward both ran on it."""
    ran = _first_tier_only(monkeypatch)
    layer = getattr(sn.nn, cell)(5, 7)
    lengths = [4, 2, 6]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 5)).astype(np.float32),
                                  [lengths])
    with sn.config(tiered=True):
        (Y, h, *_), pullback = layer.vjp(X, backend="numba")
        forward_runs = len(ran)
        dY = rng.standard_normal(Y.data.shape).astype(np.float32)
        none = [None] * len(layer.state_widths())
        grads = pullback([dY, *none], wrt=list(layer.parameters()) + ["X"])
    (Y_ref, h_ref, *_), pullback_ref = layer.vjp(X, backend="interpreter")
    want = pullback_ref([dY, *none], wrt=list(layer.parameters()) + ["X"])
    assert_close(Y, Y_ref, what=f"{cell} Y")
    assert_close(h, h_ref, what=f"{cell} h")
    assert_close(list(grads), list(want), what=f"{cell} gradients")
    assert forward_runs >= 1 and len(ran) > forward_runs, "the backward did not run on the executor"


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_a_layers_later_calls_run_the_loop_its_first_built(rng, cell, monkeypatch):
    """A layer on the first tier, called again with new inputs of the same
    lengths: its later calls run the loop the first call built (its gates'
    weights, views of one array, read through their joined copy)."""
    _first_tier_only(monkeypatch)
    builds = []
    build = executor_program.Steps._build
    monkeypatch.setattr(executor_program.Steps, "_build",
                        lambda self, *a: builds.append(1) or build(self, *a))
    layer, lengths = getattr(sn.nn, cell)(5, 7), [4, 2, 6]
    found = []
    with sn.config(tiered=True):
        for _ in range(3):
            X = sn.LoDTensor.from_lengths(
                rng.standard_normal((sum(lengths), 5)).astype(np.float32), [lengths])
            assert_close(layer(X, backend="numba")[0], layer(X, backend="interpreter")[0])
            found.append(len(builds))
    assert found[0] >= 1 and found[2] == found[0], found


def _first_tier_only(monkeypatch):
    """Tiered calls whose kernels never load (a compile worker that never
    answers, none taken from the disk cache, where another test put it, and
    none ready where a test before compiled it in this process): the list of
    the programs the executor then runs."""
    ran = []
    call = executor.Executor.__call__

    def counted(self, args, consts, workers=1):
        ran.append(self.program)
        return call(self, args, consts, workers)

    class Silent:
        def submit(self, *args, **kwargs):
            pass

        def send(self, *args, **kwargs):
            pass

    monkeypatch.setattr(executor.Executor, "__call__", counted)
    monkeypatch.setattr(loading, "compile_worker", lambda: Silent())
    monkeypatch.setattr(numba_cpu.NumbaProgram, "compiled_before", lambda self: False)
    monkeypatch.setattr(numba_cpu.NumbaProgram, "ready", property(lambda self: False))
    monkeypatch.setenv("STEPNET_TIERED", "1")
    return ran


def test_a_nested_nets_gradients(rng, monkeypatch):
    """A nested net's forward and backward answered on the first tier, to
    the interpreter's results, both on the executor: the forward (its
    workspace too) and the backward, whose outer step gives the gradient of
    its paragraph's words (a ragged output) from its nested net's every step."""
    ran = _first_tier_only(monkeypatch)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((23, 3)).astype(np.float64),
                                  [[2, 0, 3, 1, 1], [2, 3, 0, 4, 5, 1, 8]])
    rnn = _nested(X, rng, np.float64)
    dc = rng.standard_normal((7, 5))
    dp = rng.standard_normal((7, 5))
    with sn.config(tiered=True):
        (c, p), pullback = sn.vjp(rnn, x=X, backend="numba")
        forward_runs = len(ran)
        found = pullback([dc, dp], wrt=["x"])
    (c_ref, p_ref), pullback_ref = sn.vjp(rnn, x=X, backend="interpreter")
    assert_close([c, p], [c_ref, p_ref], what="outputs")
    assert_close(found, pullback_ref([dc, dp], wrt=["x"]), what="dx")
    assert forward_runs == 2, ran  # (the forward and its nested net)
    assert len(ran) > forward_runs and any(
        p.eqn.attrs["name"].endswith("_grad") for p in ran[forward_runs:]), ran


def test_nan_and_inf_as_on_the_interpreter(rng):
    """NaN and inf where the interpreter has them, the other values close."""
    lengths = [3, 4]
    data = rng.standard_normal((7, 4)).astype(np.float32)
    data[1, 2], data[5, 0], data[6, 3] = np.nan, np.inf, -np.inf
    X = sn.LoDTensor.from_lengths(data, [lengths])
    rnn = _gated(X, 4, rng)
    outputs, expected = _both(rnn, x=X)
    want = expected[0].data
    assert np.isnan(want).any()
    for got in outputs:
        got = got[0].data
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        assert_close(got[finite], want[finite], what="the finite values")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_op_on_special_values_as_on_the_interpreter(dtype):
    """Every elementwise op on NaN, infinities, 0.0 and -0.0, extremes and
    subnormals, in the loop and step by step (tests/test_numerics.py's net)."""
    from test_numerics import NUMBA_OPS, SPECIALS, every_op_net, feeds, pairs, specials_mismatch

    feed = feeds(*pairs(SPECIALS), dtype)
    rnn, labels = every_op_net(feed["x"], feed["y"], NUMBA_OPS)
    with np.errstate(all="ignore"):
        found, expected = _both(rnn, **feed)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for how, outputs in zip(["one worker", "two workers", "step by step"], found):
        wrong = [f"{label}: {why}" for label, a, e in zip(labels, outputs, expected)
                 if (why := specials_mismatch(a, e, tol))]
        assert not wrong, f"{how}:\n" + "\n".join(wrong)


def test_an_op_the_loop_does_not_compute_runs_op_by_op(rng):
    """A run with a comparison and a ``where`` (not in the loop's table)
    runs op by op on NumPy, to the interpreter's results."""
    lengths = [3, 5]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((8, 4)).astype(np.float32), [lengths])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h")
        h.update(sn.ops.where(sn.ops.greater(x, h.pre_state()), x, 0.5 * h.pre_state()))
        rnn.add_outputs(h)
    program = rnn.program(rnn.all_steps_flags(True))
    run = executor.compile_program(program)
    assert run is not None and not any(run.runs.values())
    assert run.why_apart == "its step's values are not of one float dtype"  # (a bool mask)
    _agree(rnn, x=X)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swapped_states_concats_and_products_of_products_in_one_call(rng, dtype):
    """The time loop in one call where memories swap their states (each
    new value another's state: copied aside first), a step concatenates
    values by columns, and a product's left operand is a column block of a
    merged product (its rows apart: copied together first, but for the
    last steps' one row, read where it is)."""
    lengths = [3, 6, 0, 1, 8]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((18, 4)).astype(dtype), [lengths])

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)

    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        a = rnn.add_memory(shape=[4], name="a", init=np.full(4, 0.5, dtype))
        b = rnn.add_memory(shape=[4], name="b")
        h = rnn.add_memory(shape=[5], name="h")
        a.update(b.pre_state() + x)
        b.update(a.pre_state())
        p = sn.ops.matmul(h.pre_state(), w(5, 6))
        q = sn.ops.matmul(h.pre_state(), w(5, 5))
        both = sn.ops.concat([a.pre_state(), x], axis=1)
        h.update(sn.ops.tanh(sn.ops.matmul(p, w(6, 5)) + q + sn.ops.matmul(both, w(8, 5))))
        rnn.add_outputs(h, b)
    run = executor.compile_program(rnn.program(rnn.all_steps_flags(True)))
    assert run.why_apart is None
    _agree(rnn, x=X)
    _agree(rnn, all_steps=False, x=X)


@pytest.mark.parametrize("pre_state_out", [False, True])
def test_the_last_runs_values_stored_where_the_step_keeps_them(rng, pre_state_out):
    """The step's last run stores its values into the outputs' rows and the
    memories' states itself (no buffer written and copied); not into the
    states where an output is a memory's pre-state, which the run would
    have overwritten before it was copied."""
    lengths = [4, 7, 0, 2]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((13, 3)).astype(np.float32), [lengths])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[5], name="h")
        g = rnn.add_memory(shape=[5], name="g", init=np.full(5, 0.25, np.float32))
        new = sn.ops.tanh(sn.ops.matmul(x, rng.standard_normal((3, 5)).astype(np.float32))
                          + sn.ops.matmul(h.pre_state(), np.eye(5, dtype=np.float32) * 0.5))
        h.update(new)
        g.update(g.pre_state() * 0.5 + new)
        rnn.add_outputs(h, g.pre_state() if pre_state_out else g)
    for all_steps in (True, False):
        _agree(rnn, all_steps=all_steps, x=X)
        run = executor.compile_program(rnn.program(rnn.all_steps_flags(all_steps)))
        run(rnn.bind(x=X), rnn.const_values(), workers=1)
        steps = run.kept_steps[len(lengths)][-1]
        copies = [p for p in steps.prog if p[0] == 0 and p[2] - p[1] == 2]
        # (the pre-state's output copied from the state, then the states
        # copied from the run's values: the output of h stored by the run)
        assert len(copies) == (3 if pre_state_out else 0), steps.prog


def _nested(X, rng, dtype=np.float32, reverse=False, init=None, deep=False):
    """A two-level net (W6's kind): an inner gated cell over each paragraph's
    words (started from zeros, or from ``init``: a constant, or "outer": the
    outer memory), its last state the paragraph vector, then an outer cell
    over each chapter's paragraph vectors; ``deep``: the inner net nests a
    third level over each word's letters."""
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)

    I, H = X.data.shape[1], 5
    rnn = sn.create_rnn_op(output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        c = rnn.add_memory(shape=[H], name="c", init=np.zeros(H, dtype))
        inner = sn.create_rnn_op(reverse=reverse)
        with inner.stepnet():
            word = inner.add_input(x, name="word")
            if deep:
                letters = sn.create_rnn_op()
                with letters.stepnet():
                    a = letters.add_input(word, name="letter")
                    s = letters.add_memory(shape=[I], name="s", init=np.zeros(I, dtype))
                    s.update(sn.ops.tanh(sn.ops.matmul(a, w(I, I)) + s.pre_state()))
                    letters.add_outputs(s)
                word = letters(output_all_steps=False)
            start = (c.pre_state() if isinstance(init, str) else np.zeros(H, dtype) if init is None
                     else init)
            h = inner.add_memory(shape=[H], name="h", init=start)
            z = sn.ops.sigmoid(sn.ops.matmul(word, w(I, H)) + sn.ops.matmul(h.pre_state(), w(H, H)))
            n = sn.ops.tanh(sn.ops.matmul(word, w(I, H)) + sn.ops.matmul(h.pre_state(), w(H, H)))
            h.update((1.0 - z) * h.pre_state() + z * n)
            inner.add_outputs(h)
        p = inner(output_all_steps=False)
        c.update(sn.ops.tanh(sn.ops.matmul(p, w(H, H)) + sn.ops.matmul(c.pre_state(), w(H, H))))
        rnn.add_outputs(c, p)
    return rnn


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reverse", [False, True])
def test_nested_nets_run_their_inner_nets_first(rng, dtype, reverse, monkeypatch):
    """A nested rnn that reads no value of its enclosing step (W6's) runs
    first over every sub-sequence (in groups, each group over its own
    sequences'), its results rows of the outer step: uneven, empty
    paragraphs and chapters, a constant start, groups."""
    monkeypatch.setattr("stepnet.jit.threads.SPLIT_MIN_WORK", 1)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((23, 3)).astype(dtype),
                                  [[2, 0, 3, 1, 1], [2, 3, 0, 4, 5, 1, 8]])
    rnn = _nested(X, rng, dtype, reverse)
    for all_steps in (True, False):
        program = rnn.program(rnn.all_steps_flags(all_steps))
        assert executor.why_not(program) is None
        one = _agree(rnn, all_steps, x=X)
        assert isinstance(one[1], sn.LoDTensor) == all_steps
    _agree(_nested(X, rng, dtype, init=np.full(5, 0.25, dtype)), x=X)


def test_groups_take_about_as_many_rows_of_a_nested_net(rng, monkeypatch):
    """Sequences are dealt to the groups by their innermost rows (a nested
    net's words, not its paragraphs): chapters 1 and 3, of 40 words each,
    go to different groups (by their paragraphs, 5, 4, 3, 2, they went to
    one, 80 words against 8)."""
    from stepnet.jit import threads

    groups = []
    run_each = threads.run_each
    monkeypatch.setattr(threads, "run_each", lambda fn, items: groups.append(
        [list(g) for g in items]) or run_each(fn, items))
    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 1)
    words = [1] * 5 + [10] * 4 + [1] * 3 + [20] * 2
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(words), 3)).astype(np.float32),
                                  [[5, 4, 3, 2], words])
    rnn = _nested(X, rng, np.float32, False)
    _agree(rnn, x=X)
    (first, second), = [g for g in groups if len(g) == 2]
    assert (1 in first) != (3 in first) and (1 in second) != (3 in second), (first, second)


@pytest.mark.parametrize("reads_step", [False, True])
def test_a_nested_net_reads_a_constant_its_enclosing_step_computes(rng, reads_step):
    """Weights the enclosing step computes from a Parameter (a constant of
    the call, a static input of the nested net with no batch dimension) are
    the same for every sequence: not a row per sequence (the interpreter
    took rows of them, the executor and the Numba kernel found no value)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 3)).astype(np.float32),
                                  [[2, 1, 0, 2], [2, 0, 3, 1, 3]])
    W = rng.standard_normal((3, 4)).astype(np.float32)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        c = rnn.add_memory(shape=[4], name="c")
        weights = sn.ops.tanh(sn.Parameter(W, name="W"))  # (computed once a call)
        inner = sn.create_rnn_op()
        with inner.stepnet():
            word = inner.add_input(x, name="word")
            h = inner.add_memory(shape=[4], name="h", init=c.pre_state() if reads_step else None)
            h.update(sn.ops.tanh(sn.ops.matmul(word, weights) + h.pre_state()))
            inner.add_outputs(h)
        c.update(inner(output_all_steps=False) + c.pre_state())
        rnn.add_outputs(c)
    # (the CUDA backend refuses a nested net reading its enclosing step's values)
    expected = assert_backends_agree(rnn, backends=["numba"])
    # (each paragraph's state from the same weights: the first one's, by hand)
    first = np.zeros(4, np.float32)
    for t in range(2):
        first = np.tanh(X.data[t] @ np.tanh(W) + first)
    if not reads_step:
        np.testing.assert_allclose(expected.data[0], first, rtol=1e-5, atol=1e-6)
    _agree(rnn, x=X)


def test_three_levels_run_each_inner_net_first(rng, monkeypatch):
    monkeypatch.setattr("stepnet.jit.threads.SPLIT_MIN_WORK", 1)  # (in groups too)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((20, 3)).astype(np.float32),
                                  [[2, 1], [2, 1, 3], [4, 3, 0, 5, 2, 6]])
    _agree(_nested(X, rng, deep=True), x=X)


def test_a_nested_net_that_reads_the_step_runs_at_each_step(rng):
    """A nested rnn started from the outer memory runs at each outer step,
    over the sub-sequences of the step's rows (the time loop in Python)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((23, 3)).astype(np.float32),
                                  [[2, 0, 3, 1, 1], [2, 3, 0, 4, 5, 1, 8]])
    rnn = _nested(X, rng, init="outer")
    run = executor.compile_program(rnn.program((True, True)))
    assert run.why_apart == "it has a rnn stage the loop does not run (rnn)"
    _agree(rnn, x=X)
    _agree(rnn, all_steps=False, x=X)


@pytest.mark.parametrize("summed", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("from_outer", [False, True])
def test_a_nested_nets_every_step_runs_at_each_step(rng, summed, reverse, from_outer):
    """A nested rnn's every step, a ragged value of the enclosing step,
    given out (a ragged output: all steps, or each sequence's last) or
    summed there, runs on the executor step by step, the ragged values op
    by op: the nested net first over every paragraph (started from zeros),
    each step then reading its rows of it, or at each step over the step's
    paragraphs (started from the outer memory)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((14, 3)).astype(np.float32),
                                  [[2, 1, 0, 3], [2, 3, 1, 0, 4, 4]])
    W = sn.Parameter((rng.standard_normal((3, 3)) / 2).astype(np.float32), name="W")
    rnn = sn.create_rnn_op(output_num=2, reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        c = rnn.add_memory(shape=[3], name="c")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            h = inner.add_memory(shape=[3], name="h", init=c.pre_state() if from_outer else None)
            h.update(sn.ops.tanh(inner.add_input(x, name="w") @ W + h.pre_state()))
            inner.add_outputs(h)
        every = inner(output_all_steps=True)
        c.update(inner(output_all_steps=False))
        rnn.add_outputs(c, sn.ops.seq_sum(every) if summed else every)
    for all_steps in (True, False):
        run = executor.compile_program(rnn.program(rnn.all_steps_flags(all_steps)))
        assert run.why_apart == ("a value of its step is ragged" if summed
                                 else "an output or a memory of its step is ragged")
        assert bool(run.first) != from_outer  # (the nested net first, or at each step)
        one = _agree(rnn, all_steps)
        if not summed:  # (the words' LoD under the chapters', or each chapter's last paragraph)
            last = [2, 1, 0, 0] if reverse else [3, 1, 0, 4]
            assert one[1].lod == (X.lod if all_steps else [list(np.cumsum([0] + last))])


@pytest.mark.parametrize("from_outer", [False, True])
def test_a_taggers_gradients_through_its_nested_nets_every_step(rng, from_outer, monkeypatch):
    """A hierarchical tagger (every word's state given out, a ragged output
    of the enclosing net) trains on the first tier: the backward reads the
    words' cotangent as its nested backward net's step input."""
    ran = _first_tier_only(monkeypatch)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((14, 3)), [[2, 1, 0, 3], [2, 3, 1, 0, 4, 4]])
    W = sn.Parameter(rng.standard_normal((3, 3)) / 2, name="W")
    rnn = sn.create_rnn_op(output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        c = rnn.add_memory(shape=[3], name="c", dtype=np.float64)
        inner = sn.create_rnn_op(output_num=2, reverse=True)
        with inner.stepnet():
            h = inner.add_memory(shape=[3], name="h", dtype=np.float64,
                                 init=c.pre_state() if from_outer else None)
            h.update(sn.ops.tanh(inner.add_input(x, name="w") @ W + h.pre_state()))
            inner.add_outputs(h, h)
        last, every = inner(output_all_steps=[False, True])
        c.update(sn.ops.tanh(last + c.pre_state() @ W))
        rnn.add_outputs(every, c)
    dw, dc = rng.standard_normal((14, 3)), rng.standard_normal((4, 3))
    with sn.config(tiered=True):
        found, pullback = sn.vjp(rnn, x=X, output_all_steps=[True, False], backend="numba")
        grads = pullback([sn.LoDTensor(dw, X.lod), dc], wrt=[W, "x"])
    expected, pullback = sn.vjp(rnn, x=X, output_all_steps=[True, False], backend="interpreter")
    assert_close(found, expected, what="outputs")
    assert_close(grads, pullback([sn.LoDTensor(dw, X.lod), dc], wrt=[W, "x"]), what="gradients")
    assert any(p.eqn.attrs["name"].endswith("_grad") for p in ran), ran


@pytest.mark.parametrize("from_outer", [False, True])
def test_a_hierarchical_attention_network_on_the_first_tier(rng, from_outer, monkeypatch):
    """The word attention over a nested net's every step (run first, or at
    each step): the forward, and a training step's backward, whose words'
    cotangent sums three ops' terms; with a cotangent for the weights too
    (read by entry in the backward: a step input of two levels), each
    backward on the executor."""
    rnn, X = word_attention(rng, dtype=np.float64, from_outer=from_outer)
    _agree(rnn)
    ran = _first_tier_only(monkeypatch)
    dh = rng.standard_normal((X.lod[0][-1], 4))
    da = rng.standard_normal((X.lod[1][-1], 1))
    expected, reference = sn.vjp(rnn, X=X, output_all_steps=[True, True], backend="interpreter")
    for cts in ([dh, None], [dh, da]):
        ran.clear()
        with sn.config(tiered=True):
            found, pullback = sn.vjp(rnn, X=X, output_all_steps=[True, True], backend="numba")
            grads = pullback(cts, wrt=rnn.parameters() + ["X"])
        assert_close(found, expected, what="outputs")
        assert_close(grads, reference(cts, wrt=rnn.parameters() + ["X"]), what="gradients")
        assert any(p.eqn.attrs["name"].endswith("_grad") for p in ran), ran


def test_attention_weights_and_a_prior_over_the_memory_on_the_first_tier(rng, monkeypatch):
    """A prior given at each step, combined row by row with the memory (a
    step input of two levels), and the attention weights' gradient (their
    cotangent read as one in the backward), each program on the executor."""
    rnn, W = attention_prior(rng, [3, 6, 0, 2, 4], [2, 3, 1, 0, 2])
    _agree(rnn)
    ran = _first_tier_only(monkeypatch)
    expected, reference = sn.vjp(rnn, backend="interpreter")
    cts = [rng.standard_normal(expected[0].data.shape), rng.standard_normal(expected[1].data.shape)]
    with sn.config(tiered=True):
        found, pullback = sn.vjp(rnn, backend="numba")
        grads = pullback(cts, wrt=[W, "prior", "M"])
    assert_close(found, expected, what="outputs")
    assert_close(grads, reference(cts, wrt=[W, "prior", "M"]), what="gradients")
    assert {rnn.name, f"{rnn.name}_grad"} <= {p.eqn.attrs["name"] for p in ran}, ran


def test_a_nested_nets_gradient_through_its_documents_memory_on_the_first_tier(rng, monkeypatch):
    """Each word attending to its document's memory (a nested net reading
    its enclosing net's ragged static input): the backward, whose nested
    net keeps an accumulator over the memory's rows per sentence, as the
    interpreter's, on the first tier."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((7, 4)), [[2, 1, 0, 2], [1, 3, 0, 2, 1]])
    M, K = (sn.LoDTensor.from_lengths(rng.standard_normal((6, 4)), [[3, 0, 1, 2]]) for _ in "MK")
    top, W = document_attention(rng, X, M, K, reverse=False)
    ran = _first_tier_only(monkeypatch)
    expected, reference = sn.vjp(top, backend="interpreter")
    cts = [rng.standard_normal(o.data.shape) for o in expected]
    with sn.config(tiered=True):
        found, pullback = sn.vjp(top, backend="numba")
        grads = pullback(cts, wrt=[W, "M", "K", "X"])
    assert_close(found, expected, what="outputs")
    assert_close(grads, reference(cts, wrt=[W, "M", "K", "X"]), what="gradients")
    assert {top.name, f"{top.name}_grad"} <= {p.eqn.attrs["name"] for p in ran}, ran


def test_a_step_input_of_two_levels_read_by_ops_and_why_not_one_given_out(rng, monkeypatch):
    """A step input of two LoD levels read by an op (each step a sequence of
    rows: a bag of words per paragraph) runs op by op at each step, as the
    interpreter runs it, beside a nested net over it (hoisted, or reading
    the step), and so do its gradients on the first tier; one given out is
    left to the interpreter, with the reason."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)).astype(np.float32),
                                  [[2, 0, 1], [2, 3, 1]])
    W = sn.Parameter(rng.standard_normal((3, 3)).astype(np.float32), name="W")
    for reads_step in (False, True):
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            x = rnn.add_input(X, name="x")
            h = rnn.add_memory(shape=[3], name="h")
            inner = sn.create_rnn_op(name="words")
            with inner.stepnet():
                g = inner.add_memory(init=h.pre_state() if reads_step else None, shape=[3], name="g")
                g.update(sn.ops.tanh(inner.add_input(x, name="w") @ W + g.pre_state()))
                inner.add_outputs(g)
            h.update(sn.ops.tanh(sn.ops.seq_sum(x @ W) + inner(output_all_steps=False)))
            rnn.add_outputs(h)
        program = rnn.program(rnn.all_steps_flags(True))
        assert executor.why_not(program) is None
        run = executor.compile_program(program)
        for workers in (1, 2):
            assert_close(run(rnn.bind(), rnn.const_values(), workers=workers)[0],
                         rnn(backend="interpreter"), what=f"{reads_step}, {workers}")
    ran = _first_tier_only(monkeypatch)
    G = rng.standard_normal((3, 3)).astype(np.float32)
    with sn.config(tiered=True):
        got = sn.gradients(rnn, wrt=[W, "x"], grad_outputs=[G], backend="numba")
    names = {p.eqn.attrs["name"] for p in ran}
    assert {rnn.name, f"{rnn.name}_grad"} <= names, names  # (the forward and the backward)
    assert_close(list(got), list(sn.gradients(rnn, wrt=[W, "x"], grad_outputs=[G],
                                              backend="interpreter")), what="gradients")
    given = sn.create_rnn_op()
    with given.stepnet():
        given.add_outputs(given.add_input(X, name="x"))
    assert executor.why_not(given.program((True,))) == ("a step input of more than one LoD "
                                                        "level is an output of its step")


@pytest.mark.parametrize("reverse", [False, True])
def test_an_attention_cell_over_ragged_static_memories(rng, reverse):
    """An attention decoder's step (W5's gates, each sequence attending over
    its own memory rows: a ragged static input, one sequence without any)
    runs its time loop in Python, the stages that read the memory op by op
    as on the interpreter, the others as in every other step-net."""
    lengths, memory_lengths = [3, 1, 4, 2], [2, 0, 5, 3]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 3)).astype(np.float32),
                                  [lengths])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((sum(memory_lengths), 4)).astype(np.float32),
                                  [memory_lengths])

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    rnn = sn.create_rnn_op(reverse=reverse, output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        mem = rnn.add_static_input(M, name="mem")
        h = rnn.add_memory(shape=[4], name="h", init=np.zeros(4, np.float32))
        context = sn.ops.attention(sn.ops.matmul(h.pre_state(), w(4, 4)), mem)
        z = sn.ops.sigmoid(sn.ops.matmul(x, w(3, 4)) + sn.ops.matmul(context, w(4, 4)))
        h.update((1.0 - z) * h.pre_state() + z * sn.ops.tanh(sn.ops.matmul(context, w(4, 4))))
        rnn.add_outputs(h, context)
    run = executor.compile_program(rnn.program((True, True)))
    assert run.why_apart == "a value of its step is ragged"
    _agree(rnn, x=X)
    _agree(rnn, all_steps=False, x=X)


@pytest.mark.parametrize("reverse", [False, True])
def test_attention_weights_given_out_as_a_ragged_output(rng, reverse):
    """Each step's attention weights over its sequence's memory rows, given
    out (every step: a two-level LoDTensor; or each sequence's last), a
    sequence of no steps and one of no memory rows among them: step by step,
    as on the interpreter."""
    lengths, memory_lengths = [3, 1, 4, 2, 0], [2, 0, 5, 3, 1]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 3)).astype(np.float32),
                                  [lengths])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((sum(memory_lengths), 4)).astype(np.float32),
                                  [memory_lengths])
    W = sn.Parameter(rng.standard_normal((3, 4)).astype(np.float32), name="W")
    rnn = sn.create_rnn_op(reverse=reverse, output_num=2)
    with rnn.stepnet():
        x, mem = rnn.add_input(X, name="x"), rnn.add_static_input(M, name="mem")
        h = rnn.add_memory(shape=[4], name="h")
        a = sn.ops.seq_softmax(sn.ops.sum(mem * h.pre_state(), axis=-1, keepdims=True))
        h.update(sn.ops.tanh(x @ W + sn.ops.seq_sum(a * mem)))
        rnn.add_outputs(h, a)
    for all_steps in ((True, True), (False, False), (True, False)):
        assert executor.compile_program(rnn.program(all_steps)).why_apart == \
            "an output or a memory of its step is ragged"
        weights = _agree(rnn, all_steps)[1]
        assert weights.lod[-1][-1] == (sum(np.multiply(lengths, memory_lengths)) if all_steps[1]
                                       else sum(memory_lengths[:4]))


def test_an_attention_cells_gradients_accumulate_over_its_memory_rows(rng, monkeypatch):
    """The gradient of an attention decoder's memory (a ragged static
    input: each sequence's own rows, one without any) is a ragged memory of
    the backward, accumulated at each step over the rows of the sequences
    still running: answered on the first tier by the executor, to the
    interpreter's gradients."""
    ran = _first_tier_only(monkeypatch)
    lengths, memory_lengths = [3, 1, 4, 2], [2, 0, 5, 3]
    X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 3)), [lengths])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((sum(memory_lengths), 4)), [memory_lengths])
    Wq = sn.Parameter(rng.standard_normal((4, 4)) / 2, name="Wq")
    Wx = sn.Parameter(rng.standard_normal((3, 4)) / 2, name="Wx")
    rnn = sn.create_rnn_op(reverse=True)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        mem = rnn.add_static_input(M, name="mem")
        h = rnn.add_memory(shape=[4], name="h")
        context = sn.ops.attention(h.pre_state() @ Wq, mem)
        h.update(sn.ops.tanh(x @ Wx + context + h.pre_state()))
        rnn.add_outputs(h)
    dh = rng.standard_normal((sum(lengths), 4))
    with sn.config(tiered=True):
        _, pullback = sn.vjp(rnn, x=X, mem=M, backend="numba")
        found = pullback([dh], wrt=["mem", "x", Wq, Wx])
    grads = [p for p in ran if p.eqn.attrs.get("ragged_memories")]
    assert grads, [p.eqn.attrs["name"] for p in ran]
    _, reference = sn.vjp(rnn, x=X, mem=M, backend="interpreter")
    assert_close(found, reference([dh], wrt=["mem", "x", Wq, Wx]), what="gradients")


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_quantized_products_run_in_one_call(rng, mode, monkeypatch):
    """A quantized step-net (``sn.quantize``: its hoisted input product and
    its two per-step products of the state, merged, all ``matmul_int8`` or
    ``matmul_bf16``) runs its time loop in one call, to the interpreter's
    results, a row holding NaN as there; a later call with other weights
    runs the same loop, pointed at them."""
    lengths = [5, 0, 7, 3]
    data = rng.standard_normal((sum(lengths), 6)).astype(np.float32)
    data[9, 2] = np.nan
    X = sn.LoDTensor.from_lengths(data, [lengths])
    rnn = sn.create_rnn_op(name="cell")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[40], name="h")
        W, U, V = (sn.Parameter(rng.standard_normal(shape).astype(np.float32) * 0.3, name=name)
                   for name, shape in (("W", (6, 40)), ("U", (40, 40)), ("V", (40, 40))))
        gate = sn.ops.sigmoid(h.pre_state() @ V)
        h.update(gate * sn.ops.tanh(x @ W + h.pre_state() @ U) + (1 - gate) * h.pre_state())
        rnn.add_outputs(h)
    small = sn.quantize(rnn, mode)
    program = small.program(small.all_steps_flags(True))
    run = executor.compile_program(program)
    assert executor_program.Steps.why_not(run) is None
    args, consts = small.bind(), small.const_values()
    weights = [k for k, v in consts.items() if np.asarray(v).dtype in (np.int8, np.uint16)]
    assert len(weights) == 3
    builds = []
    build = executor_program.Steps._build
    monkeypatch.setattr(executor_program.Steps, "_build",
                        lambda self, *a: builds.append(1) or build(self, *a))
    for flip in (False, True):  # (the second call: every weight negated)
        given = {k: (_negated(v) if flip and k in weights else v) for k, v in consts.items()}
        want = interpreter.compile_program(program)(args, given)[0].data
        got = run(args, given, workers=1)[0].data
        assert run.how == "one call"
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(want).any() and not np.isnan(want).all()
        assert_close(got[~np.isnan(want)], want[~np.isnan(want)], what=f"{mode}, flipped {flip}")
    assert len(builds) == 1, builds


def _negated(w):
    """int8 weights negated, or bfloat16 ones (their bits: the sign bit flipped)."""
    w = np.asarray(w)
    return -w if w.dtype == np.int8 else w ^ np.uint16(0x8000)
