"""Quantized ONNX models (stepnet/onnx/quantized.py, DynamicQuantizeLSTM in
stepnet/onnx/recurrent.py): the integer ops bit for bit against the ONNX
reference, on stepnet's own entries; onnxruntime's DynamicQuantizeLSTM node
against onnxruntime; models quantized by onnxruntime's quantize_dynamic from
PyTorch exports, within int8's error of their float model."""

import os

import numpy as np
import pytest

import stepnet as sn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import stepnet.onnx  # noqa: E402,F401

_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.uint8): TensorProto.UINT8,
          np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int32): TensorProto.INT32}


def _model(nodes, feeds, outputs, inits=(), domains=(), out_type=TensorProto.UNDEFINED):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, _TYPES[v.dtype], list(v.shape))
                     for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, out_type, None) for o in outputs],
        [numpy_helper.from_array(a, n) for n, a in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)] + [
        helper.make_opsetid(d, 1) for d in domains])


rng = np.random.default_rng(0)
_A = rng.integers(0, 256, (6, 9)).astype(np.uint8)
_B = rng.integers(-127, 128, (9, 5)).astype(np.int8)
_CASES = {
    "DynamicQuantizeLinear": (["x"], {"x": rng.standard_normal((5, 7)).astype(np.float32)}, 3, {}),
    "MatMulInteger": (["a", "b", "az", "bz"], {"a": _A, "b": _B, "az": np.array(3, np.uint8),
                                               "bz": np.arange(5).astype(np.int8)}, 1, {}),
    "ConvInteger": (["x", "w", "xz"], {"x": rng.integers(0, 256, (2, 3, 9, 8)).astype(np.uint8),
                                       "w": rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8),
                                       "xz": np.array(128, np.uint8)}, 1, {"pads": [1, 1, 1, 1]}),
    "QLinearMatMul": (["a", "as", "az", "b", "bs", "bz", "ys", "yz"],
                      {"a": _A, "as": np.array(0.02, np.float32), "az": np.array(128, np.uint8),
                       "b": _B, "bs": np.array(0.01, np.float32), "bz": np.array(0, np.int8),
                       "ys": np.array(0.05, np.float32), "yz": np.array(120, np.uint8)}, 1, {}),
}


