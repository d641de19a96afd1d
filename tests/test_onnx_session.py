"""stepnet.onnx.InferenceSession against ONNX's own node tests and onnxruntime."""

import importlib
import warnings

import numpy as np
import pytest

import stepnet as sn

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from stepnet.onnx import InferenceSession  # noqa: E402

from conftest import assert_close  # noqa: E402
from nets import nested_encoder  # noqa: E402

# ----------------------------------------------------------------------------
# every ONNX backend node test of GRU, LSTM, RNN and Scan


def _node_cases():
    """The test cases onnx generates for its recurrent ops (its own
    collect/expect machinery, importing only those four modules)."""
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in ("gru", "lstm", "rnn", "scan"):
            importlib.import_module(f"onnx.backend.test.case.node.{module}")
    return [c for c in node_cases._NodeTestCases
            if c.model.graph.node[0].op_type in ("GRU", "LSTM", "RNN", "Scan")]


NODE_CASES = {c.name: c for c in _node_cases()}
# Numba compiles a kernel per case: a sample runs by default, all of them under -m slow
NUMBA_SAMPLE = {"test_gru_seq_length", "test_lstm_with_peepholes", "test_simple_rnn_bidirectional",
                "test_scan_sum", "test_scan9_multi_state"}


def _backend_params():
    for name in sorted(NODE_CASES):
        yield pytest.param(name, "interpreter", id=f"{name}-interpreter")
        marks = () if name in NUMBA_SAMPLE else (pytest.mark.slow,)
        yield pytest.param(name, "numba", id=f"{name}-numba", marks=marks)


def test_every_recurrent_node_case_is_collected():
    counts = {}
    for c in NODE_CASES.values():
        op = c.model.graph.node[0].op_type
        counts[op] = counts.get(op, 0) + 1
    print(f"\nONNX backend node cases: {len(NODE_CASES)} ({counts})")
    assert set(counts) == {"GRU", "LSTM", "RNN", "Scan"}
    assert len(NODE_CASES) >= 22


@pytest.mark.parametrize("name, backend", list(_backend_params()))
def test_onnx_backend_node_case(name, backend):
    case = NODE_CASES[name]
    session = InferenceSession(case.model, backend=backend)
    for inputs, outputs in case.data_sets:
        feeds = {arg.name: value for arg, value in zip(session.get_inputs(), inputs)}
        got = session.run(None, feeds)
        assert len(got) == len(outputs)
        for g, e in zip(got, outputs):
            assert_close(g, np.asarray(e), what=name)
            # and at ONNX's own tolerances, as its backend test runner checks
            np.testing.assert_allclose(g, e, rtol=case.rtol, atol=case.atol, err_msg=name)


# ----------------------------------------------------------------------------
# helpers: single-node models, run by stepnet and by onnxruntime


def _model(nodes, inputs, outputs, initializers=(), opset=22, domain_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in domain_opsets]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    return model


def _info(name, array):
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)
    return helper.make_tensor_value_info(name, elem, list(np.shape(array)))


def _ort_run(model, feeds, names=None):
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


def _compare(model, feeds, backends=("interpreter",), names=None, tol_dtype=None):
    expected = _ort_run(model, feeds, names)
    for backend in backends:
        got = InferenceSession(model, backend=backend).run(names, feeds)
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_close(g, e, dtype=tol_dtype, what=f"{backend} output {i}")
    return expected


# ----------------------------------------------------------------------------
# randomized GRU / LSTM / RNN nodes over the attribute space, onnxruntime the oracle

_ACTIVATIONS = ["Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh",
                "HardSigmoid", "Elu", "Softsign", "Softplus"]
_TAKES = {"Affine": 2, "LeakyRelu": 1, "ThresholdedRelu": 1, "ScaledTanh": 2, "HardSigmoid": 2,
          "Elu": 1}
_GATES = {"GRU": 3, "LSTM": 4, "RNN": 1}
_NUM_ACTS = {"GRU": 2, "LSTM": 3, "RNN": 1}


def random_recurrent_node(op, seed):
    """One GRU/LSTM/RNN node with attributes and optional inputs drawn at random."""
    r = np.random.default_rng(seed)
    T, B, I, H = int(r.integers(1, 6)), int(r.integers(1, 5)), int(r.integers(1, 5)), int(r.integers(1, 5))
    direction = ["forward", "reverse", "bidirectional"][r.integers(3)]
    D = 2 if direction == "bidirectional" else 1
    G = _GATES[op]
    layout = int(r.integers(2))
    attrs = {"hidden_size": H, "direction": direction, "layout": layout}
    if r.random() < 0.5:
        acts = [str(a) for a in r.choice(_ACTIVATIONS, _NUM_ACTS[op] * (D if r.random() < 0.5 else 1))]
        attrs["activations"] = acts
        n_alpha = sum(_TAKES.get(a, 0) >= 1 for a in acts)
        n_beta = sum(_TAKES.get(a, 0) >= 2 for a in acts)
        # onnxruntime's defaults differ from the ONNX operators' for these
        # three (docs/onnx.md): the models spell their parameters out
        explicit = any(a in ("Affine", "ScaledTanh", "ThresholdedRelu") for a in acts)
        if n_alpha and (explicit or r.random() < 0.7):
            attrs["activation_alpha"] = [float(v) for v in r.uniform(0.1, 1.5, n_alpha)]
        if n_beta and (explicit or r.random() < 0.7):
            attrs["activation_beta"] = [float(v) for v in r.uniform(0.1, 1.0, n_beta)]
    if r.random() < 0.3:
        attrs["clip"] = float(r.uniform(0.5, 3.0))
    if op == "GRU" and r.random() < 0.5:
        attrs["linear_before_reset"] = 1
    if op == "LSTM" and r.random() < 0.3:
        attrs["input_forget"] = 1
    f = np.float32
    x_shape = (B, T, I) if layout else (T, B, I)
    state_shape = (B, D, H) if layout else (D, B, H)
    arrays = {"X": r.standard_normal(x_shape).astype(f),
              "W": (r.standard_normal((D, G * H, I)) * 0.6).astype(f),
              "R": (r.standard_normal((D, G * H, H)) * 0.6).astype(f)}
    if r.random() < 0.7:
        arrays["B"] = (r.standard_normal((D, 2 * G * H)) * 0.3).astype(f)
    if r.random() < 0.6:
        arrays["sequence_lens"] = r.integers(1, T + 1, B).astype(np.int32)
    if r.random() < 0.6:
        arrays["initial_h"] = r.standard_normal(state_shape).astype(f)
    if op == "LSTM":
        if r.random() < 0.5:
            arrays["initial_c"] = r.standard_normal(state_shape).astype(f)
        if r.random() < 0.5:
            arrays["P"] = (r.standard_normal((D, 3 * H)) * 0.5).astype(f)
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h"] + (["initial_c", "P"] if op == "LSTM" else [])
    node_inputs = [n if n in arrays else "" for n in order]
    while node_inputs[-1] == "":
        node_inputs.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    if r.random() < 0.3:
        outputs[0] = ""  # Y omitted
    elif r.random() < 0.3:
        outputs = outputs[:1]  # only Y
    # weights as initializers half of the time, as graph inputs otherwise
    as_init = r.random() < 0.5

    def build(attrs, arrays):
        node = helper.make_node(op, node_inputs, outputs, **attrs)
        inits = [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B", "P")
                 if k in arrays and as_init]
        feeds = {k: v for k, v in arrays.items() if not (as_init and k in ("W", "R", "B", "P"))}
        model = _model([node], [_info(k, v) for k, v in feeds.items()],
                       [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o],
                       inits)
        return model, feeds

    model, feeds = build(attrs, arrays)
    # onnxruntime runs neither layout=1 nor one direction's activations for
    # both: its model is the same node with layout 0 and the list spelled out
    oracle_attrs = dict(attrs, layout=0)
    if "activations" in attrs and len(attrs["activations"]) < _NUM_ACTS[op] * D:
        oracle_attrs["activations"] = attrs["activations"] * 2
        for key in ("activation_alpha", "activation_beta"):
            if key in attrs:
                oracle_attrs[key] = attrs[key] * 2
    oracle_arrays = dict(arrays)
    if layout:
        for k in ("X", "initial_h", "initial_c"):
            if k in arrays:
                oracle_arrays[k] = np.ascontiguousarray(np.swapaxes(arrays[k], 0, 1))
    oracle_model, oracle_feeds = build(oracle_attrs, oracle_arrays)
    expected = _ort_run(oracle_model, oracle_feeds)
    if layout:  # Y [T, D, B, H] -> [B, T, D, H]; states [D, B, H] -> [B, D, H]
        expected = [np.transpose(e, (2, 0, 1, 3)) if e.ndim == 4 else np.swapaxes(e, 0, 1)
                    for e in expected]
    return model, feeds, expected


