"""The CUDA backend against the interpreter.

Without a GPU, tests/conftest.py turns on Numba's CUDA simulator, which runs
every thread in Python: sizes stay tiny. Both time-loop paths are checked: the
persistent kernel (one launch for every step, the default at these sizes; the
simulator runs it as one block, as its grid-wide sync needs) and one launch per
stage and step (``PERSISTENT_MAX_ELEMENTS = 0``). A real GPU runs the
persistent kernel on one block per multiprocessor.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nets import gru_net, nested_encoder, zero_width_net
from pairwise import pairwise_params, spread_params
from stepnet_strategies import build_random_stepnet

import stepnet as sn

pytestmark = pytest.mark.skipif("cuda" not in sn.backends(),
                                reason="no CUDA GPU and no CUDA simulator")

numba_cuda = pytest.importorskip("stepnet.jit.numba_cuda")
from stepnet.jit import cuda_run  # noqa: E402


LOOPS = ["block", "chunks of 3", "persistent", "global-weights", "per-stage"]


@pytest.fixture(params=LOOPS)
def loop(request, monkeypatch):
    """Run a test on every time-loop driver (``cuda_run.LoopPlan``): one
    block (the default at these sizes); one block with the step GEMMs'
    products written out 3 at a time (the loop over the inputs and its tail
    both run); a cooperative grid with the weights resident in shared
    memory; the same reading them from global memory; a launch per stage
    and step."""
    if request.param in ("persistent", "global-weights"):
        monkeypatch.setattr(cuda_run, "BLOCK_MAX_MACS", -1)
    if request.param == "chunks of 3":
        monkeypatch.setattr(cuda_run, "UNROLL", 3)
    if request.param == "global-weights":
        monkeypatch.setattr(cuda_run, "_shared_limit", lambda: 0)
    if request.param == "per-stage":
        monkeypatch.setattr(cuda_run, "PERSISTENT_MAX_ELEMENTS", 0)
    return request.param


def agree(rnn, output_all_steps=True, **feeds):
    """The cuda backend against the interpreter, at any size."""
    return assert_backends_agree(rnn, output_all_steps, backends=["cuda"], **feeds)


def _gated_cell(X, reverse=False, dtype=np.float32, static=None):
    r = np.random.default_rng(0)
    W = sn.Parameter((r.standard_normal((X.shape[1], 4)) * 0.5).astype(dtype), name="W")
    U = sn.Parameter((r.standard_normal((4, 4)) * 0.5).astype(dtype), name="U")
    b = sn.Parameter((r.standard_normal(4) * 0.1).astype(dtype), name="b")
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h", dtype=dtype)
        hp = h.pre_state()
        z = sn.ops.sigmoid(x @ W + hp @ U + b)
        cand = sn.ops.tanh(x @ W + (z * hp) @ U)
        if static is not None:
            cand = cand + rnn.add_static_input(static, name="s")
        h.update((1 - z) * hp + z * cand)
        rnn.add_outputs(h, z)
    return rnn


@pytest.mark.parametrize("reverse,flags,loop", pairwise_params(
    [[False, True], [(True, True), (False, True), (True, False)], LOOPS],
    [str, lambda f: "-".join(map(str, f)), str]), indirect=["loop"])
def test_gated_cell_with_variable_lengths(reverse, flags, loop):
    r = np.random.default_rng(1)
    X = sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), [[4, 0, 2, 3]])
    agree(_gated_cell(X, reverse), output_all_steps=flags)


def test_float64_static_input_and_rebinding(loop):
    r = np.random.default_rng(2)
    X = sn.LoDTensor.from_lengths(r.standard_normal((6, 2)), [[1, 3, 2]])
    rnn = _gated_cell(X, dtype=np.float64, static=r.standard_normal((3, 4)))
    agree(rnn)
    Y = sn.LoDTensor.from_lengths(r.standard_normal((5, 2)), [[5, 0]])
    out = agree(rnn, x=Y, s=r.standard_normal((2, 4)))
    assert out[0].data.dtype == np.float64


def test_products_with_no_terms_or_no_columns(loop):
    rnn, weights = zero_width_net(np.random.default_rng(3), [3, 0, 2])
    want = agree(rnn)
    grads = {backend: sn.gradients(rnn, wrt=weights, backend=backend,
                                   grad_outputs=[np.ones_like(want[0].data), None])
             for backend in ("cuda", "interpreter")}
    for got, expected in zip(grads["cuda"], grads["interpreter"]):
        assert_close(got, expected)


def test_shape_ops_in_a_step(loop):
    """slice, concat, pad, sum, transpose and broadcast_axis on step values,
    a swap of two memories (a snapshot) and a pre-state output."""
    r = np.random.default_rng(3)
    X = sn.LoDTensor.from_lengths(r.standard_normal((7, 4)).astype(np.float32), [[3, 4]])
    M = sn.Parameter((r.standard_normal((2, 3)) * 0.5).astype(np.float32), name="M")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        a = rnn.add_memory(shape=[4], name="a")
        b = rnn.add_memory(shape=[4], name="b")
        left, right = sn.ops.slice(x, 0, 2), sn.ops.slice(x, 2, 4)
        both = sn.ops.concat([right, left + a.pre_state()[:, :2]], axis=1)
        padded = sn.ops.pad(sn.ops.relu(left), 1, 1)
        grid = sn.ops.broadcast_axis(both, 1, 2)                      # [B, 2, 4]
        flipped = sn.ops.transpose(grid)                              # [B, 4, 2]
        total = sn.ops.sum(flipped, axis=-1)                          # [B, 4]
        mixed = sn.ops.tanh(total + padded + b.pre_state()) @ sn.ops.pad(M, 1, 1, axis=0)
        a.update(b.pre_state())
        b.update(sn.ops.concat([mixed, sn.ops.sum(x, axis=1, keepdims=True)], axis=1))
        rnn.add_outputs(a, b, a.pre_state(), sn.ops.where(x > 0, x, 0.0))
    agree(rnn)
    agree(rnn, output_all_steps=False)


def test_matmul_that_is_not_a_gemm(loop):
    """Per-row matrices times per-row matrices, and a step value times a
    constant vector: the dot-product form of matmul's record, on every backend."""
    r = np.random.default_rng(5)
    X = sn.LoDTensor.from_lengths(r.standard_normal((6, 4)).astype(np.float32), [[2, 4]])
    v = sn.Parameter(r.standard_normal(3).astype(np.float32), name="v")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[2], name="h")
        scale = sn.ops.broadcast_axis(h.pre_state(), 2, 3)                  # [B, 2, 3]
        q = sn.ops.broadcast_axis(sn.ops.slice(x, 1, 4), 1, 2) * scale  # [B, 2, 3]
        gram = q @ sn.ops.transpose(q)                                  # [B, 2, 2]
        dot = sn.ops.broadcast_axis(sn.ops.slice(x, 0, 3) @ v, 1, 2)    # [B] -> [B, 2]
        h.update(sn.ops.tanh(sn.ops.sum(gram, axis=-1) * 0.1 + dot))
        rnn.add_outputs(h)
    assert_backends_agree(rnn)


