"""sn.quantize (stepnet/quantize.py) and the quantized products
(stepnet/ops/quantized.py, stepnet/jit/int8_gemm.py, stepnet/jit/quantized.py):
the int8 kernel bit for bit against the NumPy reference; quantized layers
and step-nets on the Numba backend and the executor against the interpreter,
and within int8's error of the float model; special values; bf16 rounding;
what is refused, and where."""

import importlib

import numpy as np
import pytest
from conftest import assert_close
from nets import lod, nested_encoder, tanh_cell, weight

import stepnet as sn
from stepnet import executor, interpreter
from stepnet.ops import quantized as q
from stepnet.jit import int8_gemm, quantized as routines


def _rows(rng, m, k):
    a = rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.01, 10, (m, 1)).astype(np.float32)
    if m > 2:
        a[1] = 0
    return a


@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (1, 1, 1), (3, 7, 5), (9, 33, 17), (64, 128, 96),
                                   (13, 256, 200), (130, 70, 130)])
def test_int8_kernel_is_the_reference_bit_for_bit(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    a = _rows(rng, m, k)
    w, scale = q.int8_weights(rng.standard_normal((k, n)).astype(np.float32))
    out = np.full((m, n), np.nan, np.float32)
    routines.int8_rows(a, routines.int8_prepare(w, scale), out)
    np.testing.assert_array_equal(out, q.int8_product(a, w, scale))
    # the quantized rows themselves, and the scales
    qa, s = np.empty((m, k), np.int8), np.empty(m, np.float32)
    int8_gemm.quantize_rows(a, qa, s)
    ref_q, ref_s = q.quantize_rows(a)
    np.testing.assert_array_equal(qa, ref_q)
    np.testing.assert_array_equal(s, ref_s)
    _assert_row_sums(a, w, scale)


def _assert_row_sums(a, w, scale):
    """``int8_row_sums`` leaves the exact int32 sums (zeros in its columns
    past n) and the rows' scales, which dequantize to ``int8_rows``'s bits."""
    m, n = a.shape[0], w.shape[1]
    prepared = routines.int8_prepare(w, scale)
    sums, s = int8_gemm.sums_buffer(m, n), np.full(m, np.nan, np.float32)
    sums[:] = -1
    routines.int8_row_sums(a, prepared, sums, s)
    ref_q, ref_s = q.quantize_rows(a)
    np.testing.assert_array_equal(s, ref_s)
    np.testing.assert_array_equal(sums[:, :n], ref_q.astype(np.int32) @ w.astype(np.int32))
    assert (sums[:, n:len(prepared[0]) * int8_gemm._WIDTH] == 0).all()
    np.testing.assert_array_equal(sums[:, :n].astype(np.float32) * (s[:, None] * prepared[1]),
                                  q.int8_product(a, w, scale))


@pytest.mark.skipif(not int8_gemm._AMX, reason="AMX's tiles: a CPU with AMX-INT8, Linux granting them")
def test_amx_tiles_give_the_reference_bits():
    """Where the process may use AMX, products of 8 rows and more run on its
    tiles (a block of 32 rows, the rows past m's computed and dropped, k
    padded to whole tiles), fewer on the vector loop: both bit for bit
    (int8) or as the reference rounds (bf16)."""
    from numba import njit, types

    assert int8_gemm.int8_path().startswith("amx tdpbusd")
    rng = np.random.default_rng(5)
    for m, k, n in ((7, 64, 64), (8, 64, 64), (31, 1, 3), (97, 200, 129), (200, 256, 1024)):
        a = _rows(rng, m, k)
        w, scale = q.int8_weights(rng.standard_normal((k, n)).astype(np.float32))
        out = np.full((m, n), np.nan, np.float32)
        routines.int8_rows(a, routines.int8_prepare(w, scale), out)
        np.testing.assert_array_equal(out, q.int8_product(a, w, scale))
        _assert_row_sums(a, w, scale)  # (whole blocks of rows into the sums, a last one apart)
        if int8_gemm._AMX_BF16:  # (float32 sums in the tiles' order: to their rounding)
            bits = q.to_bf16(w * scale)
            routines.bf16_rows(a, routines.bf16_prepare(bits), out)
            ref = q.bf16_product(a, bits)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    signature = (types.Array(types.int8, 2, "C"), types.Array(types.float32, 1, "C"),
                 types.Array(types.int8, 3, "C"), types.Array(types.float32, 1, "C"),
                 types.Array(types.float32, 2, "A"))
    fresh = njit(nogil=True)(int8_gemm.int8_product.py_func)  # (cached code shows no assembly)
    fresh.compile(signature)
    asm = fresh.inspect_asm(signature)
    assert "tdpbusd" in asm and "vpdpbusd" in asm and "ldtilecfg" in asm


_REFUSED = """
from stepnet.jit import own_loop
if {refused}:
    own_loop._tiles_permitted = lambda: False  # (as where Linux refuses the tiles)
from stepnet.jit import cache, int8_gemm
print(int8_gemm.int8_path(), cache.build_key())
"""


def test_a_process_refused_amx_runs_vnni_and_keeps_its_code_apart():
    """Where Linux does not lend the tiles (an older kernel, a sandbox), the
    int8 products take the vector path and the compiled helpers another
    cache folder than a process that may use the tiles on the same CPU."""
    import subprocess
    import sys

    found = [subprocess.run([sys.executable, "-c", _REFUSED.format(refused=refused)],
                            capture_output=True, text=True, timeout=300) for refused in (True, False)]
    assert all(f.returncode == 0 for f in found), found[0].stderr[-2000:] + found[1].stderr[-2000:]
    (path, key), (own_path, own_key) = (f.stdout.strip().rsplit(" ", 1) for f in found)
    assert not path.startswith("amx"), path
    assert (key != own_key) == own_path.startswith("amx") == int8_gemm._AMX, (path, own_path)


def test_int8_rows_with_special_values():
    a = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [1, np.nan, 2, 3], [np.inf, 1, 2, 3],
                  [-1e-30, 1e-30, 0, 5e-31], [1e-40, 0, -1e-40, 5e-41]], np.float32)
    # a row of subnormals keeps its proportions (1e-40 and 5e-41: 127 and 64)
    np.testing.assert_array_equal(q.quantize_rows(a[5:])[0], [[127, 0, -127, 64]])
    w, scale = q.int8_weights(np.arange(12, dtype=np.float32).reshape(4, 3) - 5)
    ref = q.int8_product(a, w, scale)
    assert np.all(np.isnan(ref[2:4])) and np.all(ref[1] == 0) and np.all(np.isfinite(ref[[0, 1, 4, 5]]))
    out = np.empty_like(ref)
    routines.int8_rows(a, routines.int8_prepare(w, scale), out)
    np.testing.assert_array_equal(out, ref)