RANDOM_SEEDS = range(24)


@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_recurrent_node_matches_onnxruntime(op, seed):
    _check_random_node(op, seed, "interpreter")


def _check_random_node(op, seed, backend):
    model, feeds, expected = random_recurrent_node(op, seed)
    got = InferenceSession(model, backend=backend).run(None, feeds)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        # unbounded activations (Relu, Softplus, Affine) can overflow float32;
        # onnxruntime's Softplus overflows earlier than stepnet's: compare
        # where the oracle is finite
        finite = np.isfinite(e)
        assert finite.mean() > 0.5
        assert_close(np.where(finite, g, 0), np.where(finite, e, 0), what=f"{op} seed {seed} output {i}")


@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_recurrent_node_numba(op, seed):
    _check_random_node(op, seed, "numba")


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_a_bidirectional_nodes_directions_run_apart(op, run_apart_calls):
    """A bidirectional node over enough rows (threads.SPLIT_MIN_WORK, 0
    here) runs its two directions at once (threads.run_apart), to
    onnxruntime's results."""
    calls = run_apart_calls
    seeds = []
    for seed in range(40):
        node = random_recurrent_node(op, seed)[0].graph.node[0]
        if any(a.name == "direction" and a.s == b"bidirectional" for a in node.attribute):
            seeds.append(seed)
        if len(seeds) == 2:
            break
    assert len(seeds) == 2
    for seed in seeds:
        calls.clear()
        _check_random_node(op, seed, "numba")
        assert calls == [[0, 1]]


@pytest.mark.slow
@pytest.mark.parametrize("op", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_recurrent_node_numba_all(op, seed):
    _check_random_node(op, seed, "numba")


def _gru_arrays(r, T=4, B=3, I=5, H=6, dtype=np.float32):
    return {"X": r.standard_normal((T, B, I)).astype(dtype),
            "W": (r.standard_normal((1, 3 * H, I)) * 0.5).astype(dtype),
            "R": (r.standard_normal((1, 3 * H, H)) * 0.5).astype(dtype),
            "B": (r.standard_normal((1, 6 * H)) * 0.3).astype(dtype)}


def _gru_model(arrays, opset, H=6, extra_attrs=None, outputs=("Y", "Y_h"), elem=TensorProto.FLOAT):
    node = helper.make_node("GRU", ["X", "W", "R", "B"], list(outputs), hidden_size=H,
                            **(extra_attrs or {}))
    return _model([node], [_info("X", arrays["X"])],
                  [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                  [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B")], opset=opset)


@pytest.mark.parametrize("opset", [7, 14, 22])
def test_gru_opsets(opset, rng):
    arrays = _gru_arrays(rng)
    _compare(_gru_model(arrays, opset), {"X": arrays["X"]})


def test_gru_opset3_output_sequence(rng):
    arrays = _gru_arrays(rng)
    expected = InferenceSession(_gru_model(arrays, 22)).run(None, {"X": arrays["X"]})
    for flag in (0, 1):
        model = _gru_model(arrays, 3, extra_attrs={"output_sequence": flag})
        got = InferenceSession(model, backend="interpreter").run(None, {"X": arrays["X"]})
        assert_close(got, expected)


def test_float16_model_is_computed_in_float32(rng):
    arrays = _gru_arrays(rng)
    half = {k: v.astype(np.float16) for k, v in arrays.items()}
    model = _gru_model(half, 22, elem=TensorProto.FLOAT16)
    Y, Y_h = InferenceSession(model, backend="interpreter").run(None, {"X": half["X"]})
    assert Y.dtype == np.float16 and Y_h.dtype == np.float16
    wide = {k: v.astype(np.float32) for k, v in half.items()}
    expected = _ort_run(_gru_model(wide, 22), {"X": wide["X"]})
    assert_close(Y, expected[0].astype(np.float16))
    assert_close(Y_h, expected[1].astype(np.float16))


def test_float64_lstm_matches_float32_oracle(rng):
    """onnxruntime's CPU LSTM is float32 only: float64 is checked against it at
    float32's tolerance and against stepnet's own two backends at float64's."""
    T, B, I, H = 5, 2, 3, 4
    arrays = {"X": rng.standard_normal((T, B, I)), "W": rng.standard_normal((1, 4 * H, I)) * 0.5,
              "R": rng.standard_normal((1, 4 * H, H)) * 0.5}
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y", "Y_h", "Y_c"], hidden_size=H)

    def model(dtype):
        a = {k: v.astype(dtype) for k, v in arrays.items()}
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        return _model([node], [_info(k, a[k]) for k in a],
                      [helper.make_tensor_value_info(o, elem, None) for o in ("Y", "Y_h", "Y_c")]), a

    m64, a64 = model(np.float64)
    interp = InferenceSession(m64, backend="interpreter").run(None, a64)
    assert all(y.dtype == np.float64 for y in interp)
    assert_close(InferenceSession(m64, backend="numba").run(None, a64), interp)
    m32, a32 = model(np.float32)
    oracle = _ort_run(m32, a32)
    assert_close([y.astype(np.float32) for y in interp], oracle)


def test_zero_length_sequence(rng):
    """A sequence of length 0 gives zeros in Y and its initial state in Y_h."""
    arrays = _gru_arrays(rng)
    h0 = rng.standard_normal((1, 3, 6)).astype(np.float32)
    node = helper.make_node("GRU", ["X", "W", "R", "B", "L", "h0"], ["Y", "Y_h"], hidden_size=6)
    model = _model([node], [_info("X", arrays["X"]), _info("L", np.zeros(3, np.int32)),
                            _info("h0", h0)],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("Y", "Y_h")],
                   [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B")])
    lengths = np.array([4, 0, 2], np.int32)
    Y, Y_h = InferenceSession(model, backend="interpreter").run(
        None, {"X": arrays["X"], "L": lengths, "h0": h0})
    assert np.all(Y[:, :, 1] == 0) and np.all(Y[2:, :, 2] == 0)
    assert_close(Y_h[:, 1], h0[:, 1])
    # the other sequences are what onnxruntime gives with lengths >= 1
    ok = np.array([4, 1, 2], np.int32)
    expected = _ort_run(model, {"X": arrays["X"], "L": ok, "h0": h0})
    assert_close(Y[:, :, [0, 2]], expected[0][:, :, [0, 2]])


def _streaming_lstm(direction, layout, I, H):
    """An LSTM node model with sequence_lens ``L`` and the same without it
    (a streaming model), ``weights(seed)`` and ``feeds(batch, steps, seed)``."""
    D = 2 if direction == "bidirectional" else 1
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "L", "h0", "c0"], ["Y", "Y_h", "Y_c"],
                            hidden_size=H, direction=direction, layout=layout, name="lstm")
    dims = ["B", D, H] if layout else [D, "B", H]
    model = _model([node], [_float("X", ["T", "B", "I"] if not layout else ["B", "T", "I"]),
                            _float("W", [D, 4 * H, I]), _float("R", [D, 4 * H, H]),
                            _float("B", [D, 8 * H]),
                            helper.make_tensor_value_info("L", TensorProto.INT32, ["B"]),
                            _float("h0", dims), _float("c0", dims)],
                   [_float("Y"), _float("Y_h"), _float("Y_c")])
    without_lengths = _model([helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "c0"],
                                               ["Y", "Y_h", "Y_c"], hidden_size=H,
                                               direction=direction, layout=layout,
                                               name="lstm")],
                             [i for i in model.graph.input if i.name != "L"],
                             list(model.graph.output))

    def weights(seed):
        r = np.random.default_rng(seed)
        return {k: (r.standard_normal(shape) * 0.5).astype(np.float32) for k, shape in
                (("W", (D, 4 * H, I)), ("R", (D, 4 * H, H)), ("B", (D, 8 * H)))}

    def feeds(batch, steps, seed):
        r = np.random.default_rng(seed)
        x = r.standard_normal((batch, steps, I) if layout else (steps, batch, I))
        state = (batch, D, H) if layout else (D, batch, H)
        return {"X": x.astype(np.float32), "h0": r.standard_normal(state).astype(np.float32),
                "c0": r.standard_normal(state).astype(np.float32)}

    return model, without_lengths, weights, feeds


def test_a_streaming_bidirectional_nodes_directions_run_apart(monkeypatch, run_apart_calls):
    """A node without sequence_lens, called again with the same weights,
    takes its streaming path; there too its directions run at once over
    enough rows (SPLIT_MIN_WORK 0 here), to the interpreter's results.

    Which way a call goes (rows by steps, or the sequences' order where
    the library's bits differ by rows; each kernel called directly with
    one thread) depends on the machine, so each call is checked for what
    holds on every one: its directions never run one without the other,
    and with two threads or more they run at once."""
    from stepnet.jit import threads
    from stepnet.onnx import recurrent

    calls = run_apart_calls
    streamed = []
    run_streaming = recurrent.RecurrentNode._run_streaming

    def streaming(self, *args):
        out = run_streaming(self, *args)
        streamed.append(out is not None)
        return out

    monkeypatch.setattr(recurrent.RecurrentNode, "_run_streaming", streaming)
    _, model, weights, feeds = _streaming_lstm("bidirectional", 0, 3, 4)
    ours = InferenceSession(model, backend="numba")
    oracle = InferenceSession(model, backend="interpreter")
    f = {**feeds(3, 5, 0), **weights(0)}
    for _ in range(4):
        calls.clear()
        for g, e in zip(ours.run(None, f), oracle.run(None, f)):
            assert_close(g, e, what="streaming LSTM")
        assert all(items == [0, 1] for items in calls), calls
        if threads.count() >= 2:
            assert calls, "the directions ran one after the other"
    # the kernels are prepared once they have answered (the first call
    # compiles them): from then on the calls stream
    assert streamed[-2:] == [True, True], streamed


def test_a_read_only_view_fed_as_weights_is_read_again_at_each_call(rng):
    """A weight fed as a read-only view of the caller's array, which changes
    in place between calls, is the caller's (its values read at each call),
    not one of the session's constants (kept by identity: the first call's
    weights ran again)."""
    arrays = _gru_arrays(rng)
    node = helper.make_node("GRU", ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=6)
    model = _model([node], [_info("X", arrays["X"]), _info("R", arrays["R"])],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("Y", "Y_h")],
                   [numpy_helper.from_array(arrays[k], k) for k in ("W", "B")])
    session = InferenceSession(model, backend="interpreter")
    R = arrays["R"].copy()
    view = R.view()
    view.flags.writeable = False
    for call in range(3):
        feeds = {"X": arrays["X"], "R": view}
        assert_close(session.run(None, feeds), _ort_run(model, {**feeds, "R": R.copy()}),
                     what=f"call {call}")
        R *= 0.5  # (the caller's array, changed in place)


