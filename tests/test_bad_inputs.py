"""Broken and hostile inputs: a named stepnet error before anything is
allocated or compiled, never a third-party exception or a traceback."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import stepnet as sn
from conftest import assert_close
from nets import named_tanh_net
from stepnet import cli
from stepnet.yaml.initializers import generator, initialize

YAML = textwrap.dedent("""\
    name: huge
    inputs:
      x: {{shape: [4], lod_level: 1}}
    parameters:
      HUGE: {{shape: [{rows}, {cols}], init: {init}}}
    nets:
      cell:
        inputs: {{xt: x}}
        memories:
          h: {{shape: [{cols}]}}
        step:
          - h = tanh(xt @ HUGE + h.pre)
        outputs: [h]
    outputs:
      final: cell.last
    """)


def _yaml(tmp_path, rows, cols, init="normal"):
    path = tmp_path / "huge.yaml"
    path.write_text(YAML.format(rows=rows, cols=cols, init=init))
    return path


def test_a_parameter_that_cannot_fit_is_refused_before_it_is_made(tmp_path):
    path = _yaml(tmp_path, 200000, 200000)
    with pytest.raises(sn.SizeError, match=r"huge.yaml.*parameter 'HUGE' \[200000, 200000\] "
                                           r"float32 needs 149 GiB, more than this machine's"):
        sn.load_yaml(path)
    with pytest.raises(MemoryError):  # (what code catching NumPy's MemoryError sees)
        sn.load_yaml(path)


def test_max_memory_sets_the_limit(tmp_path):
    path = _yaml(tmp_path, 4, 1000)  # 16 KB
    with sn.config(max_memory="8KiB"):
        with pytest.raises(sn.SizeError, match=r"needs 16 KiB, more than sn.config.max_memory "
                                               r"\(8.0 KiB; STEPNET_MAX_MEMORY\)"):
            sn.load_yaml(path)
    assert sn.load_yaml(path).parameters["HUGE"].value.shape == (4, 1000)
    for text, size in (("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096)):
        with sn.config(max_memory=text):
            assert sn.config.max_memory == size
    with pytest.raises(sn.UnsupportedError, match=r"max_memory='lots'\): expected a number"):
        sn.config(max_memory="lots")


@pytest.mark.parametrize("init", ["normal", "uniform", "xavier", "zeros", "ones"])
def test_float32_parameters_are_made_in_float32_with_the_same_values(init):
    """Drawn by blocks straight into float32: the values of one float64 draw
    of the whole shape, rounded."""
    shape = (300, 4000)  # (more than one block of draws)
    got = initialize(init, shape, np.float32, {}, generator(3, "W"))
    rng = generator(3, "W")
    scale = 1 / np.sqrt(shape[0])
    limit = np.sqrt(6.0 / sum(shape))
    expected = {"normal": lambda: rng.normal(0.0, scale, size=shape),
                "uniform": lambda: rng.uniform(-scale, scale, size=shape),
                "xavier": lambda: rng.uniform(-limit, limit, size=shape),
                "zeros": lambda: np.zeros(shape), "ones": lambda: np.ones(shape)}[init]()
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert np.array_equal(got, expected.astype(np.float32))


def test_the_command_prints_one_line_for_a_size_that_cannot_fit(tmp_path):
    path = _yaml(tmp_path, 200000, 200000)
    proc = subprocess.run([sys.executable, "-m", "stepnet", "run", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("stepnet: error: ") and "needs 149 GiB" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_command_never_prints_a_traceback_unless_asked(tmp_path, monkeypatch, capsys):
    path = _yaml(tmp_path, 4, 3)

    def broken(args):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(cli, "cmd_check", broken)
    assert cli.main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == ("stepnet: error: RuntimeError: something inside broke "
                   "(--debug shows where)\n")
    with pytest.raises(RuntimeError, match="something inside broke"):
        cli.main(["check", str(path), "--debug"])


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    pytest.importorskip("onnx")
    path = tmp_path_factory.mktemp("onnx") / "gru.onnx"
    sn.onnx.export(sn.nn.GRU(3, 4, seed=0), str(path))
    return path


@pytest.mark.parametrize("damage", ["truncated", "random", "empty-name"])
def test_a_damaged_onnx_file_is_a_stepnet_error_that_names_it(onnx_file, tmp_path, damage):
    data = onnx_file.read_bytes()
    bad = tmp_path / f"{damage}.onnx"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        bad.write_bytes(b"\x0a\xff\xff\xff\xff\x0f")  # a field longer than the file
    with pytest.raises(sn.Error, match=rf"ONNX model '{bad}' cannot be read: .* \(a truncated or "
                                       r"damaged file, or not an ONNX model\)"):
        sn.onnx.InferenceSession(str(bad))
    with pytest.raises(sn.Error, match=r"ONNX model 'given as bytes' cannot be read"):
        sn.onnx.InferenceSession(bad.read_bytes())
    assert os.path.exists(bad)


def _broadcast_lod(rows, features=3):
    """A LoDTensor of ``rows`` rows in one sequence that takes no memory: one
    row broadcast (a LoD can declare billions of steps)."""
    data = np.broadcast_to(np.zeros((1, features), np.float32), (rows, features))
    return sn.LoDTensor(data, [[0, rows]])


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_a_call_whose_outputs_cannot_fit_is_refused_before_they_are_made(backend):
    gru = sn.nn.GRU(3, 128, seed=0)
    with pytest.raises(sn.SizeError, match=r"^the outputs of step-net 'gru_l0_fwd' need 1.4 TiB, "
                                           r"more than this machine's memory \(.*\); the largest, "
                                           r"output 0 \(\w+\) \[3000000000, 128\] float32, 1.4 TiB$"):
        gru(_broadcast_lod(3_000_000_000), backend=backend)
    # (outputs under 16 MiB in all are not checked: no machine has less)
    with sn.config(max_memory="16MiB"):  # 40960 steps of 128 float32: 20 MiB
        with pytest.raises(sn.SizeError, match=r"need 20 MiB, more than sn.config.max_memory"):
            gru(_broadcast_lod(40960), backend="interpreter")
    with sn.config(max_memory="1KiB"):
        out, _ = gru(_broadcast_lod(100), backend="interpreter")  # 50 KiB: not checked
    assert out.data.shape == (100, 128)


def test_copies_a_call_makes_of_its_inputs_are_refused_before_they_are_made():
    """A broadcast input cast to the net's dtype, and a memory's initial
    value made whole, are copies as large as the LoD or the shape says."""
    rows = 3_000_000_000
    wide = sn.LoDTensor(np.broadcast_to(np.zeros((1, 3), np.float64), (rows, 3)), [[0, rows]])
    with pytest.raises(sn.SizeError, match=r"^LoDTensor.astype: the cast copy \[3000000000, 3\] "
                                           r"float32 needs 34 GiB"):
        sn.nn.GRU(3, 4, seed=0)(wide, backend="interpreter")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        rnn.add_input(sn.LoDTensor(np.zeros((2, 1), np.float32), [[0, 1, 2]]), name="X")
        h = rnn.add_memory(shape=[rows], name="h")
        h.update(h.pre_state() * 2.0)
        rnn.add_outputs(h)
    with sn.config(max_memory="1GiB"), pytest.raises(
            sn.SizeError, match=r"^memory h's initial value \[2, 3000000000\] float32 needs 22 GiB"):
        rnn(backend="interpreter", output_all_steps=False)
    rnn = sn.create_rnn_op()  # (last steps only: the kernel's contiguous copy of the rows)
    with rnn.stepnet():
        x = rnn.add_input(_broadcast_lod(2), name="X")
        h = rnn.add_memory(shape=[3], name="h")
        h.update(h.pre_state() + x)
        rnn.add_outputs(h)
    if "numba" in sn.backends():
        with pytest.raises(sn.SizeError, match=r"^an input's rows made contiguous \[3000000000, 3\]"):
            rnn(X=_broadcast_lod(rows), backend="numba", output_all_steps=False)


def test_a_training_call_whose_workspace_cannot_fit_is_refused_before_it_runs():
    """The values a training call keeps for its backward count with its
    outputs: 20000 steps of a GRU of 128 units give 10 MiB of outputs (it
    runs) and several times that kept."""
    gru = sn.nn.GRU(3, 128, seed=0)
    X = _broadcast_lod(20000)
    with sn.config(max_memory="32MiB"):
        gru(X, backend="interpreter")
        with pytest.raises(sn.SizeError, match=r"^the outputs and workspace of step-net "
                                               r"'gru_l0_fwd' need \d+ MiB, more than "
                                               r"sn.config.max_memory \(32 MiB"):
            sn.vjp(gru, X, backend="interpreter")


def test_onnx_sizes_are_checked_before_arrays_are_made(tmp_path):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([200000, 200000], np.int64), "shape")
    huge = TensorProto(name="HUGE", data_type=TensorProto.FLOAT, dims=[200000, 200000])
    for name, nodes, inits, message in (
            ("initializer", [helper.make_node("Identity", ["HUGE"], ["y"])], [huge],
             r"ONNX graph: initializer 'HUGE' \[200000, 200000\] float32 needs 149 GiB"),
            ("constant_of_shape", [helper.make_node("ConstantOfShape", ["shape"], ["y"],
                                                    name="zeros")], [shape],
             r"ONNX node 'zeros' \(ConstantOfShape\): its output \[200000, 200000\] \(a byte an "
             r"element at least\) needs 37 GiB"),
            ("expand", [helper.make_node("Expand", ["x", "shape"], ["y"], name="wide")], [shape],
             r"ONNX node 'wide' \(Expand\): its output \[200000, 200000\] float32 needs 149 GiB"),
            ("range", [helper.make_node("Range", ["zero", "far", "one"], ["y"], name="count")],
             [numpy_helper.from_array(np.array(v, np.int64), n)
              for n, v in (("zero", 0), ("far", 10**11), ("one", 1))],
             r"ONNX node 'count' \(Range\): its output \[100000000000\] int64 needs 745 GiB"),
            ("pad", [helper.make_node("Pad", ["x", "pads"], ["y"], name="wider")],
             [numpy_helper.from_array(np.array([0, 0, 0, 10**11], np.int64), "pads")],
             r"ONNX node 'wider' \(Pad\): its output \[1, 100000000001\] float32 needs 373 GiB")):
        graph = helper.make_graph(
            nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
        with pytest.raises(sn.SizeError, match=rf"^{path}: {message}, more than this machine's"):
            sn.onnx.InferenceSession(str(path), backend="interpreter").run(
                None, {"x": np.ones((1, 1), np.float32)})


def test_rows_and_random_inputs_of_declared_shapes_are_checked(tmp_path, capsys):
    text = textwrap.dedent("""\
        name: wide
        inputs:
          x: {{shape: [{width}], lod_level: 1}}
        parameters:
          W: {{shape: [4, 4]}}
        nets:
          cell:
            inputs: {{xt: x}}
            memories:
              h: {{shape: [4]}}
            step:
              - h = tanh(h.pre @ W)
            outputs: [h]
        outputs:
          final: cell.last
        """)
    wide = tmp_path / "wide.yaml"
    wide.write_text(text.format(width=10**12))
    with pytest.raises(sn.SizeError, match=rf"^{wide}:3: inputs.x.shape: one row \[1000000000000\] "
                                           r"\(a byte an element at least\) needs 931 GiB"):
        sn.load_yaml(wide)
    rows = tmp_path / "rows.yaml"  # a row fits; `stepnet run`'s random rows would not
    rows.write_text(text.format(width=10**8))
    with sn.config(max_memory="1GiB"):
        assert cli.main(["run", str(rows), "--backend", "interpreter", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"stepnet: error: {rows}: random input 'x' of up to [24, 100000000] float64 needs 18 GiB, "
        "more than sn.config.max_memory (1.0 GiB; STEPNET_MAX_MEMORY)\n")
    model = sn.load_yaml(rows)  # and from Python, the rows it draws
    with sn.config(max_memory="1GiB"):
        with pytest.raises(sn.SizeError, match=r"^random input 'x' \[\d+, 100000000\] float64 "
                                               r"needs \d+ GiB, more than sn.config.max_memory"):
            model.random_feeds(num_sequences=4, max_length=6)


def test_a_hidden_size_typed_with_extra_zeros_is_refused_naming_the_parameter():
    with pytest.raises(sn.SizeError, match=r"^the parameters of GRU\(hidden_size=2560000000\) "
                                           r"need .* TiB, more than .*; the largest, l0_fwd_R "
                                           r"\[2560000000, 7680000000\] float32"):
        sn.nn.GRU(128, 2560000000)


def _tanh_net(dtype=np.float32, **memory):
    """``h = tanh(x @ W + h.pre)`` over two sequences of 3 and 2 rows of 3
    features (W [3, 4]): the step-net, X and W."""
    rng = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(dtype), [[2, 3]])
    W = sn.Parameter(rng.standard_normal((3, 4)).astype(dtype), name="W")
    return named_tanh_net(X, W, **memory), X, W


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
@pytest.mark.parametrize("shape", [(3, 6), (1, 4), (0, 0)])
def test_a_parameter_given_another_shape_after_the_definition_is_refused(backend, shape):
    """Kernels index a constant by the shape it had when the step-net was
    defined: a Parameter whose value changed shape since is refused by name
    before anything runs (a layer's too)."""
    rnn, X, W = _tanh_net(shape=[4])
    rnn(backend=backend)
    W.value = np.zeros(shape, np.float32)
    with pytest.raises(sn.ShapeError, match=rf"Parameter W: its value now has shape \[{shape[0]}, "
                       rf"{shape[1]}\], but rnn was defined with \[3, 4\]"):
        rnn(backend=backend)
    gru = sn.nn.GRU(3, 4, seed=0)
    gru(X, backend=backend)
    weight = gru.parameters()[0]
    weight.value = np.zeros((3, 5), np.float32)
    with pytest.raises(sn.ShapeError, match=f"Parameter {weight.name}: its value now has shape"):
        gru(X, backend=backend)


@pytest.mark.parametrize("offsets, states, error, message", [
    ([0, 2, 500000], [None], sn.LoDError, "offsets end at 500000 but the data has 5 rows"),
    ([0, 4, 2], [None], sn.LoDError, "offsets must be non-decreasing"),
    ([0, -3, 5], [None], sn.LoDError, "offsets must be non-negative"),
    ([0.0, 2.0, 5.0], [None], sn.LoDError, "offsets must be integers"),
    ([0, 2, 5], [np.zeros((1, 4), np.float32)], sn.ShapeError, r"state 0 has shape \[1, 4\]"),
    ([0, 2, 5], [np.zeros((2, 1), np.float32)], sn.ShapeError, r"takes \[2, 4\]"),
    ([0, 2, 5], [None, None], sn.ShapeError, "2 states given, the step-net takes 1"),
])
def test_a_prepared_call_checks_its_offsets_and_states(offsets, states, error, message):
    """The prepared call (docs/design.md §4) reads rows by its offsets and a
    row per sequence of each state: both are checked before the kernel."""
    rnn, X, _ = _tanh_net(init=np.zeros((2, 4), np.float32))
    f = rnn.compile("numba")
    f()
    f.wait()
    call = f.prepared(True)
    assert call is not None
    Y = call(X.data, np.array([0, 2, 5]), [None])[0]
    assert_close(Y, rnn(backend="interpreter").data)
    with pytest.raises(error, match=message):
        call(X.data, np.array(offsets), states)


def test_arguments_of_the_wrong_kind_are_named(tmp_path, capsys):
    """wrt: one item is a list of one, anything else not a list is named;
    out: a read-only or integer buffer is named; output_all_steps: a string
    is not a sequence of flags; --seed: a negative seed is named."""
    rnn, _, W = _tanh_net(np.float64, shape=[4])
    kwargs = {"grad_outputs": [np.ones((2, 4))], "output_all_steps": False, "backend": "interpreter"}
    one, = sn.gradients(rnn, wrt=W, **kwargs)
    assert_close(one, sn.gradients(rnn, wrt=[W], **kwargs)[0])
    with pytest.raises(sn.StepNetError, match="wrt: expects Parameters or input names.*got int"):
        sn.gradients(rnn, wrt=5, **kwargs)
    read_only = np.zeros((3, 4))
    read_only.flags.writeable = False
    for buffer, what in ((read_only, "a read-only float64 array"), (np.zeros((3, 4), np.int32),
                                                                     "a int32 array")):
        with pytest.raises(sn.ShapeError, match=f"out\\[0\\]: needs a writeable array .* got {what}"):
            sn.gradients(rnn, wrt=[W], accumulate=True, out=[buffer], **kwargs)
    with pytest.raises(sn.ShapeError,
                       match=r"grad_outputs\[0\] \(output \w+\): dtype <U1 is not a number"):
        sn.gradients(rnn, wrt=[W], grad_outputs=[np.full((2, 4), "a")], output_all_steps=False,
                     backend="interpreter")
    with pytest.raises(sn.StepNetError, match="output_all_steps: expects a bool, or one per output"):
        rnn(output_all_steps="yes", backend="interpreter")
    with pytest.raises(SystemExit):
        cli.main(["check", str(_yaml(tmp_path, 4, 3)), "--seed", "-1"])
    assert "argument --seed: expects a whole number >= 0, got '-1'" in capsys.readouterr().err


def test_an_input_file_whose_lod_and_lengths_disagree_is_refused(tmp_path, capsys):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_cell.yaml")
    np.savez(tmp_path / "in.npz", x=np.ones((7, 24), np.float32),
             **{"x.lod.0": np.array([0, 3, 7]), "x.lengths.0": np.array([2, 5])})
    assert cli.main(["run", example, "--input", str(tmp_path / "in.npz")]) == 1
    assert "has both x.lod.0 and x.lengths.0, and they disagree" in capsys.readouterr().err


def test_a_layer_size_that_is_no_whole_number_is_named(tmp_path, capsys):
    for value in ("two", True, 2.5, float("nan")):
        with pytest.raises(sn.StepNetError, match=f"GRU: num_layers must be a positive integer, "
                                                  f"got {re.escape(repr(value))}"):
            sn.nn.GRU(3, 4, num_layers=value)
    path = tmp_path / "layers.yaml"
    path.write_text("inputs:\n  x: {shape: [4]}\nlayers:\n  enc:\n    type: gru\n    input: x\n"
                    "    hidden_size: 5\n    num_layers: two\noutputs:\n  y: enc.all\n")
    with pytest.raises(sn.YAMLError, match=r"layers.yaml:8: layers.enc.num_layers: .*got 'two'"):
        sn.load_yaml(path)


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_data_shrunk_in_place_under_its_lod_is_refused_before_a_kernel_reads_it(backend):
    rng = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(np.float32), [[2, 3]])
    rnn = named_tanh_net(X, sn.Parameter(rng.standard_normal((3, 4)).astype(np.float32)), shape=[4])
    Y = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(np.float32), [[2, 3]])
    Y.data.resize((2, 3), refcheck=False)
    with pytest.raises(sn.LoDError, match="input x: the LoD's offsets end at 5 but the data has 2 rows"):
        rnn(x=Y, backend=backend)
