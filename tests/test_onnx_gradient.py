"""The ONNX Gradient operator against finite differences (onnxruntime does
not run it) and ONNX's own Gradient model tests."""

import importlib
import warnings

import numpy as np
import pytest

import stepnet as sn

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from stepnet.onnx import InferenceSession  # noqa: E402

TRAINING = "ai.onnx.preview.training"
F64 = TensorProto.DOUBLE


def _simple_gradient_cases():
    import onnx.backend.test.case.model as model_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("onnx.backend.test.case.model.gradient")
    return [c for c in model_cases._SimpleModelTestCases if c.name.startswith("test_gradient")]


@pytest.mark.parametrize("case", _simple_gradient_cases(), ids=lambda c: c.name)
def test_onnx_gradient_model_cases(case):
    session = InferenceSession(case.model, backend="interpreter")
    for inputs, outputs in case.data_sets:
        got = session.run(None, {a.name: v for a, v in zip(session.get_inputs(), inputs)})
        for g, e in zip(got, outputs):
            np.testing.assert_allclose(g, e, rtol=1e-6)


# ----------------------------------------------------------------------------
# helpers: a graph computing y, and the same graph with a Gradient node


def _info(name, array):
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)
    return helper.make_tensor_value_info(name, elem, list(np.shape(array)))


def _models(nodes, feeds, xs, y, zs=(), initializers=(), opset=17):
    """``(forward model giving y, model giving y and dy/dx for each x)``."""
    inputs = [_info(k, v) for k, v in feeds.items()]
    y_info = helper.make_tensor_value_info(y, F64, None)
    grads = [f"d_{x}" for x in xs]
    gradient = helper.make_node("Gradient", list(xs) + list(zs), grads, domain=TRAINING,
                                xs=list(xs), y=y, name="grad", **({"zs": list(zs)} if zs else {}))
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)]
    forward = helper.make_model(helper.make_graph(nodes, "f", inputs, [y_info],
                                                  initializer=list(initializers)),
                                opset_imports=imports[:1])
    with_grad = helper.make_model(
        helper.make_graph(nodes + [gradient], "g", inputs,
                          [y_info] + [helper.make_tensor_value_info(g, F64, None) for g in grads],
                          initializer=list(initializers)),
        opset_imports=imports)
    return forward, with_grad


def _finite_differences(forward, feeds, x, backend="interpreter", eps=1e-6):
    session = InferenceSession(forward, backend=backend)

    def total(values):
        return float(np.sum(session.run(None, values)[0]))

    base = np.asarray(feeds[x], np.float64)
    grad = np.zeros_like(base)
    for i in np.ndindex(base.shape):
        for sign in (1, -1):
            moved = base.copy()
            moved[i] += sign * eps
            grad[i] += sign * total(dict(feeds, **{x: moved})) / (2 * eps)
    return grad


def _check(nodes, feeds, xs, y="y", zs=(), initializers=(), backend="interpreter", opset=17,
           rtol=1e-6, atol=1e-7):
    forward, with_grad = _models(nodes, feeds, xs, y, zs, initializers, opset)
    got = InferenceSession(with_grad, backend=backend).run(None, feeds)
    expected_y = InferenceSession(forward, backend=backend).run(None, feeds)[0]
    np.testing.assert_allclose(got[0], expected_y, rtol=1e-12)
    for x, g in zip(xs, got[1:]):
        assert g.shape == np.shape(feeds[x]) and g.dtype == np.float64
        fd = _finite_differences(forward, feeds, x, backend)
        np.testing.assert_allclose(g, fd, rtol=rtol, atol=atol, err_msg=f"d y / d {x}")
    return got


# ----------------------------------------------------------------------------
# every graph-level op with a gradient rule

R = np.random.default_rng(5)


def _a(*shape, positive=False):
    v = R.standard_normal(shape)
    return np.abs(v) + 0.5 if positive else v


_node = helper.make_node


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value)))