def test_empty_batch_and_all_empty_sequences():
    X = sn.LoDTensor.from_lengths(np.zeros((0, 3), np.float32), [[0, 0]])
    rnn = _gated_cell(X)
    agree(rnn)
    agree(rnn, output_all_steps=False)


@pytest.mark.parametrize("layer,loop", spread_params(["gru", "lstm", "rnn"], LOOPS), indirect=["loop"])
def test_nn_layers(layer, loop):
    r = np.random.default_rng(4)
    X = sn.LoDTensor.from_lengths(r.standard_normal((7, 3)).astype(np.float32), [[3, 1, 3]])
    make = {"gru": lambda: sn.nn.GRU(3, 4, num_layers=2, direction="bidirectional_concat", seed=1,
                                     linear_before_reset=True),
            "lstm": lambda: sn.nn.LSTM(3, 4, direction="reverse", peephole=True, seed=1),
            "rnn": lambda: sn.nn.RNN(3, 4, nonlinearity="relu", seed=1)}[layer]
    net = make()
    expected = net(X, backend="interpreter")
    assert_close(net(X, backend="cuda"), expected)


def _random_stepnets_agree(data):
    rnn, feeds = build_random_stepnet(data.draw)
    for all_steps in (True, False):
        agree(rnn, output_all_steps=all_steps)
        agree(rnn, output_all_steps=all_steps, **feeds)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_stepnets(data):
    _random_stepnets_agree(data)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_stepnets_many(data):
    _random_stepnets_agree(data)