@pytest.mark.parametrize("direction, layout", [("forward", 0), ("bidirectional", 1)])
def test_recurrent_node_called_again_and_again(direction, layout, rng):
    """A streaming model's calls (same weights, states fed back) take the
    node's short path on numba (its kernel's machine code called directly);
    new weights, another batch, states that are strided views, a wrong
    state shape, a wrong width of X and sequence_lens still get what the
    interpreter gives."""
    D, I, H = (2 if direction == "bidirectional" else 1), 3, 4
    model, without_lengths, weights, feeds = _streaming_lstm(direction, layout, I, H)

    ours = InferenceSession(without_lengths, backend="numba")
    oracle = InferenceSession(without_lengths, backend="interpreter")
    lstm = ours.graph.nodes[0].impl
    w, got = weights(0), None
    for call, (batch, steps, new_weights) in enumerate(
            [(2, 3, None), (2, 3, None), (2, 3, None), (3, 5, None), (3, 5, 1), (1, 2, None),
             (1, 2, 1)]):
        if new_weights is not None:  # new values, then the same values in new arrays
            w = weights(new_weights) if call == 4 else {k: v.copy() for k, v in w.items()}
        f = {**feeds(batch, steps, call), **w}
        if call == 2:  # the states fed back, as a stream does
            f["h0"], f["c0"] = got[1], got[2]
        if call in (2, 3, 5):
            assert lstm._streaming is not None, f"call {call}: the short path is not taken"
        got = ours.run(None, f)
        assert_close(got, oracle.run(None, f), what=f"call {call}")
    # each direction's machine code called at once where every argument is exact
    direct = []
    for kernel in lstm._streaming[1]:
        kernel.direct = (lambda f: lambda *args: direct.append(1) or f(*args))(kernel.direct)
    f = {**feeds(1, 2, 12), **w}
    assert_close(ours.run(None, f), oracle.run(None, f), what="direct")
    assert len(direct) == D
    strided = {**feeds(2, 3, 11), **w}  # states that are views with a stride
    for name in ("h0", "c0"):
        strided[name] = np.repeat(strided[name], 2, axis=-1)[..., ::2]
    assert not strided["h0"].flags.c_contiguous
    assert_close(ours.run(None, strided), oracle.run(None, strided), what="strided states")
    assert len(direct) == D  # (not for strided states: the prepared call takes them)
    bad = {**feeds(2, 3, 9), **w}
    bad["h0"] = bad["h0"][:1] if layout else bad["h0"][:, :1]  # one row for a batch of two
    for session in (ours, oracle):
        with pytest.raises(sn.ShapeError, match="initial_h has shape"):
            session.run(None, bad)
    wide = {**feeds(2, 3, 9), **w}
    wide["X"] = np.concatenate([wide["X"], wide["X"]], axis=2)  # 6 features for weights of 3
    for session in (ours, oracle):
        with pytest.raises(sn.ShapeError, match="'lstm' \\(LSTM\\)"):
            session.run(None, wide)
    f = {**feeds(3, 4, 10), **w, "L": np.array([4, 1, 3], np.int32)}
    assert_close(InferenceSession(model, backend="numba").run(None, f),
                 InferenceSession(model, backend="interpreter").run(None, f), what="lengths")


def _full_sequences_node(op, direction, seed, B=3, T=5, I=4, H=5, lengths=None):
    """A time-major (layout 0) node, without sequence_lens unless
    ``lengths`` are given (fed as ``L``), its weights as initializers, and
    ``feeds(seed)``: X (NaN past each length) and the initial states."""
    r = np.random.default_rng(seed)
    D, G = (2 if direction == "bidirectional" else 1), _GATES[op]
    weights = {"W": (r.standard_normal((D, G * H, I)) * 0.6).astype(np.float32),
               "R": (r.standard_normal((D, G * H, H)) * 0.6).astype(np.float32),
               "B": (r.standard_normal((D, 2 * G * H)) * 0.3).astype(np.float32)}
    states = ["initial_h"] + (["initial_c"] if op == "LSTM" else [])
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, ["X", "W", "R", "B", "" if lengths is None else "L"] + states,
                            outputs, hidden_size=H, direction=direction, layout=0)
    inputs = [_float("X", ["T", "B", I])] + [_float(n, [D, "B", H]) for n in states]
    if lengths is not None:
        inputs.append(helper.make_tensor_value_info("L", TensorProto.INT32, ["B"]))
    model = _model([node], inputs, [_float(o) for o in outputs],
                   [numpy_helper.from_array(v, k) for k, v in weights.items()])

    def feeds(seed):
        r = np.random.default_rng(seed)
        f = {"X": r.standard_normal((T, B, I)).astype(np.float32)}
        f.update({n: r.standard_normal((D, B, H)).astype(np.float32) for n in states})
        if lengths is not None:
            f["L"] = np.asarray(lengths, np.int32)
            f["X"][np.arange(T)[:, None] >= f["L"][None, :]] = np.nan  # (never read)
        return f

    return model, feeds


