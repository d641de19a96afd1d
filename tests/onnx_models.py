"""Small PyTorch models of common recurrent architectures, exported to ONNX
with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``, which
runs offline), for tests/test_onnx_models.py and benchmarks/onnx_streaming.py.

Each builder returns a :class:`Exported`: the ``onnx.ModelProto``, the torch
module it came from and a function making feeds of a given batch and length.
Weights are seeded; sizes are small so that the tests stay fast.

- ``crnn``: Conv + BatchNorm + ReLU + MaxPool twice, a 2-layer bidirectional
  LSTM, a GRU, Linear and LogSoftmax over the classes: a CTC-style output
  ``[T, B, classes]`` for an image ``[B, 1, 16, W]``.
- ``speech``: a waveform ``[B, N]`` through an STFT written as a Conv1d with
  fixed cosine and sine kernels, a log magnitude, a Conv1d, a 2-layer LSTM
  and a Linear: ``[B, T, classes]``.
- ``vad``: a voice-activity detector shaped like Silero VAD: a scripted
  module whose ``If`` on the scalar sample rate picks one of two branches
  (each a reflect-padded STFT conv, a Conv1d and an LSTM carrying the state
  ``[2, B, H]``), with ``Shape``/``Gather``/``Slice``/``Pad``/``Cast``/
  ``Equal``/``Not``/``Size`` around it. Called once per chunk of 512 samples.
- ``gru_lm``: an embedding, a 2-layer GRU with its state as input and output,
  and a softmax whose weight is the embedding's (tied).
- ``seq2seq_encoder``: an embedding, ``pack_padded_sequence`` (unsorted
  lengths), a bidirectional GRU, ``pad_packed_sequence`` and a bridge from the
  final states to the decoder's initial state.
- ``stream_gru``: an STFT conv, a GRU carrying its state and a Linear: a
  streaming model with no control flow.
"""

from __future__ import annotations

import io
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def _torch():
    import torch

    return torch


@dataclass
class Exported:
    name: str
    model: object  # onnx.ModelProto
    module: object  # the torch module (scripted for vad)
    feeds: Callable  # feeds(batch, length, seed) -> {input name: array}


def export(module, args, opset, input_names, output_names, dynamic_axes, **kw):
    """``module`` as an ONNX ModelProto by the TorchScript exporter."""
    import onnx

    torch = _torch()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset,
                          input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, **kw)
    return onnx.load_from_string(buf.getvalue())


def op_counts(graph, counts=None) -> Counter:
    """How often each op occurs in a graph and its subgraphs."""
    import onnx

    counts = Counter() if counts is None else counts
    for node in graph.node:
        counts[node.op_type] += 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                op_counts(attr.g, counts)
    return counts


def _randomize_batchnorm(module, generator):
    torch = _torch()
    for m in module.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=generator) * 0.2)
                m.running_var.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=generator) * 0.2)


# ----------------------------------------------------------------------------
# the models


def crnn(opset=17, classes=11) -> Exported:
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn = nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d((2, 1)))
            self.lstm = nn.LSTM(16 * 4, 16, num_layers=2, bidirectional=True)
            self.gru = nn.GRU(32, 16)
            self.fc = nn.Linear(16, classes)

        def forward(self, image):                              # [B, 1, 16, W]
            f = self.cnn(image)                                # [B, 16, 4, W / 2]
            b, c, h, w = f.shape
            f = f.permute(3, 0, 1, 2).reshape(w, b, c * h)    # [T, B, 64]
            y, _ = self.lstm(f)
            y, _ = self.gru(y)
            return F.log_softmax(self.fc(y), dim=2)           # [T, B, classes]

    g = torch.manual_seed(0)
    module = CRNN()
    _randomize_batchnorm(module, g)
    module.eval()

    def feeds(batch=2, width=24, seed=0):
        r = np.random.default_rng(seed)
        return {"image": r.standard_normal((batch, 1, 16, width)).astype(np.float32)}

    x = torch.from_numpy(feeds()["image"])
    # no constant folding: the BatchNormalization nodes stay in the model
    model = export(module, (x,), opset, ["image"], ["log_probs"],
                   {"image": {0: "B", 3: "W"}, "log_probs": {0: "T", 1: "B"}},
                   do_constant_folding=False)
    return Exported("crnn", model, module, feeds)


def _stft_basis(n_fft):
    """Cosine then sine rows of the windowed DFT, ``[2F, 1, n_fft]``."""
    f = n_fft // 2 + 1
    t = np.arange(n_fft)
    k = np.arange(f)[:, None]
    window = np.hanning(n_fft)
    basis = np.concatenate([np.cos(2 * np.pi * k * t / n_fft) * window,
                            -np.sin(2 * np.pi * k * t / n_fft) * window])
    return basis[:, None, :].astype(np.float32)