OP_CASES = {
    "Add": ([_node("Add", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(3)}),
    "Sub": ([_node("Sub", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(2, 1)}),
    "Mul": ([_node("Mul", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(3)}),
    "Div": ([_node("Div", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(2, 3, positive=True)}),
    "Sum": ([_node("Sum", ["a", "b", "a"], ["y"])], {"a": _a(2, 3), "b": _a(3)}),
    "Mean": ([_node("Mean", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(2, 3)}),
    "Max": ([_node("Max", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(2, 3)}),
    "Min": ([_node("Min", ["a", "b"], ["y"])], {"a": _a(2, 3), "b": _a(2, 3)}),
    "Neg": ([_node("Neg", ["a"], ["y"])], {"a": _a(4)}),
    "Abs": ([_node("Abs", ["a"], ["y"])], {"a": _a(4)}),
    "Exp": ([_node("Exp", ["a"], ["y"])], {"a": _a(4)}),
    "Log": ([_node("Log", ["a"], ["y"])], {"a": _a(4, positive=True)}),
    "Tanh": ([_node("Tanh", ["a"], ["y"])], {"a": _a(4)}),
    "Sigmoid": ([_node("Sigmoid", ["a"], ["y"])], {"a": _a(4)}),
    "Relu": ([_node("Relu", ["a"], ["y"])], {"a": _a(4)}),
    "Softplus": ([_node("Softplus", ["a"], ["y"])], {"a": _a(4)}),
    "Erf": ([_node("Erf", ["a"], ["y"])], {"a": _a(4)}),
    "Softsign": ([_node("Softsign", ["a"], ["y"])], {"a": _a(4)}),
    "Sqrt": ([_node("Sqrt", ["a"], ["y"])], {"a": _a(4, positive=True)}),
    "Reciprocal": ([_node("Reciprocal", ["a"], ["y"])], {"a": _a(4, positive=True)}),
    "Elu": ([_node("Elu", ["a"], ["y"], alpha=0.7)], {"a": _a(6)}),
    "LeakyRelu": ([_node("LeakyRelu", ["a"], ["y"], alpha=0.2)], {"a": _a(6)}),
    "ThresholdedRelu": ([_node("ThresholdedRelu", ["a"], ["y"], alpha=0.3)], {"a": _a(6)}),
    "HardSigmoid": ([_node("HardSigmoid", ["a"], ["y"], alpha=0.3, beta=0.4)], {"a": _a(6)}),
    "Selu": ([_node("Selu", ["a"], ["y"])], {"a": _a(6)}),
    "Identity": ([_node("Identity", ["a"], ["y"])], {"a": _a(3)}),
    "Clip": ([_const("lo", -0.4), _const("hi", 0.5), _node("Clip", ["a", "lo", "hi"], ["y"])],
             {"a": _a(8)}),
    "Where": ([_node("Greater", ["a", "b"], ["c"]), _node("Where", ["c", "a", "b"], ["y"])],
              {"a": _a(2, 3), "b": _a(3)}),
    "MatMul": ([_node("MatMul", ["a", "b"], ["y"])], {"a": _a(2, 3, 4), "b": _a(4, 2)}),
    "MatMul-vector": ([_node("MatMul", ["a", "b"], ["y"])], {"a": _a(4), "b": _a(4, 2)}),
    "Gemm": ([_node("Gemm", ["a", "b", "c"], ["y"], alpha=0.7, beta=1.3, transA=1, transB=1)],
             {"a": _a(4, 2), "b": _a(3, 4), "c": _a(3)}),
    "Concat": ([_node("Concat", ["a", "b"], ["y"], axis=1)], {"a": _a(2, 3), "b": _a(2, 2)}),
    "Split": ([_const("sizes", np.array([1, 2], np.int64)),
               _node("Split", ["a", "sizes"], ["p", "q"], axis=1),
               _node("Mul", ["p", "q"], ["y"])], {"a": _a(2, 3)}),
    "Slice": ([_const("st", np.array([1, 0], np.int64)), _const("en", np.array([3, 4], np.int64)),
               _const("ax", np.array([0, 1], np.int64)), _const("sp", np.array([1, 2], np.int64)),
               _node("Slice", ["a", "st", "en", "ax", "sp"], ["y"])], {"a": _a(4, 4)}),
    "Squeeze": ([_const("ax", np.array([1], np.int64)), _node("Squeeze", ["a", "ax"], ["s"]),
                 _node("Mul", ["s", "s"], ["y"])], {"a": _a(3, 1, 2)}),
    "Unsqueeze": ([_const("ax", np.array([0], np.int64)), _node("Unsqueeze", ["a", "ax"], ["s"]),
                   _node("Mul", ["s", "s"], ["y"])], {"a": _a(3, 2)}),
    "Reshape": ([_const("shape", np.array([3, -1], np.int64)), _node("Reshape", ["a", "shape"], ["s"]),
                 _node("Mul", ["s", "s"], ["y"])], {"a": _a(2, 3)}),
    "Transpose": ([_node("Transpose", ["a"], ["t"], perm=[2, 0, 1]),
                   _node("Mul", ["t", "w"], ["y"])], {"a": _a(2, 3, 4), "w": _a(4, 2, 3)}),
    "ReduceSum": ([_const("ax", np.array([1], np.int64)), _node("ReduceSum", ["a", "ax"], ["s"], keepdims=0),
                   _node("Mul", ["s", "s"], ["y"])], {"a": _a(2, 3, 2)}),
    "ReduceMean": ([_node("ReduceMean", ["a"], ["s"], axes=[0, 2], keepdims=1),
                    _node("Mul", ["s", "s"], ["y"])], {"a": _a(2, 3, 2)}),
    "Softmax": ([_node("Softmax", ["a"], ["s"], axis=1), _node("Mul", ["s", "w"], ["y"])],
                {"a": _a(2, 3), "w": _a(2, 3)}),
    "Pow": ([_node("Pow", ["a", "b"], ["y"])], {"a": _a(3, positive=True), "b": _a(3)}),
    "Gather": ([_const("idx", np.array([2, 0, 2], np.int64)), _node("Gather", ["a", "idx"], ["y"], axis=1)],
               {"a": _a(2, 3)}),
}
OP_CASES["Mean"][1]["b"] = _a(2, 3)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_gradient_against_finite_differences(name):
    nodes, feeds = OP_CASES[name]
    opset = 11 if name == "ReduceMean" else 17
    _check(nodes, feeds, list(feeds), opset=opset)


def test_every_rule_is_tested():
    from stepnet.onnx.ops import OPS

    with_rule = {name for name, entry in OPS.items() if entry.vjp is not None}
    tested = {name.split("-")[0] for name in OP_CASES} | {"Dropout", "Cast", "Flatten"}
    assert with_rule <= tested, sorted(with_rule - tested)


def test_gradient_with_respect_to_an_intermediate_tensor():
    """xs may name a tensor a node computes: the graph is cut there."""
    nodes = [helper.make_node("Mul", ["a", "a"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])]
    feeds = {"a": _a(3)}
    forward, with_grad = _models(nodes, feeds, ["a"], "y")
    graph = with_grad.graph
    grad = helper.make_node("Gradient", ["h"], ["d_h"], domain=TRAINING, xs=["h"], y="y", name="gh")
    graph.node[-1].CopyFrom(grad)
    del graph.output[1:]
    graph.output.append(helper.make_tensor_value_info("d_h", F64, None))
    y, d_h = InferenceSession(with_grad).run(None, feeds)
    np.testing.assert_allclose(d_h, 1 - np.tanh(feeds["a"] ** 2) ** 2, rtol=1e-12)


# ----------------------------------------------------------------------------
# GRU, LSTM and RNN nodes


def _recurrent_case(op, direction="forward", layout=0, lengths=None, linear_before_reset=0, peephole=False,
                    seed=0):
    r = np.random.default_rng(seed)
    T, B, I, H = 4, 3, 2, 3
    D = 2 if direction == "bidirectional" else 1
    G = {"GRU": 3, "LSTM": 4, "RNN": 1}[op]
    feeds = {"X": r.standard_normal((B, T, I) if layout else (T, B, I)),
             "W": r.standard_normal((D, G * H, I)) * 0.5, "R": r.standard_normal((D, G * H, H)) * 0.5,
             "B": r.standard_normal((D, 2 * G * H)) * 0.3,
             "h0": r.standard_normal((B, D, H) if layout else (D, B, H)) * 0.5}
    ins = ["X", "W", "R", "B", "L" if lengths is not None else "", "h0"]
    zs = []
    if lengths is not None:
        feeds["L"] = np.asarray(lengths, np.int32)
        zs = ["L"]
    if op == "LSTM":
        feeds["c0"] = r.standard_normal(feeds["h0"].shape) * 0.5
        ins.append("c0")
        if peephole:
            feeds["P"] = r.standard_normal((D, 3 * H)) * 0.5
            ins.append("P")
    attrs = {"hidden_size": H, "direction": direction, "layout": layout}
    if linear_before_reset:
        attrs["linear_before_reset"] = 1
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    # y = sum(Y * C1) + sum(Y_h * C2) (+ sum(Y_c * C3)): every output carries a gradient
    weights = [numpy_helper.from_array(r.standard_normal(s), f"C{i}")
               for i, s in enumerate([(B, T, D, H) if layout else (T, D, B, H)]
                                     + [feeds["h0"].shape] * (len(outs) - 1))]
    nodes = [helper.make_node(op, ins, outs, **attrs)]
    terms = []
    for i, o in enumerate(outs):
        nodes.append(helper.make_node("Mul", [o, f"C{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("ReduceSum", [f"m{i}"], [f"s{i}"], keepdims=0))
        terms.append(f"s{i}")
    nodes.append(helper.make_node("Sum", terms, ["y"]))
    xs = [k for k in feeds if k != "L"]
    return nodes, feeds, xs, zs, weights


RECURRENT_CASES = [
    ("GRU", {}), ("GRU", {"direction": "bidirectional", "lengths": [4, 1, 2]}),
    ("GRU", {"linear_before_reset": 1, "direction": "reverse", "layout": 1, "lengths": [2, 4, 3]}),
    ("LSTM", {}), ("LSTM", {"direction": "bidirectional", "peephole": True, "lengths": [3, 4, 1]}),
    ("RNN", {"direction": "reverse", "lengths": [1, 3, 4]}), ("RNN", {"layout": 1}),
]


@pytest.mark.parametrize("op, options", RECURRENT_CASES, ids=lambda v: str(v))
def test_recurrent_node_gradient(op, options):
    nodes, feeds, xs, zs, weights = _recurrent_case(op, **options)
    _check(nodes, feeds, xs, zs=zs, initializers=weights, opset=17, rtol=1e-5, atol=1e-6)


def test_recurrent_node_gradient_on_numba():
    nodes, feeds, xs, zs, weights = _recurrent_case("GRU", direction="bidirectional", lengths=[4, 2, 3])
    forward, with_grad = _models(nodes, feeds, xs, "y", zs, weights)
    expected = InferenceSession(with_grad, backend="interpreter").run(None, feeds)
    got = InferenceSession(with_grad, backend="numba").run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------
# Scan nodes


def _scan9_case(reverse_in=False, reverse_out=False, in_axis=0):
    H, I, T = 3, 2, 4
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "W"], ["xw"]),
         helper.make_node("MatMul", ["h", "U"], ["hu"]),
         helper.make_node("Add", ["xw", "hu"], ["s"]),
         helper.make_node("Add", ["s", "b"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_next"]),
         helper.make_node("Sigmoid", ["h_next"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("h", F64, [2, H]),
         helper.make_tensor_value_info("x_t", F64, [2, I])],
        [helper.make_tensor_value_info("h_next", F64, [2, H]),
         helper.make_tensor_value_info("y_t", F64, [2, H])])
    r = np.random.default_rng(2)
    X = np.moveaxis(r.standard_normal((T, 2, I)), 0, in_axis).copy()
    feeds = {"h0": r.standard_normal((2, H)), "X": X, "W": r.standard_normal((I, H)) * 0.6,
             "U": r.standard_normal((H, H)) * 0.6, "b": r.standard_normal(H) * 0.2}
    C = numpy_helper.from_array(r.standard_normal((T, 2, H)), "C")
    nodes = [helper.make_node("Scan", ["h0", "X"], ["hT", "Y"], body=body, num_scan_inputs=1,
                              scan_input_directions=[int(reverse_in)],
                              scan_output_directions=[int(reverse_out)], scan_input_axes=[in_axis]),
             helper.make_node("Mul", ["Y", "C"], ["YC"]),
             helper.make_node("ReduceSum", ["YC"], ["s1"], keepdims=0),
             helper.make_node("ReduceSum", ["hT"], ["s2"], keepdims=0),
             helper.make_node("Add", ["s1", "s2"], ["y"])]
    return nodes, feeds, [C]


@pytest.mark.parametrize("reverse_in, reverse_out, in_axis", [(False, False, 0), (True, True, 1)])
def test_scan9_gradient(reverse_in, reverse_out, in_axis):
    """xs: the initial state, the scan input, and weights the body reads from
    the outer graph."""
    nodes, feeds, inits = _scan9_case(reverse_in, reverse_out, in_axis)
    _check(nodes, feeds, ["h0", "X", "W", "U", "b"], initializers=inits, opset=16)


def test_scan9_gradient_on_numba():
    nodes, feeds, inits = _scan9_case(True, False, 1)
    forward, with_grad = _models(nodes, feeds, ["h0", "X", "W", "U", "b"], "y", (), inits, 16)
    expected = InferenceSession(with_grad, backend="interpreter").run(None, feeds)
    got = InferenceSession(with_grad, backend="numba").run(None, feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


def test_scan8_gradient_with_sequence_lens_and_directions():
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "a"], ["sa"]),
         helper.make_node("Tanh", ["sa"], ["t"]),
         helper.make_node("Add", ["t", "c"], ["s1"]),
         helper.make_node("Sigmoid", ["s1"], ["y"])],
        "body",
        [helper.make_tensor_value_info(n, F64, [2]) for n in ("s", "a", "c")],
        [helper.make_tensor_value_info(n, F64, [2]) for n in ("s1", "y")])
    r = np.random.default_rng(4)
    feeds = {"L": np.array([3, 1, 2], np.int64), "s0": r.standard_normal((3, 2)),
             "A": r.standard_normal((3, 3, 2)), "Cin": r.standard_normal((3, 3, 2))}
    weights = [numpy_helper.from_array(r.standard_normal((3, 3, 2)), "K")]
    nodes = [helper.make_node("Scan", ["L", "s0", "A", "Cin"], ["sT", "Y"], body=body, num_scan_inputs=2,
                              directions=[1, 0]),
             helper.make_node("Mul", ["Y", "K"], ["YK"]),
             helper.make_node("ReduceSum", ["YK"], ["r1"], keepdims=0),
             helper.make_node("ReduceSum", ["sT"], ["r2"], keepdims=0),
             helper.make_node("Add", ["r1", "r2"], ["y"])]
    got = _check(nodes, feeds, ["s0", "A", "Cin"], zs=["L"], initializers=weights, opset=8)
    # past each sequence's length the scan inputs do not matter
    assert np.all(got[2][1, 1:] == 0) and np.all(got[3][2, 2:] == 0)


# ----------------------------------------------------------------------------
# errors


def test_gradient_of_a_gradient_is_refused():
    nodes = [helper.make_node("Mul", ["a", "a"], ["y"]),
             helper.make_node("Gradient", ["a"], ["g1"], domain=TRAINING, xs=["a"], y="y", name="first"),
             helper.make_node("Gradient", ["a"], ["g2"], domain=TRAINING, xs=["a"], y="g1", name="second")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", F64, [2])],
                              [helper.make_tensor_value_info("g2", F64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(TRAINING, 1)])
    with pytest.raises(sn.UnsupportedError, match="'second' \\(Gradient\\).*higher-order"):
        InferenceSession(model).run(None, {"a": np.ones(2)})


def test_op_without_a_rule_is_named():
    nodes = [helper.make_node("ReduceMax", ["a"], ["y"], keepdims=0, name="rmax")]
    forward, with_grad = _models(nodes, {"a": _a(3)}, ["a"], "y", opset=17)
    with pytest.raises(sn.UnsupportedError, match="'rmax' \\(ReduceMax\\): has no gradient rule"):
        InferenceSession(with_grad).run(None, {"a": _a(3)})


def test_y_that_xs_do_not_reach_is_refused():
    nodes = [helper.make_node("Mul", ["a", "b"], ["y"])]
    forward, with_grad = _models(nodes, {"a": _a(2), "b": _a(2)}, ["a"], "y")
    with pytest.raises(sn.UnsupportedError, match="depends on 'b'"):
        InferenceSession(with_grad).run(None, {"a": _a(2), "b": _a(2)})


def test_scan9_gradient_when_the_body_mixes_rows():
    """A body summing over axis 0 runs as one sequence; its pullback too."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "U"], ["hu"]),
         helper.make_node("Add", ["hu", "x_t"], ["s"]),
         helper.make_node("ReduceSum", ["s", "zero"], ["col"], keepdims=1),
         helper.make_node("Sub", ["s", "col"], ["c"]),
         helper.make_node("Tanh", ["c"], ["h_next"]),
         helper.make_node("Identity", ["h_next"], ["y_t"])],
        "body",
        [helper.make_tensor_value_info("h", F64, [2, 3]), helper.make_tensor_value_info("x_t", F64, [2, 3])],
        [helper.make_tensor_value_info("h_next", F64, [2, 3]),
         helper.make_tensor_value_info("y_t", F64, [2, 3])])
    r = np.random.default_rng(8)
    feeds = {"h0": r.standard_normal((2, 3)), "X": r.standard_normal((3, 2, 3)),
             "U": r.standard_normal((3, 3)) * 0.5}
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(r.standard_normal((3, 2, 3)), "C")]
    nodes = [helper.make_node("Scan", ["h0", "X"], ["hT", "Y"], body=body, num_scan_inputs=1,
                              scan_output_directions=[1]),
             helper.make_node("Mul", ["Y", "C"], ["YC"]),
             helper.make_node("ReduceSum", ["YC"], ["y"], keepdims=0)]
    _check(nodes, feeds, ["h0", "X", "U"], initializers=inits, opset=16)