def _numba_and_interpreter(model):
    """The model's numba session, its interpreter session, the numba node."""
    ours = InferenceSession(model, backend="numba")
    return ours, InferenceSession(model, backend="interpreter"), ours.graph.nodes[0].impl


@pytest.mark.parametrize("op, direction, lengths", [
    ("GRU", "forward", None), ("LSTM", "reverse", None), ("RNN", "bidirectional", None),
    ("LSTM", "bidirectional", None), ("GRU", "forward", [5, 2, 0]),
    ("LSTM", "reverse", [3, 5, 1]), ("GRU", "bidirectional", [4, 5, 2])])
def test_a_time_major_node_reads_x_and_writes_y_by_steps(op, direction, lengths, monkeypatch):
    """A node of layout 0 gives its prepared kernels X's rows as they are,
    by steps (step t of sequence b at row t * B + b; with sequence_lens,
    the rows past each length never read, Y zero there), and takes Y's back
    so: nothing copied to the sequences' order and back. The first such call
    is checked bit for bit against the sequences' order; every call equals
    the interpreter's results (the node's new arrays filled with NaN where
    it asks for empty ones: Y's zeros are its own)."""
    from stepnet.onnx import graph as graph_module, recurrent

    class Poisoned:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float, **kwargs):
            array = np.empty(shape, dtype, **kwargs)
            if array.dtype.kind == "f":
                array.fill(np.nan)
            return array

    monkeypatch.setattr(recurrent, "np", Poisoned())
    monkeypatch.setattr(graph_module, "lower", lambda *args: None)  # (the node's own call)
    model, feeds = _full_sequences_node(op, direction, 0, lengths=lengths)
    ours, oracle, node = _numba_and_interpreter(model)
    rows, read = [], []
    for call in range(5):
        if call == 2:  # (the kernels are prepared: they answered the first calls)
            for run in node.compiled.values():
                run.kernel.by_steps = (lambda by_steps: lambda data, *args, **kw: rows.append(data)
                                       or by_steps(data, *args, **kw))(run.kernel.by_steps)
        f, before = feeds(call), len(rows)
        assert_close(ours.run(None, f), oracle.run(None, f), what=f"{op} {direction} call {call}")
        if call >= 2:  # (whether the kernels read X's own rows)
            read.append(len(rows) > before and np.shares_memory(rows[-1], f["X"]))
    # by steps at every call where its first call gave the sequences' order's bits; on a
    # BLAS whose rows' results depend on where they lie (OpenBLAS's Haswell kernels) that
    # call's results are put aside, and the sequences' order (X copied) runs from then on
    if node._by_steps:
        assert read == [True] * 3 and len(rows) == 3 * len(node.compiled), read
    else:
        assert node._by_steps is False and read in ([True, False, False], [False] * 3), read


def test_a_time_major_node_whose_rows_by_steps_disagree_takes_the_sequences_order(monkeypatch):
    """Where the first call by steps does not give, bit for bit, what the
    sequences' order gives, the node never calls by steps again: its results
    stay right."""
    from stepnet.jit.prepared import PreparedCall

    calls = []
    by_steps = PreparedCall.by_steps

    def wrong(self, data, offsets, states, padded=False):
        calls.append(1)
        y, *last = by_steps(self, data, offsets, states, padded)
        return [y[::-1].copy()] + last  # (rows in the wrong order)

    monkeypatch.setattr(PreparedCall, "by_steps", wrong)
    model, feeds = _full_sequences_node("GRU", "bidirectional", 1)
    ours, oracle, node = _numba_and_interpreter(model)
    for call in range(5):
        f = feeds(call)
        assert_close(ours.run(None, f), oracle.run(None, f), what=f"call {call}")
    assert node._by_steps is False and len(calls) == 2  # (once a direction)


def test_a_time_major_view_of_batch_first_rows_keeps_the_sequences_order():
    """X given as a time-major view of a batch-first array (as a Transpose
    node gives) is already in the sequences' order: the node reads it so,
    without copying it by steps."""
    model, feeds = _full_sequences_node("LSTM", "forward", 2)
    ours, oracle, node = _numba_and_interpreter(model)
    for call in range(4):
        f = feeds(call)
        f["X"] = np.ascontiguousarray(f["X"].transpose(1, 0, 2)).transpose(1, 0, 2)
        assert not f["X"].flags.c_contiguous
        assert_close(ours.run(None, f), oracle.run(None, f), what=f"call {call}")
    assert node._by_steps is None and node._streaming is not None


def test_rows_by_steps_stay_within_the_rows():
    """``rows_by_steps``: each sequence starts at its index, where the row
    step is their number and every step of every sequence is within the
    rows; else it raises (no row outside the arrays is ever read or
    written)."""
    from stepnet.jit import numba_runtime

    starts = np.array([0, 5, 10], np.int64)
    numba_runtime.rows_by_steps(starts, np.array([5, 5, 5], np.int64), 3, 15)
    assert starts.tolist() == [0, 1, 2]
    starts = np.array([0, 5, 7], np.int64)
    numba_runtime.rows_by_steps(starts, np.array([5, 2, 0], np.int64), 3, 15)
    assert starts.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="more steps than the rows hold"):
        numba_runtime.rows_by_steps(starts, np.array([5, 6, 5], np.int64), 3, 15)
    with pytest.raises(ValueError, match="more steps than the rows hold"):
        numba_runtime.rows_by_steps(starts, np.array([5, 5, 5], np.int64), 3, 14)
    with pytest.raises(ValueError, match="not the number of sequences"):
        numba_runtime.rows_by_steps(starts, np.array([5, 5, 5], np.int64), 5, 25)


# ----------------------------------------------------------------------------
# Scan: custom bodies, against onnxruntime


def _scan_rnn_model(opset, H=4, I=3, reverse_in=False, reverse_out=False, in_axis=0, out_axis=0,
                    weights_as_input=False):
    """Scan-9+: an Elman RNN whose body reads W, U, b from the outer graph."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
         helper.make_node("MatMul", ["h", "U"], ["hu"]),
         helper.make_node("Add", ["xw", "hu"], ["s"]),
         helper.make_node("Add", ["s", "b"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_next"]),
         helper.make_node("Identity", ["h_next"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, H]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [2, I])],
        [helper.make_tensor_value_info("h_next", TensorProto.FLOAT, [2, H]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [2, H])])
    node = helper.make_node("Scan", ["h0", "X"], ["h_T", "Y"], body=body, num_scan_inputs=1,
                            scan_input_directions=[int(reverse_in)],
                            scan_output_directions=[int(reverse_out)],
                            scan_input_axes=[in_axis], scan_output_axes=[out_axis])
    r = np.random.default_rng(7)
    weights = {"W": (r.standard_normal((I, H)) * 0.5).astype(np.float32),
               "U": (r.standard_normal((H, H)) * 0.5).astype(np.float32),
               "b": (r.standard_normal(H) * 0.1).astype(np.float32)}
    T = 5
    X = r.standard_normal((T, 2, I)).astype(np.float32)
    X = np.moveaxis(X, 0, in_axis).copy()
    feeds = {"h0": r.standard_normal((2, H)).astype(np.float32), "X": X}
    inputs = [_info("h0", feeds["h0"]), _info("X", X)]
    inits = []
    if weights_as_input:
        feeds.update(weights)
        inputs += [_info(k, v) for k, v in weights.items()]
    else:
        inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h_T", "Y")]
    return _model([node], inputs, outs, inits, opset=opset), feeds


@pytest.mark.parametrize("opset", [9, 11, 16, 21])
def test_scan_rnn_opsets(opset):
    model, feeds = _scan_rnn_model(opset)
    _compare(model, feeds)


@pytest.mark.parametrize("reverse_in, reverse_out, in_axis, out_axis",
                         [(True, False, 0, 0), (False, True, 0, 1), (True, True, 1, 2),
                          (False, False, 2, 1)])
def test_scan_axes_and_directions(reverse_in, reverse_out, in_axis, out_axis):
    model, feeds = _scan_rnn_model(16, reverse_in=reverse_in, reverse_out=reverse_out,
                                   in_axis=in_axis, out_axis=out_axis)
    _compare(model, feeds)


def test_scan_on_numba_with_outer_graph_inputs():
    """Weights fed as graph inputs are static inputs of the step-net, rebound
    on every run; initializers are traced as constants."""
    model, feeds = _scan_rnn_model(16, weights_as_input=True)
    expected = _compare(model, feeds, backends=("interpreter", "numba"))
    session = InferenceSession(model, backend="numba")
    doubled = dict(feeds, W=feeds["W"] * 2)
    assert not np.allclose(session.run(None, doubled)[1], expected[1])
    assert_close(session.run(None, doubled), _ort_run(model, doubled))
    model, feeds = _scan_rnn_model(16)
    _compare(model, feeds, backends=("numba",))


def _scan8_model(directions):
    """Scan-8: batch axis, optional sequence_lens, a running sum and a gated
    output; two scan inputs with their own directions."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "a"], ["s1"]),
         helper.make_node("Mul", ["s1", "c"], ["m"]),
         helper.make_node("Sigmoid", ["m"], ["g"]),
         helper.make_node("Mul", ["g", "a"], ["y"])],
        "body",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("s1", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    node = helper.make_node("Scan", ["L", "s0", "A", "C"], ["sT", "Y"], body=body,
                            num_scan_inputs=2, directions=list(directions))
    r = np.random.default_rng(3)
    feeds = {"L": np.array([4, 1, 3], np.int64), "s0": r.standard_normal((3, 3)).astype(np.float32),
             "A": r.standard_normal((3, 4, 3)).astype(np.float32),
             "C": r.standard_normal((3, 4, 3)).astype(np.float32)}
    model = _model([node], [_info(k, v) for k, v in feeds.items()],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("sT", "Y")],
                   opset=8)
    return model, feeds


