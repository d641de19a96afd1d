"""The quantized peers (``run.py``'s quantized section): int8 inference of
W1 (GRU), W2 (LSTM), W5 (the custom cell) and W7 (the 2-layer bidirectional
LSTM), with the float32 items of peers.py's families beside them.

- ``stepnet-int8``: the stepnet items with ``sn.quantize(model, "int8")``.
- ``torch-int8``: ``torch.ao.quantization.quantize_dynamic`` of nn.GRU and
  nn.LSTM (int8 weights, activations quantized per call: PyTorch's dynamic
  quantized RNNs on fbgemm).
- ``onnxruntime-int8``: the LSTM node's model quantized by
  ``onnxruntime.quantization.quantize_dynamic`` (a ``DynamicQuantizeLSTM``
  node); onnxruntime quantizes no GRU node.

Each family runs in its own process, as every family of run.py does.
"""

from __future__ import annotations

import peers
from peers import _sn_nn_gru, _sn_run_layer, peer


@peer("stepnet-int8", ["W1"], "stepnet nn.GRU int8 (sn.quantize)")
def stepnet_int8_gru(wl):
    import stepnet as sn

    layer, X = _sn_nn_gru(sn, wl)
    return _sn_run_layer(sn.quantize(layer, "int8"), X, lambda h_n: h_n[0])


@peer("stepnet-int8", ["W2"], "stepnet nn.LSTM int8 (sn.quantize)")
@peer("stepnet-int8", ["W7"], "stepnet nn.LSTM 2 layers bidirectional_concat int8 (sn.quantize)")
def stepnet_int8_lstm(wl):
    import stepnet as sn

    layer, X, last = peers.sn_nn_lstm(sn, wl)
    return _sn_run_layer(sn.quantize(layer, "int8"), X, last)


@peer("stepnet-int8", ["W5"], "stepnet custom cell in the DSL int8 (sn.quantize)")
def stepnet_int8_custom(wl):
    import stepnet as sn

    rnn, X = peers.sn_custom_rnn(sn, wl)
    f = sn.quantize(rnn, "int8").compile("numba")
    last = peers._sn_last_rows(X.lod[-1])

    def run():
        out = f(x=X)
        return out, out.data[last]

    return run


def _torch_int8(torch, m):
    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in \
        torch.backends.quantized.supported_engines else torch.backends.quantized.engine
    # (quantize_dynamic swaps a model's children: the RNN goes in a container)
    holder = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(m), {torch.nn.GRU, torch.nn.LSTM},
                                                    dtype=torch.qint8)
    if type(holder[0]).__module__.startswith("torch.nn.modules"):
        raise RuntimeError(f"quantize_dynamic left the {type(m).__name__} as it was")
    return holder[0]


@peer("torch-int8", ["W1"], "torch nn.GRU, quantize_dynamic int8")
@peer("torch-int8", ["W2", "W7"], "torch nn.LSTM, quantize_dynamic int8")
def torch_int8_layer(wl):
    import torch

    m, last = peers.torch_rnn(torch, wl)
    return peers.torch_run(torch, _torch_int8(torch, m), wl, last)


peers.not_applicable("torch-int8", ["W5"], "no quantized form of a custom cell")


@peer("onnxruntime-int8", ["W2"], "onnxruntime DynamicQuantizeLSTM (quantize_dynamic)")
def ort_int8_lstm(wl):
    import os
    import tempfile

    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = peers._onnx_node_model("LSTM", wl.weights, wl.dims["I"], wl.dims["H"], False)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "lstm.onnx"), os.path.join(tmp, "lstm_int8.onnx")
        onnx.save(model, src)
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
        ops = {n.op_type for n in onnx.load(dst).graph.node}
        if "DynamicQuantizeLSTM" not in ops:
            raise RuntimeError(f"quantize_dynamic wrote {sorted(ops)}, no DynamicQuantizeLSTM")
        sess = ort.InferenceSession(dst, peers._ort_options(), providers=["CPUExecutionProvider"])
    feeds = {"X": wl.x_time_major()}

    def run():
        y, h = sess.run(None, feeds)
        return y, h[0]

    return run


peers.not_applicable("onnxruntime-int8", ["W1"], "quantize_dynamic quantizes no GRU node")
peers.not_applicable("onnxruntime-int8", ["W5"], "no quantized form of a custom cell")
peers.not_applicable("onnxruntime-int8", ["W7"], "the stacked bidirectional LSTM is not one "
                                                 "node here")
