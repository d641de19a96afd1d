"""Real models on stepnet.onnx.InferenceSession, against onnxruntime.

- Models exported from PyTorch (tests/onnx_models.py): a CRNN, a speech model
  with a convolutional front end, a VAD with ``If`` on its sample rate
  (opsets 15-18), a GRU language model with a tied softmax and a seq2seq
  encoder over packed sequences: every output within 1e-4 of onnxruntime's
  in float32; in float16 at float16's tolerance.
- Every ONNX backend node test of the default domain at opsets up to 22.
- ``If``, ``Loop`` and ``Scan`` holding recurrent nodes; the models
  ``stepnet.onnx.export`` writes for nested step-nets.
- Batch and sequence length change without a compile.
- Errors name the node when the session is made.
"""

import contextlib
import importlib
import os
import pkgutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import stepnet as sn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from stepnet.onnx import InferenceSession  # noqa: E402
from stepnet.onnx import conv as onnx_conv  # noqa: E402

from conftest import assert_close  # noqa: E402

ATOL = 1e-4  # float32: max |stepnet - onnxruntime| over every output


def _ort(model, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


_ORT_SCRIPT = """
import sys, numpy as np, onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
np.savez(sys.argv[3], *session.run(None, dict(np.load(sys.argv[2]))))
"""


def _ort_in_subprocess(model, feeds, tmp_path):
    """onnxruntime's outputs, or None where it fails or crashes on the model
    (it segfaults on some float16 LSTM models)."""
    model_path, feeds_path, out_path = (str(tmp_path / n) for n in ("m.onnx", "f.npz", "o.npz"))
    onnx.save(model, model_path)
    np.savez(feeds_path, **feeds)
    done = subprocess.run([sys.executable, "-c", _ORT_SCRIPT, model_path, feeds_path, out_path],
                          capture_output=True, timeout=300)
    if done.returncode != 0:
        return None
    outs = np.load(out_path)
    return [outs[f"arr_{i}"] for i in range(len(outs.files))]


def _check_against(got, expected, what):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, f"{what} output {i}"
        diff = float(np.max(np.abs(g.astype(np.float64) - e))) if e.size else 0.0
        assert diff <= ATOL, f"{what} output {i}: max |difference| {diff} > {ATOL}"


@contextlib.contextmanager
def _counting_compiles():
    """Counts the programs the Numba backend compiles inside the block."""
    from stepnet.backends import _module

    module = _module("numba")
    original = module.compile_program
    count = [0]

    def counting(program):
        count[0] += 1
        return original(program)

    module.compile_program = counting
    try:
        yield count
    finally:
        module.compile_program = original


# ----------------------------------------------------------------------------
# models exported from PyTorch


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("torch")
    import onnx_models

    return onnx_models


_EXPORTED = {}


def _exported(models, name, **kw):
    key = (name, tuple(sorted(kw.items())))
    if key not in _EXPORTED:
        ex = models.BUILDERS[name](**kw)
        _EXPORTED[key] = (ex, InferenceSession(ex.model))
    return _EXPORTED[key]


# two feeds per model: the second changes the batch and the sequence length
SHAPES = {
    "crnn": [{"batch": 2, "width": 24}, {"batch": 3, "width": 16}],
    "speech": [{"batch": 2, "samples": 400}, {"batch": 1, "samples": 256}],
    "gru_lm": [{"batch": 2, "length": 7}, {"batch": 3, "length": 4}],
    "seq2seq_encoder": [{"batch": 3, "length": 6}, {"batch": 5, "length": 4}],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_exported_model_matches_onnxruntime(models, name):
    ex, session = _exported(models, name)
    first, second = SHAPES[name]
    feeds = ex.feeds(**first)
    _check_against(session.run(None, feeds), _ort(ex.model, feeds), f"{name} {first}")
    with _counting_compiles() as compiles:   # a new batch and length: no compile
        feeds = ex.feeds(**second, seed=1)
        _check_against(session.run(None, feeds), _ort(ex.model, feeds), f"{name} {second}")
    assert compiles[0] == 0


@pytest.mark.parametrize("name", sorted(SHAPES) + ["vad"])
def test_exported_model_with_every_elementwise_run_fused_matches_onnxruntime(models, name,
                                                                             monkeypatch):
    """Runs of elementwise nodes run fused from a key's second call
    (stepnet/onnx/fusion.py); here at any size, so the small test shapes fuse
    too, and node by node (no plan compiled into one call)."""
    from stepnet.onnx import fusion, graph

    monkeypatch.setattr(fusion, "MIN_SIZE", 1)
    monkeypatch.setattr(graph, "lower", lambda *args: None)
    ex = models.BUILDERS[name]()
    session = InferenceSession(ex.model)
    feeds = ex.feeds(**SHAPES.get(name, [{"batch": 3}])[0])
    for _ in range(3):
        got = session.run(None, feeds)
    _check_against(got, _ort(ex.model, feeds), f"{name}, fused")
    graphs = [session.graph] + [sub for node in session.graph.nodes for sub in node.subgraphs.values()]
    fused = [node.op for graph in graphs for plan in graph.fused.values() for node in plan
             if isinstance(node, fusion.FusedNode)]
    if name == "vad":
        assert "Mul+Mul+Add+Add+Sqrt" in fused, fused


@pytest.mark.parametrize("name", sorted(SHAPES) + ["vad", "stream_gru"])
def test_exported_model_compiled_into_one_call_matches_onnxruntime(models, name):
    """Where a key's whole plan lowers (stepnet/onnx/lowering.py), its one
    compiled call answers (made ready whichever was faster) and matches
    onnxruntime as the nodes do; the speech model's, the VAD's and the stream GRU's
    plans lower."""
    from stepnet.onnx.lowering import GraphNode

    ex = models.BUILDERS[name]()
    session = InferenceSession(ex.model)
    feeds = ex.feeds(**SHAPES.get(name, [{"batch": 3}])[0])
    for _ in range(3):
        session.run(None, feeds)
    lowered = [node for plan in session.graph.fused.values() for node in plan
               if isinstance(node, GraphNode)]
    for node in lowered:
        assert node.state in ("timing", "ready", "slower")
        node.state = "ready"
    _check_against(session.run(None, feeds), _ort(ex.model, feeds), f"{name}, one call")
    assert bool(lowered) == (name in ("speech", "vad", "stream_gru")), [n.op for n in lowered]


def test_exported_models_hold_the_architectures(models):
    ops = {name: models.op_counts(_exported(models, name)[0].model.graph) for name in SHAPES}
    assert {"Conv", "BatchNormalization", "MaxPool", "LSTM", "GRU", "LogSoftmax"} <= set(ops["crnn"])
    assert ops["crnn"]["LSTM"] == 2  # two layers, each bidirectional
    assert {"Conv", "LSTM"} <= set(ops["speech"])
    assert {"Gather", "GRU", "LogSoftmax"} <= set(ops["gru_lm"])
    assert {"TopK", "ScatterElements", "GRU"} <= set(ops["seq2seq_encoder"])  # packing


def test_crnn_on_the_interpreter(models):
    ex, _ = _exported(models, "crnn")
    feeds = ex.feeds(batch=2, width=12)
    got = InferenceSession(ex.model, backend="interpreter").run(None, feeds)
    _check_against(got, _ort(ex.model, feeds), "crnn (interpreter)")


def test_tied_softmax_is_the_embedding(models):
    """The LM's output projection is its embedding, transposed (the exporter
    writes the transpose as an initializer of its own)."""
    ex, session = _exported(models, "gru_lm")
    graph = ex.model.graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    embedding = arrays[next(n for n in graph.node if n.op_type == "Gather").input[0]]
    projection = arrays[next(n for n in graph.node if n.op_type == "MatMul").input[1]]
    np.testing.assert_array_equal(projection, embedding.T)
    import torch

    feeds = ex.feeds(batch=2, length=5, seed=4)
    with torch.no_grad():
        expected = ex.module(*(torch.from_numpy(v) for v in feeds.values()))
    _check_against(session.run(None, feeds), [e.numpy() for e in expected], "gru_lm vs torch")


def test_packed_sequences_respect_lengths(models):
    """Past each sequence's length the encoder's outputs are zero, as pad_packed_sequence gives."""
    ex, session = _exported(models, "seq2seq_encoder")
    feeds = ex.feeds(batch=4, length=6, seed=3)
    outputs, hidden = session.run(None, feeds)
    for b, n in enumerate(feeds["lengths"]):
        assert np.all(outputs[b, n:] == 0) and np.any(outputs[b, :n] != 0)
    import torch

    with torch.no_grad():
        expected = ex.module(*(torch.from_numpy(v) for v in feeds.values()))
    assert np.max(np.abs(outputs - expected[0].numpy())) <= ATOL
    assert np.max(np.abs(hidden - expected[1].numpy())) <= ATOL


@pytest.mark.parametrize("opset", [15, 16, 17, 18])
def test_vad_with_if_on_the_sample_rate(models, opset):
    ex, session = _exported(models, "vad", opset=opset)
    counts = models.op_counts(ex.model.graph)
    for op in ("If", "Shape", "Gather", "Slice", "Pad", "Cast", "Equal", "Not", "Size", "LSTM"):
        assert counts[op] > 0, op
    assert ex.model.opset_import[0].version == opset
    for batch, sr in ((1, 16000), (4, 16000), (2, 8000)):
        feeds = ex.feeds(batch=batch, samples=512 if sr == 16000 else 256, sr=sr, seed=batch)
        _check_against(session.run(None, feeds), _ort(ex.model, feeds), f"vad{opset} {batch} {sr}")


def test_vad_streams_with_its_state(models):
    """Chunks of 512 samples, the state of each call fed to the next; then
    64 streams in one call; no compile after the first chunk."""
    ex, session = _exported(models, "vad", opset=16)
    theirs = ort.InferenceSession(ex.model.SerializeToString(), providers=["CPUExecutionProvider"])
    audio = (0.3 * np.random.default_rng(7).standard_normal((1, 512 * 6))).astype(np.float32)
    state = ours = np.zeros((2, 1, 32), np.float32)
    sr = np.array(16000, np.int64)
    session.run(None, {"input": audio[:, :512], "state": ours, "sr": sr})
    with _counting_compiles() as compiles:
        for i in range(6):
            chunk = audio[:, 512 * i:512 * (i + 1)]
            p, ours = session.run(None, {"input": chunk, "state": ours, "sr": sr})
            q, state = theirs.run(None, {"input": chunk, "state": state, "sr": sr})
            _check_against([p, ours], [q, state], f"chunk {i}")
        feeds = ex.feeds(batch=64, seed=9)
        _check_against(session.run(None, feeds), theirs.run(None, feeds), "64 streams")
        feeds = ex.feeds(batch=3, samples=1024, seed=10)  # longer chunks: more frames
        _check_against(session.run(None, feeds), theirs.run(None, feeds), "1024 samples")
    assert compiles[0] == 0


def _silero_models():
    """The ONNX files of the ``silero-vad`` package (the ``silero`` extra), found
    without importing it (its package imports torchaudio)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        return []
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return sorted(f for f in os.listdir(data) if f.endswith(".onnx")) if os.path.isdir(data) else []


# (slow: a model's compiles from a cold cache take 15-80 s; the default run has
# its form in test_onnx_lowering.py's small model with an If on the sample rate)
@pytest.mark.slow
@pytest.mark.parametrize("name", _silero_models() or ["silero_vad.onnx"])
def test_silero_vad_models_stream_as_onnxruntime(name):
    """Silero VAD's own models, as its package ships them: chunks of 64 + 512
    samples (256 at 8 kHz), the state carried from call to call, at one
    stream and at three, against onnxruntime; the streaming models' chunks
    of one stream answered by one compiled call (an ``If`` on the sample
    rate, the branches' own checks of the state's shape, ``Gather`` of the
    state and ``Pow`` in it)."""
    from stepnet.onnx.lowering import GraphNode

    if name not in _silero_models():
        pytest.skip("the silero-vad package is not installed")
    spec = importlib.util.find_spec("silero_vad")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", name)
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    session = InferenceSession(path)
    inputs = {i.name: i for i in theirs.get_inputs()}
    rng = np.random.default_rng(3)
    if "input" in inputs and "state" not in inputs:  # (a sequence of chunks, one stream)
        for frames in (1, 7, 7, 7):
            feeds = {"input": (0.3 * rng.standard_normal((frames, 576))).astype(np.float32),
                     "h": np.zeros((1, 1, 128), np.float32), "c": np.zeros((1, 1, 128), np.float32)}
            _check_against(session.run(None, feeds), theirs.run(None, feeds), f"{name} {frames}")
        return
    dtype = np.float16 if "float16" in inputs["input"].type else np.float32
    fixed = inputs["state"].shape[1] if isinstance(inputs["state"].shape[1], int) else None
    rates = [16000] if "16k" in name or "sr" not in inputs else [16000, 8000]
    for sr in rates:
        for batch in [fixed] if fixed else [1, 3]:
            ours = state = np.zeros((2, batch, 128), dtype)
            samples = 512 + 64 if sr == 16000 else 256 + 32
            for i in range(5):
                feeds = {"input": (0.3 * rng.standard_normal((batch, samples))).astype(dtype)}
                if "sr" in inputs:
                    feeds["sr"] = np.array(sr, np.int64)
                p, ours = session.run(None, dict(feeds, state=ours))
                q, state = theirs.run(None, dict(feeds, state=state))
                _check_against([p, ours], [q, state], f"{name} {sr} {batch} chunk {i}")
            if dtype == np.float32 and batch == 1 and sr == 16000:
                # the third call of a key compiles and checks its one call (the nodes answer)
                lowered = [node for plan in session.graph.fused.values() for node in plan
                           if isinstance(node, GraphNode)]
                assert len(lowered) == 1 and lowered[0].state in ("timing", "ready", "slower"), \
                    [getattr(n, "state", n.op) for plan in session.graph.fused.values() for n in plan]


FLOAT16 = ["crnn", "speech", "vad", "gru_lm", "seq2seq_encoder"]


@pytest.mark.parametrize("name", FLOAT16)
def test_float16_model(models, name, tmp_path):
    """The model converted to float16: against onnxruntime's float16 run where
    it runs it (in a subprocess: it crashes on some), else against its float32
    run on the same inputs; at float16's tolerance (|d| <= 1e-3 max(1, |x|):
    rounding the outputs alone to float16 moves them by up to 4.9e-4)."""
    ex, _ = _exported(models, name)
    half = models.to_float16(ex.model)
    feeds = models.half_feeds(ex.feeds())
    got = InferenceSession(half).run(None, feeds)
    assert all(g.dtype == np.float16 for g in got)
    expected = _ort_in_subprocess(half, feeds, tmp_path)
    if expected is None:  # onnxruntime does not run it: its float32 run on the same values
        wide = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        expected = [e.astype(np.float16) for e in _ort(ex.model, wide)]
    assert_close(got, expected, dtype=np.float16, what=f"{name} float16")


# ----------------------------------------------------------------------------
# every ONNX backend node test of the default domain, opsets up to 22


def _node_cases(max_opset=22):
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in pkgutil.iter_modules(node_cases.__path__):
            importlib.import_module(f"onnx.backend.test.case.node.{module.name}")
    out = []
    for case in node_cases._NodeTestCases:
        opset = max((o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx")),
                    default=0)
        if opset <= max_opset and all(n.domain in ("", "ai.onnx") for n in case.model.graph.node):
            out.append(case)
    return out


RANDOM_OPS = {"Bernoulli", "RandomNormal", "RandomUniform", "RandomNormalLike",
              "RandomUniformLike", "Multinomial"}


def _ops_of(graph):
    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                ops |= _ops_of(attr.g)
    return ops


def _compare_case(got, expected, case, exact_values=True):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, list):
            assert isinstance(g, list) and len(g) == len(e)
            _compare_case(g, e, case, exact_values)
            continue
        if e is None:
            assert g is None
            continue
        g, e = np.asarray(g), np.asarray(e)
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        if not exact_values:
            continue
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(g, e, rtol=case.rtol, atol=case.atol)
        else:
            np.testing.assert_array_equal(g, e)


def test_every_default_domain_node_case_runs():
    """Each case's session is made and run on the interpreter (recurrent nodes
    are compiled in tests/test_onnx_session.py); random ops are checked for
    shape and dtype. Two cases are known to differ, listed in docs/onnx.md."""
    cases = _node_cases()
    ops = set()
    failures = {}
    known = {"test_if_opt"}  # onnx.reference's Optional wraps a sequence in a list
    pillow = importlib.util.find_spec("PIL") is not None
    for case in cases:
        case_ops = _ops_of(case.model.graph)
        if "ImageDecoder" in case_ops and not pillow:
            with pytest.raises(sn.UnsupportedError, match="ImageDecoder.*Pillow"):
                InferenceSession(case.model, backend="interpreter")
            continue
        if case.name in known:
            continue
        try:
            session = InferenceSession(case.model, backend="interpreter")
            for inputs, outputs in case.data_sets:
                feeds = {a.name: v for a, v in zip(session.get_inputs(), inputs)}
                _compare_case(session.run(None, feeds), outputs, case,
                              exact_values=not (case_ops & RANDOM_OPS))
            ops |= case_ops
        except (AssertionError, sn.errors.Error) as e:
            failures[case.name] = str(e)[:300]
    assert not failures, failures
    print(f"\n{len(cases)} node cases, {len(ops)} ops")
    assert len(cases) > 1000 and len(ops) > 160


def _with_constant_inputs(case, inputs):
    """The case's one-node model with every input but the first an
    initializer: what stepnet binds when the session is made."""
    model = onnx.ModelProto.FromString(case.model.SerializeToString())
    graph = model.graph
    keep = graph.input[0]
    constants = [numpy_helper.from_array(np.asarray(v), info.name)
                 for info, v in zip(graph.input[1:], inputs[1:])]
    del graph.input[:]
    graph.input.append(keep)
    graph.initializer.extend(constants)
    return model


def test_bound_ops_on_constant_inputs_match_the_node_cases():
    """The node cases of the ops stepnet binds to constant inputs (a Slice's
    starts, a Conv's weight, a Pad's pads, ...), those inputs made constants;
    later opsets too (Squeeze's and Reshape's cases are at opset 23 and on)."""
    from stepnet.onnx.ops import OPS

    bound = {name for name, entry in OPS.items() if entry.bind is not None}
    checked = set()
    for case in _node_cases(max_opset=100):
        ops = _ops_of(case.model.graph)
        if len(case.model.graph.node) != 1 or not ops <= bound or case.name == "test_identity_opt":
            continue
        for inputs, outputs in case.data_sets:
            if len(inputs) < 2 or not all(isinstance(v, np.ndarray) and v.dtype != object
                                          for v in inputs):
                continue
            session = InferenceSession(_with_constant_inputs(case, inputs), backend="interpreter")
            got = session.run(None, {session.get_inputs()[0].name: inputs[0]})
            _compare_case(got, outputs, case)
            checked |= ops
    assert {"Slice", "Squeeze", "Unsqueeze", "Reshape", "Pad", "Conv", "ReduceMean", "Gather"} <= checked


@pytest.mark.parametrize("spatial, kernel, strides", [((40,), (8,), (4,)), ((9, 12), (3, 5), (2, 3)),
                                                     ((16,), (16,), (1,))])
def test_conv_with_a_constant_weight_matches_onnxruntime(spatial, kernel, strides, rng):
    """Windows taken by output position (strided or wide kernels): one
    sample in a call (the channels' rows computed at once) and several."""
    C, M = 3, 5
    w = rng.standard_normal((M, C) + kernel).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], strides=list(strides),
                            pads=[1] * (2 * len(spatial)))
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", C, *spatial])], [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w"),
                                         numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = InferenceSession(model, backend="interpreter")
    for n in (1, 3, 1):
        feeds = {"x": rng.standard_normal((n, C, *spatial)).astype(np.float32)}
        got, = session.run(None, feeds)
        expected, = _ort(model, feeds)
        assert_close(got, expected, what=f"{n} samples")