@pytest.mark.parametrize("op", sorted(_CASES))
def test_integer_ops_are_the_reference_bit_for_bit(op):
    inputs, feeds, count, attrs = _CASES[op]
    outputs = [f"y{i}" for i in range(count)]
    model = _model([helper.make_node(op, inputs, outputs, **attrs)], feeds, outputs)
    session = sn.onnx.InferenceSession(model)
    assert session.graph.nodes[0].table is not None  # stepnet's entry, not the reference
    for got, want in zip(session.run(None, feeds), ReferenceEvaluator(model).run(None, feeds)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def _int8_lstm(weights, per_column, unsigned):
    """A DynamicQuantizeLSTM node's W or R (int8 or uint8 [D, rows, 4H]) with
    its scale and zero point, from float weights [D, rows, 4H]."""
    axis = (1,) if per_column else (1, 2)
    top = np.abs(weights).max(axis=axis, keepdims=True)
    scale = (top / 127).astype(np.float32)
    q = np.clip(np.rint(weights / scale), -127, 127)
    zero = np.zeros_like(scale, np.int8)
    if unsigned:
        q, zero = q + 128, np.full_like(scale, 128, np.uint8)
    shape = (weights.shape[0], weights.shape[2]) if per_column else (weights.shape[0],)
    return (q.astype(np.uint8 if unsigned else np.int8), scale.reshape(shape),
            zero.reshape(shape))


@pytest.mark.parametrize("direction,per_column,unsigned", [("forward", False, False),
                                                           ("bidirectional", True, False),
                                                           ("reverse", True, True)])
def test_dynamic_quantize_lstm_node_against_onnxruntime(direction, per_column, unsigned):
    D, I, H, T, B = 2 if direction == "bidirectional" else 1, 6, 8, 7, 3
    r = np.random.default_rng(1)
    W, S_w, Z_w = _int8_lstm(r.uniform(-0.5, 0.5, (D, I, 4 * H)).astype(np.float32), per_column,
                             unsigned)
    R, S_r, Z_r = _int8_lstm(r.uniform(-0.5, 0.5, (D, H, 4 * H)).astype(np.float32), per_column,
                             unsigned)
    if per_column and not unsigned:  # (a zero point per direction beside scales per column)
        Z_r = np.zeros(D, np.int8)
    bias = r.uniform(-0.2, 0.2, (D, 8 * H)).astype(np.float32)
    inits = [("W", W), ("R", R), ("B", bias), ("sw", S_w), ("zw", Z_w), ("sr", S_r), ("zr", Z_r)]
    node = helper.make_node("DynamicQuantizeLSTM", ["X", "W", "R", "B", "", "", "", "", "sw", "zw",
                                                    "sr", "zr"],
                            ["Y", "Y_h", "Y_c"], domain="com.microsoft", hidden_size=H,
                            direction=direction)
    feeds = {"X": r.standard_normal((T, B, I)).astype(np.float32)}
    model = _model([node], feeds, ["Y", "Y_h", "Y_c"], inits, domains=["com.microsoft"],
                   out_type=TensorProto.FLOAT)
    session = sn.onnx.InferenceSession(model)
    got = session.run(None, feeds)
    again = session.run(None, feeds)  # (a streaming model's next call: the node's prepared kernels)
    for a, b in zip(again, got):
        np.testing.assert_array_equal(a, b)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds)
    # the float LSTM of the dequantized weights: what both approximate
    shape = (D, 1, 4 * H) if per_column else (D, 1, 1)

    def dequantized(q, s, z):
        z = z.reshape(shape if z.size == s.size else (D, 1, 1))
        return ((q.astype(np.float32) - z) * s.reshape(shape)).transpose(0, 2, 1)

    float_node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y", "Y_h", "Y_c"], hidden_size=H,
                                  direction=direction)
    float_model = _model([float_node], feeds, ["Y", "Y_h", "Y_c"],
                         [("W", dequantized(W, S_w, Z_w)), ("R", dequantized(R, S_r, Z_r)),
                          ("B", bias)], out_type=TensorProto.FLOAT)
    exact = ort.InferenceSession(float_model.SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w, e in zip(got, want, exact):
        assert g.shape == w.shape and g.dtype == np.float32
        ours, theirs = np.abs(g - e).max(), np.abs(w - e).max()
        assert ours < 3e-2 and ours <= 2 * theirs + 1e-3, (ours, theirs)


def _quantized(tmp_path, exported):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = os.fspath(tmp_path / "model.onnx"), os.fspath(tmp_path / "int8.onnx")
    onnx.save(exported.model, src)
    quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
    return src, dst


@pytest.mark.parametrize("name,written", [("speech", "DynamicQuantizeLSTM"),
                                          ("gru_lm", "MatMulInteger"), ("crnn", "ConvInteger")])
def test_models_quantized_by_onnxruntime(tmp_path, name, written):
    import onnx_models

    exported = getattr(onnx_models, name)()
    src, dst = _quantized(tmp_path, exported)
    assert written in onnx_models.op_counts(onnx.load(dst).graph)
    feeds = exported.feeds()
    got = sn.onnx.InferenceSession(dst).run(None, feeds)
    theirs = ort.InferenceSession(dst, providers=["CPUExecutionProvider"]).run(None, feeds)
    exact = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, t, e in zip(got, theirs, exact):
        scale = np.abs(e).max()
        ours, ort_error = np.abs(g - e).max() / scale, np.abs(t - e).max() / scale
        if written == "DynamicQuantizeLSTM":  # (stepnet quantizes by rows, onnxruntime by
            # tensor: two errors of one size, either the larger on a given model)
            assert ours < 5e-2 and ours <= 2 * ort_error + 1e-3, (ours, ort_error)
        else:  # the integer ops have one meaning: onnxruntime's results
            np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-5 * scale)