def test_gradients_on_cuda():
    """The backward of a step-net is a step-net: it runs on this backend too."""
    r = np.random.default_rng(5)
    X = sn.LoDTensor.from_lengths(r.standard_normal((6, 3)).astype(np.float32), [[2, 4]])
    gru = sn.nn.GRU(3, 4, seed=2)
    dY = r.standard_normal((6, 4)).astype(np.float32)
    dh = r.standard_normal((1, 2, 4)).astype(np.float32)
    wrt = gru.parameters() + ["X", "h0"]
    expected = sn.gradients(gru, wrt, [dY, dh], backend="interpreter", X=X)
    actual = sn.gradients(gru, wrt, [dY, dh], backend="cuda", X=X)
    for a, e in zip(actual, expected):
        assert_close(a, e, what="cuda gradient")


def test_source_is_printable():
    X = sn.LoDTensor.from_lengths(np.ones((3, 3), np.float32), [[3]])
    source = _gated_cell(X).compile("cuda").source
    assert "@cuda.jit" in source and "def persistent(" in source and "grid.sync()" in source
    assert "def block(" in source and "cuda.syncthreads()" in source
    # a stage kernel takes the arrays it reads, not every array of the call
    # (each argument costs every launch on the host); the loop kernels all
    params = {line[4:line.index("(")]: line[line.index("(") + 1:-2].split(", ")
              for line in source.splitlines() if line.startswith("def ")}
    every = params.pop("persistent")[3:]
    assert params.pop("block")[3:] == every
    stages = [p[3:] for name, p in params.items() if name.startswith(("hoisted", "step"))]
    assert stages and all(set(p) <= set(every) for p in stages)
    assert all(len(p) < len(every) for p in stages), (every, stages)
    assert set().union(*stages) == set(every)


def test_a_steps_copies_of_one_width_are_one_stage():
    """The outputs and the memory update at the end of a step (all of the
    memory's width) are one stage kernel: one launch a step on the per-stage
    path, one grid-wide sync in the persistent kernel."""
    X = sn.LoDTensor.from_lengths(np.ones((3, 3), np.float32), [[3]])
    source = _gated_cell(X).compile("cuda").source
    kernels = source.split("@cuda.jit")
    step = [k for k in kernels if k.startswith("\ndef step")]
    copies = [k for k in step if "mem0[i, j] =" in k]
    assert len(copies) == 1, step
    assert "out0[tok[off + i], j] =" in copies[0] and "out1[tok[off + i], j] =" in copies[0]
    persistent = next(k for k in kernels if k.startswith("\ndef persistent("))
    assert persistent.count("grid.sync()") == len(step)


def _gru(lengths, width, hidden):
    r = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(r.standard_normal((sum(lengths), width)).astype(np.float32),
                                  [lengths])
    return gru_net(X, r, hidden=hidden)


@pytest.mark.parametrize("driver", ["block", "persistent"])
def test_what_a_call_does_is_counted(driver, monkeypatch):
    """The design's promises, counted as a call runs: one launch for the
    hoisted GEMM and one for the whole time loop; no grid-wide sync on one
    block, one a stage on the grid; the step GEMM's weights (U: 3 x 8 x 8
    float32) read from shared memory, none from global memory, at every
    step; each array copied to the device once."""
    if driver == "persistent":
        monkeypatch.setattr(cuda_run, "BLOCK_MAX_MACS", -1)
    f = _gru([3, 1, 2], 5, 8).compile("cuda")
    f(output_all_steps=True)
    counts = f.last_call(output_all_steps=True)
    assert counts.plan.driver == driver and counts.plan.resident
    # 24 columns of 8 weights, each padded to 9 words (distinct banks)
    assert counts.plan.shared_bytes == 24 * 9 * 4
    assert counts.launches == 2
    stages = len(f.schedule.step) + 1  # the step's stages, then its outputs and memory update
    assert (counts.block_syncs_per_step, counts.grid_syncs_per_step) == \
        ((stages, 0) if driver == "block" else (0, stages))
    assert counts.global_weight_bytes_per_step == 0
    # the sequence, the memory, the step table, the input and the recurrent
    # weights (each joined by columns) and the four biases in one copy
    assert counts.copies_to_device == 1