@pytest.mark.parametrize("pads, dilation, bias", [([1, 1], 1, True), ([0, 0], 2, False),
                                                  ([2, 0], 1, False)])
def test_conv_of_stride_one_over_many_samples_matches_onnxruntime(pads, dilation, bias, rng,
                                                                   monkeypatch):
    """A 1-D Conv of stride 1 on many samples sums one GEMM per kernel tap
    (no im2col copy): padded or not, dilated, with and without a bias; few
    samples take the im2col path. Each against onnxruntime."""
    C, M, K, L = 33, 16, 3, 16
    w = rng.standard_normal((M, C, K)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(M).astype(np.float32), "b"))
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], pads=pads,
                            dilations=[dilation])
    model = _model([node], [_f32("x", ["N", C, L])], [_f32("y")], inits)
    by_taps, real = [], onnx_conv._conv_by_taps
    monkeypatch.setattr(onnx_conv, "_conv_by_taps",
                        lambda x, *rest: by_taps.append(len(x)) or real(x, *rest))
    session = InferenceSession(model, backend="interpreter")
    for n in (64, 1, 40):
        feeds = {"x": rng.standard_normal((n, C, L)).astype(np.float32)}
        got, = session.run(None, feeds)
        expected, = _ort(model, feeds)
        assert_close(got, expected, what=f"{n} samples")
    assert by_taps == [64, 40]


