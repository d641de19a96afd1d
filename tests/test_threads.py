"""Sequence groups on threads, and a layer's directions at once (stepnet.jit.threads)."""


import os
import signal

import numba
import numpy as np
import pytest

import stepnet as sn
from conftest import assert_close
from nets import nested_encoder, small_gru
from stepnet.jit import threads


@pytest.fixture
def split_everything(monkeypatch):
    """Every run with two or more sequences splits into groups."""
    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 0)
    previous = numba.get_num_threads()
    yield
    numba.set_num_threads(previous)


def program_of(rnn):
    return rnn.compile("numba")._runner(rnn.all_steps_flags(True))


@pytest.mark.parametrize("threads", [2, 3])
def test_groups_cover_the_sequences_in_order_balanced_by_rows(rng, split_everything, threads):
    lengths = [[9, 1, 1, 1, 1, 1, 8, 0, 2]]
    rnn = small_gru(rng, lengths)
    program = program_of(rnn)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    groups = program.plan(rnn.bind()).groups
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths[0])
    assert all(a < b and b == c for (a, b), (c, _) in zip(groups, groups[1:]))
    assert len(groups) == numba.get_num_threads()
    if len(groups) == 2:  # 24 rows: the first cut falls after the 12th row
        assert groups == ((0, 4), (4, 9))


@pytest.mark.parametrize("lengths", [[[5, 0, 4, 7, 1]], [[2, 3, 0], [3, 2, 5, 4, 1]],
                                     [[0, 0, 3]], [[4]]])
def test_a_split_run_equals_one_group(rng, split_everything, lengths):
    """Sequence groups on threads give the interpreter's results, LoD
    included, for flat and nested batches, all-steps and last-step outputs."""
    if len(lengths) == 1:
        rnn = small_gru(rng, lengths)
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
    rnn = small_gru(rng, lengths, hidden=64)
    program = program_of(rnn)
    assert program.cuts_sequences
    rows, width = sum(lengths[0]), 8
    expected = rnn(backend="interpreter")
    for count in (2, 3):
        if count > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(count)
        splits = program.splits(rows, width, len(lengths[0]))
        assert splits == (count == 3 or not threads.SPINS)
        assert len(program.plan(rnn.bind()).groups) == (count if splits else 1)
        assert_close(rnn(backend="numba"), expected)
    nested = program_of(nested_encoder(rng, hidden=64, outputs=("h",)).rnn)
    assert nested.source.count("cut = group_cut(board") == 2 and nested.cuts_sequences


def test_a_quantized_net_cuts_its_sequences_as_its_float_one_does(rng, split_everything):
    """An int8 net's kernel weighs its quantized products as the float net's
    kernel weighs its products: it gives part of its sequences to the helper
    (on two threads a run is one group, cut in the kernel, not groups on
    Python's threads), and equals the quantized interpreter."""
    lengths = [[12, 3, 7, 0, 9, 5, 11, 2]]
    rnn = small_gru(rng, lengths, hidden=64)
    small = sn.quantize(rnn, "int8")
    program, float_program = program_of(small), program_of(rnn)
    assert "int8_row_sums(" in program.source
    assert program.cuts_sequences and program.largest_weights == float_program.largest_weights
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() == 2:
        rows = sum(lengths[0])
        assert program.splits(rows, 8, len(lengths[0])) == float_program.splits(rows, 8, len(lengths[0]))
        assert len(program.plan(small.bind()).groups) == len(float_program.plan(rnn.bind()).groups)
    assert_close(small(backend="numba"), small(backend="interpreter"))


def test_gradients_of_a_split_run(rng, split_everything):
    rnn = small_gru(rng, [[6, 2, 0, 5, 3]])
    W, U = rnn.parameters()
    dY = rng.standard_normal((16, 16)).astype(np.float32)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    got = sn.gradients(rnn, wrt=[W, U], grad_outputs=[dY], backend="numba")
    want = sn.gradients(rnn, wrt=[W, U], grad_outputs=[dY], backend="interpreter")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


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
    # (8 features, as the second layer of per_layer takes: both layers run one kernel)
    layer = sn.nn.LSTM(8, 4, num_layers=2, direction="bidirectional_concat", combine=combine,
                       seed=1)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 8)).astype(np.float32), [[4, 0, 5]])
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