def test_int8_weights_per_column():
    w = np.array([[1.0, 0.0, -4.0], [-0.5, 0.0, 2.0]], np.float32)
    wq, scale = q.int8_weights(w)
    assert wq.dtype == np.int8 and scale.dtype == np.float32
    np.testing.assert_array_equal(wq, [[127, 0, -127], [-64, 0, 64]])
    np.testing.assert_allclose(scale, [1 / 127, 0, 4 / 127], rtol=1e-7)
    with pytest.raises(sn.ShapeError, match="NaN or infinity"):
        q.int8_weights(np.array([[np.nan]], np.float32))


def test_bf16_rounding():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, 3.4e38, np.nan],
                 np.float32)
    back = q.from_bf16(q.to_bf16(x))
    # ties to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7
    np.testing.assert_array_equal(back[:6], [1.0, 1.0, 1 + 2 ** -6, -2.5, np.inf, -np.inf])
    assert np.isinf(back[6]) and np.isnan(back[7])
    a = np.random.default_rng(0).standard_normal((5, 9)).astype(np.float32)
    a[2, 3], a[4, 0] = np.nan, np.inf
    w = q.to_bf16(np.random.default_rng(1).standard_normal((9, 4)))
    out = np.empty((5, 4), np.float32)
    routines.bf16_rows(a, routines.bf16_prepare(w), out)
    ref = q.bf16_product(a, w)
    assert np.all(np.isnan(out[2])) and np.all(np.isnan(ref[2]))
    np.testing.assert_array_equal(out[4], ref[4])  # (an infinity of w[0]'s signs)
    assert_close(out[[0, 1, 3]], ref[[0, 1, 3]], what="bf16 product")