def test_every_default_domain_op_loads_at_every_opset():
    """Every operator of the default domain, opsets 7 to 22, has an
    implementation in the session (a node of it is made)."""
    from stepnet.onnx.ops import NodeContext
    from stepnet.onnx.reference import ReferenceOp

    names = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
    checked, missing = 0, []
    for name in sorted(names):
        for opset in range(7, 23):
            try:
                schema = onnx.defs.get_schema(name, opset, "")
            except onnx.defs.SchemaError:
                continue
            if schema.deprecated or name in ("If", "Loop", "Scan", "GRU", "LSTM", "RNN"):
                continue
            node = helper.make_node(name, [f"i{k}" for k in range(schema.min_input)],
                                    [f"o{k}" for k in range(max(schema.min_output, 1))])
            ctx = NodeContext(name, name, opset)
            try:
                ReferenceOp(node, ctx, {"": opset})
            except sn.UnsupportedError as e:
                if "Pillow" not in str(e):
                    missing.append((name, opset, str(e)[:100]))
            except (sn.errors.Error, ValueError, TypeError, KeyError):
                pass  # attributes this bare node lacks: the op itself was found
            checked += 1
    assert not missing, missing
    assert checked > 1500


GAPS = [  # ops onnx.reference lacks at these opsets: (node, opset, inputs)
    (helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 3], spatial_scale=0.5),
     17, {"x": (2, 3, 8, 9), "rois": np.array([[0, 1, 1, 7, 9], [1, 0, 3, 17, 13], [0, 5, 5, 6, 6]],
                                               np.float32)}),
    (helper.make_node("GlobalLpPool", ["x"], ["y"], p=3), 17, {"x": (2, 3, 5, 4)}),
    (helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"), 20, {"x": (3, 4)}),
    (helper.make_node("Gelu", ["x"], ["y"]), 20, {"x": (3, 4)}),
    (helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2), 21,
     {"x": (2, 4, 3), "s": (4,), "b": (4,)}),
    (helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]), 13,
     {"q": np.array([0, 3, 128, 255], np.uint8), "scale": np.float32(0.5), "zero": np.uint8(128)}),
    (helper.make_node("Scatter", ["x", "i", "u"], ["y"], axis=1), 10,
     {"x": (2, 5), "i": np.array([[1, 3], [0, 4]], np.int64), "u": (2, 2)}),
]


