"""A key's whole plan compiled into one call (stepnet/onnx/lowering.py):
the streaming models of tests/onnx_models.py chunk after chunk, special
values, layouts and batches the first call did not see, and the plans it
leaves to the nodes; every result against the same session run node by
node."""

import re
import warnings

import numpy as np
import pytest

pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import onnx_models  # noqa: E402
from test_onnx_fusion import _spectrum_model  # noqa: E402  (x [B, 6, T] -> y, m)
from pairwise import spread_params  # noqa: E402
from stepnet.onnx import InferenceSession, graph as graph_module, lowering_nodes  # noqa: E402
from stepnet.onnx.lowering import GraphNode  # noqa: E402


def _graph_nodes(session):
    return [node for plan in session.graph.fused.values() for node in plan
            if isinstance(node, GraphNode)]


def _node_by_node(model, monkeypatch):
    """A session of ``model`` whose plans are never compiled into one call
    (for the rest of the test)."""
    monkeypatch.setattr(graph_module, "lower", lambda *args: None)
    return InferenceSession(model)


def _stream(session, name, chunks, feeds=None):
    """The outputs of a call on each of ``chunks`` of a streaming model, its
    state carried (from ``feeds``, the last call's, where given), and the
    feeds of the next call."""
    state_in, state_out = {"vad": ("state", 1), "stream_gru": ("h", 1)}[name]
    feeds, outs = dict(feeds or chunks[0]), []
    for chunk in chunks:
        feeds.update({k: v for k, v in chunk.items() if k != state_in})
        got = session.run(None, feeds)
        outs.append(got)
        feeds[state_in] = got[state_out]
    return outs, feeds


def _close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,batch", spread_params(["vad", "stream_gru"], [1, 3]))
def test_a_streaming_model_runs_as_one_compiled_call(name, batch, monkeypatch):
    ex = onnx_models.BUILDERS[name]()
    chunks = [ex.feeds(batch=batch, seed=i) for i in range(6)]
    session = InferenceSession(ex.model)
    # (the first call makes the key's memo, the second its plan lowered, the
    # third compiles it and checks it against the nodes)
    ours, feeds = _stream(session, name, chunks[:3])
    (node,) = _graph_nodes(session)
    assert node.state in ("timing", "ready", "slower")
    node.state = "ready"  # (whichever is the faster here: the compiled call answers)
    calls = []
    entry = node.entry
    node.entry = lambda *args: calls.append(1) or entry(*args)
    ours += _stream(session, name, chunks[3:], feeds)[0]
    assert len(calls) == 3
    reference = _node_by_node(ex.model, monkeypatch)
    for got, want in zip(ours, _stream(reference, name, chunks)[0]):
        for g, w in zip(got, want):
            _close(g, w)


def _lowered(name):
    """A model of two streams, its session after the calls that lower its
    plan, and the compiled call, made to answer."""
    ex = onnx_models.BUILDERS[name]()
    feeds = ex.feeds(batch=2, seed=0)
    session = InferenceSession(ex.model)
    for _ in range(3):
        session.run(None, feeds)
    (node,) = _graph_nodes(session)
    node.state = "ready"
    return ex, feeds, session, node