def test_a_step_of_more_work_than_a_block_has_threads(loop):
    """A step GEMM of more outputs than the block has threads (2 rows x 144
    columns against 32 threads on the simulator), of an inner dimension
    (48) past one chunk of written-out products: each thread takes several
    outputs in turn."""
    agree(_gru([3, 2], 4, 48))


def test_calls_of_other_sizes_after_one_another():
    """A compiled step-net keeps its device arrays and their views from call
    to call while their shapes hold: calls of other lengths and sizes in turn
    each give the interpreter's results."""
    rnn = _gru([3, 1, 2], 5, 8)
    f = rnn.compile("cuda")
    r = np.random.default_rng(9)
    for lengths in ([3, 1, 2], [4, 4], [1], [3, 1, 2]):
        X = sn.LoDTensor.from_lengths(r.standard_normal((sum(lengths), 5)).astype(np.float32),
                                      [lengths])
        got = f(x=X)
        want = rnn(backend="interpreter", x=X)
        assert_close(got.data, want.data)
    assert f.last_call().copies_to_device == 1


def test_weights_that_do_not_fit_are_read_from_global_memory(monkeypatch):
    monkeypatch.setattr(cuda_run, "_shared_limit", lambda: 24 * 9 * 4 - 1)
    f = _gru([2, 2], 3, 8).compile("cuda")
    f()
    counts = f.last_call()
    assert counts.plan.driver == "persistent" and not counts.plan.resident
    assert counts.global_weight_bytes_per_step == 3 * 8 * 8 * 4


@pytest.mark.parametrize("blocks_down", [None, 1])
def test_hoisted_gemm_tiles_and_their_edges(blocks_down, monkeypatch):
    """A hoisted GEMM larger than one tile in rows and columns, of a K that
    is not a multiple of the tile's slice: the tiled kernel's edges; with one
    block down (as past CUDA's 65,535), that block takes every tile of rows."""
    if blocks_down:
        monkeypatch.setattr(cuda_run, "MAX_GRID_Y", blocks_down)
    T = cuda_run.TILE + 9
    r = np.random.default_rng(5)
    X = sn.LoDTensor.from_lengths(r.standard_normal((T, cuda_run.TILE_K + 3)).astype(np.float32),
                                  [[T - 40, 40]])
    W = sn.Parameter(r.standard_normal((X.shape[1], cuda_run.TILE + 5)).astype(np.float32) * 0.3)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[W.shape[1]], name="h")
        h.update(sn.ops.tanh(x @ W) + 0.5 * h.pre_state())
        rnn.add_outputs(h)
    agree(rnn)


def _three_levels(r):
    lengths = [[2, 0, 3], [2, 1, 0, 2, 1], [1, 3, 2, 0, 2, 1]]
    return sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), lengths)


@pytest.mark.parametrize("reverse,loop", spread_params([False, True], LOOPS), indirect=["loop"])
def test_nested_step_nets_three_levels(reverse, loop):
    """Nested nets reading only their step input run once over every
    sub-sequence before the enclosing loop, at every depth."""
    r = np.random.default_rng(6)
    X = _three_levels(r)
    W = sn.Parameter((r.standard_normal((3, 4)) * 0.5).astype(np.float32), name="W")
    U = sn.Parameter((r.standard_normal((4, 4)) * 0.5).astype(np.float32), name="U")
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h")
        mid = sn.create_rnn_op(name="sentences")
        with mid.stepnet():
            s = mid.add_input(x, name="s")
            m = mid.add_memory(shape=[4], name="m")
            words = sn.create_rnn_op(name="words", reverse=not reverse)
            with words.stepnet():
                w = words.add_input(s, name="w")
                g = words.add_memory(init=0.5, shape=[4], name="g")
                g.update(sn.ops.tanh(w @ W + g.pre_state() @ U))
                words.add_outputs(g)
            m.update(sn.ops.sigmoid(words(output_all_steps=False) + m.pre_state() @ U))
            mid.add_outputs(m)
        h.update(sn.ops.tanh(mid(output_all_steps=False) @ U + h.pre_state()))
        rnn.add_outputs(h)
    agree(rnn)
    agree(rnn, output_all_steps=False)