@pytest.mark.parametrize("node, opset, inputs", GAPS, ids=lambda v: getattr(v, "op_type", ""))
def test_ops_the_reference_lacks_match_onnxruntime(node, opset, inputs):
    r = np.random.default_rng(0)
    feeds = {k: v if isinstance(v, (np.ndarray, np.generic)) else r.standard_normal(v).astype(np.float32)
             for k, v in inputs.items()}
    feeds = {k: np.asarray(v) for k, v in feeds.items()}
    model = _model([node], [_info(k, v) for k, v in feeds.items()], [_f32("y")], opset=opset)
    _check_against(InferenceSession(model).run(None, feeds), _ort(model, feeds), node.op_type)


def test_multinomial_draws_from_each_row():
    node = helper.make_node("Multinomial", ["x"], ["y"], sample_size=200, seed=1.0)
    logits = np.log(np.array([[0.7, 0.3, 0.0], [0.0, 0.0, 1.0]], np.float32) + 1e-30)
    model = _model([node], [_info("x", logits)], [helper.make_tensor_value_info("y", TensorProto.INT32,
                                                                                None)])
    draws = InferenceSession(model).run(None, {"x": logits})[0]
    assert draws.shape == (2, 200) and draws.dtype == np.int32
    assert set(draws[0]) <= {0, 1} and 0.55 < np.mean(draws[0] == 0) < 0.85
    assert np.all(draws[1] == 2)