def speech(opset=17, classes=12) -> Exported:
    torch = _torch()
    nn = torch.nn

    class Speech(nn.Module):
        def __init__(self, n_fft=32, hop=16):
            super().__init__()
            self.hop, self.bins = hop, n_fft // 2 + 1
            self.register_buffer("basis", torch.from_numpy(_stft_basis(n_fft)))
            self.conv = nn.Conv1d(self.bins, 24, 3, padding=1)
            self.lstm = nn.LSTM(24, 20, num_layers=2, batch_first=True)
            self.fc = nn.Linear(20, classes)

        def forward(self, wave):                                        # [B, N]
            spec = nn.functional.conv1d(wave.unsqueeze(1), self.basis, stride=self.hop)
            re, im = spec[:, :self.bins], spec[:, self.bins:]
            mag = torch.log(re * re + im * im + 1e-4)                  # [B, F, T]
            z = torch.relu(self.conv(mag)).transpose(1, 2)             # [B, T, 24]
            y, _ = self.lstm(z)
            return self.fc(y)                                           # [B, T, classes]

    torch.manual_seed(1)
    module = Speech().eval()

    def feeds(batch=2, samples=400, seed=0):
        r = np.random.default_rng(seed)
        return {"wave": (0.5 * r.standard_normal((batch, samples))).astype(np.float32)}

    x = torch.from_numpy(feeds()["wave"])
    model = export(module, (x,), opset, ["wave"], ["logits"],
                   {"wave": {0: "B", 1: "N"}, "logits": {0: "B", 1: "T"}})
    return Exported("speech", model, module, feeds)