def test_special_values_go_through_the_compiled_call_as_through_the_nodes(monkeypatch):
    ex, feeds, session, node = _lowered("vad")
    x = feeds["input"].copy()
    x[0, 5], x[0, 100], x[1, 7] = np.nan, np.inf, -np.inf
    special = dict(feeds, input=x)
    reference = _node_by_node(ex.model, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's, node by node: inf - inf)
        got, want = session.run(None, special), reference.run(None, special)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_an_input_fed_in_another_layout_is_read_where_it_lies(monkeypatch):
    ex, feeds, session, node = _lowered("stream_gru")
    wide = np.repeat(feeds["chunk"], 2, axis=-1)
    strided = dict(feeds, chunk=wide[..., ::2])  # (the same values, every other column)
    assert not strided["chunk"].flags.c_contiguous
    calls, entry = [], node.entry
    node.entry = lambda *args: calls.append(args) or entry(*args)
    got = session.run(None, strided)
    assert len(calls) == 1 and any(a is strided["chunk"] for a in calls[0])  # (not copied first)
    reference = _node_by_node(ex.model, monkeypatch)
    for g, w in zip(got, reference.run(None, feeds)):
        _close(g, w)


def test_a_value_of_another_shape_or_dtype_never_reaches_the_compiled_call(rng):
    """The graph indexes by the shapes of its key: a value that is not as
    compiled (which a key's shapes rule out) is refused before the call."""
    session = InferenceSession(_spectrum_model())
    x = rng.standard_normal((2, 6, 6)).astype(np.float32)
    for _ in range(3):
        session.run(None, {"x": x})
    (node,) = _graph_nodes(session)
    env = dict(session.graph.run_constants, x=x)
    assert node._call_values(env) is not None
    for other in (x[:1], x.astype(np.float64), x.reshape(2, 36)):
        assert node._call_values(dict(env, x=other)) is None


def test_a_compiled_call_that_disagrees_with_the_nodes_is_not_used(rng, monkeypatch):
    def wrong_transpose(w, node):  # (a square x: the same shape, other values)
        w.body.append(f"    {w.made(node.outputs[0])} = {w.ref(node.inputs[0])}")
        return True

    monkeypatch.setitem(lowering_nodes.LOWER, "Transpose", wrong_transpose)
    session = InferenceSession(_spectrum_model())
    x = rng.standard_normal((2, 6, 6)).astype(np.float32)
    session.run(None, {"x": x})
    with pytest.warns(RuntimeWarning, match="disagreed"):
        got = session.run(None, {"x": x})
    (node,) = _graph_nodes(session)
    assert node.state == "refused"
    xt = x.transpose(0, 2, 1)
    m = np.sqrt(xt[..., :3] ** 2 + xt[..., 3:] ** 2 + np.float32(1e-6))
    want = [1 / (1 + np.exp(-m * np.linspace(0.5, 2.0, 3).astype(np.float32))) - 0.5, m]
    for g, w in zip(got, want):
        _close(g, w)
    got = session.run(None, {"x": x})  # (the nodes, no second warning)
    for g, w in zip(got, want):
        _close(g, w)


def test_a_plan_with_a_node_it_does_not_lower_runs_its_nodes(rng):
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
         helper.make_node("Sqrt", ["s"], ["y"])], "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = InferenceSession(model)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    for _ in range(3):
        (got,) = session.run(None, {"x": x})
    assert session.graph.fused and not _graph_nodes(session)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    _close(got, np.sqrt(e / e.sum(axis=1, keepdims=True)))