# ----------------------------------------------------------------------------
# control flow holding recurrent nodes, built by hand


def _info(name, array):
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(array).dtype)
    return helper.make_tensor_value_info(name, elem, list(np.shape(array)))


def _f32(name, shape=None):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _gru_weights(r, I, H, prefix):
    arrays = {"W": r.standard_normal((1, 3 * H, I)) * 0.5, "R": r.standard_normal((1, 3 * H, H)) * 0.5,
              "B": r.standard_normal((1, 6 * H)) * 0.2}
    return [numpy_helper.from_array(a.astype(np.float32), prefix + k) for k, a in arrays.items()]


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_if_with_recurrent_branches(backend):
    """If picks a GRU branch or an LSTM branch; both read the outer X."""
    r = np.random.default_rng(0)
    T, B, I, H = 5, 3, 4, 6
    then = helper.make_graph(
        [helper.make_node("GRU", ["X", "gW", "gR", "gB"], ["Y", "Yh"], hidden_size=H),
         helper.make_node("Squeeze", ["Yh", "zero"], ["out"])],
        "then", [], [_f32("out")])
    lstm_w = [numpy_helper.from_array((r.standard_normal((1, 4 * H, I)) * 0.5).astype(np.float32), "lW"),
              numpy_helper.from_array((r.standard_normal((1, 4 * H, H)) * 0.5).astype(np.float32), "lR")]
    other = helper.make_graph(
        [helper.make_node("LSTM", ["X", "lW", "lR"], ["Y", "Yh", "Yc"], hidden_size=H),
         helper.make_node("Add", ["Yh", "Yc"], ["s"]),
         helper.make_node("Squeeze", ["s", "zero"], ["out"])],
        "else", [], [_f32("out")])
    nodes = [helper.make_node("Greater", ["flag", "half"], ["cond"]),
             helper.make_node("If", ["cond"], ["h"], then_branch=then, else_branch=other)]
    inits = _gru_weights(r, I, H, "g") + lstm_w + [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.float32(0.5), "half")]
    X = r.standard_normal((T, B, I)).astype(np.float32)
    model = _model(nodes, [_info("X", X), _f32("flag", [])], [_f32("h")], inits)
    session = InferenceSession(model, backend=backend)
    for flag in (1.0, 0.0):
        feeds = {"X": X, "flag": np.array(flag, np.float32)}
        _check_against(session.run(None, feeds), _ort(model, feeds), f"flag {flag}")