def test_bf16_says_where_it_runs_at_float32_speed():
    """Where the kernels have no bf16 instructions, quantizing to bf16 warns
    (once a process); where they have them, nothing is said."""
    import sys
    import warnings

    sys.modules["stepnet.quantize"]._say_bf16_speed.cache_clear()
    if int8_gemm.BF16:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sn.quantize(sn.nn.GRU(4, 8), "bf16")
    else:
        with pytest.warns(UserWarning, match="bf16's results at float32's speed"):
            sn.quantize(sn.nn.GRU(4, 8), "bf16")


def _layer_input(rng, width, lengths=(7, 3, 0, 5)):
    x = rng.standard_normal((len(lengths), max(lengths), width)).astype(np.float32)
    return x, np.array(lengths)


_LAYERS = [("GRU", {}), ("LSTM", {"direction": "bidirectional_concat"}), ("RNN", {"num_layers": 2}),
           ("GRU", {"linear_before_reset": True})]


# (the GRU and the LSTM in int8 and the GRU in bf16 by default, every case in
# the slow run: each compiles its kernels)
@pytest.mark.parametrize("cell,options,mode", [
    (c, o, m) if (i, m) in ((0, "int8"), (1, "int8"), (0, "bf16")) else
    pytest.param(c, o, m, marks=pytest.mark.slow)
    for m in ("int8", "bf16") for i, (c, o) in enumerate(_LAYERS)])
def test_quantized_layers(cell, options, mode):
    rng = np.random.default_rng(3)
    layer = getattr(sn.nn, cell)(12, 16, seed=1, **options)
    small = sn.quantize(layer, mode)
    assert small.quantized == mode and layer.quantized is None
    x = _layer_input(rng, 12)
    on_numba = small(x, backend="numba")
    reference = small(x, backend="interpreter")
    assert_close(on_numba, reference, what=f"{mode} {cell} on numba")
    # within the quantization's error of the float layer
    y, y_float = on_numba[0], layer(x, backend="interpreter")[0]
    error = np.abs(y - y_float).max() / np.abs(y_float).max()
    assert error < (2e-2 if mode == "int8" else 1e-2), error
    assert f"matmul_{mode}" in small.step_net(0, 0).ir()


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_quantized_custom_step_net_on_every_cpu_tier(mode):
    rng = np.random.default_rng(5)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((12, 6)).astype(np.float32), [[5, 0, 7]])
    W = sn.Parameter(rng.standard_normal((6, 8)).astype(np.float32) * 0.5, name="W")
    U = sn.Parameter(rng.standard_normal((8, 8)).astype(np.float32) * 0.3, name="U")
    V = sn.Parameter(rng.standard_normal((8, 8)).astype(np.float32) * 0.3, name="V")
    rnn = sn.create_rnn_op(name="cell")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[8], name="h")
        gate = sn.ops.sigmoid(h.pre_state() @ V)
        h.update(gate * sn.ops.tanh(x @ W + h.pre_state() @ U) + (1 - gate) * h.pre_state())
        rnn.add_outputs(h)
    small = sn.quantize(rnn, mode)
    assert small.quantized == mode and f"matmul_{mode}" in small.ir() and "matmul_" not in rnn.ir()
    # the two products of h share their left operand: one merged product
    stages = str(small.compile("numba").schedule)
    assert stages.count(f"matmul_{mode}") == 2 and f"matmul_{mode}[merged 2]:" in stages
    expected = small(backend="interpreter")
    assert_close(small(backend="numba"), expected, what=f"{mode} step-net on numba")
    program = small.program(True)
    run = executor.compile_program(program)
    assert run is not None, executor.why_not(program)
    args, consts = small.bind(), small.const_values()
    for workers in (1, 2):
        assert_close(run(args, consts, workers=workers)[0], expected, what=f"executor, {workers}")
        assert run.how == "one call"  # (the quantized products in the executor's loop)
    float_out = interpreter.compile_program(rnn.program(True))(rnn.bind(), rnn.const_values())[0]
    assert np.abs(expected.data - float_out.data).max() < 3e-2
    # the weights are a snapshot: the float Parameters' later values do not reach it
    W.value = W.value * 0
    assert_close(small(backend="interpreter"), expected, what="after W changed")