def test_explain_prints_the_plan_a_call_runs(rng, split_everything, capsys, monkeypatch):
    """``compiled.explain(**inputs)`` prints the plan a call on those inputs
    runs (and returns it); the call itself takes the same groups."""
    rnn = small_gru(rng, [[9, 1, 1, 1, 1, 1, 8, 0, 2]])
    compiled = rnn.compile("numba")
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    found = compiled.explain()
    assert str(found) in capsys.readouterr().out
    assert found.sequences == 9 and found.rows == 24 and found.threads == numba.get_num_threads()
    assert found.groups == (((0, 4), (4, 9)) if found.threads == 2 else ((0, 9),))
    taken = []
    run_each = threads.run_each
    monkeypatch.setattr(threads, "run_each", lambda fn, items: taken.append(list(items))
                        or run_each(fn, items))
    assert_close(compiled(), rnn(backend="interpreter"))
    assert taken == ([[0, 1]] if len(found.groups) == 2 else [])
    one = small_gru(rng, [[5]]).compile("numba").explain()
    assert one.groups == ((0, 1),) and "one sequence" in str(one)
    assert rnn.compile("interpreter").explain() is None
    assert "interpreter: every sequence in one call" in capsys.readouterr().out


def test_a_plan_that_a_kernel_cannot_run_is_refused():
    from stepnet.jit.plan import RunPlan

    good = RunPlan(2, 5, 20, ((0, 2), (2, 5)), False, False, "test")
    assert good.check() is good
    for groups, helper in ((((0, 2), (3, 5)), False), (((0, 2), (2, 4)), False),
                           (((0, 1), (1, 2), (2, 5)), False), (((0, 2), (2, 5)), True)):
        with pytest.raises(AssertionError):
            RunPlan(2, 5, 20, groups, helper, False, "test").check()


def test_run_each_from_a_pool_thread_never_waits_on_itself(monkeypatch):
    """A run on the pool that runs items on the pool itself (a direction run
    apart, cut into sequence groups), from several callers at once: an item
    no pool thread has started runs on the thread that waits for it, so no
    call waits for a pool thread that is itself waiting (here every run on
    a pool of one thread)."""
    import threading
    import time

    monkeypatch.setattr(threads, "_POOL", None)

    def nested(i):
        return threads.run_each(lambda j: (i, j), range(2))

    results = {}

    def caller(c):
        results[c] = threads.run_each(nested, range(2))

    callers = [threading.Thread(target=caller, args=(c,), daemon=True) for c in range(4)]
    for t in callers:
        t.start()
    deadline = time.monotonic() + 30
    for t in callers:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in callers), "a run_each waited forever"
    assert all(results[c] == [[(i, j) for j in range(2)] for i in range(2)] for c in range(4))
    assert threads._POOL._max_workers == 1


@pytest.mark.slow
def test_a_bidirectional_layer_on_four_threads_returns(rng, tmp_path):
    """With 4 Numba threads (the default of a 4-core machine) each direction
    of a bidirectional GRU runs apart on 2, cut into sequence groups on the
    pool: forward and backward return, as the interpreter computes."""
    from conftest import run_python

    code = """
import numpy as np, stepnet as sn
rng = np.random.default_rng(0)
gru = sn.nn.GRU(64, 16, direction="bidirectional_concat", seed=0)
lengths = rng.integers(20, 40, 200).tolist()
X = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 64)).astype("float32"), [lengths])
(Y, h), pullback = sn.vjp(gru, X)
dX, = pullback([np.ones_like(Y.data), None], wrt=["X"])
(Y0, h0), pullback0 = sn.vjp(gru, X, backend="interpreter")
dX0, = pullback0([np.ones_like(Y.data), None], wrt=["X"])
assert np.allclose(Y.data, Y0.data, atol=1e-5) and np.allclose(dX, dX0, atol=1e-4)
print("returned")
"""
    assert "returned" in run_python(code, tmp_path, NUMBA_NUM_THREADS="4", STEPNET_TIERED="0")


def test_a_forked_child_runs_work_on_threads_of_its_own():
    """The parent's pool of threads is not in a forked child: a layer's two
    directions given to it would wait forever."""
    assert threads.run_each(lambda x: x + 1, [1, 2]) == [2, 3]  # (this process's pool made)
    pid = os.fork()
    if pid == 0:  # (the child: its exit code is the test's answer; an alarm ends a hang)
        signal.alarm(60)
        os._exit(0 if threads.run_each(lambda x: x * 2, [3, 4]) == [6, 8] else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