def test_if_on_a_memoized_condition_runs_its_branch_inline():
    """A run whose key (shapes, small integer inputs) decides an If's
    condition runs the chosen branch's nodes in the graph's own plan, nested
    Ifs too, and skips nodes whose outputs only decided nodes read (the
    ``chunk`` below, read only by Shape); every call matches onnxruntime."""
    def branch(name, nodes, out):
        return helper.make_graph(nodes, name, [], [_f32(out)])

    inner_then = branch("inner_then", [helper.make_node("Add", ["t1", "one_f"], ["t2"])], "t2")
    inner_else = branch("inner_else", [helper.make_node("Sub", ["t1", "one_f"], ["t3"])], "t3")
    then = branch("then", [helper.make_node("Mul", ["x", "two_f"], ["t1"]),
                           helper.make_node("If", ["positive"], ["t4"], then_branch=inner_then,
                                            else_branch=inner_else)], "t4")
    other = branch("else", [helper.make_node("Neg", ["x"], ["e1"])], "e1")
    last_then = branch("last_then", [helper.make_node("Mul", ["mid", "two_f"], ["l1"])], "l1")
    last_else = branch("last_else", [helper.make_node("Identity", ["mid"], ["l2"])], "l2")
    nodes = [
        helper.make_node("Equal", ["mode", "one"], ["is_one"]),
        helper.make_node("Greater", ["mode", "zero"], ["positive"]),
        helper.make_node("Identity", ["x"], ["chunk"], name="chunk_node"),
        helper.make_node("Shape", ["chunk"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["width"]),
        helper.make_node("Equal", ["width", "four"], ["wide"]),
        helper.make_node("If", ["is_one"], ["mid"], then_branch=then, else_branch=other),
        helper.make_node("If", ["wide"], ["y"], then_branch=last_then, else_branch=last_else),
    ]
    inits = [numpy_helper.from_array(np.array(v, dtype), name) for name, v, dtype in (
        ("one", 1, np.int64), ("zero", 0, np.int64), ("four", 4, np.int64),
        ("one_f", 1.0, np.float32), ("two_f", 2.0, np.float32))]
    model = _model(nodes, [_f32("x", ["B", "W"]),
                           helper.make_tensor_value_info("mode", TensorProto.INT64, [])],
                   [_f32("y")], inits)
    session = InferenceSession(model)
    r = np.random.default_rng(3)
    for mode, width in ((1, 4), (0, 4), (1, 3), (-1, 4), (1, 4), (0, 3)):
        for call in range(2):  # the second call of a key runs its memoized plan
            feeds = {"x": r.standard_normal((2, width)).astype(np.float32),
                     "mode": np.array(mode, np.int64)}
            _check_against(session.run(None, feeds), _ort(model, feeds), f"mode {mode} {call}")
    plans = [memo[1] for memo in session.graph.memo.values()]
    assert len(plans) == 5
    for plan in plans:
        assert [n.op for n in plan if n.kind == "if"] == []
        assert "chunk_node" not in [n.ctx.node for n in plan]
        assert {"Mul", "Neg"} & {n.op for n in plan}


def test_an_input_with_a_default_left_unfed_on_a_memoized_run():
    """An initializer that is also a graph input is a default: a run that
    does not feed it takes the initializer, on the first run of its shapes
    and on the memoized ones after it."""
    bias = np.arange(4, dtype=np.float32)
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Reshape", ["x", "shape"], ["same"]),
             helper.make_node("Add", ["same", "b"], ["y"])]
    model = _model(nodes, [_f32("x", ["N", 4]), _f32("b", [4])], [_f32("y")],
                   [numpy_helper.from_array(bias, "b")])
    session = InferenceSession(model)
    r = np.random.default_rng(4)
    for call in range(3):
        feeds = {"x": r.standard_normal((2, 4)).astype(np.float32)}
        _check_against(session.run(None, feeds), _ort(model, feeds), f"call {call}")
    fed = {"x": feeds["x"], "b": -bias}
    _check_against(session.run(None, fed), _ort(model, fed), "b fed")


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_loop_with_a_gru_in_its_body(backend):
    """A Loop whose body runs a GRU on the carried sequence, a scan output
    per iteration and a condition computed in the body."""
    r = np.random.default_rng(1)
    T, B, H = 4, 2, 5
    body = helper.make_graph(
        [helper.make_node("GRU", ["x_in", "W", "R", "Bias"], ["Y", "Yh"], hidden_size=H),
         helper.make_node("Squeeze", ["Y", "one"], ["x_out"]),                 # [T, B, H]
         helper.make_node("ReduceSum", ["Yh"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 _f32("x_in", [T, B, H])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _f32("x_out", [T, B, H]),
         _f32("total", [])])
    nodes = [helper.make_node("Loop", ["M", "", "X"], ["X_final", "totals"], body=body)]
    inits = _gru_weights(r, H, H, "") + [
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.float32(100.0), "limit")]
    inits[0].name, inits[1].name, inits[2].name = "W", "R", "Bias"
    X = r.standard_normal((T, B, H)).astype(np.float32)
    M = np.array(3, np.int64)
    model = _model(nodes, [_info("M", M), _info("X", X)], [_f32("X_final"), _f32("totals")], inits)
    feeds = {"M": M, "X": X}
    session = InferenceSession(model, backend=backend)
    _check_against(session.run(None, feeds), _ort(model, feeds), "loop")
    feeds = {"M": np.array(0, np.int64), "X": X}  # no iteration: the input comes back
    got = session.run(None, feeds)
    assert_close(got[0], X)
    assert got[1].shape[0] == 0


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_scan_with_a_gru_in_its_body(backend):
    """A Scan over chunks whose body runs a GRU over each chunk, its state
    carried from chunk to chunk (the body runs node by node)."""
    r = np.random.default_rng(2)
    chunks, T, B, I, H = 3, 4, 2, 3, 5
    body = helper.make_graph(
        [helper.make_node("GRU", ["x", "W", "R", "Bias", "", "h"], ["Y", "h_next"], hidden_size=H),
         helper.make_node("Squeeze", ["Y", "one"], ["y"])],
        "body", [_f32("h", [1, B, H]), _f32("x", [T, B, I])],
        [_f32("h_next", [1, B, H]), _f32("y", [T, B, H])])
    nodes = [helper.make_node("Scan", ["h0", "X"], ["hT", "Ys"], body=body, num_scan_inputs=1)]
    inits = _gru_weights(r, I, H, "") + [numpy_helper.from_array(np.array([1], np.int64), "one")]
    inits[0].name, inits[1].name, inits[2].name = "W", "R", "Bias"
    feeds = {"h0": r.standard_normal((1, B, H)).astype(np.float32),
             "X": r.standard_normal((chunks, T, B, I)).astype(np.float32)}
    model = _model(nodes, [_info(k, v) for k, v in feeds.items()], [_f32("hT"), _f32("Ys")], inits,
                   opset=16)
    session = InferenceSession(model, backend=backend)
    _check_against(session.run(None, feeds), _ort(model, feeds), "scan of GRUs")


def test_scan_body_transposing_a_state_runs_node_by_node():
    """A Transpose stepnet does not trace on a step value: the Scan runs its
    body as a graph at each step instead."""
    body = helper.make_graph(
        [helper.make_node("Transpose", ["s"], ["s2"], perm=[1, 0, 2]),
         helper.make_node("Add", ["s2", "x"], ["s3"]),
         helper.make_node("Tanh", ["s3"], ["s4"])],
        "body", [_f32("s", [2, 2, 2]), _f32("x", [2, 2, 2])], [_f32("s4", [2, 2, 2])])
    node = helper.make_node("Scan", ["s0", "X"], ["sT"], body=body, num_scan_inputs=1)
    r = np.random.default_rng(3)
    feeds = {"s0": r.standard_normal((2, 2, 2)).astype(np.float32),
             "X": r.standard_normal((3, 2, 2, 2)).astype(np.float32)}
    model = _model([node], [_info(k, v) for k, v in feeds.items()], [_f32("sT")], opset=16)
    _check_against(InferenceSession(model, backend="numba").run(None, feeds), _ort(model, feeds),
                   "transpose in a scan body")


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_exported_nested_step_net_runs_in_the_session(backend, rng):
    """stepnet.onnx.export writes a nested step-net as a Scan inside a Scan
    body; the session runs it to onnxruntime's and stepnet's numbers."""
    from stepnet.onnx.export import to_nested_padded

    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 2)).astype(np.float32),
                                  [[2, 1], [3, 2, 4]])
    W = sn.Parameter(rng.standard_normal((2, 3)).astype(np.float32), name="W")
    U = sn.Parameter(0.5 * rng.standard_normal((3, 3)).astype(np.float32), name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[3], name="h")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            w = inner.add_input(x, name="w")
            g = inner.add_memory(shape=[3], name="g")
            g.update(sn.ops.tanh(w @ W + g.pre_state() @ U))
            inner.add_outputs(g)
        h.update(sn.ops.tanh(inner(output_all_steps=False) + h.pre_state() @ U))
        rnn.add_outputs(h, inner())
    model = sn.onnx.export(rnn, output_all_steps=(True, True))
    padded, lengths = to_nested_padded(X)
    feeds = {"X": padded, "lengths": lengths[0].astype(np.int64),
             "X_lengths_1": lengths[1].astype(np.int64)}
    got = InferenceSession(model, backend=backend).run(None, feeds)
    _check_against(got, _ort(model, feeds), "nested export")
    expected = rnn(output_all_steps=(True, True), backend="interpreter")
    for g, e in zip(got, expected):
        assert_close(g, to_nested_padded(e)[0])