def test_int8_products_only_runs_read_are_dequantized_as_they_are_read():
    """An int8 product that only the step's elementwise runs read leaves its
    int32 sums and its rows' scales, which the runs dequantize as they read
    them (``KernelPlan.dequantized``), before the loop (x @ W) or in the
    step (h @ U); one whose result the step also gives out (tanh(h) @ V)
    is dequantized by its own routine. All agree with the interpreter."""
    from stepnet import schedule
    from stepnet.jit import cpu_codegen
    from stepnet.jit.kernel_plan import kernel_plan

    rng = np.random.default_rng(8)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 6)).astype(np.float32), [[4, 0, 5]])
    W, U, V = (sn.Parameter(rng.standard_normal(shape).astype(np.float32) * 0.4, name=name)
               for name, shape in (("W", (6, 8)), ("U", (8, 8)), ("V", (8, 5))))
    rnn = sn.create_rnn_op(name="cell")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[8], name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state() @ U))
        rnn.add_outputs(h, sn.ops.tanh(h.pre_state()) @ V)
    small = sn.quantize(rnn, "int8")
    program = small.program(True)
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    read_by_runs = {v.shape[-1] for s in plan.dequantized[sched] for v in s.outputs}
    assert read_by_runs == {8}, read_by_runs  # (x @ W and h @ U: 8 columns; not V's 5)
    assert len(plan.dequantized[sched]) == 2
    assert "int8 sums dequantized by the runs reading them" in str(plan)
    source, _ = cpu_codegen.generate_source(program)
    assert source.count("int8_row_sums(") == 2 and source.count("int8_rows(") == 1, source
    expected = small(backend="interpreter")
    for got, want in zip(small(backend="numba"), expected):
        assert_close(got, want, what="int8 sums read dequantized")
    # a nested net's products too, one of them by the enclosing net's state
    encoder = sn.quantize(nested_encoder(rng, features=6, hidden=8, inner_reads_outer=True).rnn,
                          "int8")
    program = encoder.program(True)
    nested_plan = kernel_plan(program, schedule.schedule(program))
    assert len(nested_plan.dequantized) == 3 and all(nested_plan.dequantized.values())
    for got, want in zip(encoder(backend="numba"), encoder(backend="interpreter")):
        assert_close(got, want, what="a nested net's int8 sums read dequantized")


def test_nan_and_inf_inputs_agree_across_backends():
    layer = sn.quantize(sn.nn.GRU(4, 8, seed=0), "int8")
    x = np.ones((3, 4, 4), np.float32)
    x[0, 1, 2] = np.nan
    x[1, 2, 0] = np.inf
    lengths = np.array([4, 4, 2])
    for got, want in zip(layer((x, lengths), backend="numba"),
                         layer((x, lengths), backend="interpreter")):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        assert_close(got[finite], want[finite], what="special values")
    want = layer((x, lengths), backend="interpreter")[0]
    # a row holding NaN or inf makes NaN (its scale): from that step on, the state
    assert np.isnan(want[0, 1:]).all() and np.isnan(want[1, 2:]).all() and np.isfinite(want[2, :2]).all()