def test_a_shape_fed_at_each_call_keeps_its_reshape_out_of_the_compiled_call(rng):
    """A Reshape whose target shape is an input of any length (not part of a
    run's key) is computed from each call's value: never compiled in."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Tanh", ["r"], ["y"])],
        "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12]),
                    helper.make_tensor_value_info("shape", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = InferenceSession(model)
    x = rng.standard_normal((2, 12)).astype(np.float32)
    for shape in [[4, 6]] * 12 + [[6, 4]] * 3:
        (got,) = session.run(None, {"x": x, "shape": np.array(shape)})
        _close(got, np.tanh(x.reshape(shape)))
    assert not _graph_nodes(session)


def test_deterministic_runs_are_never_compiled_into_one_call(rng, monkeypatch):
    from stepnet.jit import blas

    monkeypatch.setattr(blas, "DETERMINISTIC", True)
    session = InferenceSession(_spectrum_model())
    x = rng.standard_normal((2, 6, 6)).astype(np.float32)
    for _ in range(3):
        session.run(None, {"x": x})
    assert not _graph_nodes(session)


def _one_call_and_nodes(model, feeds, monkeypatch):
    """The outputs of ``model``'s one compiled call on ``feeds`` (made to
    answer, after the calls that lower it), and those of its nodes."""
    session = InferenceSession(model)
    for _ in range(3):
        session.run(None, feeds)
    (node,) = _graph_nodes(session)
    node.state = "ready"
    return session.run(None, feeds), _node_by_node(model, monkeypatch).run(None, feeds)


def _one_call_as_nodes_and_onnxruntime(model, feeds, monkeypatch):
    """``model``'s one compiled call on ``feeds`` gives what its nodes give
    (NaN where they give NaN) and what onnxruntime gives where neither is
    NaN (its MaxPool drops a NaN from a window, NumPy's maximum keeps it)."""
    ort = pytest.importorskip("onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's: inf - inf, NaN compared)
        got, want = _one_call_and_nodes(model, feeds, monkeypatch)
    theirs = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w, t in zip(got, want, theirs):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        _close(g, w)
        numbers = ~np.isnan(t) & ~np.isnan(g)
        np.testing.assert_allclose(g[numbers], t[numbers], rtol=1e-5, atol=1e-5)


def _model(nodes, inits, x_shape, **outputs):
    """A model of ``nodes`` from a float32 input ``x`` of ``x_shape`` to
    ``outputs`` (name: element type)."""
    graph = helper.make_graph(
        nodes, "model", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(name, kind, None) for name, kind in outputs.items()],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pads_reductions_products_and_joins_in_one_call(rng, mode, monkeypatch):
    """Pad (on two axes), a 1-D Conv with padding and a stride, MatMul of a 3-D value,
    ReduceSum and ReduceMean over inner axes, Concat, Flatten, a float Cast,
    Erf (math's) and a Transpose of the input in one call: as node by node."""
    inits = [numpy_helper.from_array(np.array([1, 0, 2, 0, 0, 3], np.int64), "pads"),
             numpy_helper.from_array(np.array(np.nan, np.float32), "fill"),
             numpy_helper.from_array(rng.standard_normal((5, 4, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((6, 2)).astype(np.float32), "m"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    pad_inputs = ["x", "pads"] + (["fill"] if mode == "constant" else [])
    nodes = [helper.make_node("Pad", pad_inputs, ["p"], mode=mode),
             helper.make_node("Conv", ["p", "w", "b"], ["c"], pads=[1, 1], strides=[2]),
             helper.make_node("MatMul", ["c", "m"], ["mm"]),
             helper.make_node("ReduceSum", ["mm", "axis1"], ["s"], keepdims=1),
             helper.make_node("ReduceMean", ["c"], ["r"], axes=[2], keepdims=1),
             helper.make_node("Concat", ["s", "mm"], ["j"], axis=1),
             helper.make_node("Flatten", ["j"], ["f"], axis=1),
             helper.make_node("Cast", ["r"], ["y2"], to=TensorProto.DOUBLE),
             helper.make_node("Erf", ["f"], ["e"]),
             helper.make_node("Relu", ["e"], ["y"]),
             # an input's axes permuted, joined on its first axis, reduced over its middle one
             helper.make_node("Transpose", ["x"], ["xt"], perm=[2, 0, 1]),
             helper.make_node("Concat", ["xt", "xt"], ["xc"], axis=0),
             helper.make_node("ReduceMean", ["xc"], ["y3"], axes=[1], keepdims=0)]
    model = _model(nodes, inits, ["B", 4, 7], y=TensorProto.FLOAT, y2=TensorProto.DOUBLE,
                   y3=TensorProto.FLOAT)
    x = rng.standard_normal((3, 4, 7)).astype(np.float32)
    got, want = _one_call_and_nodes(model, {"x": x}, monkeypatch)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, outputs", [("GRU", ["Y"]), ("LSTM", ["Y", "Y_h"]),
                                         ("LSTM", ["", "Y_h"]), ("RNN", ["", "Y_h"])])
def test_a_recurrent_node_that_leaves_out_final_states_is_compiled(op, outputs, rng, monkeypatch):
    """The kernel writes every final state: those the node leaves out go to
    buffers of the call's own."""
    gates = {"GRU": 3, "LSTM": 4, "RNN": 1}[op]
    inits = [numpy_helper.from_array(rng.standard_normal((1, gates * 4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((1, gates * 4, 4)).astype(np.float32), "R")]
    nodes = [helper.make_node(op, ["x", "W", "R"], outputs, hidden_size=4)]
    model = _model(nodes, inits, ["T", "B", 3], **dict.fromkeys(filter(None, outputs), TensorProto.FLOAT))
    x = rng.standard_normal((5, 2, 3)).astype(np.float32)
    session = InferenceSession(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            session.run(None, {"x": x})
        (node,) = _graph_nodes(session)
        assert node.state in ("timing", "ready", "slower")
        node.state = "ready"
        got = session.run(None, {"x": x})
    want = _node_by_node(model, monkeypatch).run(None, {"x": x})
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.parametrize("stride, dilation", [(1, 1), (1, 2), (3, 1), (2, 2)])
def test_convolutions_big_enough_to_share_and_the_loops_after_them(rng, stride, dilation,
                                                                   monkeypatch):
    """A 1-D Conv by taps (stride 1) and by windows, dilated or not, its
    product big enough to be cut with the helper, an elementwise run over
    its rows (laid out channels-last: the loops follow them, and so do the
    values they store, but for those given back), a Transpose and a MatMul
    big enough to be cut too: as node by node."""
    from stepnet.jit import threads

    inits = [numpy_helper.from_array(rng.standard_normal((32, 16, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32), "m")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[2, 1], strides=[stride],
                              dilations=[dilation]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Mul", ["r", "c"], ["e"]),
             helper.make_node("Transpose", ["e"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "m"], ["y"]),
             helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Identity", ["e"], ["i"])]
    model = _model(nodes, inits, ["B", 16, 70], y=TensorProto.FLOAT, s=TensorProto.FLOAT,
                   i=TensorProto.FLOAT)
    x = rng.standard_normal((8, 16, 70)).astype(np.float32)
    x[0, 3, 5], x[1, 0, 0] = np.nan, np.inf
    session = InferenceSession(model)
    for _ in range(3):
        session.run(None, {"x": x})
    (node,) = _graph_nodes(session)
    if threads.SPINS and threads.count() >= 2:  # (else no helper: every product alone)
        assert sum(spec[0] == "product board" for spec in node._args) == 2
    # (e made channels-last, as the Conv's rows: a view of its array with the axes permuted)
    assert re.search(r"(v\d+) = np\.lib\.stride_tricks\.as_strided\(\1m, ", node.source), node.source
    assert node.state in ("timing", "ready", "slower")  # (it agreed with the nodes)
    node.state = "ready"
    calls, entry = [], node.entry
    node.entry = lambda *args: calls.append(1) or entry(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's: inf - inf)
        got = session.run(None, {"x": x})
        want = _node_by_node(model, monkeypatch).run(None, {"x": x})
    assert calls == [1] and got[1].flags.c_contiguous and got[2].flags.c_contiguous  # (given back)
    for g, w in zip(got, want):  # (sums that cancel: within 1e-5 of the largest finite value)
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w[np.isfinite(w)]).max())


def _branchy_model():
    """Shaped like Silero VAD's export: an ``If`` on the sample rate whose
    branches hold values of their own that the shapes decide (an ``If`` on
    the state's batch size), the state's halves taken by ``Gather`` and a
    magnitude squared by ``Pow``."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64

    def const(name, value):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))

    def branch(tag, scale):
        def sub(nodes, outputs):
            return helper.make_graph(nodes, f"{tag}_{outputs[0]}", [], [
                helper.make_tensor_value_info(n, f32, None) for n in outputs])
        # the state's halves where its batch is the input's, else zeros (always the first here)
        halves = sub([const(f"{tag}_i0", np.array(0, np.int64)),
                      const(f"{tag}_i1", np.array(1, np.int64)),
                      helper.make_node("Gather", ["state", f"{tag}_i0"], [f"{tag}_h"], axis=0),
                      helper.make_node("Gather", ["state", f"{tag}_i1"], [f"{tag}_c"], axis=0)],
                     [f"{tag}_h", f"{tag}_c"])
        zeros = sub([helper.make_node("Sub", ["state", "state"], [f"{tag}_z"]),
                     helper.make_node("ReduceSum", [f"{tag}_z", f"{tag}_ax0"], [f"{tag}_zh"],
                                      keepdims=0),
                     helper.make_node("Identity", [f"{tag}_zh"], [f"{tag}_zc"])],
                    [f"{tag}_zh", f"{tag}_zc"])
        nodes = [const(f"{tag}_two", np.array(2.0, np.float32)),
                 const(f"{tag}_three", np.array(3.0, np.float32)),
                 const(f"{tag}_scale", np.array(scale, np.float32)),
                 const(f"{tag}_ax0", np.array([0], np.int64)),
                 const(f"{tag}_ax1", np.array([1], np.int64)),
                 const(f"{tag}_cols", np.array([7, 0, -1], np.int64)),
                 helper.make_node("Gather", ["x", f"{tag}_cols"], [f"{tag}_picked"], axis=1),
                 helper.make_node("Pow", ["x", f"{tag}_two"], [f"{tag}_sq"]),
                 helper.make_node("Pow", ["x", f"{tag}_three"], [f"{tag}_cube"]),
                 helper.make_node("Add", [f"{tag}_sq", f"{tag}_cube"], [f"{tag}_sum"]),
                 helper.make_node("Mul", [f"{tag}_sum", f"{tag}_scale"], [f"{tag}_m"]),
                 helper.make_node("Shape", ["state"], [f"{tag}_shape"]),
                 helper.make_node("Gather", [f"{tag}_shape", f"{tag}_ax1"], [f"{tag}_b"], axis=0),
                 helper.make_node("Shape", ["x"], [f"{tag}_xshape"]),
                 helper.make_node("Gather", [f"{tag}_xshape", f"{tag}_ax0"], [f"{tag}_xb"], axis=0),
                 helper.make_node("Equal", [f"{tag}_b", f"{tag}_xb"], [f"{tag}_same1"]),
                 helper.make_node("Squeeze", [f"{tag}_same1", f"{tag}_ax0"], [f"{tag}_same"]),
                 helper.make_node("If", [f"{tag}_same"], [f"{tag}_h2", f"{tag}_c2"],
                                  then_branch=halves, else_branch=zeros),
                 helper.make_node("MatMul", [f"{tag}_m", "w"], [f"{tag}_p"]),
                 helper.make_node("Add", [f"{tag}_p", f"{tag}_h2"], [f"{tag}_h3"]),
                 helper.make_node("Tanh", [f"{tag}_h3"], [f"{tag}_h4"]),
                 helper.make_node("Unsqueeze", [f"{tag}_h4", f"{tag}_ax0"], [f"{tag}_hu"]),
                 helper.make_node("Unsqueeze", [f"{tag}_c2", f"{tag}_ax0"], [f"{tag}_cu"]),
                 helper.make_node("Concat", [f"{tag}_hu", f"{tag}_cu"], [f"{tag}_state"], axis=0)]
        return helper.make_graph(nodes, tag, [], [
            helper.make_tensor_value_info(f"{tag}_h4", f32, None),
            helper.make_tensor_value_info(f"{tag}_state", f32, None),
            helper.make_tensor_value_info(f"{tag}_picked", f32, None)])

    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["rate"], value=numpy_helper.from_array(
            np.array(16000, np.int64), "rate")),
         helper.make_node("Equal", ["sr", "rate"], ["is16k"]),
         helper.make_node("If", ["is16k"], ["y", "stateN", "picked"], then_branch=branch("hi", 0.5),
                          else_branch=branch("lo", -0.25))],
        "branchy",
        [helper.make_tensor_value_info("x", f32, ["B", 8]),
         helper.make_tensor_value_info("state", f32, [2, "B", 4]),
         helper.make_tensor_value_info("sr", i64, [])],
        [helper.make_tensor_value_info("y", f32, None),
         helper.make_tensor_value_info("stateN", f32, None),
         helper.make_tensor_value_info("picked", f32, None)],
        initializer=[numpy_helper.from_array(
            np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (NumPy's: inf - inf)
@pytest.mark.parametrize("sr", [16000, 8000])
def test_an_if_on_the_sample_rate_with_decided_values_in_its_branches_is_one_call(
        sr, rng, monkeypatch):
    """An ``If`` whose branch has values of its own that the key decides
    (its own ``If`` on the state's shape) is replaced by the branch's plan
    for the key, so the whole call (``Gather`` of the state, ``Pow`` by a
    constant in a run of elementwise nodes) compiles into one; as node by
    node and as onnxruntime, NaN and inf included."""
    model = _branchy_model()
    x = rng.standard_normal((3, 8)).astype(np.float32)
    x[0, 1], x[1, 2], x[2, 3] = np.nan, np.inf, -np.inf
    feeds = {"x": x, "state": rng.standard_normal((2, 3, 4)).astype(np.float32),
             "sr": np.array(sr, np.int64)}
    session = InferenceSession(model)
    for _ in range(3):
        session.run(None, feeds)
    (node,) = _graph_nodes(session)
    assert session.graph.fused[next(iter(session.graph.fused))] == [node]
    node.state = "ready"
    calls, entry = [], node.entry
    node.entry = lambda *args: calls.append(1) or entry(*args)
    got = session.run(None, feeds)
    assert calls == [1]
    want = _node_by_node(model, monkeypatch).run(None, feeds)
    ort = pytest.importorskip("onnxruntime")
    theirs = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w, t in zip(got, want, theirs):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        _close(g, w)
        np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-6)


def test_gemms_and_splits_in_one_call(rng, monkeypatch):
    """Gemm by a constant and by a computed value, transposed operands,
    alpha and beta, C of every broadcast (one not read where beta is 0, its
    NaN neither), and Split by sizes given and the input's: in one call, as
    node by node and as onnxruntime."""
    f32 = TensorProto.FLOAT

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [init("w", rng.standard_normal((4, 5)).astype(np.float32)),
             init("wt", rng.standard_normal((5, 4)).astype(np.float32)),
             init("c1", rng.standard_normal(5).astype(np.float32)),
             init("c2", rng.standard_normal((3, 1)).astype(np.float32)),
             init("c3", np.array(np.nan, np.float32)),
             init("sizes", np.array([2, 3], np.int64))]
    nodes = [helper.make_node("Gemm", ["x", "w", "c1"], ["g1"]),
             helper.make_node("Gemm", ["x", "wt", "c2"], ["g2"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Transpose", ["x"], ["xt"]),
             helper.make_node("Gemm", ["xt", "w", "c3"], ["g3"], transA=1, beta=0.0, alpha=-1.5),
             helper.make_node("Gemm", ["x", "x"], ["g4"], transB=1),
             helper.make_node("Split", ["g1", "sizes"], ["s1", "s2"], axis=1),
             helper.make_node("Split", ["g2"], ["t1", "t2", "t3"], axis=0),
             helper.make_node("Tanh", ["s2"], ["y1"]),
             helper.make_node("Add", ["g3", "g2"], ["y2"]),
             helper.make_node("Concat", ["t1", "t3", "t2"], ["y3"], axis=0),
             helper.make_node("Sigmoid", ["s1"], ["y4"])]
    model = _model(nodes, inits, [3, 4], y1=f32, y2=f32, y3=f32, y4=f32, g4=f32)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    x[1, 2] = np.inf
    _one_call_as_nodes_and_onnxruntime(model, {"x": x}, monkeypatch)


def test_small_convolutions_and_max_pools_in_one_call(rng, monkeypatch):
    """What a streaming model's front end convolves by direct loops: 2-D
    Convs (3x3 padded, strided and dilated, SAME), depthwise and grouped
    ones (1-D and 2-D), MaxPool over 1-D and 2-D windows (padded, strided,
    dilated; NaN taken as np.maximum takes it): in one call, as node by
    node and as onnxruntime."""
    f32 = TensorProto.FLOAT

    def init(name, shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    inits = [init("k33", (4, 2, 3, 3)), init("b4", (4,)), init("dw", (4, 1, 1, 3)),
             init("g2", (6, 2, 2, 2)), init("k1", (6, 2, 3)), init("b6", (6,)),
             numpy_helper.from_array(np.array([1, 4, 1, 10], np.int64), "shape1d")]
    nodes = [helper.make_node("Conv", ["x", "k33", "b4"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "dw"], ["c2"], group=4, strides=[1, 2],
                              auto_pad="SAME_UPPER"),
             helper.make_node("Conv", ["c1", "g2", "b6"], ["c3"], group=2, dilations=[2, 1],
                              pads=[2, 1, 0, 1]),
             helper.make_node("MaxPool", ["c3"], ["p1"], kernel_shape=[2, 3], strides=[1, 2],
                              pads=[1, 1, 0, 1]),
             helper.make_node("MaxPool", ["c2"], ["p2"], kernel_shape=[1, 2], dilations=[1, 2]),
             helper.make_node("Reshape", ["x", "shape1d"], ["r"]),
             helper.make_node("Squeeze", ["r", "ax2"], ["x1"]),
             helper.make_node("Conv", ["x1", "k1", "b6"], ["c4"], group=2, strides=[2],
                              pads=[2, 1]),
             helper.make_node("MaxPool", ["c4"], ["p3"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Relu", ["p1"], ["y1"]), helper.make_node("Tanh", ["p2"], ["y2"]),
             helper.make_node("Sigmoid", ["p3"], ["y3"])]
    inits.append(numpy_helper.from_array(np.array([2], np.int64), "ax2"))
    model = _model(nodes, inits, [1, 2, 2, 10], y1=f32, y2=f32, y3=f32)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "B"
    x = rng.standard_normal((1, 2, 2, 10)).astype(np.float32)
    x[0, 1, 0, 4] = np.nan
    _one_call_as_nodes_and_onnxruntime(model, {"x": x}, monkeypatch)


@pytest.mark.parametrize("op", ["GRU", pytest.param("LSTM", marks=pytest.mark.slow)])
def test_a_bidirectional_node_with_fed_states_is_compiled(op, rng, monkeypatch):
    """Each direction's kernel called in the one call, its states read from
    the fed ones and its Y and final states put at its place."""
    gates, f32 = {"GRU": 3, "LSTM": 4}[op], TensorProto.FLOAT
    inits = [numpy_helper.from_array(rng.standard_normal((2, gates * 4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((2, gates * 4, 4)).astype(np.float32), "R")]
    states = ["h0"] + ["c0"] * (op == "LSTM")
    outputs = ["Y", "Y_h"] + ["Y_c"] * (op == "LSTM")
    nodes = [helper.make_node(op, ["x", "W", "R", "", "", *states], outputs, hidden_size=4,
                              direction="bidirectional")]
    graph = helper.make_graph(
        nodes, "bidirectional", [helper.make_tensor_value_info("x", f32, [3, "B", 3])] + [
            helper.make_tensor_value_info(n, f32, [2, "B", 4]) for n in states],
        [helper.make_tensor_value_info(n, f32, None) for n in outputs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((3, 2, 3)).astype(np.float32)}
    feeds.update({n: rng.standard_normal((2, 2, 4)).astype(np.float32) for n in states})
    _one_call_as_nodes_and_onnxruntime(model, feeds, monkeypatch)


def test_an_enhancement_models_ops_in_one_call(rng, monkeypatch):
    """What a streaming enhancement model (GTCRN) is made of besides its
    GRUs: PRelu and BatchNormalization in an elementwise run, ConvTranspose
    (grouped, strided, 1-D and 2-D), ScatterND into a cache, Expand, and
    Gather by indices of two axes: in one call, as node by node and as
    onnxruntime."""
    f32 = TensorProto.FLOAT

    def init(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    inits = [init("slope", rng.standard_normal((4, 1, 1)).astype(np.float32)),
             *(init(n, rng.uniform(0.5, 2, 4).astype(np.float32)) for n in ("s", "b", "m", "v")),
             init("wt", rng.standard_normal((4, 2, 1, 3)).astype(np.float32)),
             init("bt", rng.standard_normal(4).astype(np.float32)),
             init("w1", rng.standard_normal((2, 3, 2)).astype(np.float32)),
             init("rows", np.array([[0], [2]], np.int64)),
             init("to", np.array([1, 4, 2, 6], np.int64)),
             init("starts", np.array([0], np.int64)), init("ends", np.array([1], np.int64)),
             init("axis3", np.array([3], np.int64)),
             init("pick", np.array([[5, 0], [1, 1]], np.int64))]
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["a"]),
             helper.make_node("BatchNormalization", ["a", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
             helper.make_node("Tanh", ["bn"], ["y1"]),
             helper.make_node("ConvTranspose", ["bn", "wt", "bt"], ["y2"], group=2, strides=[1, 2],
                              pads=[0, 1, 0, 1]),
             helper.make_node("Squeeze", ["x", "starts"], ["x3"]),
             helper.make_node("ConvTranspose", ["x3", "w1"], ["y3"], strides=[3], output_padding=[1]),
             helper.make_node("Slice", ["x", "starts", "ends", "axis3"], ["col"]),
             helper.make_node("Expand", ["col", "to"], ["y4"]),
             helper.make_node("Gather", ["x", "pick"], ["y5"], axis=3),
             helper.make_node("Mul", ["u", "u"], ["u2"]),
             helper.make_node("ScatterND", ["cache", "rows", "u2"], ["y6"])]
    graph = helper.make_graph(
        nodes, "enhancement", [helper.make_tensor_value_info("x", f32, [1, 4, 2, 6]),
                               helper.make_tensor_value_info("cache", f32, [3, 5]),
                               helper.make_tensor_value_info("u", f32, [2, 5])],
        [helper.make_tensor_value_info(f"y{k}", f32, None) for k in range(1, 7)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = rng.standard_normal((1, 4, 2, 6)).astype(np.float32)
    x[0, 1, 0, 2], x[0, 2, 1, 3] = np.nan, -np.inf
    feeds = {"x": x, "cache": rng.standard_normal((3, 5)).astype(np.float32),
             "u": rng.standard_normal((2, 5)).astype(np.float32)}
    _one_call_as_nodes_and_onnxruntime(model, feeds, monkeypatch)