def test_nested_step_net_reading_the_enclosing_step_is_refused_by_name():
    r = np.random.default_rng(7)
    rnn = nested_encoder(r, [[2], [1, 2]], features=2, hidden=2, start_from_outer=True,
                         outputs=("h",)).rnn
    with pytest.raises(sn.UnsupportedError,
                       match="cuda backend: nested step-net words starts a memory from a value"):
        rnn(backend="cuda")


def test_without_gpu_or_simulator_the_backend_is_not_listed():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = ("import os, stepnet as sn\n"
            "assert 'cuda' not in sn.backends(), sn.backends()\n"
            "try:\n    sn.set_default_backend('cuda')\nexcept sn.BackendError as e:\n    print(e)\n")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not available on this machine" in out.stdout and "NUMBA_ENABLE_CUDASIM=1" in out.stdout


def _on_host(value):
    """A result given back on the device, copied to the host."""
    if isinstance(value, sn.LoDTensor):
        assert value.on_device
        return value.to_host()
    assert not isinstance(value, np.ndarray)  # a device array
    return value.copy_to_host()


def _rows(value):
    return value.data if isinstance(value, sn.LoDTensor) else value


@pytest.mark.parametrize("flags,loop", spread_params([(True, True), (False, False), (True, False)], LOOPS,
                                                    lambda f: "-".join(map(str, f))), indirect=["loop"])
def test_step_inputs_on_the_device_are_read_in_place_and_outputs_stay_there(flags, loop):
    """A LoDTensor whose rows are a device array: read where they lie (one
    copy a call: the weights' and the tables'), every output given back on
    the device as the interpreter computes it, the initial state given on
    the device too; each call's outputs its own (a second call on other rows
    leaves the first's as they were)."""
    from numba import cuda

    r = np.random.default_rng(5)
    X = sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), [[4, 0, 2, 3]])
    h0 = r.standard_normal((4, 4)).astype(np.float32)
    rnn = _gated_cell(X)
    f = rnn.compile("cuda")
    X_gpu = sn.LoDTensor(cuda.to_device(X.data), X.lod)
    assert X_gpu.on_device and X_gpu.shape == X.shape and X_gpu.dtype == X.dtype
    assert sn.LoDTensor.from_lengths(cuda.to_device(X.data), [[4, 0, 2, 3]]).on_device
    on_gpu = f(output_all_steps=flags, x=X_gpu, h=cuda.to_device(h0))
    assert f.last_call(output_all_steps=flags).copies_to_device == 1
    f(output_all_steps=flags, x=sn.LoDTensor(cuda.to_device(X.data * 2), X.lod), h=h0)
    expected = rnn(output_all_steps=flags, backend="interpreter", x=X, h=h0)
    for got, want in zip(on_gpu, expected):
        got = _on_host(got)
        assert_close(_rows(got), _rows(want))
        if isinstance(want, sn.LoDTensor):
            assert got.lod == want.lod


def test_device_inputs_with_no_steps_and_refusals():
    from numba import cuda

    X = sn.LoDTensor.from_lengths(np.zeros((0, 3), np.float32), [[0, 0]])
    rnn = _gated_cell(X)
    Y, z = rnn(backend="cuda", x=X.to_device())
    assert Y.on_device and Y.shape == (0, 4) and Y.lod == [[0, 0, 0]]
    X = sn.LoDTensor.from_lengths(np.ones((3, 3), np.float32), [[1, 2]]).to_device()
    with pytest.raises(sn.BackendError, match="input x: its data is on the GPU.*backend='cuda'"):
        rnn(backend="interpreter", x=X)
    with pytest.raises(sn.UnsupportedError, match="gradients take rows on the host"):
        sn.nn.GRU(3, 4).vjp(X, backend="cuda")
    with pytest.raises(sn.LoDError, match="to_padded: .* on the GPU; call .to_host"):
        X.to_padded()
    strided = sn.LoDTensor(cuda.to_device(np.ones((3, 6), np.float32))[:, ::2], [[0, 1, 3]])
    with pytest.raises(sn.ShapeError, match="input x: its rows on the GPU are not C-contiguous"):
        rnn(backend="cuda", x=strided)
    half = sn.LoDTensor.from_lengths(np.ones((3, 3), np.float16), [[1, 2]]).to_device()
    with pytest.raises(sn.ShapeError, match="input x: float16 rows on the GPU, computed in float32"):
        rnn(backend="cuda", x=half)