def test_what_quantize_refuses():
    with pytest.raises(sn.StepNetError, match="mode"):
        sn.quantize(sn.nn.GRU(4, 8), "int4")
    with pytest.raises(sn.StepNetError, match="float64"):
        sn.quantize(sn.nn.GRU(4, 8, dtype=np.float64), "int8")
    small = sn.quantize(sn.nn.GRU(4, 8), "int8")
    with pytest.raises(sn.StepNetError, match="quantized already"):
        sn.quantize(small, "bf16")
    with pytest.raises(sn.UnsupportedError, match="float layer"):
        small.to_onnx()
    with pytest.raises(sn.UnsupportedError, match="ONNX sessions"):
        sn.quantize(object(), "int8")
    x = (np.ones((2, 3, 4), np.float32), np.array([3, 2]))
    small(x, backend="interpreter", keep_workspace=True)
    with pytest.raises(sn.UnsupportedError, match="no gradient"):
        sn.gradients(small, wrt=[small.parameters()[0]],
                     grad_outputs=[np.ones((2, 3, 8), np.float32), None])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        h = rnn.add_memory(shape=[3], name="h")
        h.update(sn.ops.tanh(rnn.add_input(sn.LoDTensor.from_lengths(np.ones((2, 3), np.float32),
                                                                     [[2]]), name="x")
                             + h.pre_state()))
        rnn.add_outputs(h)
    with pytest.raises(sn.StepNetError, match="no product"):
        sn.quantize(rnn, "int8")
    W = sn.Parameter(np.ones((3, 3), np.float32), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():  # (now with a product)
        h = rnn.add_memory(shape=[3], name="h")
        h.update(sn.ops.tanh(rnn.add_input(sn.LoDTensor.from_lengths(np.ones((2, 3), np.float32),
                                                                     [[2]]), name="x") @ W))
        rnn.add_outputs(h)
    with pytest.raises(sn.UnsupportedError, match=r"a quantized model \(int8\) has no gradient"):
        sn.gradients(sn.quantize(rnn, "int8"), wrt=[W], grad_outputs=[np.ones((2, 3), np.float32)])
    rng = np.random.default_rng(0)
    wide = tanh_cell(lod(rng, [3, 2], 4, np.float64), weight(rng, 4, 5, dtype=np.float64))
    with pytest.raises(sn.StepNetError, match="products by constant matrices in float64; quantized"):
        sn.quantize(wide, "int8")
    with pytest.raises(sn.StepNetError, match=r"GRUCell is one step .* quantize that step-net"):
        sn.quantize(sn.nn.GRUCell(4, 8), "int8")
    pytest.importorskip("onnx")
    for as_scan in (False, True):
        with pytest.raises(sn.UnsupportedError, match=r"onnx.export: the model is quantized \(int8\)"):
            sn.onnx.export(small, "unused.onnx", as_scan=as_scan)


def test_a_quantized_model_keeps_the_weights_it_was_made_from():
    """docs/quantization.md: its weights (biases too) are a snapshot; the
    float model's are left as they were."""
    rng = np.random.default_rng(5)
    gru = sn.nn.GRU(4, 8, seed=0)
    x = (rng.standard_normal((2, 5, 4)).astype(np.float32), np.array([5, 3]))
    X, W = lod(rng, [3, 2], 4), weight(rng, 4, 5)
    b = sn.Parameter(np.full(5, 0.5, np.float32), name="b")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        h = rnn.add_memory(shape=[5], name="h")
        h.update(sn.ops.tanh(rnn.add_input(X, name="x") @ W + b + h.pre_state()))
        rnn.add_outputs(h)
    consts = len(rnn.frame.state.consts)
    models = [(gru, lambda m: m(x, backend="interpreter")[0]), (rnn, lambda m: m(backend="interpreter").data)]
    for model, run in models:
        small = sn.quantize(model, "int8")
        before = run(small)
        for p in model.parameters():
            p.value *= 3
        np.testing.assert_array_equal(run(small), before)
    assert len(rnn.frame.state.consts) == consts
    # a layer's weights are quantized by quantize itself, not at its first call
    small = sn.quantize(gru, "int8")
    for p in small.parameters():
        p.value *= 3
    np.testing.assert_array_equal(small(x, backend="interpreter")[0],
                                  sn.quantize(gru, "int8")(x, backend="interpreter")[0])


def test_quantize_names_weights_it_cannot_take_and_the_bridges_refuse_its_models():
    gru = sn.nn.GRU(4, 3, num_layers=2, seed=0)
    gru.parameters()[-1].value[0] = np.inf  # a bias: not quantized, allowed
    gru.parameters()[16].value[0, 0] = np.nan  # l1_fwd_R_r
    with pytest.raises(sn.ShapeError, match=r"the weights l1_fwd_\w+ of step-net 'gru_l1_fwd' hold NaN"):
        sn.quantize(gru, "int8")
    small = sn.quantize(sn.nn.GRU(4, 3, seed=0), "int8")
    for bridge in ("torch", "jax"):
        module = pytest.importorskip(bridge) and importlib.import_module(f"stepnet.{bridge}")
        wrap = module.Module if bridge == "torch" else module.function
        with pytest.raises(sn.UnsupportedError, match=r"GRU is quantized \(int8\): its weights are fixed"):
            wrap(small)


def test_cuda_refuses_quantized_products_before_running():
    from stepnet.jit import numba_cuda

    small = sn.quantize(sn.nn.GRU(4, 8), "int8")
    with pytest.raises(sn.UnsupportedError, match="CPU backends only"):
        numba_cuda._Kernels(small.step_net(0, 0).program(True))


def test_yaml_and_cli_quantize(tmp_path, capsys):
    from stepnet import cli

    model = sn.load_yaml("examples/custom_cell.yaml")
    small = sn.quantize(model, "int8")
    assert small.quantized == "int8" and model.quantized is None
    feeds = model.random_feeds(seed=2)
    expected = small(feeds, backend="interpreter")
    got = small(feeds, backend="numba")
    for name in expected:
        assert_close(got[name], expected[name], what=f"quantized YAML model: {name}")
    text = open("examples/custom_cell.yaml").read()
    path = tmp_path / "cell.yaml"
    path.write_text("quantize: int8\n" + text)
    from_file = sn.load_yaml(path)
    assert from_file.quantized == "int8"
    got = from_file(feeds, backend="interpreter")
    for name in expected:
        assert_close(got[name], expected[name], what=f"quantize: int8: {name}")
    path.write_text("dtype: float64\n" + text)
    with pytest.raises(sn.StepNetError, match="in float64; quantized products take float32"):
        sn.quantize(sn.load_yaml(path), "int8")
    path.write_text("inputs:\n  x: {shape: [4], lod_level: 1}\nnets:\n  rnn:\n    inputs: {x: x}\n"
                    "    memories:\n      h: {shape: [4]}\n    step:\n      - h = tanh(x + h.pre)\n"
                    "    outputs: [h]\noutputs:\n  hs: rnn.all.h\n")
    with pytest.raises(sn.StepNetError, match="no net of .* has a product"):
        sn.quantize(sn.load_yaml(path), "int8")
    path.write_text("quantize: int4\n" + text)
    with pytest.raises(sn.YAMLError, match="quantize"):
        sn.load_yaml(path)
    assert cli.main(["run", "examples/custom_cell.yaml", "--quantize", "bf16", "--backend",
                     "interpreter", "-q"]) == 0
    assert "states" in capsys.readouterr().out
    path.write_text("quantize: int8\n" + text)  # (the file's key and the flag disagree)
    assert cli.main(["run", str(path), "--quantize", "bf16", "--backend", "interpreter", "-q"]) == 1
    assert f"--quantize bf16: {path} says quantize: int8; give one of them" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("key", ["W1", "W2", "W5"])
def test_int8_error_at_the_benchmark_sizes(key):
    """docs/quantization.md's bound: int8 moves the outputs by under 1e-2 of
    their norm at the sizes of benchmarks/run.py's W1, W2 and W5 (T = 100,
    B = 64, I = 128, H = 256), on their inputs and weights (W5), or on N(0, 1)
    inputs and PyTorch-initialized weights (the layers)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import peers
    import workloads

    wl = workloads.make(key)
    if key == "W5":
        model, _ = peers.sn_custom_rnn(sn, wl)

        def run(m):
            return m(backend="numba").data
    else:
        model = (sn.nn.GRU if key == "W1" else sn.nn.LSTM)(128, 256, seed=0)
        x = (wl.x, wl.lengths)

        def run(m):
            return m(x, backend="numba")[0]
    exact = run(model)
    for mode, bound in (("int8", 1e-2), ("bf16", 4e-3)):
        error = np.linalg.norm(run(sn.quantize(model, mode)) - exact) / np.linalg.norm(exact)
        assert error < bound, (key, mode, error)


_OTHER_PATH = """
import re
import numpy as np
from llvmlite import binding
from numba import types
from stepnet.jit import int8_gemm as g, quantized as routines
from stepnet.jit.own_loop import compiled_features
from stepnet.ops import quantized as q
array = lambda dt, nd, layout="C": types.Array(dt, nd, layout)
packed = array(types.int8 if g._VNNI else types.int16, 3)  # (the path's packed weights)
g.int8_product.compile((array(types.int8, 2), array(types.float32, 1), packed,
                        array(types.float32, 1), array(types.float32, 2, "A")))
asm = g.int8_product.inspect_asm(g.int8_product.signatures[0])
if g.BF16:
    g.bf16_product.compile((array(types.float32, 2), array(types.uint16, 3),
                            array(types.float32, 2, "A")))
    asm += g.bf16_product.inspect_asm(g.bf16_product.signatures[0])
host = binding.get_host_cpu_features()
runs = all(host.get(feature, False) for feature in compiled_features())
if runs:  # this machine can run the path's code: bit for bit against the reference
    rng = np.random.default_rng(3)
    for m, k, n in ((1, 1, 1), (9, 33, 17), (13, 258, 200), (100, 128, 70)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        w, scale = q.int8_weights(rng.standard_normal((k, n)).astype(np.float32))
        out = np.full((m, n), np.nan, np.float32)
        routines.int8_rows(a, routines.int8_prepare(w, scale), out)
        np.testing.assert_array_equal(out, q.int8_product(a, w, scale))
        sums, s = g.sums_buffer(m, n), np.empty(m, np.float32)
        routines.int8_row_sums(a, routines.int8_prepare(w, scale), sums, s)
        np.testing.assert_array_equal(sums[:, :n].astype(np.float32) * (s[:, None] * scale), out)
        bits = q.to_bf16(w * scale)
        routines.bf16_rows(a, routines.bf16_prepare(bits), out)
        np.testing.assert_allclose(out, q.bf16_product(a, bits), rtol=1e-5, atol=1e-5)
print(g.int8_path(), sorted(set(re.findall(r"\\b(vpmaddwd|vpdpbusd|vdpbf16ps|tdpbusd|tdpbf16ps)\\b",
                                           asm))),
      "zmm" in asm, "ran" if runs else "compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("cpu,path,instructions,zmm", [
    ("sapphirerapids", "avx512-vnni vpdpbusd", "vdpbf16ps", True),
    ("icelake-server", "avx512-vnni vpdpbusd", "vpdpbusd", True),
    ("skylake-avx512", "avx512bw vpmaddwd", "vpmaddwd", True),
    ("alderlake", "avx-vnni vpdpbusd", "vpdpbusd", False),
    ("haswell", "avx2 vpmaddwd", "vpmaddwd", False),
    ("x86-64", "portable loop", "[]", False)])
def test_int8_paths_of_other_cpus(cpu, path, instructions, zmm, tmp_path):
    """The int8 (and bf16) products' paths for CPUs this machine may not be,
    compiled as Numba compiles for them (``NUMBA_CPU_NAME`` with its own
    features: ``NUMBA_CPU_FEATURES`` empty), their machine code holding the
    path's instruction; where this machine has the path's features, also
    run against the reference (int8 bit for bit; an AVX-512 machine runs the
    AVX2 path)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path),
               STEPNET_CACHE_DIR=str(tmp_path))
    found = subprocess.run([sys.executable, "-c", _OTHER_PATH], env=env, capture_output=True,
                           text=True, timeout=600)
    assert found.returncode == 0, found.stderr[-2000:]
    line = found.stdout.strip().splitlines()[-1]
    assert path in line and instructions in line, line  # (AMX's path first where it runs)
    assert line.endswith((f"{zmm} ran", f"{zmm} compiled")), line


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_from_torch_takes_pytorch_int8_layers(cell):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = getattr(torch.nn, cell)(6, 8, num_layers=2, bidirectional=True)
    int8 = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(module), {type(module)},
                                                  dtype=torch.qint8)[0]
    layer = getattr(sn.nn, cell).from_torch(int8)
    assert layer.quantized == "int8"
    x = np.random.default_rng(0).standard_normal((3, 5, 6)).astype(np.float32)
    with torch.inference_mode():
        theirs = int8(torch.from_numpy(x).transpose(0, 1))[0].transpose(0, 1).numpy()
        exact = module(torch.from_numpy(x).transpose(0, 1))[0].transpose(0, 1).numpy()
    ours = layer((x, np.array([5, 5, 5])), backend="numba")[0]
    ours_error, their_error = np.abs(ours - exact).max(), np.abs(theirs - exact).max()
    assert ours_error < 3e-2 and ours_error <= 2 * their_error + 1e-3, (ours_error, their_error)