@pytest.mark.parametrize("directions", [(0, 0), (1, 1), (0, 1)])
def test_scan8_sequence_lens_and_directions(directions):
    model, feeds = _scan8_model(directions)
    got = InferenceSession(model, backend="interpreter").run(None, feeds)
    # the loop, written out per sequence
    L, s, A, C = feeds["L"], feeds["s0"].copy(), feeds["A"], feeds["C"]
    Y = np.zeros_like(A)
    for b in range(3):
        a_seq, c_seq = A[b, :L[b]], C[b, :L[b]]
        a_seq = a_seq[::-1] if directions[0] else a_seq
        c_seq = c_seq[::-1] if directions[1] else c_seq
        for t in range(L[b]):
            s[b] = s[b] + a_seq[t]
            Y[b, t] = 1 / (1 + np.exp(-(s[b] * c_seq[t]))) * a_seq[t]
    assert_close(got, [s, Y])


def test_scan8_matches_onnxruntime():
    model, feeds = _scan8_model((0, 1))
    _compare(model, feeds, backends=("interpreter", "numba"))


def test_scan_body_ops_match_onnxruntime():
    """A body using Gemm, Concat, Split, Slice, Squeeze/Unsqueeze, ReduceSum,
    Transpose, Where, Clip and activations, against onnxruntime."""
    H = 4
    consts = [
        helper.make_node("Constant", [], ["axes0"], value=numpy_helper.from_array(np.array([0], np.int64))),
        helper.make_node("Constant", [], ["lo"], value=numpy_helper.from_array(np.float32(-0.5))),
        helper.make_node("Constant", [], ["hi"], value=numpy_helper.from_array(np.float32(0.8))),
        helper.make_node("Constant", [], ["st"], value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Constant", [], ["en"], value=numpy_helper.from_array(np.array([3], np.int64))),
        helper.make_node("Constant", [], ["ax1"], value=numpy_helper.from_array(np.array([1], np.int64))),
    ]
    body = helper.make_graph(
        consts + [
            helper.make_node("Unsqueeze", ["h", "axes0"], ["h2"]),                    # [1, H]
            helper.make_node("Gemm", ["h2", "U"], ["hu"], transB=1, alpha=0.9),       # [1, H]
            helper.make_node("Squeeze", ["hu", "axes0"], ["hu1"]),                    # [H]
            helper.make_node("Concat", ["x_t", "hu1"], ["cat"], axis=0),               # [2H]
            helper.make_node("Split", ["cat"], ["p", "q"], axis=0, num_outputs=2),     # [H], [H]
            helper.make_node("Mul", ["p", "q"], ["pq"]),
            helper.make_node("Clip", ["pq", "lo", "hi"], ["pc"]),
            helper.make_node("Greater", ["p", "q"], ["gt"]),
            helper.make_node("Where", ["gt", "pc", "q"], ["w"]),
            helper.make_node("LeakyRelu", ["w"], ["lr"], alpha=0.2),
            helper.make_node("Tanh", ["lr"], ["h_next"]),
            helper.make_node("Slice", ["h_next", "st", "en"], ["sl"]),                # [2]
            helper.make_node("ReduceSum", ["sl", "axes0"], ["rs"], keepdims=1),        # [1]
            helper.make_node("Unsqueeze", ["h_next", "ax1"], ["col"]),                 # [H, 1]
            helper.make_node("Transpose", ["col"], ["row"], perm=[1, 0]),              # [1, H]
            helper.make_node("Softplus", ["row"], ["y_t"]),
        ],
        "body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [H]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [H])],
        [helper.make_tensor_value_info("h_next", TensorProto.FLOAT, [H]),
         helper.make_tensor_value_info("rs", TensorProto.FLOAT, [1]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [1, H])])
    node = helper.make_node("Scan", ["h0", "X"], ["hT", "R", "Y"], body=body, num_scan_inputs=1)
    r = np.random.default_rng(11)
    U = (r.standard_normal((H, H)) * 0.7).astype(np.float32)
    feeds = {"h0": r.standard_normal(H).astype(np.float32),
             "X": r.standard_normal((6, H)).astype(np.float32)}
    model = _model([node], [_info(k, v) for k, v in feeds.items()],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("hT", "R", "Y")],
                   [numpy_helper.from_array(U, "U")], opset=18)
    _compare(model, feeds, backends=("interpreter", "numba"))


def test_graph_around_recurrent_nodes_matches_onnxruntime(rng):
    """Graph-level ops feeding and reading a GRU and a Scan."""
    T, B, I, H = 5, 3, 4, 6
    arrays = _gru_arrays(rng, T, B, I, H)
    proj = (rng.standard_normal((H, 2)) * 0.5).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["X"], ["Xr"]),
        helper.make_node("GRU", ["Xr", "W", "R", "B"], ["Y", "Y_h"], hidden_size=H),
        helper.make_node("Squeeze", ["Y", "one"], ["Ys"]),                       # [T, B, H]
        helper.make_node("Transpose", ["Ys"], ["Yb"], perm=[1, 0, 2]),           # [B, T, H]
        helper.make_node("MatMul", ["Yb", "proj"], ["Z"]),                       # [B, T, 2]
        helper.make_node("ReduceMean", ["Z", "one"], ["Zm"], keepdims=0),        # [B, 2]
        helper.make_node("Softmax", ["Zm"], ["P"], axis=-1),
    ]
    inits = [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B")]
    inits += [numpy_helper.from_array(proj, "proj"), numpy_helper.from_array(np.array([1], np.int64), "one")]
    model = _model(nodes, [_info("X", arrays["X"])],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("P", "Y_h")],
                   inits)
    _compare(model, {"X": arrays["X"]})


def test_inputs_and_outputs_like_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    model, feeds = _scan_rnn_model(16, weights_as_input=True)
    ours = InferenceSession(model)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(ours.get_inputs() + ours.get_outputs(), theirs.get_inputs() + theirs.get_outputs()):
        assert (a.name, a.type) == (b.name, b.type)
    for a, b in zip(ours.get_inputs(), theirs.get_inputs()):
        assert a.shape == b.shape
    assert [a.name for a in ours.get_inputs()] == [a.name for a in theirs.get_inputs()]
    # output selection and order
    hT, = ours.run(["h_T"], feeds)
    Y, hT2 = ours.run(["Y", "h_T"], feeds)
    assert_close(hT, hT2)