@pytest.mark.parametrize("layer", [
    lambda: sn.nn.GRU(3, 4, num_layers=2), lambda: sn.nn.LSTM(3, 4),
    lambda: sn.nn.GRU(3, 4, direction="bidirectional_concat"),
    lambda: sn.nn.RNN(3, 4, direction="bidirectional_sum")],
    ids=["gru-2-layers", "lstm", "gru-bidirectional-concat", "rnn-bidirectional-sum"])
def test_layers_given_rows_on_the_device_give_back_device_arrays(layer):
    from numba import cuda

    layer = layer()
    r = np.random.default_rng(6)
    X = sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), [[4, 0, 2, 3]])
    Y, states = layer(X.to_device(), backend="cuda")
    Y_host, states_host = layer(X, backend="interpreter")
    assert Y.on_device and Y.lod == X.lod
    assert_close(Y.to_host().data, Y_host.data)
    for h, h_host in zip(states if isinstance(states, tuple) else [states],
                         states_host if isinstance(states_host, tuple) else [states_host]):
        assert_close(_on_host(h), h_host)
    with pytest.raises(sn.UnsupportedError, match="padded input on the GPU"):
        layer((cuda.to_device(np.zeros((2, 3, 3), np.float32)), [3, 1]), backend="cuda")


def test_gradients_of_rows_on_the_device_are_summed_there(monkeypatch):
    """sn.vjp of a step-net whose step input lies on the device: the
    forward keeps its workspace there, the backward reads it there, the
    weight gradients are summed over the tokens there (the host's
    transposed products are never called), dX stays on the device; all as
    the interpreter computes them, with all-steps cotangents given on the
    device or on the host."""
    from numba import cuda

    from stepnet.jit import transposed

    def host_products(products):
        raise AssertionError("a weight gradient summed on the host")

    monkeypatch.setattr(transposed, "transposed_products", host_products)
    r = np.random.default_rng(8)
    X = sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), [[4, 0, 2, 3]])
    h0 = r.standard_normal((4, 4)).astype(np.float32)
    rnn = _gated_cell(X)
    W, U, b = rnn.parameters()
    dY = r.standard_normal((9, 4)).astype(np.float32)
    dz = r.standard_normal((9, 4)).astype(np.float32)
    wrt = [W, U, b, "x", "h"]
    _, reference = sn.vjp(rnn, backend="interpreter", x=X, h=h0)
    expected = reference([dY, dz], wrt=wrt)
    for placed in (lambda a: cuda.to_device(a), lambda a: a):
        Y, pullback = sn.vjp(rnn, backend="cuda", x=X.to_device(), h=h0)
        assert Y[0].on_device
        grads = pullback([placed(dY), sn.LoDTensor(placed(dz), X.lod)], wrt=wrt)
        for g, e in zip(grads[:3] + grads[4:], expected[:3] + expected[4:]):
            assert isinstance(g, np.ndarray)
            assert_close(g, e)
        assert not isinstance(grads[3], np.ndarray)  # dX on the device
        assert_close(grads[3].copy_to_host(), expected[3])


def test_a_torch_cuda_tensor_is_read_where_it_lies():
    """Rows given as a torch CUDA tensor (``__cuda_array_interface__``): only
    on a real GPU with a CUDA build of PyTorch (the simulator has no such
    arrays)."""
    torch = pytest.importorskip("torch")
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a GPU and a CUDA build of PyTorch")
    r = np.random.default_rng(9)
    X = sn.LoDTensor.from_lengths(r.standard_normal((9, 3)).astype(np.float32), [[4, 0, 2, 3]])
    rnn = _gated_cell(X)
    X_gpu = sn.LoDTensor(torch.from_numpy(X.data).cuda(), X.lod)
    assert X_gpu.on_device
    Y, z = rnn(backend="cuda", x=X_gpu)
    expected = rnn(backend="interpreter", x=X)
    assert_close(torch.as_tensor(Y.data, device="cuda").cpu().numpy(), expected[0].data)
    assert_close(z.to_host().data, expected[1].data)