def vad_module(hidden=32):
    """The scripted VAD (a torch.jit.ScriptModule)."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class Branch(nn.Module):
        def __init__(self, n_fft: int, hop: int):
            super().__init__()
            self.hop, self.bins, self.pad = hop, n_fft // 2 + 1, n_fft // 4
            self.register_buffer("basis", torch.from_numpy(_stft_basis(n_fft)))
            self.enc = nn.Conv1d(self.bins, 16, 3, padding=1)
            self.lstm = nn.LSTM(16, hidden)
            self.out = nn.Linear(hidden, 1)

        def forward(self, x, h, c):
            x = F.pad(x.unsqueeze(1), (self.pad, self.pad), mode="reflect")
            spec = F.conv1d(x, self.basis, stride=self.hop)
            re, im = spec[:, :self.bins], spec[:, self.bins:]
            z = torch.relu(self.enc(torch.sqrt(re * re + im * im + 1e-6)))
            y, (h2, c2) = self.lstm(z.permute(2, 0, 1), (h, c))      # over the frames
            p = torch.sigmoid(self.out(y)).mean(0)                     # [B, 1]
            return p, h2, c2

    class VAD(nn.Module):
        def __init__(self):
            super().__init__()
            self.b16 = Branch(64, 32)
            self.b8 = Branch(32, 16)

        def forward(self, x, state, sr):
            h, c = state[0:1], state[1:2]
            chunk = x
            if chunk.size(0) == 1:         # a batch of one seen as one chunk: its rank
                chunk = chunk.squeeze(0)   # is unknown to the exporter (Shape + Size)
            n = chunk.size(-1)
            if sr == 16000:
                p, h2, c2 = self.b16(x, h, c)
            else:
                p, h2, c2 = self.b8(x, h, c)
            if chunk.dim() > 2 or (not bool(sr == 16000) and n != x.numel() // x.size(0)):
                p = p * 0
            return p, torch.cat([h2, c2], 0)

    torch.manual_seed(2)
    return torch.jit.script(VAD().eval())


def vad(opset=16, hidden=32) -> Exported:
    torch = _torch()
    module = vad_module(hidden)

    def feeds(batch=1, samples=512, seed=0, sr=16000):
        r = np.random.default_rng(seed)
        return {"input": (0.3 * r.standard_normal((batch, samples))).astype(np.float32),
                "state": (0.1 * r.standard_normal((2, batch, hidden))).astype(np.float32),
                "sr": np.array(sr, np.int64)}

    args = tuple(torch.from_numpy(v) for v in feeds().values())
    model = export(module, args, opset, ["input", "state", "sr"], ["output", "stateN"],
                   {"input": {0: "B", 1: "N"}, "state": {1: "B"}, "output": {0: "B"},
                    "stateN": {1: "B"}})
    return Exported(f"vad{opset}", model, module, feeds)


def gru_lm(opset=17, vocab=30, size=16) -> Exported:
    torch = _torch()
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, size)
            self.gru = nn.GRU(size, size, num_layers=2, batch_first=True)
            self.decoder = nn.Linear(size, vocab)
            self.decoder.weight = self.embed.weight                   # tied

        def forward(self, tokens, h0):
            y, h = self.gru(self.embed(tokens), h0)
            return torch.log_softmax(self.decoder(y), dim=-1), h

    torch.manual_seed(3)
    module = LM().eval()

    def feeds(batch=2, length=7, seed=0):
        r = np.random.default_rng(seed)
        return {"tokens": r.integers(0, vocab, (batch, length)).astype(np.int64),
                "h0": (0.2 * r.standard_normal((2, batch, size))).astype(np.float32)}

    args = tuple(torch.from_numpy(v) for v in feeds().values())
    model = export(module, args, opset, ["tokens", "h0"], ["log_probs", "h"],
                   {"tokens": {0: "B", 1: "T"}, "h0": {1: "B"}, "log_probs": {0: "B", 1: "T"},
                    "h": {1: "B"}})
    return Exported("gru_lm", model, module, feeds)


def seq2seq_encoder(opset=17, vocab=25, size=12) -> Exported:
    torch = _torch()
    nn = torch.nn

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, size)
            self.rnn = nn.GRU(size, size, bidirectional=True, batch_first=True)
            self.bridge = nn.Linear(2 * size, size)

        def forward(self, tokens, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths,
                                                       batch_first=True, enforce_sorted=False)
            out, h = self.rnn(packed)
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                      total_length=tokens.shape[1])
            return out, torch.tanh(self.bridge(torch.cat([h[0], h[1]], 1)))

    torch.manual_seed(4)
    module = Encoder().eval()

    def feeds(batch=3, length=6, seed=0):
        r = np.random.default_rng(seed)
        lengths = r.integers(1, length + 1, batch).astype(np.int64)
        lengths[r.integers(batch)] = length                            # the longest is full
        tokens = r.integers(1, vocab, (batch, length)).astype(np.int64)
        tokens[np.arange(length) >= lengths[:, None]] = 0               # padding
        return {"tokens": tokens, "lengths": lengths}

    args = tuple(torch.from_numpy(v) for v in feeds().values())
    model = export(module, args, opset, ["tokens", "lengths"], ["outputs", "hidden"],
                   {"tokens": {0: "B", 1: "T"}, "lengths": {0: "B"}, "outputs": {0: "B", 1: "T"},
                    "hidden": {0: "B"}})
    return Exported("seq2seq_encoder", model, module, feeds)


def stream_gru(opset=17, hidden=48) -> Exported:
    """A plain streaming model: an STFT conv over a chunk, a GRU carrying its
    state ``[1, B, H]`` from chunk to chunk, a Linear and a sigmoid per frame.
    No control flow, no shape computations."""
    torch = _torch()
    nn = torch.nn

    class StreamGRU(nn.Module):
        def __init__(self, n_fft=64, hop=32):
            super().__init__()
            self.hop, self.bins = hop, n_fft // 2 + 1
            self.register_buffer("basis", torch.from_numpy(_stft_basis(n_fft)))
            self.gru = nn.GRU(self.bins, hidden)
            self.out = nn.Linear(hidden, 1)

        def forward(self, chunk, h):                                    # [B, N], [1, B, H]
            spec = nn.functional.conv1d(chunk.unsqueeze(1), self.basis, stride=self.hop)
            re, im = spec[:, :self.bins], spec[:, self.bins:]
            y, h = self.gru(torch.log(re * re + im * im + 1e-4).permute(2, 0, 1), h)
            return torch.sigmoid(self.out(y)), h                       # [T, B, 1], [1, B, H]

    torch.manual_seed(5)
    module = StreamGRU().eval()

    def feeds(batch=1, samples=512, seed=0):
        r = np.random.default_rng(seed)
        return {"chunk": (0.3 * r.standard_normal((batch, samples))).astype(np.float32),
                "h": (0.1 * r.standard_normal((1, batch, hidden))).astype(np.float32)}

    args = tuple(torch.from_numpy(v) for v in feeds().values())
    model = export(module, args, opset, ["chunk", "h"], ["prob", "hN"],
                   {"chunk": {0: "B", 1: "N"}, "h": {1: "B"}, "prob": {0: "T", 1: "B"},
                    "hN": {1: "B"}})
    return Exported("stream_gru", model, module, feeds)


BUILDERS = {"crnn": crnn, "speech": speech, "vad": vad, "gru_lm": gru_lm,
            "seq2seq_encoder": seq2seq_encoder, "stream_gru": stream_gru}


# ----------------------------------------------------------------------------
# float16


def to_float16(model):
    """The same model computing in float16: float initializers, graph inputs
    and outputs, ``Constant`` values, ``ConstantOfShape`` fills and casts to
    float become float16 (subgraphs included); intermediate type annotations
    are dropped."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())

    def tensor(t):
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))

    def value_infos(infos):
        for info in infos:
            tt = info.type.tensor_type
            if tt.elem_type == TensorProto.FLOAT:
                tt.elem_type = TensorProto.FLOAT16

    def graph(g):
        for t in g.initializer:
            tensor(t)
        value_infos(g.input)
        value_infos(g.output)
        del g.value_info[:]
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensor(attr.t)
                elif attr.type == onnx.AttributeProto.GRAPH:
                    graph(attr.g)
                elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16

    graph(model.graph)
    return model


def half_feeds(feeds):
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