def test_session_loads_paths_and_bytes(tmp_path, rng):
    arrays = _gru_arrays(rng)
    model = _gru_model(arrays, 22)
    path = tmp_path / "gru.onnx"
    onnx.save(model, str(path))
    expected = InferenceSession(model, backend="interpreter").run(None, {"X": arrays["X"]})
    for source in (str(path), path, model.SerializeToString()):
        assert_close(InferenceSession(source, backend="interpreter").run(None, {"X": arrays["X"]}),
                     expected)


def _node_model(op, feeds, inits=(), opset=17, outputs=1, **attrs):
    """(a model of one float32 node ``op`` on ``feeds`` and constants ``inits``, ``feeds``)."""
    names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op, [*feeds, *(n for n, _ in inits)], names, **attrs)
    model = _model([node], [_info(n, v) for n, v in feeds.items()],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                   [onnx.numpy_helper.from_array(v, n) for n, v in inits], opset)
    return model, feeds


def test_edges_of_gemm_flatten_pad_and_clip_as_onnxruntime():
    """Gemm's beta 0 reads no C (its NaN neither); Flatten of an empty
    tensor; negative pads crop; Clip without bounds clips inf to the
    dtype's largest."""
    f32 = np.float32
    ones, x = np.ones((2, 2), f32), np.arange(12, dtype=f32).reshape(3, 4)
    cases = [
        _node_model("Gemm", {"a": ones, "b": ones, "c": np.full((2, 2), np.nan, f32)}, beta=0.0),
        _node_model("Flatten", {"x": np.zeros((0, 3, 2), f32)}, axis=1),
        _node_model("Flatten", {"x": np.zeros((3, 0, 2), f32)}, axis=2),
        _node_model("Pad", {"x": x}, [("p", np.array([-1, 0, 0, -1]))]),
        _node_model("Pad", {"x": x}, [("p", np.array([-1, 2, 1, -2]))], mode="edge"),
        _node_model("Clip", {"x": np.array([np.inf, -np.inf, 1.0], f32)}),
    ]
    for model, feeds in cases:
        expected = _ort_run(model, feeds)
        for backend in ("interpreter", "numba"):
            got = InferenceSession(model, backend=backend).run(None, feeds)
            what = f"{model.graph.node[0].op_type} on {backend}"
            assert got[0].shape == expected[0].shape, what
            np.testing.assert_array_equal(got[0], expected[0], err_msg=what)


def test_invalid_axes_and_splits_are_refused_at_their_node():
    f32 = np.float32
    cases = [
        (_node_model("Unsqueeze", {"x": np.ones((1, 3), f32)}, [("a", np.array([5]))]),
         r"\(Unsqueeze\): axes \[5\] must be distinct, in \[-3, 3\)"),
        (_node_model("Unsqueeze", {"x": np.ones((1, 3), f32)}, [("a", np.array([0, -4]))]),
         "must be distinct"),
        (_node_model("Flatten", {"x": np.ones((2, 3, 4), f32)}, axis=-4),
         r"\(Flatten\): axis -4 is out of range for a value of rank 3"),
        (_node_model("Split", {"x": np.arange(3, dtype=f32)}, opset=13, outputs=2, axis=0),
         r"\(Split\): an axis of 3 does not split into 2 equal parts"),
        (_node_model("Pad", {"x": np.arange(3, dtype=f32)}, [("p", np.array([3, 0]))], mode="reflect"),
         r"\(Pad\): a reflect pad of \[\(3, 0\)\] is wider"),
        (_node_model("Pad", {"x": np.arange(3, dtype=f32)}, [("p", np.array([-2, -2]))]),
         r"\(Pad\): pads \[-2, -2\] crop more than"),
    ]
    for (model, feeds), message in cases:
        with pytest.raises(sn.ShapeError, match=message):
            InferenceSession(model, backend="interpreter").run(None, feeds)


# ----------------------------------------------------------------------------
# errors: before anything runs, naming the node, op and attribute


def _unchecked_model(nodes, inputs, outputs, opset=22):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _float(name, shape=None):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_unsupported_op_names_the_node():
    model = _unchecked_model([helper.make_node("Frobnicate", ["a", "b"], ["c"], name="mix")],
                             [_float("a"), _float("b")], [_float("c")])
    with pytest.raises(sn.UnsupportedError, match=r"'mix' \(Frobnicate\).*not an operator"):
        InferenceSession(model)


def test_unsupported_attribute_names_the_attribute():
    node = helper.make_node("GRU", ["X", "W", "R"], ["Y"], name="g1", hidden_size=2, fancy=3)
    model = _unchecked_model([node], [_float("X"), _float("W"), _float("R")], [_float("Y")])
    with pytest.raises(sn.UnsupportedError, match=r"'g1' \(GRU\): attribute 'fancy'"):
        InferenceSession(model)


def test_constant_inputs_of_one_type_parameter_and_two_types_are_refused():
    """A GRU's W float32 and B float64 (both the schema's T): refused when the
    session is made, naming the node and both inputs, as onnxruntime refuses it."""
    H = 2
    inits = [numpy_helper.from_array(np.zeros((1, 3 * H, 3), np.float32), "W"),
             numpy_helper.from_array(np.zeros((1, 3 * H, H), np.float32), "R"),
             numpy_helper.from_array(np.zeros((1, 6 * H), np.float64), "B")]
    node = helper.make_node("GRU", ["X", "W", "R", "B"], ["Y"], name="g1", hidden_size=H)
    graph = helper.make_graph([node], "g", [_float("X", [None, None, 3])], [_float("Y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    with pytest.raises(sn.Error, match=r"'g1' \(GRU\): input 3 \(B\) 'B' is a tensor\(double\) "
                                       r"and input 1 \(W\) 'W' a tensor\(float\); the operator "
                                       r"takes both as one type \(T\)"):
        InferenceSession(model, backend="interpreter")


def test_unknown_domain_is_refused():
    node = helper.make_node("Foo", ["a"], ["b"], domain="com.example", name="f")
    graph = helper.make_graph([node], "g", [_float("a")], [_float("b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22),
                                                    helper.make_opsetid("com.example", 1)])
    with pytest.raises(sn.UnsupportedError, match="'f' \\(Foo\\): domain 'com.example'"):
        InferenceSession(model)


def test_op_stepnet_does_not_trace_runs_the_scan_body_node_by_node():
    body = helper.make_graph(
        [helper.make_node("Transpose", ["s"], ["s2"], perm=[1, 0, 2], name="tr"),
         helper.make_node("Add", ["s2", "x"], ["s3"])],
        "body", [_float("s", [2, 2, 2]), _float("x", [2, 2, 2])],
        [_float("s3", [2, 2, 2])])
    node = helper.make_node("Scan", ["s0", "X"], ["sT"], body=body, num_scan_inputs=1, name="scan")
    model = _model([node], [_float("s0", [2, 2, 2]), _float("X", [3, 2, 2, 2])], [_float("sT")],
                   opset=16)
    feeds = {"s0": np.zeros((2, 2, 2), np.float32),
             "X": np.arange(24, dtype=np.float32).reshape(3, 2, 2, 2)}
    _compare(model, feeds)


def test_bad_feeds_are_refused(rng):
    arrays = _gru_arrays(rng)
    session = InferenceSession(_gru_model(arrays, 22), backend="interpreter")
    with pytest.raises(sn.StepNetError, match="no value fed for input"):
        session.run(None, {})
    with pytest.raises(sn.StepNetError, match="'Z' is not an input"):
        session.run(None, {"X": arrays["X"], "Z": arrays["X"]})
    with pytest.raises(sn.ShapeError, match="dtype float64"):
        session.run(None, {"X": arrays["X"].astype(np.float64)})
    with pytest.raises(sn.ShapeError, match="has shape \\[4, 3\\]"):
        session.run(None, {"X": arrays["X"][:, :, 0]})
    with pytest.raises(sn.StepNetError, match="'nope' is not an output"):
        session.run(["nope"], {"X": arrays["X"]})


def test_an_unknown_backend_is_refused_when_the_session_is_made(rng):
    arrays = _gru_arrays(rng)
    with pytest.raises(sn.BackendError) as made:
        InferenceSession(_gru_model(arrays, 22), backend="bogus")
    assert str(made.value) == "unknown backend 'bogus'; known: cuda, interpreter, numba"
    X = sn.LoDTensor.from_lengths(np.ones((2, 3), np.float32), [[2]])
    with pytest.raises(sn.BackendError) as called:  # as a layer's call says it
        sn.nn.GRU(3, 4)(X, backend="bogus")
    assert str(called.value) == str(made.value)


def test_bad_sequence_lens_and_features_are_refused(rng):
    """Fed values that do not fit the node: a ShapeError naming it, X and W."""
    arrays = _gru_arrays(rng)
    node = helper.make_node("GRU", ["X", "W", "R", "B", "L"], ["Y"], hidden_size=6, name="g")
    model = _model([node], [_float("X"), _info("L", np.zeros(3, np.int32))],  # (X of any shape)
                   [_float("Y")], [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B")])
    session = InferenceSession(model, backend="interpreter")
    with pytest.raises(sn.ShapeError, match=r"'g' \(GRU\): sequence_lens\[1\] = 9"):
        session.run(None, {"X": arrays["X"], "L": np.array([1, 9, 2], np.int32)})
    X = np.zeros(arrays["X"].shape[:2] + (arrays["X"].shape[2] + 1,), np.float32)
    features = arrays["W"].shape[2]
    with pytest.raises(sn.ShapeError, match=rf"'g' \(GRU\): X has {features + 1} features "
                                            rf"\(its last axis\), and W .* takes {features}"):
        session.run(None, {"X": X, "L": np.array([1, 2, 2], np.int32)})


# ----------------------------------------------------------------------------
# models stepnet exports, run again by stepnet


def _export_feeds(X):
    padded, lengths = X.to_padded()
    return {"X": padded, "lengths": lengths.astype(np.int64)}


def test_exported_step_net_runs_in_the_session(rng):
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 3)).astype(np.float32), [[4, 0, 5]])
    W = sn.Parameter(rng.standard_normal((3, 4)).astype(np.float32) * 0.5, name="W")
    U = sn.Parameter(rng.standard_normal((4, 4)).astype(np.float32) * 0.5, name="U")
    rnn = sn.create_rnn_op(reverse=True)
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[4], name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state() @ U))
        rnn.add_outputs(h)
    model = sn.onnx.export(rnn, output_all_steps=False)
    expected = rnn(output_all_steps=False, backend="interpreter")
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    for backend in ("interpreter", "numba"):
        got = InferenceSession(model, backend=backend).run(None, _export_feeds(X))
        assert_close(got, expected)