NESTED = [{}, {"reverse_outer": True}, {"reverse_inner": True}, {"start_from_outer": True},
          {"inner_reads_outer": True}, {"static": True}, {"init": True}]


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("numba", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", NESTED, ids=lambda v: "-".join(v) or "plain")
def test_exported_nested_variants_run_in_the_session(variant, backend):
    """Every shape of nested step-net the exporter writes (tests/nets.py):
    reversed nets, an inner memory started from the outer one, an inner net
    reading the outer memory, a static input, an initial memory."""
    from nets import nested_encoder

    from stepnet.onnx.export import to_nested_padded

    net = nested_encoder(np.random.default_rng(0), **variant)
    model = sn.onnx.export(net.rnn, output_all_steps=(True, True, False))
    padded, lengths = to_nested_padded(net.X)
    feeds = {"X": padded, "lengths": lengths[0].astype(np.int64),
             "X_lengths_1": lengths[1].astype(np.int64)}
    extra = {"G": net.G, "h": net.H0}
    feeds.update({i.name: extra[i.name] for i in model.graph.input if i.name not in feeds})
    _check_against(InferenceSession(model, backend=backend).run(None, feeds), _ort(model, feeds),
                   f"nested {variant}")


# ----------------------------------------------------------------------------
# errors when the session is made, naming the node


def _unchecked(nodes, inputs, outputs, opset=17, imports=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] + list(imports))


