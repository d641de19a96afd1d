"""A custom cell to ONNX and back: stepnet exports it, onnxruntime runs the
model, stepnet's own InferenceSession runs the same model on its kernels, and
all three agree.

Run it: ``python examples/onnx_roundtrip.py`` (needs ``pip install 'stepnet[onnx]'``
and onnxruntime for the second runtime).
"""

import numpy as np

import stepnet as sn

rng = np.random.default_rng(0)
X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 8)).astype(np.float32), [[4, 0, 5]])
W = sn.Parameter((rng.standard_normal((8, 16)) * 0.3).astype(np.float32), name="W")
U = sn.Parameter((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), name="U")

# a minimal gated cell: h' = z * h + (1 - z) * tanh(x W + h U)
rnn = sn.create_rnn_op()
with rnn.stepnet():
    x = rnn.add_input(X, name="x")
    h = rnn.add_memory(shape=[16], name="h")
    z = sn.ops.sigmoid(x @ W + h.pre_state() @ U)
    h.update(z * h.pre_state() + (1 - z) * sn.ops.tanh(x @ W + h.pre_state() @ U))
    rnn.add_outputs(h)

expected = rnn(output_all_steps=False)                     # [3, 16]: each sequence's last state
model = sn.onnx.export(rnn, "cell.onnx", output_all_steps=False)
padded, lengths = X.to_padded()
feeds = {"x": padded, "lengths": lengths}
print("exported:", [n.op_type for n in model.graph.node])

ours, = sn.onnx.InferenceSession("cell.onnx").run(None, feeds)
print("stepnet session vs stepnet:", float(np.abs(ours - expected).max()))
assert np.allclose(ours, expected, atol=1e-5)
try:
    import onnxruntime as ort
except ImportError:
    print("onnxruntime is not installed: skipped")
else:
    theirs, = ort.InferenceSession("cell.onnx", providers=["CPUExecutionProvider"]).run(None, feeds)
    print("onnxruntime vs stepnet:", float(np.abs(theirs - expected).max()))
    assert np.allclose(theirs, expected, atol=1e-5)