@pytest.mark.parametrize("as_scan", [False, True])
def test_exported_layer_runs_in_the_session(as_scan, rng):
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 3)).astype(np.float32), [[4, 1, 4]])
    gru = sn.nn.GRU(3, 4, num_layers=2, direction="bidirectional_concat", seed=0)
    model = sn.onnx.export(gru, as_scan=as_scan)
    Y, h_n = gru(X, backend="interpreter")
    got = InferenceSession(model, backend="interpreter").run(None, _export_feeds(X))
    assert_close(got[0], Y.to_padded()[0])
    assert_close(got[1], h_n)


def test_exported_nested_step_net_runs_in_the_session(rng):
    """A nested step-net exports as a Scan inside a Scan body: the outer body
    runs node by node, its inner Scan as a step-net."""
    from stepnet.onnx.export import to_nested_padded

    net = nested_encoder(rng, [[2, 1], [3, 2, 2]], features=2, hidden=2, outputs=("h",))
    model = sn.onnx.export(net.rnn)
    padded, lengths = to_nested_padded(net.X)
    feeds = {"X": padded, "lengths": lengths[0].astype(np.int64),
             "X_lengths_1": lengths[1].astype(np.int64)}
    got = InferenceSession(model, backend="interpreter").run(None, feeds)
    assert_close(got[0], to_nested_padded(net.rnn(backend="interpreter"))[0])


def _scan_layouts(session):
    return [key[0] for node in session.graph.nodes if node.op == "Scan"
            for key, (_, rnn) in node.impl.nets.items() if rnn is not None]


def test_scan_with_rows_runs_one_sequence_per_row():
    """A body that keeps the rows of axis 0 apart runs them as sequences (one
    GEMM per step over every row), not as one sequence of matrices."""
    model, feeds = _scan_rnn_model(16)
    session = InferenceSession(model, backend="interpreter")
    assert_close(session.run(None, feeds), _ort_run(model, feeds))
    assert _scan_layouts(session) == ["rows"]


def test_scan_mixing_rows_falls_back_to_one_sequence():
    """A ReduceSum over axis 0 mixes rows: the body runs as one sequence."""
    H = 3
    body = helper.make_graph(
        [helper.make_node("Add", ["h", "x_t"], ["s"]),
         helper.make_node("ReduceSum", ["s", "zero"], ["col"], keepdims=1),   # [1, H]
         helper.make_node("Sub", ["s", "col"], ["c"]),
         helper.make_node("Tanh", ["c"], ["h_next"])],
        "body", [_float("h", [2, H]), _float("x_t", [2, H])], [_float("h_next", [2, H])])
    node = helper.make_node("Scan", ["h0", "X"], ["hT"], body=body, num_scan_inputs=1)
    r = np.random.default_rng(0)
    feeds = {"h0": r.standard_normal((2, H)).astype(np.float32),
             "X": r.standard_normal((4, 2, H)).astype(np.float32)}
    model = _model([node], [_info(k, v) for k, v in feeds.items()], [_float("hT")],
                   [numpy_helper.from_array(np.array([0], np.int64), "zero")], opset=16)
    session = InferenceSession(model, backend="interpreter")
    assert_close(session.run(None, feeds), _ort_run(model, feeds))
    assert _scan_layouts(session) == ["whole"]


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_weights_fed_as_inputs_and_changed_in_place_are_read_again(backend, rng):
    """W, R and B fed by the caller (graph inputs, not initializers): a change
    made in place between two calls, or a copy with new values, is used by
    the next call (a fresh session's answer on the same values)."""
    arrays = _gru_arrays(rng)
    node = helper.make_node("GRU", ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=6)
    model = _model([node], [_info(k, arrays[k]) for k in ("X", "W", "R", "B")],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("Y", "Y_h")])
    session = InferenceSession(model, backend=backend)
    session.run(None, arrays)
    arrays["W"] *= 0.5
    arrays["R"][0, :3] = 0
    changed = session.run(None, arrays)
    for got, want in zip(changed, InferenceSession(model, backend=backend).run(None, arrays)):
        assert_close(got, want)
    arrays["B"] = arrays["B"] + 1
    again = session.run(None, arrays)
    for got, want in zip(again, InferenceSession(model, backend=backend).run(None, arrays)):
        assert_close(got, want)


def test_no_steps_none_fed_and_an_error_that_names_its_node_once(rng):
    """X of zero steps gives empty Y and the initial states; a None fed is an
    input not fed; an error raised by a node names it once."""
    arrays = _gru_arrays(rng)
    h0 = rng.standard_normal((1, 3, 6)).astype(np.float32)
    node = helper.make_node("GRU", ["X", "W", "R", "B", "", "h0"], ["Y", "Y_h"], hidden_size=6)
    model = _model([node], [_info("X", arrays["X"][:0]), _info("h0", h0)],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("Y", "Y_h")],
                   [numpy_helper.from_array(arrays[k], k) for k in ("W", "R", "B")])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    session = InferenceSession(model, backend="interpreter")
    Y, Y_h = session.run(None, {"X": arrays["X"][:0], "h0": h0})
    assert Y.shape == (0, 1, 3, 6)
    assert_close(Y_h, h0)
    with pytest.raises(sn.StepNetError, match=r"no value fed for input\(s\) \['h0'\]"):
        session.run(None, {"X": arrays["X"], "h0": None})
    node = helper.make_node("GRU", ["X", "W", "R"], ["Y"], hidden_size=6, direction="bidirectional",
                            name="gru")
    model = _model([node], [_info("X", arrays["X"])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(arrays[k], k) for k in ("W", "R")])
    with pytest.raises(sn.UnsupportedError) as found:
        InferenceSession(model, backend="interpreter").run(None, {"X": arrays["X"]})
    assert str(found.value).count("ONNX node 'gru'") == 1, found.value