@pytest.mark.parametrize("node, opset, error, match", [
    (helper.make_node("Foo", ["a"], ["b"], name="f", domain="com.example"), 17,
     sn.UnsupportedError, r"'f' \(Foo\): domain 'com.example' is not supported"),
    (helper.make_node("Frobnicate", ["a"], ["b"], name="fr"), 17,
     sn.UnsupportedError, r"'fr' \(Frobnicate\): Frobnicate is not an operator of the default ONNX "
                          r"domain at opset 17"),
    (helper.make_node("Gelu", ["a"], ["b"], name="ge"), 17,
     sn.UnsupportedError, r"'ge' \(Gelu\): Gelu is not an operator .* at opset 17"),
    (helper.make_node("Upsample", ["a", "s"], ["b"], name="up"), 17,
     sn.UnsupportedError, r"'up' \(Upsample\): Upsample is deprecated at opset 17"),
    (helper.make_node("Add", ["a", "a", "a"], ["b"], name="add3"), 17,
     sn.errors.Error, r"'add3' \(Add\): has 3 inputs, Add-14 takes 2 to 2"),
    (helper.make_node("Cast", ["a"], ["b"], name="c"), 17,
     sn.errors.Error, r"'c' \(Cast\): attribute 'to' is required"),
    (helper.make_node("Softmax", ["a"], ["b"], name="sm", axis=1.5), 17,
     sn.errors.Error, r"'sm' \(Softmax\): attribute 'axis' is FLOAT, Softmax-13 expects INT"),
    (helper.make_node("Relu", ["a"], ["b"], name="r", alpha=0.1), 17,
     sn.UnsupportedError, r"'r' \(Relu\): attribute 'alpha' is not supported \(Relu-14 has no "
                          r"such attribute\)"),
    (helper.make_node("Gemm", ["a", ""], ["b"], name="gm"), 17,
     sn.errors.Error, r"'gm' \(Gemm\): input 1 \(B\) is required"),
    (helper.make_node("Relu", ["nowhere"], ["b"], name="lost"), 17,
     sn.errors.Error, r"node 'lost' reads 'nowhere', which nothing before it defines"),
])
def test_errors_name_the_node_when_the_session_is_made(node, opset, error, match):
    imports = [helper.make_opsetid("com.example", 1)] if node.domain else []
    model = _unchecked([node], [_f32("a"), _f32("s")], [_f32("b")], opset, imports)
    with pytest.raises(error, match=match):
        InferenceSession(model)


def test_error_inside_a_branch_names_the_node():
    bad = helper.make_graph([helper.make_node("Cast", ["a"], ["c"], name="deep")], "then", [],
                            [_f32("c")])
    ok = helper.make_graph([helper.make_node("Identity", ["a"], ["c"])], "else", [], [_f32("c")])
    model = _unchecked([helper.make_node("If", ["cond"], ["b"], then_branch=bad, else_branch=ok)],
                       [_f32("a"), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                       [_f32("b")])
    with pytest.raises(sn.errors.Error, match=r"'deep' \(Cast\): attribute 'to' is required"):
        InferenceSession(model)


def test_errors_of_constant_nodes_show_when_the_session_is_made():
    """Nodes on constants alone are computed then: a bad Reshape of an
    initializer is reported before any data is seen."""
    nodes = [helper.make_node("Reshape", ["w", "shape"], ["w2"], name="rs"),
             helper.make_node("Add", ["a", "w2"], ["b"])]
    model = _model(nodes, [_f32("a", [6])], [_f32("b")],
                   [numpy_helper.from_array(np.zeros(6, np.float32), "w"),
                    numpy_helper.from_array(np.array([4, 2], np.int64), "shape")])
    with pytest.raises(sn.errors.Error, match=r"'rs' \(Reshape\)"):
        InferenceSession(model)


def test_sparse_initializer_and_local_function():
    """A sparse initializer is made dense; a model-local function is inlined."""
    values = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "S")
    indices = numpy_helper.from_array(np.array([1, 5], np.int64), "S_idx")
    sparse = helper.make_sparse_tensor(values, indices, [2, 3])
    twice = onnx.helper.make_function("local.fn", "Twice", ["a"], ["b"],
                                      [helper.make_node("Add", ["a", "a"], ["b"])],
                                      [helper.make_opsetid("", 17)])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "S"], ["y"]),
         helper.make_node("Twice", ["y"], ["z"], domain="local.fn")], "g",
        [_f32("x", [2, 3])], [_f32("z", [2, 3])], sparse_initializer=[sparse])
    model = helper.make_model(graph, functions=[twice],
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("local.fn", 1)])
    model.ir_version = 8
    feeds = {"x": np.ones((2, 3), np.float32)}
    _check_against(InferenceSession(model).run(None, feeds), _ort(model, feeds), "sparse")


def test_outputs_belong_to_the_caller(models):
    """Changing an output in place changes nothing the session keeps (its
    constants, its memoized shape values), and the feeds stay writeable."""
    ex, session = _exported(models, "vad", opset=16)
    feeds = ex.feeds(batch=2, seed=5)
    expected = session.run(None, feeds)
    for out in session.run(None, feeds):
        out[...] = 7
    assert all(v.flags.writeable for v in feeds.values())
    _check_against(session.run(None, feeds), expected, "after writing into outputs")
    identity = _model([helper.make_node("Identity", ["w"], ["y"])], [_f32("x", [2])], [_f32("y")],
                      [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    session = InferenceSession(identity)
    session.run(None, {"x": np.zeros(2, np.float32)})[0][:] = 5
    assert_close(session.run(None, {"x": np.zeros(2, np.float32)})[0], np.ones(2, np.float32))


def test_onnx_stays_optional():
    code = "import sys, stepnet; assert 'onnx' not in sys.modules, 'onnx imported'"
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