def test_lists_and_arrays_of_the_other_byte_order_are_taken_as_onnxruntime_takes_them(rng):
    """A list (or number) is read in the declared dtype, an array of that
    dtype in the other byte order is converted (its values, not its bytes);
    an array of another dtype is still refused."""
    arrays = _gru_arrays(rng)
    model = _gru_model(arrays, 14)
    session = InferenceSession(model, backend="interpreter")
    X = arrays["X"]
    want = session.run(None, {"X": X})
    for given in (X.tolist(), X.astype(X.dtype.newbyteorder())):
        for got, expected in zip(session.run(None, {"X": given}), want):
            assert_close(got, expected)
    with pytest.raises(sn.ShapeError, match="has dtype float64, the model declares"):
        session.run(None, {"X": X.astype(np.float64)})


def test_shapes_made_from_fed_values_are_computed_again_each_call():
    """ConstantOfShape(max(L)) and Range(min(L), T): their shapes are values
    of the lengths, not of the inputs' shapes (a call with other lengths of
    the same shapes must not get the first call's)."""
    T = TensorProto
    nodes = [helper.make_node("ReduceMax", ["L"], ["mx"], keepdims=1),
             helper.make_node("ConstantOfShape", ["mx"], ["ones"],
                              value=numpy_helper.from_array(np.array([1], np.int64))),
             helper.make_node("Shape", ["ones"], ["widest"]),
             helper.make_node("ReduceMin", ["L"], ["mn"], keepdims=0),
             helper.make_node("Range", ["mn", "steps", "one"], ["r"]),
             helper.make_node("Shape", ["r"], ["padded"])]
    model = _model(nodes, [helper.make_tensor_value_info("L", T.INT64, ["B"])],
                   [helper.make_tensor_value_info(n, T.INT64, [1]) for n in ("widest", "padded")],
                   [numpy_helper.from_array(np.array(1, np.int64), "one"),
                    numpy_helper.from_array(np.array(6, np.int64), "steps")], opset=13)
    session = InferenceSession(model)
    for lengths in ([4, 6, 5], [1, 2, 2], [6, 6, 6]):
        L = np.array(lengths, np.int64)
        widest, padded = session.run(None, {"L": L})
        assert widest.tolist() == [L.max()] and padded.tolist() == [6 - L.min()]


def _one_node(op, x, opset, inits=(), **attrs):
    """A model of one ``op`` node on input ``x`` (and initializers ``inits``,
    name -> array) to ``y``."""
    node = helper.make_node(op, ["x", *(n for n, _ in inits)], ["y"], **attrs)
    return _model([node], [_info("x", x)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [numpy_helper.from_array(a, n) for n, a in inits], opset=opset)


@pytest.mark.parametrize("op, opset, attrs", [
    ("BatchNormalization", 9, {"epsilon": 1e-3}), ("BatchNormalization", 13, {}),
    ("LogSoftmax", 11, {"axis": 1}), ("Hardmax", 11, {}), ("LogSoftmax", 13, {"axis": 1}),
    ("LRN", 13, {"size": 3, "alpha": 0.1}), ("GroupNormalization", 18, {"num_groups": 2})])
def test_ops_the_reference_gets_wrong_or_refuses_match_onnxruntime(op, opset, attrs, rng):
    """BatchNormalization 9-13 in inference, LogSoftmax and Hardmax before 13
    (the input read as 2-D at axis), LogSoftmax of wide rows, LRN, and the
    deprecated but used GroupNormalization-18."""
    x = (rng.standard_normal((2, 4, 3) + (2,) * (op == "LRN")) * 3).astype(np.float32)
    if op == "LogSoftmax":  # (rows whose values span more than float32's exponent)
        x[0, :, 0], x[1, 0, :] = [0.0, 1e30, 1.0, -5.0], [0.0, 200.0, 1.0]
    inits = {"BatchNormalization": [(n, rng.uniform(0.5, 2, 4).astype(np.float32))
                                    for n in ("scale", "B", "mean", "var")],
             "GroupNormalization": [(n, rng.standard_normal(2).astype(np.float32)) for n in ("s", "b")]}
    _compare(_one_node(op, x, opset, inits.get(op, ()), **attrs), {"x": x})


@pytest.mark.parametrize("attrs, x_shape, w_shape", [
    ({"group": 2, "pads": [0, 2, 0, 2], "strides": [1, 2]}, (2, 8, 3, 6), (8, 3, 1, 5)),
    ({"strides": [2, 3], "output_padding": [1, 0]}, (1, 4, 3, 4), (4, 2, 3, 3)),
    ({"group": 4, "dilations": [2, 1], "pads": [1, 0, 2, 1]}, (2, 8, 4, 5), (8, 1, 3, 3)),
    ({"strides": [2, 2], "output_shape": [9, 10]}, (1, 4, 4, 5), (4, 3, 3, 3)),
    ({"group": 2, "strides": [2, 1], "auto_pad": "SAME_LOWER"}, (2, 4, 4, 5), (4, 2, 3, 2)),
    ({"strides": [3], "pads": [1, 2]}, (2, 3, 7), (3, 5, 3))])
def test_conv_transpose_of_any_group_matches_onnxruntime(attrs, x_shape, w_shape, rng):
    """ConvTranspose by stepnet's NumPy: grouped (the reference raises),
    strided, dilated, padded, with output_padding, output_shape or SAME."""
    x = rng.standard_normal(x_shape).astype(np.float32)
    inits = [("w", rng.standard_normal(w_shape).astype(np.float32)),
             ("b", rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(np.float32))]
    _compare(_one_node("ConvTranspose", x, 17, inits, **attrs), {"x": x})


@pytest.mark.parametrize("indices, reduction, opset", [
    ([[1], [3]], None, 11), ([[1, 2], [3, -1], [0, 0]], None, 13), ([[[1], [2]], [[1], [0]]], "add", 16),
    ([[1], [1], [2]], "mul", 16), ([[1, 4], [1, 4], [2, 0]], "max", 18), ([[1], [1], [2]], "min", 18)])
def test_scatter_nd_matches_onnxruntime(indices, reduction, opset, rng):
    """ScatterND by stepnet's NumPy (the reference loops over the indices in
    Python): rows and elements, negative indices, every reduction."""
    x = rng.standard_normal((4, 5, 3)).astype(np.float32)
    indices = np.array(indices, np.int64)
    updates = rng.standard_normal(indices.shape[:-1] + x.shape[indices.shape[-1]:]).astype(np.float32)
    attrs = {} if reduction is None else {"reduction": reduction}
    _compare(_one_node("ScatterND", x, opset, [("i", indices), ("u", updates)], **attrs), {"x": x})


def test_a_session_is_made_with_onnxruntimes_arguments():
    ort = pytest.importorskip("onnxruntime")
    x = np.ones((2, 3), np.float32)
    model = _one_node("Relu", x, 17)
    for session in (InferenceSession(model, ort.SessionOptions(), providers=["CPUExecutionProvider"]),
                    InferenceSession(model, sess_options=ort.SessionOptions(), provider_options=[{}])):
        assert session.backend is None
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_mean_over_no_values_is_nan_and_a_sum_zero(dtype):
    """docs/onnx.md, Decisions: ReduceMean over an axis of length 0 gives
    NumPy's mean of nothing (the spec leaves it undefined), ReduceSum 0."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0, axes=[1]),
             helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "empty", [helper.make_tensor_value_info("x", elem, [3, 0])],
        [helper.make_tensor_value_info(v, elem, [3]) for v in ("m", "s")],
        initializer=[numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mean, total = InferenceSession(model.SerializeToString()).run(None, {"x": np.zeros((3, 0), dtype)})
    assert mean.dtype == total.dtype == dtype
    assert np.isnan(mean).all() and mean.shape == (3,)
    assert np.array_equal(total, np.zeros(3, dtype))
